"""The drafter protocol: `propose / observe / reset`.

Drafters never see acceptance rules; acceptance rules never see models. A drafter gets
a `DraftContext` (the committed tokens, the root being the last of them, and a node
budget), returns a `Proposal` (a `TokenTree` plus, for model drafters that sampled,
the draft distributions `q` and how siblings were drawn), and afterwards observes the
`StepResult` (what the target accepted, and the target logits at every node).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol, Sequence, TypeVar, runtime_checkable

import torch

from specula.errors import ConfigError
from specula.sampling import SamplingParams
from specula.tree import TokenTree
from specula.verify import SiblingMode


@dataclass(frozen=True)
class DraftBudget:
    """Limits the decode loop puts on one proposal."""

    max_nodes: int
    """Most tree nodes the target may verify this step (0 = plain step)."""
    max_depth: int
    """Deepest node worth drafting (remaining token budget - 1: the bonus token is always emitted)."""


@dataclass(frozen=True)
class DraftContext:
    """What a drafter sees when proposing."""

    tokens: Sequence[int]
    """All committed tokens, prompt first; the last one is the tree's root."""
    prompt_len: int
    """How many of `tokens` are the prompt."""
    params: SamplingParams
    """Sampling parameters of the request (drafters that sample use the same processing)."""
    budget: DraftBudget
    """Size limits for this proposal."""
    generator: torch.Generator
    """The request's seeded random generator (for drafters that sample)."""
    baseline_rate: float | None = None
    """Tokens/s the proposal already on the table reaches without this drafter (fusion sets it for
    the draft model, whose adaptive stop rule then drafts only while it beats that rate)."""


@dataclass(frozen=True)
class Proposal:
    """A drafter's proposal."""

    tree: TokenTree
    """The proposed tree (may be empty: plain decoding step)."""
    q: torch.Tensor | None = None
    """[n + 1, vocab] draft distribution each row's children were drawn from, or None (one-hot)."""
    sibling_mode: SiblingMode = "deterministic"
    """How siblings were drawn from q: deterministic (top-k / retrieval), iid, or without replacement."""

    @classmethod
    def empty(cls) -> "Proposal":
        return cls(TokenTree.empty())

    def restrict(self, keep: Sequence[int]) -> "Proposal":
        """Keep an ancestor-closed subset of nodes, with their q rows."""
        keep = sorted(set(keep))
        if len(keep) == len(self.tree):
            return self
        q = None if self.q is None else self.q[[0, *(k + 1 for k in keep)]]
        return Proposal(self.tree.subtree(keep), q, self.sibling_mode)

    def limit(self, budget: DraftBudget) -> "Proposal":
        """Enforce the loop's budget: depth first, then the best nodes by score."""
        tree = self.tree
        out = self.restrict([i for i, d in enumerate(tree.depth) if d <= budget.max_depth])
        return out.restrict(out.tree.top_node_indices(max(budget.max_nodes, 0)))


@dataclass(frozen=True)
class StepResult:
    """One verified step, as drafters observe it."""

    root: int
    """The root token the tree hung from."""
    proposal: Proposal
    """What was verified (after the loop's budget was applied)."""
    path: tuple[int, ...]
    """Accepted node indices, root to deepest."""
    next_token: int
    """Token emitted after the path (bonus or correction)."""
    logits: torch.Tensor
    """[n + 1, vocab] raw target logits at the root and every node."""


@runtime_checkable
class Drafter(Protocol):
    """Proposes token trees; learns from verified steps."""

    name: str

    def propose(self, ctx: DraftContext) -> Proposal: ...

    def observe(self, step: StepResult) -> None: ...

    def reset(self) -> None: ...


_Config = TypeVar("_Config")


def method_config(method: str, cls: type[_Config], options: dict[str, Any], **fixed: Any) -> _Config:
    """`cls(**fixed, **options)` for a drafter's frozen config dataclass, refusing unknown options
    with an error that names the method and its options (instead of a TypeError)."""
    known = {f.name for f in fields(cls)} - set(fixed)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"method {method!r} does not take {', '.join(unknown)}; its options are "
                          f"{', '.join(sorted(known))}")
    return cls(**fixed, **options)
