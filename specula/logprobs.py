"""Log-probabilities of chosen tokens under the target, as vLLM and OpenAI return them (pure).

What is returned is the target's own distribution at each position: the log-softmax of its raw
logits, before temperature, top-k / top-p and any grammar mask (vLLM's default,
`logprobs_mode="raw_logprobs"`). Speculation never changes it: the rows come from the same
verification pass that decided the tokens, one row per emitted token, so a request asking for
logprobs costs a log-softmax over the vocabulary for each token it emits and nothing else.

Row convention of a step (`specula.tree`): logits ``[n + 1, vocab]``, row 0 after the root and
row ``i + 1`` after node ``i``; a step that accepts ``path`` emits ``path``'s tokens, then the
next token, from rows ``[0, path[0] + 1, ..., path[-1] + 1]`` (`step_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

MAX_LOGPROBS = 20
"""Most alternatives a request may ask for at each position (vLLM's default `max_logprobs`,
OpenAI's limit on `top_logprobs`)."""


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there and the target's log-probabilities at it."""

    token_id: int
    """The token at this position (emitted, or the prompt's)."""
    logprob: float
    """log p(token | everything before it) under the target's raw distribution."""
    rank: int
    """1 + how many tokens the target ranks strictly above this one (1: the most likely)."""
    top: tuple[tuple[int, float], ...] = ()
    """The most likely tokens at this position, most likely first: (token id, logprob), as many as
    the request asked for (ties in the order `torch.topk` gives)."""


def step_rows(path: Sequence[int]) -> list[int]:
    """The logit rows ([n + 1, vocab] of a verified tree) that a step's emitted tokens were
    decided from: the root's row, then the row after each accepted node."""
    return [0, *(i + 1 for i in path)]


def step_rows_of(rows: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
    """`rows[step_rows(path)]` ([len(path) + 1, ...] of a verified tree's [n + 1, ...]): a view of its first rows
    where the path is the tree's first nodes (a chain's, and a step that accepted nothing: most steps), else the
    gathered copy. A gather is a torch index op, 40-70 us right after a target's pass (`docs/native.md`,
    session 149); a path's nodes come after their parents, so its last node is len(path) - 1 only on that prefix."""
    if not path or path[-1] == len(path) - 1:
        return rows[: len(path) + 1]
    return rows[step_rows(path)]


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """Each token's logprob under its row. logits: [m, vocab] raw target logits (any float dtype,
    any device), token_ids: m tokens, top: alternatives per position (0: none)."""
    if logits.dim() != 2 or logits.shape[0] != len(token_ids):
        raise ValueError(f"logits must be [{len(token_ids)}, vocab] for {len(token_ids)} tokens, got {tuple(logits.shape)}")
    if not token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # [m, vocab] float32
    ids = torch.tensor([int(t) for t in token_ids], dtype=torch.long, device=lp.device)  # [m]
    chosen = lp.gather(1, ids[:, None])  # [m, 1]
    ranks = (lp > chosen).sum(dim=1) + 1  # [m]
    if top > 0:
        values, indices = lp.topk(min(top, lp.shape[1]), dim=-1)  # [m, top] each
        tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(int(t), lp_t, int(r), tp)
            for t, lp_t, r, tp in zip(token_ids, chosen[:, 0].tolist(), ranks.tolist(), tops)]


PROMPT_CHUNK = 512
"""Prompt tokens prefilled per pass when a request asks for the prompt's logprobs: the pass's
logits ([chunk, vocab] float32: 310 MB for a 151k vocabulary) are reduced before the next."""
