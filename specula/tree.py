"""Token trees: the one shape every drafter proposes and every verifier checks.

A `TokenTree` is stored as flat arrays in topological order (a parent always comes
before its children). Node `i` has token `tokens[i]`, parent `parents[i]` (`-1` means
"child of the root", the root being the last emitted token, which the target runs
together with the tree), an *edge score* `edge_scores[i]` (the drafter's raw estimate of
P(node accepted | parent accepted): a draft probability, a match frequency, a rank prior;
the planner calibrates it) and a `source` label (`"draft-model"`, `"prompt-lookup"`, ...).
A node's *path score* (`path_scores`, derived) is the product of edge scores along its path:
the estimated probability that it is reached and accepted. A chain is a tree whose parents
are `i - 1`.

Row convention shared with the backends and `specula.verify`: a distribution tensor of
shape `[n + 1, vocab]` has row `0` for the root and row `i + 1` for node `i`; the
children of node `i` are drawn from / checked against row `i + 1`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Literal, Sequence

import numpy as np
import torch

SiblingMode = Literal["deterministic", "iid", "without_replacement", "iid_kseq"]
"""How the children of one node were drafted: fixed candidates (one-hot q), i.i.d. draws
from q, or draws without replacement from q (`sampling.sample_without_replacement`).
"iid_kseq" is i.i.d. draws verified by SpecTr K-SEQ instead of recursive rejection sampling."""


@dataclass(frozen=True)
class TokenTree:
    """An immutable token tree in topological order (see the module docstring)."""

    tokens: tuple[int, ...]
    """Token id of each node."""
    parents: tuple[int, ...]
    """Parent node index of each node; -1 for children of the root."""
    edge_scores: tuple[float, ...]
    """Per-node edge score: the drafter's estimate of P(node accepted | parent accepted)."""
    sources: tuple[str, ...]
    """Which drafter proposed each node (the first one, where several did)."""
    credits: tuple[tuple[tuple[str, float], ...], ...] = ()
    """Per node, every drafter that proposed it with its own edge score, `(source, score)` in merge
    order (the first is `sources[i]`); empty (the usual case) when each node has one proposer:
    then `proposers(i)` is `((sources[i], edge_scores[i]),)`. Set by `merge` where two sources
    propose one node, so the planner can estimate and credit each of them (`proposers`)."""

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if not (len(self.parents) == len(self.edge_scores) == len(self.sources) == n):
            raise ValueError(
                f"TokenTree arrays differ in length: tokens={n}, parents={len(self.parents)}, "
                f"edge_scores={len(self.edge_scores)}, sources={len(self.sources)}"
            )
        if self.credits and len(self.credits) != n:
            raise ValueError(f"TokenTree credits has {len(self.credits)} entries for {n} nodes")
        for i, par in enumerate(self.parents):
            if not -1 <= par < i:
                raise ValueError(f"TokenTree node {i} has parent {par}: parents must be -1 or an earlier node")

    # ------------------------------------------------------------------ construction
    @classmethod
    def empty(cls) -> "TokenTree":
        return cls((), (), (), ())

    @classmethod
    def build(
        cls,
        tokens: Sequence[int],
        parents: Sequence[int],
        edge_scores: Sequence[float] | None = None,
        sources: Sequence[str] | str = "unknown",
    ) -> "TokenTree":
        n = len(tokens)
        if edge_scores is None:
            edge_scores = [1.0] * n
        if isinstance(sources, str):
            sources = [sources] * n
        return cls(
            tuple(int(t) for t in tokens),
            tuple(int(p) for p in parents),
            tuple(float(s) for s in edge_scores),
            tuple(sources),
        )

    @classmethod
    def from_subset(
        cls,
        tokens: Sequence[int],
        parents: Sequence[int],
        edge_scores: Sequence[float],
        keep: Sequence[int],
        source: str,
    ) -> "TokenTree":
        """The tree of the ancestor-closed, ascending node subset `keep` of a larger tree given as
        arrays (`parents` index the full arrays, -1 = root): parents are renumbered."""
        new_index = {old: new for new, old in enumerate(int(k) for k in keep)}
        kept_parents = []
        for k in keep:
            par = int(parents[int(k)])
            if par >= 0 and par not in new_index:
                raise ValueError(f"from_subset: node {int(k)} kept without its parent {par}")
            kept_parents.append(new_index[par] if par >= 0 else -1)
        return cls.build([tokens[int(k)] for k in keep], kept_parents, [edge_scores[int(k)] for k in keep], source)

    @classmethod
    def chain(
        cls, tokens: Sequence[int], edge_scores: Sequence[float] | None = None, source: str = "unknown"
    ) -> "TokenTree":
        """A chain: node i's parent is node i - 1."""
        return cls.build(tokens, list(range(-1, len(tokens) - 1)), edge_scores, source)

    @classmethod
    def from_paths(
        cls,
        paths: Iterable[Sequence[int]],
        edge_scores: Iterable[Sequence[float]] | None = None,
        source: str = "unknown",
    ) -> "TokenTree":
        """The trie of several token sequences (shared prefixes become shared nodes)."""
        tree = cls.empty()
        score_list = list(edge_scores) if edge_scores is not None else None
        for k, path in enumerate(paths):
            sc = score_list[k] if score_list is not None else None
            tree = tree.merge(cls.chain(path, sc, source))
        return tree

    # ------------------------------------------------------------------ derived (cached)
    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depth(self) -> tuple[int, ...]:
        """Depth of each node; children of the root have depth 1."""
        d: list[int] = []
        for par in self.parents:
            d.append(1 if par < 0 else d[par] + 1)
        return tuple(d)

    @cached_property
    def path_scores(self) -> tuple[float, ...]:
        """Product of edge scores along each node's path (P(reached and accepted) if the edge
        scores are acceptance probabilities); shrinks along paths when edge scores are <= 1."""
        out: list[float] = []
        for par, edge in zip(self.parents, self.edge_scores):
            out.append(edge * (out[par] if par >= 0 else 1.0))
        return tuple(out)

    @cached_property
    def max_depth(self) -> int:
        return max(self.depth, default=0)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[r] for row r (0 = root, i + 1 = node i), in node order."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, par in enumerate(self.parents):
            kids[par + 1].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """Bool [n, n]: mask[i, j] is True iff node j is node i or one of its ancestors."""
        n = len(self)
        mask = np.zeros((n, n), dtype=np.bool_)  # numpy's row copies: torch's took 5-10 us each in a step
        for i, par in enumerate(self.parents):
            if par >= 0:
                mask[i] = mask[par]
            mask[i, i] = True
        return torch.from_numpy(mask)

    @cached_property
    def position_offsets(self) -> torch.Tensor:
        """Long [n]: position of each node relative to the root (= depth)."""
        return torch.tensor(self.depth, dtype=torch.long)

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self)) if not self.children[i + 1])

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Root-to-leaf paths as node indices."""
        return tuple(self.path_to(leaf) for leaf in self.leaves)

    def path_to(self, node: int) -> tuple[int, ...]:
        """Node indices from the first level down to `node` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return tuple(reversed(path))

    def tokens_of(self, nodes: Sequence[int]) -> list[int]:
        return [self.tokens[i] for i in nodes]

    def proposers(self, node: int) -> tuple[tuple[str, float], ...]:
        """Every drafter that proposed `node`, with its own edge score: `(source, score)` pairs,
        the first being `sources[node]` (see `credits`)."""
        if self.credits:
            return self.credits[node]
        return ((self.sources[node], self.edge_scores[node]),)

    def is_chain(self) -> bool:
        return all(par == i - 1 for i, par in enumerate(self.parents))

    # ------------------------------------------------------------------ operations
    def merge(self, other: "TokenTree") -> "TokenTree":
        """Trie union by longest prefix match. A node whose path already exists keeps the
        higher edge score and the first source, and every source that proposed it is credited
        with its own score (`credits`); duplicate siblings in either tree are merged."""
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        sources: list[str] = []
        credits: list[dict[str, float]] = []  # per node: source -> its own (highest) edge score
        index: dict[tuple[int, int], int] = {}
        for tree in (self, other):
            remap: list[int] = []
            for i, (tok, par, score) in enumerate(zip(tree.tokens, tree.parents, tree.edge_scores)):
                key = (remap[par] if par >= 0 else -1, tok)
                j = index.get(key)
                if j is None:
                    j = index[key] = len(tokens)
                    tokens.append(tok)
                    parents.append(key[0])
                    scores.append(score)
                    sources.append(tree.sources[i])
                    credits.append(dict(tree.proposers(i)))
                else:
                    scores[j] = max(scores[j], score)
                    for src, raw in tree.proposers(i):
                        credits[j][src] = max(credits[j].get(src, raw), raw)
                remap.append(j)
        shared = any(len(c) > 1 for c in credits)
        return TokenTree(tuple(tokens), tuple(parents), tuple(scores), tuple(sources),
                         tuple(tuple(c.items()) for c in credits) if shared else ())

    def subtree(self, keep: Iterable[int]) -> "TokenTree":
        """Keep the given nodes (must be ancestor-closed), preserving their order."""
        kept = sorted(set(int(k) for k in keep))
        new_index = {old: new for new, old in enumerate(kept)}
        parents = []
        for old in kept:
            par = self.parents[old]
            if par >= 0 and par not in new_index:
                raise ValueError(f"subtree: node {old} kept without its parent {par} (keep must be ancestor-closed)")
            parents.append(new_index[par] if par >= 0 else -1)
        return TokenTree(
            tuple(self.tokens[k] for k in kept),
            tuple(parents),
            tuple(self.edge_scores[k] for k in kept),
            tuple(self.sources[k] for k in kept),
            tuple(self.credits[k] for k in kept) if self.credits else (),
        )

    def prune(self, drop: Iterable[int]) -> "TokenTree":
        """Remove the given nodes and all their descendants."""
        dropped = set(int(d) for d in drop)
        keep = []
        for i, par in enumerate(self.parents):
            if i in dropped or (par >= 0 and par in dropped):
                dropped.add(i)
            else:
                keep.append(i)
        return self.subtree(keep)

    def best_first_order(self, path_scores: Sequence[float] | None = None) -> list[int]:
        """All nodes in best-first order by path score (`path_scores`, or the tree's own),
        ancestor-closed at every prefix: a node becomes eligible once its parent is taken
        (expansion from the root with a heap)."""
        scores = self.path_scores if path_scores is None else path_scores
        heap = [(-scores[c], c) for c in self.children[0]]
        heapq.heapify(heap)
        order: list[int] = []
        while heap:
            _, node = heapq.heappop(heap)
            order.append(node)
            for c in self.children[node + 1]:
                heapq.heappush(heap, (-scores[c], c))
        return order

    def top_node_indices(self, budget: int) -> list[int]:
        """Indices (ascending) of the best `budget` nodes by path score, ancestor-closed."""
        if budget >= len(self):
            return list(range(len(self)))
        return sorted(self.best_first_order()[: max(budget, 0)])

    def top_nodes(self, budget: int) -> "TokenTree":
        """The best `budget` nodes by path score, ancestor-closed (see `top_node_indices`)."""
        return self if budget >= len(self) else self.subtree(self.top_node_indices(budget))

    def with_edge_scores(self, edge_scores: Sequence[float]) -> "TokenTree":
        """The same tree with new edge scores (the proposers' own scores in `credits` are kept)."""
        return TokenTree(self.tokens, self.parents, tuple(float(s) for s in edge_scores), self.sources, self.credits)
