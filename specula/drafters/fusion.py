"""`fusion`: every available drafter proposes; one tree goes to the target (RASD-style).

Sub-drafters: the draft model (if given; greedy candidates), prompt lookup, REST (if a
datastore is given) and token recycling. The model-free ones propose first (about a
millisecond); the draft model then drafts only while its next token is expected to beat
the rate their tree already reaches (the planner's adaptive stop rule, consulted before the
first draft pass too, so a step can skip the draft model entirely). The trees are merged by
longest-prefix trie union. Where a draft model is present, a retrieval branch (any other source) that leaves
the draft chain — hangs from the root or from a draft-chain node — is kept only if the
draft gives its first token at least `rasd_min_prob` (RASD prunes the retrieval tree with
the draft's probabilities; the paper's exact criterion could not be read, so this is our
version of it). The planner then keeps the best-N nodes by calibrated acceptance.

Every node is a deterministic candidate (q one-hot), so one acceptance rule verifies the
whole tree at any temperature.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from specula.drafters.base import DraftContext, Drafter, Proposal, StepResult
from specula.drafters.draft_model import DraftModelConfig, DraftModelDrafter
from specula.tree import TokenTree


@dataclass(frozen=True)
class FusionConfig:
    """Fusion settings."""

    rasd_min_prob: float = 0.02
    """Draft probability below which a retrieval branch leaving the draft chain is pruned."""


def rasd_prune(tree: TokenTree, draft_source: str, position_probs: list, min_prob: float) -> TokenTree:
    """Drop retrieval branches whose first token the draft finds unlikely.

    position_probs[d]: the draft's distribution [vocab] after the root's d-th chain node
    (d = 0: at the root). Pure function of its inputs."""
    drop = []
    for i, par in enumerate(tree.parents):
        if tree.sources[i] == draft_source:
            continue
        if par >= 0 and tree.sources[par] != draft_source:
            continue  # deeper inside a retrieval branch: judged by its first node
        d = 0 if par < 0 else tree.depth[par]
        if d < len(position_probs) and float(position_probs[d][tree.tokens[i]]) < min_prob:
            drop.append(i)
    return tree.prune(drop) if drop else tree


class FusionDrafter:
    """Merges the trees of several drafters into one deterministic-candidate tree."""

    name = "fusion"

    def __init__(self, drafters: list[Drafter], config: FusionConfig = FusionConfig()) -> None:
        self.drafters = drafters
        self.config = config
        self.draft_model = next((d for d in drafters if isinstance(d, DraftModelDrafter)), None)
        self.rate_of = None

    def set_stop_rule(self, rule) -> None:
        if self.draft_model is not None:
            self.draft_model.set_stop_rule(rule)

    def set_rate_estimator(self, rate_of) -> None:
        """rate_of(proposal, draft_seconds) -> expected tokens/s of the best tree within it (the planner's)."""
        self.rate_of = rate_of

    def propose(self, ctx: DraftContext) -> Proposal:
        t0 = time.perf_counter()
        cheap = TokenTree.empty()  # model-free drafters first: about a millisecond together
        for drafter in self.drafters:
            if drafter is not self.draft_model:
                cheap = cheap.merge(drafter.propose(ctx).tree)
        if self.draft_model is None:
            return Proposal(cheap)
        # The draft model costs a large fraction of a target step per token: it drafts only while
        # its tokens beat the rate the retrieval tree already reaches (its adaptive stop rule).
        baseline = self.rate_of(Proposal(cheap), time.perf_counter() - t0) if self.rate_of is not None else None
        tree = self.draft_model.propose(replace(ctx, baseline_rate=baseline)).tree
        tree = tree.merge(cheap)  # the draft chain first: shared prefixes keep its source
        if self.draft_model.position_probs:
            tree = rasd_prune(tree, self.draft_model.name, self.draft_model.position_probs, self.config.rasd_min_prob)
        return Proposal(tree)

    def observe(self, step: StepResult) -> None:
        for drafter in self.drafters:
            drafter.observe(step)

    def reset(self) -> None:
        for drafter in self.drafters:
            drafter.reset()

    @property
    def memory_bytes(self) -> int:
        return sum(getattr(d, "memory_bytes", 0) for d in self.drafters)


def create(*, target=None, draft=None, datastore: str | None = None, recycling_state: str | None = None,
           num_draft_tokens: int | None = None, tokenizer=None) -> FusionDrafter:
    """All drafters that can run here: draft model (if `draft`), prompt lookup, REST (if
    `datastore`), token recycling."""
    from specula.drafters import make_drafter

    drafters: list[Drafter] = []
    if draft is not None:
        drafters.append(DraftModelDrafter(draft, DraftModelConfig(num_draft_tokens=num_draft_tokens, adaptive=True,
                                                                  greedy_proposals=True)))
    drafters.append(make_drafter("prompt-lookup"))
    if datastore:
        drafters.append(make_drafter("rest", target=target, datastore=datastore, tokenizer=tokenizer))
    drafters.append(make_drafter("token-recycling", target=target, recycling_state=recycling_state, tokenizer=tokenizer))
    return FusionDrafter(drafters)
