"""The one decode loop. Every method is a drafter (and an acceptance rule) plugged in here.

    committed tokens + KV cache
      -> drafter.propose(ctx)        a Proposal (TokenTree [+ q])
      -> planner(proposal, ctx)      sized to the hardware (identity until a planner is set)
      -> target.forward_tree(tree)   logits for the root and every node
      -> verify(...)                 accepted path + one next token (pure function)
      -> target.commit(path)         cache = prefix + root + path
      -> drafter.observe(step)

The root of each step is the last emitted token, not yet in the target's cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import torch

from specula.drafters.base import DraftBudget, DraftContext, Drafter, Proposal, StepResult
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.sampling import SamplingParams, make_generator, probabilities
from specula.stats import GenerationStats
from specula.verify import VerifyResult, verify, verify_greedy



class Planner(Protocol):
    """Sizes proposals to the hardware (see `specula.planner.HardwarePlanner`)."""

    def reset(self) -> None: ...

    def should_draft(self, ctx: DraftContext) -> bool: ...

    def plan(self, proposal: Proposal, ctx: DraftContext, draft_seconds: float) -> tuple[Proposal, float]: ...

    def observe(self, step: StepResult, draft_seconds: float, verify_seconds: float,
                overhead_seconds: float = 0.0) -> None: ...


@dataclass(frozen=True)
class EngineConfig:
    """Limits of the decode loop."""

    max_tree_nodes: int = 64
    """Most tree nodes verified in one target pass (the planner may choose fewer)."""


@dataclass
class GenerationOutput:
    """Result of one generation."""

    token_ids: list[int]
    """New tokens only (the prompt excluded)."""
    text: str
    """Decoded new tokens ("" when no tokenizer was given)."""
    stats: GenerationStats
    """Counters and timings."""


@dataclass
class StreamChunk:
    """One streamed step: the tokens and text it added; `stats` is final on the last chunk."""

    token_ids: list[int]
    text: str
    finished: bool = False
    stats: GenerationStats | None = field(default=None, repr=False)


class SpeculativeDecoder:
    """Target backend + drafter (+ planner) = lossless speculative generation."""

    def __init__(
        self,
        target: HFCausalLM,
        drafter: Drafter,
        tokenizer=None,
        *,
        eos_token_ids: Sequence[int] | None = None,
        planner: Planner | None = None,
        config: EngineConfig = EngineConfig(),
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.planner = planner
        self.config = config
        if eos_token_ids is None:
            eos_token_ids = _eos_ids(target.model, tokenizer)
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)

    # ------------------------------------------------------------------ public API
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams()) -> GenerationOutput:
        """Generate from token ids; returns the new tokens, their text and the stats."""
        tokens: list[int] = []
        stats = None
        for chunk in self.stream(prompt_ids, params):
            tokens.extend(chunk.token_ids)
            stats = chunk.stats
        assert stats is not None
        return GenerationOutput(tokens, self._decode(tokens), stats)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams()) -> Iterator[StreamChunk]:
        """Yield one chunk per decode step (text deltas hold back incomplete characters)."""
        shown = ""
        emitted: list[int] = []
        stats = GenerationStats()
        for new in self._run(list(prompt_ids), params, stats):
            emitted.extend(new)
            text = self._decode(emitted)
            # Hold back a trailing replacement character: a multi-byte character may be incomplete.
            stable = text[:-1] if text.endswith("\ufffd") else text
            delta = stable[len(shown) :] if stable.startswith(shown) else stable
            shown = stable if stable.startswith(shown) else shown + delta
            yield StreamChunk(new, delta)
        final = self._decode(emitted)
        yield StreamChunk([], final[len(shown) :] if final.startswith(shown) else "", True, stats)

    # ------------------------------------------------------------------ the loop
    def _run(self, prompt: list[int], params: SamplingParams, stats: GenerationStats) -> Iterator[list[int]]:
        target, drafter = self.target, self.drafter
        if not prompt:
            raise ConfigError("the prompt is empty: give at least one token of text")
        if len(prompt) + 1 > target.max_context:
            raise ConfigError(
                f"the prompt has {len(prompt)} tokens but the target's context window is {target.max_context}; "
                "shorten the prompt"
            )
        stats.method = getattr(drafter, "name", type(drafter).__name__)
        stats.prompt_tokens = len(prompt)
        generator = make_generator(params.seed)
        t_start = time.perf_counter()

        target.reset()
        drafter.reset()
        if self.planner is not None:
            self.planner.reset()
        target.append(prompt[:-1], logits="none")
        stats.prefill_seconds = time.perf_counter() - t_start

        tokens = list(prompt)  # committed + root
        generated: list[int] = []
        check_stop = bool(params.stop) and self.tokenizer is not None
        while True:
            remaining = params.max_new_tokens - len(generated)
            room = target.max_context - len(tokens)  # cache would hold len(tokens) + n nodes
            budget = DraftBudget(
                max_nodes=max(0, min(self.config.max_tree_nodes, room)),
                max_depth=max(0, min(remaining - 1, room)),
            )
            ctx = DraftContext(tokens, len(prompt), params, budget, generator)

            t0 = time.perf_counter()
            planner = self.planner
            drafting = budget.max_nodes > 0 and budget.max_depth > 0
            if drafting and planner is not None:
                drafting = planner.should_draft(ctx)
            proposal = drafter.propose(ctx).limit(budget) if drafting else Proposal.empty()
            if planner is not None:
                proposal, predicted = planner.plan(proposal, ctx, time.perf_counter() - t0)
                stats.predicted_accepted += predicted
            t1 = time.perf_counter()

            logits = target.forward_tree(tokens[-1], proposal.tree)  # [n+1, vocab]
            result = self._verify(proposal, logits, params, generator)
            t2 = time.perf_counter()

            target.commit(result.path)
            t3 = time.perf_counter()
            step = StepResult(tokens[-1], proposal, result.path, result.next_token, logits)
            drafter.observe(step)
            if planner is not None:
                planner.observe(step, t1 - t0, t2 - t1, time.perf_counter() - t3)
            t4 = time.perf_counter()

            stats.draft_seconds += (t1 - t0) + (t4 - t3)
            stats.verify_seconds += t2 - t1
            stats.commit_seconds += t3 - t2
            stats.record_step(proposal.tree.depth, proposal.tree.sources, result.path)

            new = [*proposal.tree.tokens_of(result.path), result.next_token]
            new, reason = self._truncate(new, generated, params, check_stop)
            generated.extend(new)
            tokens.extend(new)
            stats.new_tokens = len(generated)
            stats.seconds = time.perf_counter() - t_start
            if reason is None and len(tokens) >= target.max_context:
                reason = "length"
            if reason is not None:
                stats.finish_reason = reason
            yield new
            if reason is not None:
                return

    def _verify(
        self, proposal: Proposal, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> VerifyResult:
        if params.greedy:
            return verify_greedy(proposal.tree, logits.argmax(-1))
        p = probabilities(logits, params)  # [n+1, vocab]
        q = proposal.q
        if q is not None and q.shape[-1] != p.shape[-1]:
            q = _fit_vocab(q, p.shape[-1])
        return verify(proposal.tree, p, q, proposal.sibling_mode, params, generator)

    def _truncate(
        self, new: list[int], generated: list[int], params: SamplingParams, check_stop: bool
    ) -> tuple[list[int], str | None]:
        """Cut the step's tokens at EOS, a stop string, or max_new_tokens."""
        reason = None
        if not params.ignore_eos:
            for i, tok in enumerate(new):
                if tok in self.eos_token_ids:
                    new, reason = new[: i + 1], "stop"
                    break
        limit = params.max_new_tokens - len(generated)
        if len(new) > limit:
            new, reason = new[:limit], "length"
        elif len(new) == limit and reason is None:
            reason = "length"
        if check_stop:
            cut = self._stop_cut(generated, new, params.stop)
            if cut is not None:
                new, reason = new[:cut], "stop"
        return new, reason

    def _stop_cut(self, generated: list[int], new: list[int], stops: tuple[str, ...]) -> int | None:
        """Fewest of `new` tokens whose text (after `generated`) contains a stop string, or None."""
        longest = max(len(s) for s in stops)
        # Only the tail can contain a new match: the text of a bounded window of earlier tokens.
        head = generated[-(longest + 8) :]
        for k in range(1, len(new) + 1):
            text = self._decode(head + new[:k])
            if any(s in text for s in stops):
                return k
        return None

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _fit_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Pad (with zeros) or cut the draft's vocabulary axis to the target's."""
    if q.shape[-1] > vocab:
        if q[..., vocab:].sum() > 0:
            raise ConfigError("the draft puts probability on token ids the target does not have")
        return q[..., :vocab]
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))


def _eos_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    gen_cfg = getattr(model, "generation_config", None)
    for source in (getattr(gen_cfg, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        if source is None:
            continue
        ids.extend(source if isinstance(source, (list, tuple)) else [source])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))
