"""`prompt-lookup`: propose what followed earlier occurrences of the context's suffix.

Find the longest suffix n-gram (n = max_ngram down to min_ngram) that occurred earlier in
prompt + output; the continuations of its most recent matches form a trie. A node's edge
score (what the planner calibrates into an acceptance estimate) is the fraction of the
continuations through its parent that go on through it; at the root's children it is also
multiplied by n / (max_ngram + 1) for a suffix of n tokens matched: how long a suffix matched is
the strongest sign that a copy follows, while deeper down only the matches' agreement counts,
since once the first copied token is accepted the rest of the copy usually follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specula.drafters.base import DraftContext, Proposal, StatelessDrafter, method_config, within_budget
from specula.errors import ConfigError
from specula.tree import TokenTree


@dataclass(frozen=True)
class PromptLookupConfig:
    """Prompt lookup (PLD) settings."""

    max_ngram: int = 3
    """Longest suffix n-gram tried first."""
    min_ngram: int = 1
    """Shortest suffix n-gram tried."""
    num_pred_tokens: int = 10
    """Tokens copied after each match (the continuation length)."""
    max_matches: int = 4
    """Most recent matches whose continuations form the tree (1 = a chain, as in PLD)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.num_pred_tokens < 1 or self.max_matches < 1:
            raise ConfigError("num_pred_tokens and max_matches must be >= 1")


def find_continuations(tokens: np.ndarray, cfg: PromptLookupConfig) -> tuple[int, list[np.ndarray]]:
    """(n, continuations, most recent match first) of the longest suffix n-gram seen before
    ((0, []) when none).

    tokens: [L] int64. Pure function. A match of n tokens ends at some e <= L - 2 (so a continuation follows)
    with tokens[e] equal to the last token: one comparison over the context finds every such end, and each
    longer n only narrows them (a step over 800 tokens took 83 us as n windows of the whole context, 12 now)."""
    length = len(tokens)
    if length < 2:
        return 0, []
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # ends of the 1-token matches, ascending
    for n in range(min(cfg.max_ngram, length - 1), cfg.min_ngram - 1, -1):
        matched = ends[ends >= n - 1]
        for k in range(1, n):  # the token k before the end agrees too
            matched = matched[tokens[matched - k] == tokens[length - 1 - k]]
        if len(matched):  # the most recent first; each continuation holds at least the token after its end
            return n, [tokens[e + 1 : e + 1 + cfg.num_pred_tokens] for e in matched[::-1][: cfg.max_matches]]
    return 0, []


class PromptLookupDrafter(StatelessDrafter):
    """Suffix n-gram matching over prompt + output; several matches form a tree."""

    name = "prompt-lookup"

    def __init__(self, config: PromptLookupConfig = PromptLookupConfig()) -> None:
        self.config = config

    def propose(self, ctx: DraftContext, state: None = None) -> Proposal:
        n, conts = find_continuations(np.asarray(ctx.tokens, dtype=np.int64), self.config)
        if not conts:
            return Proposal.empty()
        tokens, parents, edges = continuation_trie(conts, n / (self.config.max_ngram + 1))
        tree = TokenTree(tokens, parents, edges, (self.name,) * len(tokens))
        return within_budget(Proposal(tree), ctx.budget)


def continuation_trie(conts: Sequence[np.ndarray], weight: float) -> tuple[tuple[int, ...], tuple[int, ...],
                                                                              tuple[float, ...]]:
    """(tokens, parents, edge scores) of the trie of the continuations `conts` (most recent first), nodes in order
    of first appearance (`TokenTree.from_paths`'s order), in one walk. Pure function. A node's edge score is the
    fraction of the continuations through its parent (all of them at the root) that go on through it, times
    `weight` (the matched suffix's) at the root's children only (module docstring). One pass, where a trie of merged
    chains and every node's path counted took twice as long (`propose` over SmolLM2's outputs: 109 -> 52 us a call in
    a loop of its own, 269 -> 188 inside `fusion`'s steps; `docs/training.md`, session 146)."""
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    tokens: list[int] = []
    parents: list[int] = []
    through: list[int] = []  # per node: continuations through it
    for cont in conts:
        node = -1
        for token in cont.tolist():
            child = index.get((node, token))
            if child is None:
                child = index[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
                through.append(0)
            through[child] += 1
            node = child
    edges = tuple(through[i] / len(conts) * weight if par < 0 else through[i] / through[par]
                  for i, par in enumerate(parents))
    return tuple(tokens), tuple(parents), edges


CONFIG = PromptLookupConfig
"""The options `create` takes besides its keywords (`specula.methods`)."""


def create(*, target=None, draft=None, **options) -> PromptLookupDrafter:
    """options: PromptLookupConfig fields (max_ngram, min_ngram, num_pred_tokens, max_matches)."""
    return PromptLookupDrafter(method_config("prompt-lookup", PromptLookupConfig, options))
