"""The planner's seam: what the engine hands it each step, what it hands back, and the protocol.

    PlanRequest  one session's proposals, budget, state and drafting seconds
    Plan         the decision for that session: the tree to verify and what the planner expected
                 (handed back to `observe`, so nothing is left on the planner between calls)
    StepTiming   what the step cost, as the engine timed it
    Planner      plan / observe_pass / observe (+ per-request state and the drafters' cost view)
    PassThrough  the no-planner case: merge the proposals and keep what the budget allows
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

from specula.planner.merge import merge_proposals
from specula.step import CostView, DraftBudget, Proposal, StepResult


@dataclass(frozen=True)
class PlanRequest:
    """One session's drafts, as the engine hands them to the planner."""

    proposals: Sequence[Proposal]
    """The drafters' candidate trees (empty when nothing was drafted)."""
    budget: DraftBudget
    """The loop's limits for this session's tree."""
    state: Any
    """The planner's per-request state (`Planner.new_state()`), kept in the session."""
    draft_seconds: float
    """Seconds the drafters took this step."""
    drafted: bool = True
    """Whether the drafters ran (False: the planner paused drafting, or the budget had no room)."""
    drafter_seconds: tuple[tuple[str, float], ...] = ()
    """(drafter name, seconds) of every drafter that proposed a node this step, in drafting order."""


@dataclass(frozen=True)
class Plan:
    """The planner's decision for one session's step."""

    proposal: Proposal
    """What the target verifies (empty: a plain step)."""
    predicted: float | None = None
    """Expected accepted tokens, the bonus token included (None: no estimate, no planner)."""
    rate: float | None = None
    """Expected tokens/s of the plan when the back-off judges this step by what it realises (the
    first judged step of a request counts it as a sample); None: the step judges nothing (a
    pause, a probe, a tree verified as drawn, a batch step)."""
    candidates: int = 0
    """Nodes in the merged candidate tree before sizing."""
    explore: bool = False
    """The node was verified to keep estimates learning, not because it was predicted to pay."""
    batch: int = 1
    """Sessions sharing the target pass this plan was sized for."""
    alone: int | None = None
    """Under load: the nodes this session would have verified alone."""
    drafted: bool = True
    """Whether the drafters ran this step (copied from the request)."""
    off_by_load: bool = False
    """Under load: this session had a tree worth verifying alone but the batch plan gave it no node."""
    drafter_seconds: tuple[tuple[str, float], ...] = ()
    """(drafter name, seconds) of every drafter that proposed a node (copied from the request): what
    each cost, for the planner's measure of what it adds beside the others."""
    probes: tuple[str, ...] = ()
    """The chain drafters whose chain is verified as a probe (`PlannerView._probe`): what the step
    realised against a plain step sets when each probes next (`HardwarePlanner._judge_probes`)."""
    contexts: tuple[str | None, ...] | None = None
    """Per verified node, its sibling context in the merged tree it was chosen from
    (`planner.select.sibling_contexts`), the context its estimate was corrected for; None: read
    it from the verified tree. A node whose contesting sibling was cut is still contested: another
    drafter disagreed with it."""
    kind: frozenset[str] | None = None
    """The sources of the merged tree the plan was sized from (`HardwarePlanner.tree_factor`); None:
    no tree, or one holding a grammar-forced node."""
    tree_factor: float = 1.0
    """The factor of that kind the nodes' path probabilities were scaled by (`predicted` includes it)."""

    @property
    def nodes(self) -> int:
        return len(self.proposal.tree)

    @property
    def idle_by_load(self) -> bool:
        """A batch step on which this session drafted nothing: drafters that only learn may skip it."""
        return self.batch > 1 and not self.drafted


@dataclass(frozen=True)
class StepTiming:
    """What one session's step cost."""

    draft_seconds: float
    """Drafting (and this session's share of planning)."""
    verify_seconds: float
    """The target pass (the whole packed pass for a batch) plus the acceptance rule."""
    overhead_seconds: float = 0.0
    """The drafters' bookkeeping after the step (`observe`)."""


@runtime_checkable
class Planner(Protocol):
    """Merges and sizes the drafters' proposals each step; learns from what the steps realised."""

    def new_state(self) -> Any:
        """A request's planning state (kept in the engine's session)."""
        ...

    def should_draft(self, state: Any, batch_size: int = 1) -> bool:
        """Whether this request's drafters run this step."""
        ...

    def held(self, state: Any) -> frozenset[str]:
        """The drafters (by name) that sit this step out, decided by `should_draft` (measured to add less
        than they cost beside the others)."""
        ...

    def view(self, proposals: Sequence[Proposal], draft_seconds: float, batch_size: int = 1,
             state: Any = None) -> CostView | None:
        """The read-only cost view for the next drafter (None: drafters decide alone), for a session
        verified in a pass of `batch_size` sessions whose planning state is `state`."""
        ...

    def plan(self, requests: Sequence[PlanRequest]) -> list[Plan]:
        """One plan per request; the requests are verified together (one packed pass where the
        backend packs sequences)."""
        ...

    def prepare_batch(self, max_batch_size: int) -> None:
        """Get ready to plan batches of up to `max_batch_size` sessions (a server calls this at start-up)."""
        ...

    def observe_pass(self, plans: Sequence[Plan], seconds: float, emitted: Sequence[int] = (),
                     draft_seconds: float = 0.0) -> None:
        """The target pass that verified `plans` (one per session in it) took `seconds`; it emitted
        `emitted` tokens per session after `draft_seconds` of drafting in all (the step's goodput)."""
        ...

    def observe(self, plan: Plan, step: StepResult, state: Any, timing: StepTiming) -> None:
        """After one session's step: what was accepted and what it cost."""
        ...

    def summary(self, state: Any) -> dict | None:
        """What the planner expected for a finished request (None: nothing to say)."""
        ...


class PassThroughPlanner:
    """No planning: the merged proposals, cut to the loop's budget (research runs and tests that
    need the drafters' own trees whatever the timing)."""

    def new_state(self) -> None:
        return None

    def should_draft(self, state: None, batch_size: int = 1) -> bool:
        return True

    def held(self, state: None) -> frozenset[str]:
        return frozenset()

    def view(self, proposals: Sequence[Proposal], draft_seconds: float, batch_size: int = 1,
             state: None = None) -> None:
        return None

    def plan(self, requests: Sequence[PlanRequest]) -> list[Plan]:
        plans = []
        for r in requests:
            proposal = merge_proposals(r.proposals).limit(r.budget)
            plans.append(Plan(proposal, candidates=len(proposal.tree), batch=len(requests), drafted=r.drafted))
        return plans

    def prepare_batch(self, max_batch_size: int) -> None:
        return None

    def observe_pass(self, plans: Sequence[Plan], seconds: float, emitted: Sequence[int] = (),
                     draft_seconds: float = 0.0) -> None:
        return None

    def observe(self, plan: Plan, step: StepResult, state: None, timing: StepTiming) -> None:
        return None

    def summary(self, state: None) -> None:
        return None
