"""One chain-drafting loop for every drafter that drafts token by token with a model (a draft
model, or the target with layers skipped): draft, ask the cost view whether the next token still
pays, optionally stop at low confidence (SWIFT), and return the chain with its q rows. As lockstep
steps (`chain_steps`, `drafters.lockstep`), a packed batch's draft-model passes of one token run as
one packed pass; `draft_chain` runs it alone."""

from __future__ import annotations

import time
from typing import Callable

import torch

from specula.drafters.lockstep import Clock, Steps, drive, immediate
from specula.ema import Ema
from specula.models.device import serial_cpu_ops
from specula.sampling import probabilities
from specula.step import DraftContext, Proposal
from specula.tree import TokenTree


def draft_chain(ctx: DraftContext, source: str, k: int, logits: torch.Tensor, next_logits: Callable[[int], torch.Tensor],
                token_seconds: Ema, t_start: float, *, greedy: bool, adaptive: bool,
                stop_below: float | None = None) -> Proposal:
    """Draft up to `k` tokens from `logits` ([vocab], after the root); `next_logits(token)` runs
    the drafter one token further (timed into `token_seconds`). Greedy drafts are deterministic
    candidates: for a greedy request the argmax (q = the softmax), for a sampled one with a seed the
    token its processed q races to with the target's noise at that position
    (`DraftContext.coupled_candidate`); sampled ones draw from the request's processed q (i.i.d.
    sibling mode). `adaptive`: after each token, stop when `ctx.cost.plan_chain` says the
    rest does not pay (drafting began at `t_start`). `stop_below`: stop after a token whose
    probability under q is below it (the low-confidence token is kept)."""
    return drive(chain_steps(ctx, source, k, logits, lambda token: immediate(next_logits, token), token_seconds,
                             time.perf_counter, t_start, greedy=greedy, adaptive=adaptive, stop_below=stop_below))


def chain_steps(ctx: DraftContext, source: str, k: int, logits: torch.Tensor, next_steps: Callable[[int], Steps],
                token_seconds: Ema, clock: Clock, t_start: float, *, greedy: bool, adaptive: bool,
                stop_below: float | None = None) -> Steps:
    """`draft_chain` as lockstep steps: `next_steps(token)` yields the drafter's pass one token
    further and returns its logits; times are read on `clock` (drafting began at `t_start` on it)."""
    drafted: list[int] = []
    edges: list[float] = []
    q_rows: list[torch.Tensor] = []
    coupled = greedy and ctx.couples
    while True:
        with serial_cpu_ops():  # a row of the whole vocabulary between two draft passes, no kernel
            if coupled:  # a sampled request's fixed candidate: raced with the target's noise at its position
                q = probabilities(logits, ctx.params)  # [vocab]
                token = ctx.coupled_candidate(q, len(drafted))
                edge = float(q.max())  # how sure the draft is there, whichever token the noise picked
            elif greedy:
                q = torch.softmax(logits.float(), -1)  # [vocab]
                token = int(q.argmax())
                edge = float(q[token])
            else:
                q = probabilities(logits, ctx.params)  # [vocab]
                token = int(torch.multinomial(q, 1, generator=ctx.generator))
                edge = float(q[token])
        q_rows.append(q)
        drafted.append(token)
        edges.append(edge)
        if len(drafted) >= k or (stop_below is not None and edges[-1] < stop_below):
            break
        if adaptive and ctx.cost.plan_chain(source, edges, token_seconds.value, clock() - t_start,
                                            k - len(drafted)) == 0:
            break
        t_tok = clock()
        logits = yield from next_steps(token)
        token_seconds.update(clock() - t_tok)
    tree = TokenTree.chain(drafted, edges, source)
    with serial_cpu_ops():
        q_all = torch.stack(q_rows + [torch.zeros_like(q_rows[0])])  # [k + 1, vocab]; the leaf row is unused
    return Proposal(tree, q_all, "deterministic" if greedy else "iid")
