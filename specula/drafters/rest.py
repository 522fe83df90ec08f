"""`rest`: retrieval-based drafting from a datastore (REST, He et al., NAACL 2024).

Each step: find the longest context suffix (16 down to 2 tokens) that occurs in the datastore
(suffix-array binary search), take the continuations (10 tokens) of up to 5000 of its
occurrences, count every continuation prefix, and propose the 64 most frequent prefixes as a
prefix-closed tree. A node's edge score (what the planner calibrates into an acceptance
estimate) is the fraction of the continuations through its parent that go on through it; at
the root's children it is also multiplied by (m - 1) / m for a matched suffix of m tokens, which
tells a 2-token match (weight 0.5) from a long one (towards 1). Siblings are deterministic (q is
None). The datastore is built with
`specula datastore build` and must come from the target's tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specula.datastore.format import Datastore, DatastoreError, load_datastore
from specula.datastore.query import continuation_prefixes, longest_match, top_prefixes
from specula.datastore.tokenizers import tokenizer_fingerprint
from specula.drafters.base import DraftContext, Proposal, StatelessDrafter, method_config
from specula.errors import ConfigError
from specula.tree import TokenTree


@dataclass(frozen=True)
class RestConfig:
    """REST retrieval settings (defaults from the paper)."""

    max_suffix: int = 16
    """Longest context suffix searched."""
    min_suffix: int = 2
    """Shortest context suffix searched (at least 2: a match's edge scores weigh its length m by
    (m - 1) / m, which gives a one-token match no weight at all)."""
    continuation: int = 10
    """Tokens taken after each match (deepest tree level)."""
    max_matches: int = 5000
    """Most occurrences whose continuations are counted (evenly spaced over the matches)."""
    max_nodes: int = 64
    """Most frequent prefixes kept as the tree."""

    def __post_init__(self) -> None:
        if not 2 <= self.min_suffix <= self.max_suffix:
            raise ConfigError(f"need 2 <= min_suffix <= max_suffix, got {self.min_suffix}, {self.max_suffix} "
                              "(a one-token match carries no evidence; prompt lookup drafts from those)")
        if min(self.continuation, self.max_matches, self.max_nodes) < 1:
            raise ConfigError("continuation, max_matches and max_nodes must be >= 1")


class RestDrafter(StatelessDrafter):
    """Proposes the most frequent continuations of the context in a datastore."""

    name = "rest"

    def __init__(self, store: Datastore, config: RestConfig = RestConfig()) -> None:
        self.store = store
        self.config = config

    def propose(self, ctx: DraftContext, state: None = None) -> Proposal:
        cfg, store = self.config, self.store
        depth = min(cfg.continuation, ctx.budget.max_depth)
        budget = min(cfg.max_nodes, ctx.budget.max_nodes)
        if depth < 1 or budget < 1:
            return Proposal.empty()
        context = np.asarray(ctx.tokens[-cfg.max_suffix :], dtype=np.int64)
        unknown = np.flatnonzero(context >= store.vocab_size)  # ids the datastore cannot hold
        if len(unknown):
            context = context[unknown[-1] + 1 :]
        longest = cfg.max_suffix
        while True:
            match = longest_match(store.tokens, store.index, context, longest, cfg.min_suffix)
            if match is None:
                return Proposal.empty()
            prefixes = continuation_prefixes(store.tokens, store.index, match, depth=depth,
                                             max_matches=cfg.max_matches, separator=store.separator)
            if len(prefixes.tokens):
                break
            longest = match.length - 1  # every match ends a document: a shorter suffix may go on
        keep = top_prefixes(prefixes, budget)  # ascending = topological
        if len(keep) == 0:
            return Proposal.empty()
        counts = prefixes.counts.astype(np.float64)
        parent_counts = np.where(prefixes.parents >= 0, counts[np.maximum(prefixes.parents, 0)], prefixes.n_matches)
        weight = (match.length - 1) / match.length
        edges = counts / parent_counts * np.where(prefixes.parents >= 0, 1.0, weight)
        tree = TokenTree.from_subset(prefixes.tokens.tolist(), prefixes.parents.tolist(), edges.tolist(),
                                     keep.tolist(), self.name)
        return Proposal(tree)

    @property
    def memory_bytes(self) -> int:
        """Bytes of the memory-mapped datastore (tokens + suffix array; pages load on demand)."""
        return int(self.store.tokens.nbytes + self.store.index.nbytes)


def open_datastore(path: str, target=None, tokenizer=None, verify: bool = True) -> Datastore:
    """Load a datastore for a target: its tokenizer fingerprint must match the target's `tokenizer`
    (when given; `api` and the CLI always give it), and its ids must fit the target's vocabulary."""
    expected = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    store = load_datastore(path, expected_fingerprint=expected, verify=verify)
    width = getattr(target, "vocab_size", None)
    if width is not None and store.vocab_size > width:
        raise DatastoreError(
            f"datastore {path!r} holds ids up to {store.vocab_size - 1} but the target has {width} logits; "
            f"build it with the target's tokenizer"
        )
    return store


CONFIG = RestConfig
"""The options `create` takes besides its keywords (`specula.methods`)."""


def create(*, target=None, draft=None, datastore: str | None = None, tokenizer=None, verify: bool = True,
           **options) -> RestDrafter:
    """datastore: path of a file from `specula datastore build` (required); tokenizer: the target's
    tokenizer for the compatibility check (without it only the vocabulary size is checked);
    options: RestConfig fields."""
    if not datastore:
        raise ConfigError("method rest needs a datastore: pass datastore=FILE "
                          "(build one with `specula datastore build --tokenizer MODEL --from PATH --out FILE`)")
    return RestDrafter(open_datastore(datastore, target, tokenizer, verify), method_config("rest", RestConfig, options))
