"""`draft-model`: a smaller model with the same tokenizer drafts a chain of k tokens.

Each request keeps its own draft KV cache (the drafter's per-request state). Before proposing
it is synchronised with the committed tokens: the cache is cropped to the longest common prefix
(this is the rollback of the previous step's rejected drafts) and the missing committed tokens
are appended. Greedy requests draft the argmax (deterministic candidates); sampled requests
draw each token from the draft's processed distribution q (same temperature / top-k / top-p as
the target) and return q for the acceptance rule. Greedy proposals carry the draft's softmax
rows as `q` too (not used by the rule; the planner prunes retrieval branches with them).

Adaptive (SpecDec++-style): with a planner, the chain stops when the cost view says the next
token does not pay, and a step skips the draft model entirely when even its first token
(catching the cache up included) is not expected to beat what the other drafters' trees reach.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specula.drafters.base import DraftContext, Proposal, StepResult, method_config
from specula.ema import Ema
from specula.errors import ConfigError
from specula.models.base import TargetModel, TargetSequence, common_prefix_length, keep_common_prefix
from specula.sampling import probabilities
from specula.tree import TokenTree


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

    def propose(self, ctx: DraftContext, seq: TargetSequence) -> Proposal:
        room = self.draft.max_context - len(ctx.tokens) + 1  # the draft cache holds tokens + k - 1 drafts
        k = min(self.config.num_draft_tokens, ctx.budget.max_depth, ctx.budget.max_nodes, room)
        if k <= 0:
            return Proposal.empty()
        adaptive = self.config.adaptive and ctx.cost is not None
        if adaptive and self._token_seconds.value is not None:
            # The first draft token also pays for catching the draft cache up (the whole prompt on a
            # request's first step): on hardware where that is dear, long prompts skip the draft model.
            missing = len(ctx.tokens) - common_prefix_length(seq.tokens, ctx.tokens[:-1])
            first = self._token_seconds.value + max(0, missing - 1) * self._catch_up_seconds.get()
            if not ctx.cost.worth_drafting(self.name, first):
                return Proposal.empty()  # not worth a draft pass this step (the cache catches up later)
        t_start = time.perf_counter()
        logits = self.sync(seq, ctx.tokens)
        greedy = ctx.params.greedy or self.config.greedy_proposals
        drafted: list[int] = []
        edges: list[float] = []
        q_rows: list[torch.Tensor] = []
        for j in range(k):
            if greedy:
                q = torch.softmax(logits.float(), -1)  # [vocab]
                token = int(q.argmax())
            else:
                q = probabilities(logits, ctx.params)  # [vocab]
                token = int(torch.multinomial(q, 1, generator=ctx.generator))
            q_rows.append(q)
            drafted.append(token)
            edges.append(float(q[token]))
            if j + 1 == k:
                break
            if adaptive and self._token_seconds.value is not None and not ctx.cost.should_extend(
                self.name, edges, self._token_seconds.value, time.perf_counter() - t_start
            ):
                break
            t_tok = time.perf_counter()
            logits = seq.prefill([token], logits="last")
            self._token_seconds.update(time.perf_counter() - t_tok)
        tree = TokenTree.chain(drafted, edges, self.name)
        q_all = torch.stack(q_rows + [torch.zeros_like(q_rows[0])])  # [k + 1, vocab]; the leaf row is unused
        return Proposal(tree, q_all, "deterministic" if greedy else "iid")


def create(*, target=None, draft: TargetModel | None = None, **options) -> DraftModelDrafter:
    """options: DraftModelConfig fields (num_draft_tokens, adaptive, greedy_proposals)."""
    if draft is None:
        raise ConfigError("method 'draft-model' needs a draft model: pass --draft MODEL (same tokenizer as the target)")
    return DraftModelDrafter(draft, method_config("draft-model", DraftModelConfig, options))
