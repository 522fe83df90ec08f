"""`draft-model`: a smaller model with the same tokenizer drafts a chain of k tokens.

Each request keeps its own draft KV cache (the drafter's per-request state). Before proposing
it is synchronised with the committed tokens: the cache is cropped to the longest common prefix
(this is the rollback of the previous step's rejected drafts) and the missing committed tokens
are appended. Greedy requests draft the argmax (deterministic candidates); sampled requests
draw each token from the draft's processed distribution q (same temperature / top-k / top-p as
the target) and return q for the acceptance rule. Greedy proposals carry the draft's softmax
rows as `q` too (not used by the rule; the planner prunes retrieval branches with them).

Adaptive (SpecDec++-style, with lookahead): with a planner, the cost view says before the first
token how long a chain is worth drafting (its expected tokens against drafting + verify time,
catching the draft cache up included and spread over the request), so a step skips the draft
model when no chain beats what the other drafters' trees reach, and after each token whether the
rest still pays. A drafter the planner has no data on is assumed to be accepted often
(`PlannerConfig.explore_prior`), so it is tried and its real acceptance learned.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specula.drafters.base import DraftContext, Proposal, StepResult, method_config
from specula.drafters.chain import draft_chain
from specula.ema import Ema
from specula.errors import ConfigError
from specula.models.base import TargetModel, TargetSequence, common_prefix_length, keep_common_prefix


@dataclass(frozen=True)
class DraftModelConfig:
    """Draft-model chain settings."""

    num_draft_tokens: int | None = None
    """Tokens drafted per step (k); the most per step when adaptive. Default 5, or 12 adaptive."""
    adaptive: bool = False
    """Stop drafting early by the planner's cost-derived rule (SpecDec++-style)."""
    greedy_proposals: bool = False
    """Always draft the argmax (deterministic candidates), also when the request samples."""
    timing_ema: float = 0.2
    """EMA weight of each measured draft-token time (and catch-up time per token)."""

    def __post_init__(self) -> None:
        if self.num_draft_tokens is None:
            object.__setattr__(self, "num_draft_tokens", 12 if self.adaptive else 5)
        if self.num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")


class DraftModelDrafter:
    """Chain drafting with a smaller causal LM (SpS)."""

    name = "draft-model"

    def __init__(self, draft: TargetModel, config: DraftModelConfig = DraftModelConfig()) -> None:
        self.draft = draft
        self.config = config
        self._token_seconds = Ema(config.timing_ema)  # one draft token (a one-token pass)
        self._catch_up_seconds = Ema(config.timing_ema)  # per token, for catch-ups of >= 16 tokens

    @property
    def memory_bytes(self) -> int:
        """Bytes of the draft model's weights (its per-request KV caches come on top)."""
        return self.draft.weight_bytes

    # ------------------------------------------------------------------ per request
    def start(self) -> TargetSequence:
        return self.draft.new_sequence()

    def finish(self, seq: TargetSequence) -> None:
        seq.release()

    def observe(self, step: StepResult, seq: TargetSequence) -> None:
        return None  # rollback happens lazily in sync()

    # ------------------------------------------------------------------ drafting
    def sync(self, seq: TargetSequence, tokens) -> torch.Tensor:
        """Bring the draft cache to `tokens` (root included); logits [vocab] after the root."""
        keep = keep_common_prefix(seq, tokens[:-1])
        t0 = time.perf_counter()
        logits = seq.prefill(tokens[keep:], logits="last")
        n = len(tokens) - keep
        if n >= 16:  # a prefill-sized catch-up: learn its cost per token
            self._catch_up_seconds.update((time.perf_counter() - t0) / n)
        return logits

    def _catch_up_estimate(self, seq: TargetSequence, tokens) -> float:
        """Seconds to bring the draft cache to `tokens` before the first draft token can be drafted."""
        missing = len(tokens) - common_prefix_length(seq.tokens, tokens[:-1])
        per_token = self._catch_up_seconds.get(self._token_seconds.get() / 4)  # unmeasured: a prefill guess
        return max(0, missing - 1) * per_token

    def propose(self, ctx: DraftContext, seq: TargetSequence) -> Proposal:
        room = self.draft.max_context - len(ctx.tokens) + 1  # the draft cache holds tokens + k - 1 drafts
        k = min(self.config.num_draft_tokens, ctx.budget.max_depth, ctx.budget.max_nodes, room)
        if k <= 0:
            return Proposal.empty()
        # Adaptive (with a planner): the cost view says how many tokens are worth drafting, before the
        # first (catching the draft cache up included, spread over the request) and after each one.
        # Until a draft step has been timed, the chain runs in full once: that measures it.
        adaptive = self.config.adaptive and ctx.cost is not None and self._token_seconds.value is not None
        if adaptive:
            k = ctx.cost.plan_chain(self.name, [], self._token_seconds.value, 0.0, k,
                                    self._catch_up_estimate(seq, ctx.tokens), ctx.budget.max_depth + 1)
            if k <= 0:
                return Proposal.empty()  # not worth a draft pass this step (the cache catches up later)
        t_start = time.perf_counter()
        logits = self.sync(seq, ctx.tokens)
        return draft_chain(ctx, self.name, k, logits, lambda token: seq.prefill([token], logits="last"),
                           self._token_seconds, t_start, greedy=ctx.params.greedy or self.config.greedy_proposals,
                           adaptive=adaptive)


CONFIG = DraftModelConfig
"""The options `create` takes besides its keywords (`specula.methods`)."""


def create(*, target=None, draft: TargetModel | None = None, **options) -> DraftModelDrafter:
    """options: DraftModelConfig fields (num_draft_tokens, adaptive, greedy_proposals)."""
    if draft is None:
        raise ConfigError("method 'draft-model' needs a draft model: pass --draft MODEL (same tokenizer as the target)")
    return DraftModelDrafter(draft, method_config("draft-model", DraftModelConfig, options))
