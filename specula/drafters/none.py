"""`none`: plain decoding through the same loop (the baseline for every speed ratio)."""

from __future__ import annotations

from specula.drafters.base import DraftContext, Proposal, StepResult


class NoDrafter:
    """Proposes nothing: every step verifies only the root, i.e. plain decoding."""

    name = "none"

    def propose(self, ctx: DraftContext) -> Proposal:
        return Proposal.empty()

    def observe(self, step: StepResult) -> None:
        return None

    def reset(self) -> None:
        return None


def create(*, target=None, draft=None) -> NoDrafter:
    return NoDrafter()
