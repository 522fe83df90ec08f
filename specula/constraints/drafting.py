"""What a grammar does to a step's drafts: forbidden nodes go, forced tokens come for free.

A deterministic proposal (fixed candidates) may lose any node: the rule for fixed candidates is
lossless whatever the tree. A sampled proposal keeps its nodes: its children were drawn from q and
the rule (recursive rejection sampling, K-SEQ) assumes every draw is verified; a forbidden one has
p = 0 under the mask and is simply rejected.
"""

from __future__ import annotations

from typing import Sequence

from specula.constraints.matcher import GrammarState
from specula.step import FORCED_SOURCE, DraftBudget, Proposal
from specula.tree import TokenTree


def forced_proposal(state: GrammarState, budget: DraftBudget) -> Proposal | None:
    """The chain of tokens the grammar forces from the root (each the only token it allows, so
    the masked target emits it with probability 1), or None when the next token is free."""
    tokens = state.forced(min(budget.max_nodes, budget.max_depth))
    if not tokens:
        return None
    return Proposal(TokenTree.chain(tokens, [1.0] * len(tokens), FORCED_SOURCE))


def allowed_proposal(state: GrammarState, proposal: Proposal) -> Proposal:
    """`proposal` without the nodes the grammar forbids (sampled proposals are kept whole)."""
    if proposal.sampled or not len(proposal.tree):
        return proposal
    return proposal.restrict(state.allowed_tree(proposal.tree))


def constrained_proposals(state: GrammarState, proposals: Sequence[Proposal], budget: DraftBudget,
                          forced: bool) -> list[Proposal]:
    """The step's proposals under the grammar: the forced chain first (when `forced`), then each
    drafter's proposal without forbidden nodes. A sampled proposal cannot share a tree, so on a
    step the grammar forces tokens it is dropped for the forced chain (a choice made by the grammar
    state alone, never by what was drawn, so the law holds)."""
    out = [allowed_proposal(state, p) for p in proposals]
    chain = forced_proposal(state, budget) if forced and budget.max_nodes > 0 and budget.max_depth > 0 else None
    if chain is None:
        return out
    return [chain] + [p for p in out if not p.sampled]
