"""`none`: plain decoding through the same loop (the baseline for every speed ratio)."""

from __future__ import annotations

from specula.drafters.base import DraftContext, Proposal, StatelessDrafter


class NoDrafter(StatelessDrafter):
    """Proposes nothing: every step verifies only the root, i.e. plain decoding."""

    name = "none"

    def propose(self, ctx: DraftContext, state: None = None) -> Proposal:
        return Proposal.empty()


def create(*, target=None, draft=None) -> NoDrafter:
    return NoDrafter()
