"""`draft-model`: a smaller model with the same tokenizer drafts a chain of k tokens.

The draft keeps its own KV cache. Before proposing it is synchronised with the committed
tokens: the cache is cropped to the longest common prefix (this is the rollback of the
previous step's rejected drafts) and the missing committed tokens are appended. Greedy
requests draft the argmax (deterministic candidates); sampled requests draw each token
from the draft's processed distribution q (same temperature / top-k / top-p as the
target) and return q for the acceptance rule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from specula.drafters.base import DraftContext, Proposal, StepResult, method_config
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.sampling import probabilities
from specula.tree import TokenTree


StopRule = Callable[[list[float], float, float, "float | None"], bool]
"""rule(raw edge scores so far, seconds per draft token, seconds drafted so far, baseline tokens/s) -> stop?"""
"""rule(raw edge scores so far, seconds per draft token, drafting seconds so far) -> stop?"""


@dataclass(frozen=True)
class DraftModelConfig:
    """Draft-model chain settings."""

    num_draft_tokens: int | None = None
    """Tokens drafted per step (k); the most per step when adaptive. Default 5, or 12 adaptive."""
    adaptive: bool = False
    """Stop drafting early by the planner's cost-derived rule (SpecDec++-style)."""
    greedy_proposals: bool = False
    """Always draft the argmax (deterministic candidates), also when the request samples."""

    def __post_init__(self) -> None:
        if self.num_draft_tokens is None:
            object.__setattr__(self, "num_draft_tokens", 12 if self.adaptive else 5)
        if self.num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")


def common_prefix_length(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelDrafter:
    """Chain drafting with a smaller causal LM (SpS)."""

    name = "draft-model"

    def __init__(self, draft: HFCausalLM, config: DraftModelConfig = DraftModelConfig()) -> None:
        self.draft = draft
        self.config = config
        self.stop_rule: StopRule | None = None
        self.position_probs: list[torch.Tensor] = []
        """Softmax of the draft at the root and each drafted position but the last ([vocab] each)."""
        self._token_seconds: float | None = None
        self._catch_up_seconds: float | None = None  # per token, for catch-ups of >= 16 tokens

    def set_stop_rule(self, rule: StopRule | None) -> None:
        """Install the planner's adaptive stop rule (used when config.adaptive)."""
        self.stop_rule = rule

    def sync(self, tokens) -> torch.Tensor:
        """Bring the draft cache to `tokens` (root included); logits [vocab] after the root."""
        keep = common_prefix_length(self.draft.tokens, tokens[:-1])
        self.draft.crop(keep)
        t0 = time.perf_counter()
        logits = self.draft.append(tokens[keep:], logits="last")
        n = len(tokens) - keep
        if n >= 16:  # a prefill-sized catch-up: learn its cost per token
            per_token = (time.perf_counter() - t0) / n
            c = self._catch_up_seconds
            self._catch_up_seconds = per_token if c is None else 0.8 * c + 0.2 * per_token
        return logits

    def propose(self, ctx: DraftContext) -> Proposal:
        k = min(self.config.num_draft_tokens, ctx.budget.max_depth, ctx.budget.max_nodes)
        if k <= 0:
            return Proposal.empty()
        adaptive = self.config.adaptive and self.stop_rule is not None
        self.position_probs = []
        if adaptive and self._token_seconds is not None:
            # The first draft token also pays for catching the draft cache up (the whole prompt on a
            # request's first step): on hardware where that is dear, long prompts skip the draft model.
            missing = len(ctx.tokens) - common_prefix_length(self.draft.tokens, ctx.tokens[:-1])
            first = self._token_seconds + max(0, missing - 1) * (self._catch_up_seconds or 0.0)
            if self.stop_rule([], first, 0.0, ctx.baseline_rate):
                return Proposal.empty()  # not worth a draft pass this step (the cache catches up later)
        t_start = time.perf_counter()
        logits = self.sync(ctx.tokens)
        greedy = ctx.params.greedy or self.config.greedy_proposals
        drafted: list[int] = []
        scores: list[float] = []
        edges: list[float] = []
        q_rows: list[torch.Tensor] = []
        path_prob = 1.0
        for j in range(k):
            probs = torch.softmax(logits.float(), -1)  # [vocab]
            self.position_probs.append(probs)
            if greedy:
                token = int(probs.argmax())
                prob = float(probs[token])
            else:
                q = probabilities(logits, ctx.params)  # [vocab]
                token = int(torch.multinomial(q, 1, generator=ctx.generator))
                prob = float(q[token])
                q_rows.append(q)
            path_prob *= prob
            drafted.append(token)
            scores.append(path_prob)
            edges.append(prob)
            if j + 1 == k:
                break
            if adaptive and self._token_seconds is not None and self.stop_rule(
                edges, self._token_seconds, time.perf_counter() - t_start, ctx.baseline_rate
            ):
                break
            t_tok = time.perf_counter()
            logits = self.draft.append([token], logits="last")
            step = time.perf_counter() - t_tok
            self._token_seconds = step if self._token_seconds is None else 0.8 * self._token_seconds + 0.2 * step
        tree = TokenTree.chain(drafted, scores, self.name)
        if greedy:
            return Proposal(tree)
        q_all = torch.stack(q_rows + [torch.zeros_like(q_rows[0])])  # [k+1, vocab]; leaf row unused
        return Proposal(tree, q_all, "iid")

    def observe(self, step: StepResult) -> None:
        return None  # rollback happens lazily in sync()

    def reset(self) -> None:
        self.draft.reset()
        self.position_probs = []


def create(*, target=None, draft: HFCausalLM | None = None, **options) -> DraftModelDrafter:
    """options: DraftModelConfig fields (num_draft_tokens)."""
    if draft is None:
        raise ConfigError("method 'draft-model' needs a draft model: pass --draft MODEL (same tokenizer as the target)")
    return DraftModelDrafter(draft, method_config("draft-model", DraftModelConfig, options))
