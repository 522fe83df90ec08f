"""One chain-drafting loop for every drafter that drafts token by token with a model (a draft
model, or the target with layers skipped): draft, ask the cost view whether the next token still
pays, optionally stop at low confidence (SWIFT), and return the chain with its q rows."""

from __future__ import annotations

import time
from typing import Callable

import torch

from specula.ema import Ema
from specula.sampling import probabilities
from specula.step import DraftContext, Proposal
from specula.tree import TokenTree


def draft_chain(ctx: DraftContext, source: str, k: int, logits: torch.Tensor, next_logits: Callable[[int], torch.Tensor],
                token_seconds: Ema, t_start: float, *, greedy: bool, adaptive: bool,
                stop_below: float | None = None) -> Proposal:
    """Draft up to `k` tokens from `logits` ([vocab], after the root); `next_logits(token)` runs
    the drafter one token further (timed into `token_seconds`). Greedy drafts take the argmax
    (deterministic candidates, q = the softmax), sampled ones draw from the request's processed q
    (i.i.d. sibling mode). `adaptive`: after each token, stop when `ctx.cost.plan_chain` says the
    rest does not pay (drafting began at `t_start`). `stop_below`: stop after a token whose
    probability under q is below it (the low-confidence token is kept)."""
    drafted: list[int] = []
    edges: list[float] = []
    q_rows: list[torch.Tensor] = []
    while True:
        if greedy:
            q = torch.softmax(logits.float(), -1)  # [vocab]
            token = int(q.argmax())
        else:
            q = probabilities(logits, ctx.params)  # [vocab]
            token = int(torch.multinomial(q, 1, generator=ctx.generator))
        q_rows.append(q)
        drafted.append(token)
        edges.append(float(q[token]))
        if len(drafted) >= k or (stop_below is not None and edges[-1] < stop_below):
            break
        if adaptive and ctx.cost.plan_chain(source, edges, token_seconds.value, time.perf_counter() - t_start,
                                            k - len(drafted)) == 0:
            break
        t_tok = time.perf_counter()
        logits = next_logits(token)
        token_seconds.update(time.perf_counter() - t_tok)
    tree = TokenTree.chain(drafted, edges, source)
    q_all = torch.stack(q_rows + [torch.zeros_like(q_rows[0])])  # [k + 1, vocab]; the leaf row is unused
    return Proposal(tree, q_all, "deterministic" if greedy else "iid")
