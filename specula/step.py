"""The types one decode step passes along, imported by drafters, planner and engine alike.

    DraftContext  --drafters-->  Proposal(s)  --planner-->  Proposal  --target + rule-->  StepResult

Drafters see a `DraftContext` (committed tokens, sampling parameters, a budget, the request's
generator and, when a planner runs, a read-only `CostView`) and return a `Proposal`: a
`TokenTree` whose nodes carry *edge* scores (the drafter's estimate of P(node accepted | parent
accepted)) plus, for model drafters, the draft distributions `q` its children were drawn from.
The planner merges the proposals and sizes the result; after verification every drafter
observes the `StepResult`. Nothing in this module calls anything: it is data and protocols.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from specula.sampling import SamplingParams, position_noise, race_token
from specula.tree import SiblingMode, TokenTree

if TYPE_CHECKING:
    from specula.models.base import TargetSequence


FORCED_SOURCE = "grammar"
"""Source of the nodes a request's grammar forces (the only token it allows): certain under the
constrained target, so the planner prices them at acceptance 1 (`specula.constraints`)."""


@dataclass(frozen=True)
class DraftBudget:
    """Limits the decode loop puts on one proposal."""

    max_nodes: int
    """Most tree nodes the target may verify this step (0 = plain step)."""
    max_depth: int
    """Deepest node worth drafting (remaining token budget - 1: the bonus token is always emitted)."""


class CostView(Protocol):
    """What a drafter may read of the planner's cost model while it drafts (read-only).

    A drafter that decides mid-draft whether to go on (the draft-model chain) asks here instead
    of calling the planner: the engine builds one view per drafter per step, after the drafters
    before it have proposed, so `baseline_rate` covers their trees."""

    def verify_seconds(self, n_tokens: int) -> float:
        """Predicted latency of the target pass holding `n_tokens` of this session's tokens (root
        included); in a batch, the packed pass that also verifies the other sessions' roots."""
        ...

    @property
    def baseline_rate(self) -> float:
        """Expected tokens/s of the pass with the best tree within the proposals made so far this
        step (a plain step's rate when there are none); in a batch, counting the other sessions'
        roots, so a node pays only if it beats the batch's own rate."""
        ...

    def plan_chain(self, source: str, edge_scores: Sequence[float], seconds_per_token: float, spent_seconds: float,
                   max_more: int, one_time_seconds: float = 0.0, remaining_tokens: int = 1) -> int:
        """How many more chain tokens from `source` are worth drafting (0: stop, or do not start),
        after drafting tokens with raw edge scores `edge_scores` in `spent_seconds`, each further
        one costing `seconds_per_token`; `one_time_seconds` is paid once before the first (a draft
        cache catching up) and is spread over the `remaining_tokens` of the request. The chain is
        valued by what it adds to the tree of the proposals made before it this step, not against
        that tree (`planner.select.chain_lookahead`)."""
        ...


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
    cost: CostView | None = None
    """The planner's read-only cost view, or None when no planner runs."""
    target: TargetSequence | None = None
    """The request's target sequence, for self-drafting drafters: they may
    only call its `LayerSkipSequence` methods (scratch rows, never the committed state)."""
    seed: int | None = None
    """The request's seed (`Session.seed`; None: not given to the drafters). A sampled request's fixed
    candidates are then raced with the target's own noise at their position (`coupled_candidate`)."""

    @property
    def couples(self) -> bool:
        """A sampled request with a seed: its fixed candidates are coupled (`coupled_candidate`)."""
        return not self.params.greedy and self.seed is not None

    def coupled_candidate(self, q_row: torch.Tensor, depth: int) -> int | None:
        """The fixed candidate at `depth` of a sampled request with a seed: the draft's q_row ([vocab'] token ids,
        processed as p is: `sampling.probabilities`) raced with the noise the target's token at that position is
        raced with, so it is the target's token as often as q's closeness to p allows: with probability at least
        (1 - TV) / (1 + TV), TV the total variation between them (Gumbel coupling: Daliri, Musco and Suresh 2024,
        "Coupling without communication and drafter-invariant speculative decoding"), where the
        argmax is with p(argmax q) (Qwen2.5-Coder-1.5B with its 0.5B draft at temperature 1: 0.71 against 0.60 a
        position, docs/training.md). None for greedy requests, or without a seed (the drafter takes its argmax)."""
        noise = self.coupling_noise(depth, q_row.shape[-1])
        return None if noise is None else race_token(q_row, noise)

    def coupling_noise(self, depth: int, columns: int, vocab_index: torch.Tensor | None = None) -> torch.Tensor | None:
        """The noise the target's token at `depth` (0: the root's child) is raced with, one value per column of a
        drafter's q: [columns] float32 on the CPU, where column j is token id j, or `vocab_index[j]` (a head's draft
        vocabulary, [columns] long). None unless the request `couples`."""
        if not self.couples:
            return None
        position = len(self.tokens) - self.prompt_len + depth  # of the output; `verify_step`'s position + depth
        if vocab_index is None:
            return position_noise(self.seed, position, columns)
        index = vocab_index[:columns].cpu()  # [columns]
        return position_noise(self.seed, position, int(index.max()) + 1)[index]


@dataclass(frozen=True)
class Proposal:
    """A drafter's proposal (or the planner's merged and sized one)."""

    tree: TokenTree
    """The proposed tree (may be empty: plain decoding step)."""
    q: torch.Tensor | None = None
    """[n + 1, vocab] draft distributions: row r is the distribution the children of row r were
    drawn from (row 0 = root, row i + 1 = node i; rows without drafted children may be zero), or
    None for model-free drafters. Verification uses it only when `sibling_mode` is not
    "deterministic"; the planner also reads it to prune retrieval branches (RASD)."""
    sibling_mode: SiblingMode = "deterministic"
    """How siblings were drawn from q: deterministic (top-k / retrieval), iid, or without replacement."""

    @classmethod
    def empty(cls) -> "Proposal":
        return cls(TokenTree.empty())

    @property
    def sampled(self) -> bool:
        """Children were drawn at random from q: verify as drawn, never drop siblings by score."""
        return self.sibling_mode != "deterministic"

    def restrict(self, keep: Sequence[int]) -> "Proposal":
        """Keep an ancestor-closed subset of nodes, with their q rows."""
        keep = sorted(set(keep))
        if len(keep) == len(self.tree):
            return self
        q = None if self.q is None else self.q[[0, *(k + 1 for k in keep)]]
        return Proposal(self.tree.subtree(keep), q, self.sibling_mode)

    def limit(self, budget: DraftBudget) -> "Proposal":
        """Enforce the loop's budget: depth first, then the best nodes by path score; a sampled
        proposal keeps its first nodes in drawing order instead (a cut by score would choose draws
        by their values, which changes the law the rule assumes)."""
        tree = self.tree
        out = self.restrict([i for i, d in enumerate(tree.depth) if d <= budget.max_depth])
        n = max(budget.max_nodes, 0)
        return out.restrict(range(min(n, len(out.tree))) if self.sampled else out.tree.top_node_indices(n))


def within_budget(proposal: Proposal, budget: DraftBudget) -> Proposal:
    """`proposal` cut to `budget` (`Proposal.limit`) where it exceeds it, else itself. A drafter's
    proposal is what the cost view prices for the drafters after it (`Planner.view`): nodes no step
    can verify there told an adaptive draft model near a request's end not to draft."""
    tree = proposal.tree
    if tree.max_depth <= budget.max_depth and len(tree) <= budget.max_nodes:
        return proposal
    return proposal.limit(budget)


@dataclass(frozen=True)
class StepResult:
    """One verified step, as drafters and the planner observe it."""

    root: int
    """The root token the tree hung from."""
    proposal: Proposal
    """What was verified (after the planner and the loop's budget)."""
    path: tuple[int, ...]
    """Accepted node indices, root to deepest."""
    next_token: int
    """Token emitted after the path (bonus or correction)."""
    logits: torch.Tensor
    """[n + 1, vocab] raw target logits at the root and every node: a tensor, or on a greedy step a
    row source shaped like one (`models.native.screen.ScreenedLogits`: indexing it computes the
    logits; a drafter learning from the top ids reads `tree_rows.draft_top_k`)."""
    hidden: torch.Tensor | None = None
    """[n + 1, hidden] the target's last hidden state at the root and every node, when a drafter
    asked for hidden states (trained heads), else None."""
    idle: bool = False
    """A batch step on which this request drafted nothing (its drafts do not pay at this load):
    drafters that only learn from steps (token recycling's matrix) skip it, so speculation costs
    nothing where the batch plan switched it off."""

    @property
    def accepted_tokens(self) -> list[int]:
        """The accepted draft tokens, root to deepest (the bonus token excluded)."""
        return self.proposal.tree.tokens_of(self.path)
