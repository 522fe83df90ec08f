"""Merging the drafters' candidate trees into one (RASD tree fusion), as pure functions.

Proposals whose children are deterministic candidates (retrieval, n-gram, recycling, top-k or
greedy model drafts) merge by longest-prefix trie union (`TokenTree.merge`); model proposals
(those that carry draft distributions `q`) go first, so a node both propose keeps the model's
source label; every proposer of a node stays credited with its own score (`TokenTree.credits`),
and the planner estimates the node by its better proposer and calibrates each of them on the
outcome. Where a model proposal is present, a retrieval branch (a node from a proposal without
`q`) that leaves the model's tree - hangs from the root or from one of the model's nodes - is
kept only if the model gives its token at least `min_prob` at that point: RASD prunes the
retrieval tree with the draft's probabilities (the paper's exact criterion could not be read,
so this is our version of it).

A proposal whose children were *sampled* from q (sibling mode iid / without replacement) is
verified exactly as drawn: it cannot be merged with anything, so where one comes beside others the
first sampled proposal is verified alone and the others wait for the next step. Which one goes is
decided by who proposed, never by what was drawn, so the law holds (a decoder mixing a sampled
drafter with deterministic ones raised here on the first step both proposed).
"""

from __future__ import annotations

from typing import Sequence

from specula.models.device import serial_cpu_ops
from specula.step import Proposal
from specula.tree import TokenTree


def rasd_prune(tree: TokenTree, model: Proposal, retrieval_sources: set[str], min_prob: float) -> TokenTree:
    """Drop the retrieval branches of `tree` (nodes of `retrieval_sources`) that leave `model`'s
    tree where the model's distribution gives their first token less than `min_prob`.

    model.q: [len(model.tree) + 1, draft vocab]; rows without mass (never computed) judge nothing; a
    token past the draft's vocabulary (narrower than the target's) is one the model gives nothing."""
    assert model.q is not None
    rows: dict[tuple[int, ...], int] = {(): 0}  # token path -> q row of the model node it ends at
    for i in range(len(model.tree)):
        rows[tuple(model.tree.tokens_of(model.tree.path_to(i)))] = i + 1
    drop = []
    paths: list[tuple[int, ...]] = []
    for i, par in enumerate(tree.parents):
        path = (paths[par] if par >= 0 else ()) + (tree.tokens[i],)
        paths.append(path)
        if tree.sources[i] not in retrieval_sources:
            continue
        row = rows.get(path[:-1])
        if row is None:
            continue  # deeper inside a retrieval branch: judged by its first node
        dist = model.q[row]  # [draft vocab]: may be narrower than the target's; ids past it get nothing
        token = tree.tokens[i]
        if (float(dist[token]) if token < dist.shape[-1] else 0.0) < min_prob:
            with serial_cpu_ops():  # a row of the whole vocabulary: summed on this thread (`serial_cpu_ops`)
                if float(dist.sum()) > 0:
                    drop.append(i)
    return tree.prune(drop) if drop else tree


def merge_proposals(proposals: Sequence[Proposal], rasd_min_prob: float = 0.0) -> Proposal:
    """One proposal from the drafters' (see the module docstring). Empty proposals are ignored."""
    live = [p for p in proposals if len(p.tree)]
    if not live:
        return Proposal.empty()
    sampled = [p for p in live if p.sampled]
    if sampled:
        return sampled[0]  # verified as drawn, alone (see the module docstring)
    if len(live) == 1:
        return Proposal(live[0].tree)
    models = [p for p in live if p.q is not None]
    ordered = models + [p for p in live if p.q is None]
    tree = TokenTree.empty()
    for p in ordered:
        tree = tree.merge(p.tree)
    retrieval = {s for p in live if p.q is None for s in p.tree.sources}
    if rasd_min_prob > 0:
        for model in models:
            tree = rasd_prune(tree, model, retrieval - set(model.tree.sources), rasd_min_prob)
    return Proposal(tree)
