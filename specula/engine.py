"""The one decode loop. Every method is a set of drafters (and an acceptance rule) plugged in here.

    committed tokens + KV cache (the session's)
      -> drafter.propose(ctx, state)   candidate trees (model-free drafters first; each later
                                       drafter reads a cost view of the earlier ones' trees; a
                                       batch drafts drafter by drafter, and a drafter with lockstep
                                       steps drafts all its sessions in step, each level's passes
                                       in one call: `drafters.lockstep`)
      -> planner.plan(requests)        merged and sized to the hardware (one request: its best
                                       tree; several: the batch's goodput, SmartSpec); a
                                       `Plan` value per session
      -> seq.forward_tree(root, tree)  logits for the root and every node
      -> verify_step(...)              accepted path + one next token (pure function)
      -> seq.commit(path)              cache = prefix + root + path
      -> drafter.observe(step), planner.observe(plan, step)
      -> planner.observe_pass(...)     what the target pass cost and emitted (every session)

The root of each step is the last emitted token, not yet in the target's cache.

Per-request state lives in a `Session`: the target's KV sequence, the tokens, the generator,
the stats, the drafters' and the planner's per-request state, the text stream. `start()` makes
one, `step(sessions)` advances each by one decode step (every running session's tree verified in
one packed target pass where the backend batches: continuous batching), `finish()` frees it;
`generate()` and `stream()` are the one-request loop over those. Sessions are independent: stepping A, then B,
then A gives each exactly what it gets alone.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, Sequence

import torch

from specula.constraints import Constraint, GrammarState
from specula.constraints.drafting import constrained_proposals
from specula.drafters.base import Drafter, FeatureDrafter
from specula.drafters.lockstep import ShareClock, drive_many
from specula.drafters.none import NoDrafter
from specula.errors import ConfigError
from specula.logprobs import TokenLogprob, step_rows, step_rows_of, token_logprobs
from specula.models.device import serial_cpu_ops
from specula.models.base import (
    BatchedTargetModel, FeatureRequest, TargetModel, TargetSequence, check_context, conforms, forward_trees,
    output_room, screens_argmax,
)
from specula.min_tokens import EndsMasked
from specula.penalties import PenalizedLogits
from specula.planner import PassThroughPlanner, Plan, Planner, PlanRequest, StepTiming
from specula.prefill import PromptPrefill
from specula.prefix_cache import PrefixCache, RowLog
from specula.prompts import is_integer
from specula.sampling import SamplingParams, make_generator, request_seed, reserve_noise_width
from specula.stats import GenerationStats
from specula.step import DraftBudget, DraftContext, Proposal, StepResult
from specula.stopping import TextStream
from specula.verify import verify_step

log = logging.getLogger(__name__)


DEFAULT_PREFIX_CACHE_MIB = 1024
"""`EngineConfig.prefix_cache_mib` where the prefix cache is on by default: Qwen2.5-Coder-1.5B's float32 keys and
values take 56 KiB a token, so about 18,000 tokens of earlier requests (a draft model keeps a quarter as much of
its own: `DRAFT_PREFIX_SHARE`)."""

DRAFT_PREFIX_SHARE = 4
"""A draft model's prefix cache is the engine's divided by this: Qwen2.5-Coder-0.5B's keys and values take 24 KiB a
token against the 1.5B's 56, and it reads at most its window of a long prompt."""

DRAFTING_LIMITS = ("max_tree_nodes",)
"""The `EngineConfig` fields that bound drafting alone: method none (plain decoding) drafts nothing, so `api.load`
and `Specula` refuse them set away from their defaults for it (`EngineConfig.drafting_limits_set`), and the command
line the flags of the same name (`methods.check_drafting_used`)."""


@dataclass(frozen=True)
class EngineConfig:
    """Limits of the decode loop."""

    max_tree_nodes: int = 64
    """Most tree nodes verified in one target pass (the planner may choose fewer)."""
    prefix_cache_mib: int | None = None
    """MiB of finished requests' target caches kept so that a request whose prompt begins with the same
    tokens (a chat's next turn, a shared system prompt) prefills only the rest (`prefix_cache`; running
    requests' are copied from too, and a draft model keeps a quarter as much of its own). None:
    `DEFAULT_PREFIX_CACHE_MIB` where the target's rows are bit for bit row invariant (greedy guarantee
    "bitwise": outputs then equal an uncached run's exactly) and its sequences copy prefixes, else off; 0: off."""

    def __post_init__(self) -> None:
        if isinstance(self.max_tree_nodes, bool) or not isinstance(self.max_tree_nodes, int) or self.max_tree_nodes < 1:
            raise ConfigError(f"max_tree_nodes must be an integer >= 1, got {self.max_tree_nodes!r} (plain decoding "
                              "is the method none)")
        mib = self.prefix_cache_mib
        if mib is not None and (isinstance(mib, bool) or not isinstance(mib, int) or mib < 0):
            raise ConfigError(f"prefix_cache_mib must be an integer >= 0 (0: no prefix cache), got {mib!r}")

    def drafting_limits_set(self) -> list[str]:
        """The `DRAFTING_LIMITS` set away from their defaults, in that order (what plain decoding would ignore)."""
        default = EngineConfig()
        return [name for name in DRAFTING_LIMITS if getattr(self, name) != getattr(default, name)]

    def without_drafting_limits(self) -> "EngineConfig":
        """This config with the `DRAFTING_LIMITS` at their defaults: plain decoding's beside a method that drafts
        (`Specula.baseline`, the bench's baseline)."""
        default = EngineConfig()
        return replace(self, **{name: getattr(default, name) for name in DRAFTING_LIMITS})


@dataclass
class GenerationOutput:
    """Result of one generation."""

    token_ids: list[int]
    """New tokens only (the prompt excluded)."""
    text: str
    """Decoded new tokens, stop string excluded ("" when no tokenizer was given)."""
    stats: GenerationStats
    """Counters and timings."""
    logprobs: list[TokenLogprob] | None = None
    """One per new token when the request asked (`SamplingParams.logprobs`), else None."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One per prompt token, None for the first, when the request asked
    (`SamplingParams.prompt_logprobs`), else None."""


@dataclass
class StreamChunk:
    """One streamed step: the tokens and text it added; `stats` is final on the last chunk."""

    token_ids: list[int]
    text: str
    finished: bool = False
    stats: GenerationStats | None = field(default=None, repr=False)
    error: Exception | None = None
    """Set (with `finished`) when this session's own drafting, rule or bookkeeping raised: the
    session ends with finish_reason "error", the others in the step go on."""
    logprobs: list[TokenLogprob] | None = None
    """One per token of `token_ids` when the request asked (`SamplingParams.logprobs`)."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """The prompt's, on a session's first chunk when the request asked (`Session.prompt_logprobs`)."""


@dataclass
class Session:
    """One generation request in flight (everything that belongs to it alone)."""

    prompt: list[int]
    """The prompt's token ids."""
    params: SamplingParams
    """Sampling parameters and limits of the request."""
    seq: TargetSequence
    """The target's KV cache of this request."""
    generator: torch.Generator
    """The request's random generator (seeded by params.seed): drafters that sample, and the rules
    for sampled children."""
    seed: int
    """The request's sampling seed (params.seed, or a random one): seeds the per-position noise that
    decides the target's tokens (`sampling.position_noise`), so the same seed gives the same sample
    whatever is drafted; the drafters race their fixed candidates with it (`DraftContext.couples`)."""
    drafter_states: list[Any]
    """Per-request state of each drafter (`Drafter.start()`), in drafter order."""
    planner_state: Any
    """Per-request planner state (back-off, exploration; None for the pass-through planner)."""
    text: TextStream
    """Incremental text and stop strings."""
    stats: GenerationStats = field(default_factory=GenerationStats)
    tokens: list[int] = field(default_factory=list)
    """Committed tokens + the root (the last emitted token)."""
    generated: list[int] = field(default_factory=list)
    """New tokens so far."""
    finish_reason: str | None = None
    """None while running; then "stop" (EOS, stop string, a complete grammar match) or "length"
    (max_new_tokens, window)."""
    grammar: GrammarState | None = None
    """The request's constraint state (None: unconstrained): the target's distribution is masked
    to it, drafts it forbids are dropped, tokens it forces are drafted for free."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """The prompt tokens' logprobs (None for the first), set by `start` when the request asked."""
    features: RowLog | None = None
    """The hidden states of the committed tokens, kept for the prefix cache when a drafter reads them."""
    pending_prefill: PromptPrefill | None = None
    """The prompt's prefill while part of it has yet to run (chunked prefill); None once prefilled."""
    freed: bool = False
    """`finish` has handed its cache on (to the prefix cache) or freed it."""
    t_start: float = 0.0
    owner: Any = None
    """The decoder that started the session (only it may step it)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilled(self) -> bool:
        """The whole prompt has run: the session may step."""
        return self.pending_prefill is None


class SpeculativeDecoder:
    """Target backend + drafters + planner = lossless speculative generation."""

    def __init__(
        self,
        target: TargetModel,
        drafters: Drafter | Sequence[Drafter],
        tokenizer=None,
        *,
        eos_token_ids: Sequence[int] | None = None,
        planner: Planner | None = None,
        config: EngineConfig = EngineConfig(),
        method: str | None = None,
    ) -> None:
        self.target = target
        self.drafters: list[Drafter] = [drafters] if isinstance(drafters, Drafter) else list(drafters)
        self.tokenizer = tokenizer
        self.planner: Planner = planner if planner is not None else PassThroughPlanner()
        """Merges and sizes the proposals (`PassThroughPlanner` when none is given: merge + budget)."""
        self.config = config
        self.method = method or "+".join(d.name for d in self.drafters) or "none"
        ids = target.eos_token_ids if eos_token_ids is None else eos_token_ids
        self.eos_token_ids = frozenset(int(e) for e in ids)
        self.hidden: FeatureRequest = feature_request(self.drafters)
        """What the target's passes return for the drafters that read hidden states (no extra pass);
        False: none does."""
        self.forced_drafts = any(not isinstance(d, NoDrafter) for d in self.drafters)
        """Draft the tokens a request's grammar forces (every method that drafts; plain decoding
        stays one token per step)."""
        self.prefix_cache = prefix_cache_for(target, config.prefix_cache_mib)
        """Finished requests' target caches for the requests that begin alike (None: off)."""
        for drafter in self.drafters:  # a draft model's caches likewise (its drafts need no exactness)
            if self.prefix_cache is not None and hasattr(drafter, "keep_prefixes"):
                drafter.keep_prefixes(self.prefix_cache.max_bytes // DRAFT_PREFIX_SHARE)
        if screens_argmax(target):  # the greedy steps' output screen (`forward_trees`' argmax_only): built now
            target.output_screen()  # (0.1 s for the 1.5B), not inside the first step the planner times

    @property
    def planned(self) -> bool:
        """Whether a planner sizes the trees (False: the pass-through planner, merge + budget)."""
        return not isinstance(self.planner, PassThroughPlanner)

    # ------------------------------------------------------------------ sessions
    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt's ids, checked with the request's params as `start` checks them (ConfigError
        naming the problem): not empty, token ids of the vocabulary, within the context window with
        one new token, a logit bias and stop ids on the vocabulary, stop strings only with a tokenizer."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ConfigError("the prompt is empty: give at least one token of text")
        vocab = self.target.vocab_size
        outside = [t for t in prompt if not 0 <= t < vocab]
        if outside:
            raise ConfigError(f"prompt token id {outside[0]} is outside the model's vocabulary of {vocab}")
        check_context(self.target, len(prompt) + 1, f"the prompt ({len(prompt)} tokens) plus one new token")
        problem = params.vocabulary_problem(vocab)
        if problem:
            raise ConfigError(problem[1])
        if params.stop and self.tokenizer is None:
            raise ConfigError("stop strings need the target's tokenizer to read the text: build the decoder "
                              "with one, or stop on token ids (stop_token_ids)")
        return prompt

    def start(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
              constraint: Constraint | None = None, max_prefill_tokens: int | None = None) -> Session:
        """A new request: checks the prompt against the context window (once), compiles its
        constraint (ConstraintError when it cannot), prefills it and gives every drafter and the
        planner their per-request state. With `max_prefill_tokens`, at most that many prompt tokens
        run now (chunked prefill): while `session.prefilled` is False, `prefill` runs more, and the
        session cannot step."""
        prompt = self.check_request(prompt_ids, params)
        grammar = None
        if constraint is not None:
            if self.tokenizer is None:
                raise ConfigError("a constraint needs the target's tokenizer: build the decoder with one")
            if params.min_new_tokens:  # a complete match allows EOS alone: every token would be masked
                raise ConfigError("min_new_tokens cannot be combined with a constraint (a complete match "
                                  "allows only the end-of-sequence token): drop one of them")
            grammar = GrammarState(constraint, self.tokenizer, self.target.vocab_size, sorted(self.eos_token_ids))
        t_start = time.perf_counter()
        seq = self.target.new_sequence()
        hit = None
        if self.prefix_cache is not None and params.prompt_logprobs is None:  # logprobs: every prompt row's logits
            hit = self.prefix_cache.take(prompt, seq, bool(self.hidden))
        seed = request_seed(params.seed)
        if not params.greedy:  # drafts race their first positions with the noise verification reads, drawn once
            reserve_noise_width(seed, self.target.vocab_size)
        session = Session(
            prompt=prompt, params=params, seq=seq, generator=make_generator(seed, self.target.device), seed=seed,
            drafter_states=[], planner_state=self.planner.new_state(),
            text=TextStream(self.tokenizer, params.stop, prompt, params.min_new_tokens, params.kept_special_tokens),
            tokens=list(prompt), t_start=t_start, grammar=grammar,
            owner=self,
        )
        session.stats.method = self.method
        session.stats.prompt_tokens = len(prompt)
        session.stats.cached_tokens = hit.length if hit is not None else 0
        session.pending_prefill = PromptPrefill(
            prompt[len(seq.tokens):], self.hidden, hit.features if hit is not None else None, params.prompt_logprobs)
        session.stats.prefill_seconds = time.perf_counter() - t_start  # the prefix cache's copy
        self.prefill(session, max_prefill_tokens)
        return session

    def prefill(self, session: Session, max_tokens: int | None = None) -> bool:
        """Run the next `max_tokens` of a session's prompt (None: the rest); True once the whole prompt has
        run, when the drafters get their per-request state and the session may step. A failure frees the
        session and raises."""
        pending = session.pending_prefill
        if pending is None:
            if session.freed:
                raise ConfigError("prefill() of a finished session: start a new one")
            return True
        t0 = time.perf_counter()
        try:
            pending.run(session.seq, max_tokens)
            if pending.finished:
                self._prefilled(session, pending)
        except BaseException:
            self.finish(session)
            raise
        finally:
            session.stats.prefill_seconds += time.perf_counter() - t0
        return session.prefilled

    def _prefilled(self, session: Session, pending: PromptPrefill) -> None:
        """The whole prompt has run: its logprobs and features on the session, the prefix cache shares it, and
        the drafters get their per-request state."""
        hidden = pending.features()  # [len(prompt) - 1, k E] or None
        if pending.top_logprobs is not None:
            session.prompt_logprobs = pending.entries
        if self.prefix_cache is not None:
            session.features = RowLog(hidden) if hidden is not None else None
            self.prefix_cache.share(session.seq, session.features)  # its prompt for the requests that start meanwhile
        session.drafter_states = [d.start() for d in self.drafters]
        if self.hidden:
            for drafter, state in zip(self.drafters, session.drafter_states):
                if isinstance(drafter, FeatureDrafter) and drafter.needs_hidden:
                    drafter.observe_prompt(session.prompt, hidden, state)
        session.pending_prefill = None

    def finish(self, session: Session) -> None:
        """Free a session's caches and drafter state (idempotent); final stats are kept. Every
        drafter's clean-up runs and the caches are freed even where one raises; the first error is
        raised after."""
        errors = []
        for drafter, state in zip(self.drafters, session.drafter_states):
            try:
                drafter.finish(state)
            except Exception as exc:  # a state save, online distillation: the others still run
                errors.append(exc)
        session.drafter_states = []
        pending, session.pending_prefill = session.pending_prefill, None  # a prompt part-way through: abandoned
        if pending is not None and self.prefix_cache is not None and not session.freed:  # what ran is kept, with
            partial = pending.features()  # the features a head reads ([tokens run, k E]), for a retry
            session.features = RowLog(partial) if partial is not None else None
        if not session.freed:
            if self.prefix_cache is not None:
                self.prefix_cache.put(session.seq, session.features)  # kept for a request that begins alike
            else:
                session.seq.release()
            session.features, session.freed = None, True
        if session.finish_reason is None:
            session.finish_reason = session.stats.finish_reason = "cancelled"
        if session.stats.planner is None:
            session.stats.planner = self.planner.summary(session.planner_state)
        if errors:
            raise errors[0]

    def step(self, sessions: Sequence[Session]) -> list[StreamChunk]:
        """Advance each running session by one decode step, verifying every running session's tree
        in one target pass where the backend batches (`models.base.forward_trees`; else one pass
        each): the tokens and text each added (a finished session gets an empty chunk). Sessions
        may join and leave between steps; each gets exactly what it would alone (its own drafts,
        rule, generator and cache)."""
        self._check_step(sessions)
        running = [s for s in sessions if not s.finished]
        failed: dict[int, Exception] = {}
        chunks: dict[int, StreamChunk] = {}
        try:
            planned = self._plan(running, failed)
            running = [s for s in running if id(s) not in failed]
            items = [(s.seq, s.tokens[-1], plan.proposal.tree) for s, (plan, _) in zip(running, planned)]
            packed = len(items) > 1 and conforms(self.target, BatchedTargetModel)
            if packed:  # one pass for all: each session's step took it
                t1 = time.perf_counter()
                outs = forward_trees(self.target, items, hidden=self.hidden,
                                     argmax_only=all(_argmax_only(s, plan, self.target)
                                                     for s, (plan, _) in zip(running, planned)))
                seconds = [time.perf_counter() - t1] * len(items)
            else:  # a pass each (a backend that does not pack): each session is charged its own, which the
                # back-off judges its drafting by (the batch's sum made drafting look 4x dearer at 4 sessions)
                outs, seconds = [], []
                for s, item, (plan, _) in zip(running, items, planned):
                    t1 = time.perf_counter()
                    outs += forward_trees(self.target, [item], hidden=self.hidden,
                                          argmax_only=_argmax_only(s, plan, self.target))
                    seconds.append(time.perf_counter() - t1)
            for s, (plan, draft_seconds), out, pass_seconds in zip(running, planned, outs, seconds):
                rows, hidden = out if self.hidden else (out, None)
                try:
                    chunks[id(s)] = self._conclude(s, plan, rows, draft_seconds, pass_seconds, hidden=hidden)
                except Exception as exc:  # this session's rule or bookkeeping: it alone fails
                    failed[id(s)] = exc
        except BaseException:  # an interrupt (Ctrl-C) or a failed pass: a session stepped half-way (its cache
            # committed, its tokens not; a tree left pending) would give wrong output if stepped on: each
            # running session ends in "error" and is freed
            for s in sessions:
                if not s.finished:
                    s.finish_reason = s.stats.finish_reason = "error"
                    with contextlib.suppress(Exception):  # what propagates is the step's exception
                        self.finish(s)
            raise
        emitted = [len(chunks[id(s)].token_ids) if id(s) in chunks else 0 for s in running]
        if packed:
            self.planner.observe_pass([plan for plan, _ in planned], seconds[0], emitted,
                                      sum(draft for _, draft in planned))
        else:  # lone passes: each corrects the cost model of its size
            for (plan, draft), pass_seconds, n in zip(planned, seconds, emitted):
                self.planner.observe_pass([plan], pass_seconds, [n], draft)
        for s in sessions:
            if id(s) in failed:
                s.finish_reason = s.stats.finish_reason = "error"
                chunks[id(s)] = StreamChunk([], "", True, s.stats, error=failed[id(s)])
        return [chunks[id(s)] if id(s) in chunks else StreamChunk([], "", True, s.stats) for s in sessions]

    def _check_step(self, sessions: Sequence[Session]) -> None:
        """A ConfigError for a session listed twice or started by another decoder (before anything runs)."""
        seen: set[int] = set()
        for s in sessions:
            if id(s) in seen:
                raise ConfigError("a session was passed twice to one step(): list each once")
            seen.add(id(s))
            if s.owner is not None and s.owner is not self:
                raise ConfigError("a session started by another decoder was passed to step(): step it with the "
                                  "Specula (or decoder) that started it")
            if not s.prefilled:
                raise ConfigError("a session still prefilling its prompt was passed to step(): call prefill() "
                                  "until it returns True first")

    # ------------------------------------------------------------------ one request
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
                 constraint: Constraint | None = None) -> GenerationOutput:
        """Generate from token ids (matching `constraint` when given); returns the new tokens,
        their text and the stats."""
        collected = _Collected(params)
        for chunk in self.stream(prompt_ids, params, constraint):
            collected.add(chunk)
        return collected.output()

    def generate_many(self, jobs: Iterable[tuple[Any, Sequence[int], SamplingParams]], max_batch_size: int = 8,
                      constraint: Constraint | None = None) -> Iterator[tuple[Any, GenerationOutput]]:
        """Continuous batching offline: `jobs` (key, prompt ids, params; drawn lazily) run through
        `step`, up to `max_batch_size` sessions at once, each joining as another finishes; yields
        (key, output) as each finishes (not in job order). Each output is what `generate` gives the
        job alone. An error in one job frees every session and raises."""
        if not is_integer(max_batch_size) or max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        pending = iter(jobs)
        running: list[tuple[Any, Session, _Collected]] = []
        try:
            while True:
                while len(running) < max_batch_size:
                    job = next(pending, None)
                    if job is None:
                        break
                    key, ids, params = job
                    try:
                        session = self.start(ids, params, constraint)
                    except Exception as exc:
                        exc.add_note(f"(while starting job {key!r})")
                        raise
                    running.append((key, session, _Collected(params)))
                if not running:
                    return
                still = []
                for (key, session, collected), chunk in zip(running, self.step([s for _, s, _ in running])):
                    if chunk.error is not None:
                        chunk.error.add_note(f"(while generating job {key!r})")
                        raise chunk.error
                    collected.add(chunk)
                    if chunk.finished:
                        self.finish(session)
                        yield key, collected.output()
                    else:
                        still.append((key, session, collected))
                running = still
        finally:
            for _, session, _ in running:
                self.finish(session)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
               constraint: Constraint | None = None) -> Iterator[StreamChunk]:
        """One chunk per decode step; the last has `finished` and the final stats. Bad input raises
        here, at the call (`check_request`); the request starts at the first chunk asked for, and
        closing the iterator early frees its session."""
        self.check_request(prompt_ids, params)
        return self._stream(prompt_ids, params, constraint)

    def _stream(self, prompt_ids: Sequence[int], params: SamplingParams,
                constraint: Constraint | None) -> Iterator[StreamChunk]:
        session = self.start(prompt_ids, params, constraint)
        try:
            while not session.finished:
                chunk = self.step([session])[0]
                if chunk.error is not None:
                    raise chunk.error
                if chunk.finished:
                    self.finish(session)
                yield chunk
        finally:
            self.finish(session)

    # ------------------------------------------------------------------ the step
    def _plan(self, sessions: Sequence[Session], failed: dict[int, Exception]) -> list[tuple[Plan, float]]:
        """Drafters propose for each session, the planner merges and sizes (across the batch):
        each session's plan and drafting seconds (its share of the planning included). A session
        whose drafters raise, or whose request the planner fails on alone where the batch's plan
        raised, goes to `failed` and is left out (logged: a planner bug, not a bad request)."""
        requests = self._draft(sessions, failed)
        sessions = [s for s in sessions if id(s) not in failed]
        t0 = time.perf_counter()
        try:
            plans = self.planner.plan(requests)
        except Exception:
            culprits = self._plan_culprits(sessions, requests)
            if not culprits or len(culprits) == len(sessions):  # each alone plans (or none does): the batch fails
                raise
            log.exception("planning a batch of %d requests failed; the %d it fails on alone end in error",
                          len(sessions), len(culprits))
            failed.update(culprits)
            kept = [i for i, s in enumerate(sessions) if id(s) not in failed]
            sessions, requests = [sessions[i] for i in kept], [requests[i] for i in kept]
            plans = self.planner.plan(requests)
        for s, plan in zip(sessions, plans):
            if plan.predicted is not None:
                s.stats.predicted_accepted += plan.predicted
            s.stats.speculation_off_by_load += plan.off_by_load
        share = (time.perf_counter() - t0) / max(1, len(sessions))
        return [(plan, r.draft_seconds + share) for plan, r in zip(plans, requests)]

    def _plan_culprits(self, sessions: Sequence[Session], requests: Sequence[PlanRequest]) -> dict[int, Exception]:
        """The batch's plan raised: the sessions whose request fails to plan alone, with their
        exceptions (each tried on a copy of its planner state, which the batch's plan then reads)."""
        culprits: dict[int, Exception] = {}
        if len(requests) < 2:
            return culprits
        for s, r in zip(sessions, requests):
            try:
                self.planner.plan([replace(r, state=copy.deepcopy(r.state))])
            except Exception as exc:  # this request's drafts are what the planner cannot plan
                culprits[id(s)] = exc
        return culprits

    def _draft(self, sessions: Sequence[Session], failed: dict[int, Exception]) -> list[PlanRequest]:
        """The drafters' proposals for each session, with its budget and drafting seconds, drafter by
        drafter across the batch: a drafter with lockstep steps (`drafters.lockstep`) drafts every
        session's tree in step, so that its passes of a level run as one call (a trained head's level
        for the whole batch in one kernel call); each session's cost view still reads only its own
        earlier drafters' trees. A session whose drafter raises goes to `failed`."""
        drafts = []
        for s in sessions:
            try:
                drafts.append(_Drafting.of(self, s, len(sessions)))
            except Exception as exc:  # one request's failing must not fail the others
                failed[id(s)] = exc
        for k, drafter in enumerate(self.drafters):
            todo = [d for d in drafts if d.drafting and drafter.name not in d.held and id(d.session) not in failed]
            steps = getattr(drafter, "propose_steps", None)
            if steps is not None and len(todo) > 1:
                clocks = [ShareClock() for _ in todo]
                runs = []
                for d, clock in zip(todo, clocks):
                    t1 = time.perf_counter()
                    runs.append(steps(d.context(self.planner, len(sessions)), d.session.drafter_states[k], clock))
                    clock.spent += time.perf_counter() - t1
                outcomes = zip(todo, drive_many(runs, clocks), (clock() for clock in clocks))
            else:
                outcomes = (d.propose(drafter, k, self.planner, len(sessions)) for d in todo)
            for d, proposal, seconds in outcomes:
                if isinstance(proposal, Exception):  # one request's drafter failing must not fail the others
                    failed[id(d.session)] = proposal
                else:
                    d.add(drafter.name, proposal, seconds)
        requests = []
        for d in drafts:
            if id(d.session) in failed:
                continue
            try:
                requests.append(d.request(self.forced_drafts))
            except Exception as exc:  # its grammar's drafts: it alone fails
                failed[id(d.session)] = exc
        return requests

    def _conclude(self, session: Session, plan: Plan, logits: torch.Tensor, draft_seconds: float,
                  pass_seconds: float, hidden: torch.Tensor | None = None) -> StreamChunk:
        """The rule accepts, the cache commits, drafters and planner observe; the step's chunk.
        `logits` [n + 1, vocab] (and `hidden` [n + 1, E] when a drafter asked) came from a pass of
        `pass_seconds`."""
        target, planner, stats, tokens = self.target, self.planner, session.stats, session.tokens
        proposal = plan.proposal
        t1 = time.perf_counter()
        logits_p = logits
        if session.grammar is not None:  # the constrained law: forbidden tokens at -inf, row by row
            logits_p = session.grammar.masked(logits_p, proposal.tree)
        if session.params.penalized:  # each row by its own history: the output, then its path
            logits_p = PenalizedLogits(logits_p, proposal.tree, session.prompt, session.generated, session.params)
        if len(session.generated) < session.params.min_new_tokens:  # each row by its output position
            logits_p = EndsMasked(logits_p, proposal.tree, len(session.generated), session.params,
                                  self.eos_token_ids)
        if logits_p is not logits and logits.device.type != "cpu":
            logits_p = logits_p.full()
        result = verify_step(proposal.tree, logits_p, session.params, q=proposal.q, mode=proposal.sibling_mode,
                             seed=session.seed, position=len(session.generated), generator=session.generator)
        t2 = time.perf_counter()
        verify_seconds = pass_seconds + (t2 - t1)

        session.seq.commit(result.path)
        if session.features is not None and hidden is not None:
            with serial_cpu_ops():  # torch split the 1.5B's 4 rows of 4,608 over its sleeping workers: 0.34 ms
                session.features.extend(step_rows_of(hidden, result.path))  # the root's row and each accepted node's
        t3 = time.perf_counter()
        step = StepResult(tokens[-1], proposal, result.path, result.next_token, logits, hidden,
                          idle=plan.idle_by_load)
        for drafter, state in zip(self.drafters, session.drafter_states):
            drafter.observe(step, state)
        planner.observe(plan, step, session.planner_state,
                        StepTiming(draft_seconds, verify_seconds, time.perf_counter() - t3))
        t4 = time.perf_counter()

        stats.draft_seconds += draft_seconds + (t4 - t3)
        stats.verify_seconds += verify_seconds
        stats.commit_seconds += t3 - t2

        new, reason = self._truncate([*step.accepted_tokens, result.next_token], session)
        if session.grammar is not None:
            new = session.grammar.commit(new)
            if session.grammar.ended:
                reason = "stop"  # EOS after a complete match: also where EOS is otherwise ignored
        if reason is None and not output_room(target.max_context, len(tokens) + len(new)):
            reason = "length"
        # the text token by token, as plain decoding makes it: a stop string ends the output where it
        # would there, however many tokens this step accepted
        new, text, stopped = session.text.take(new, final=reason is not None)
        if stopped:
            reason = "stop"
        # The stats count what the step emitted: drafts accepted past EOS, a stop or the budget are cut.
        tree = proposal.tree
        stats.record_step(tree.depth, [[name for name, _ in tree.proposers(i)] for i in range(len(tree))],
                          result.path[:max(0, len(new) - 1)])
        logprobs = None
        if session.params.logprobs is not None:  # the rows the emitted tokens came from (raw logits)
            logprobs = token_logprobs(logits[step_rows(result.path)[: len(new)]], new, session.params.logprobs)
        session.generated.extend(new)
        tokens.extend(new)
        stats.new_tokens = len(session.generated)
        stats.seconds = time.perf_counter() - session.t_start
        if reason is not None:
            session.finish_reason = stats.finish_reason = reason
        return StreamChunk(new, text, reason is not None, stats, logprobs=logprobs,
                           prompt_logprobs=session.prompt_logprobs if stats.steps == 1 else None)

    def _truncate(self, new: list[int], session: Session) -> tuple[list[int], str | None]:
        """Cut the step's tokens at EOS or a stop token id, or max_new_tokens (stop strings: the
        text stream's `take`)."""
        params = session.params
        reason = None
        for i, tok in enumerate(new):
            if tok in params.stop_token_ids or (tok in self.eos_token_ids and not params.ignore_eos):
                new, reason = new[: i + 1], "stop"
                break
        limit = params.max_new_tokens - len(session.generated)
        if len(new) > limit:
            new, reason = new[:limit], "length"
        elif len(new) == limit and reason is None:
            reason = "length"
        return new, reason


class _Drafting:
    """One session's drafting in a step (`SpeculativeDecoder._draft`): its context and budget, the
    drafters it holds back, and the proposals and seconds so far."""

    def __init__(self, session: Session, ctx: DraftContext, drafting: bool, held: frozenset[str]) -> None:
        self.session, self.ctx, self.drafting, self.held = session, ctx, drafting, held
        self.proposals: list[Proposal] = []
        self.spent: list[tuple[str, float]] = []  # (drafter, seconds) of those that proposed nodes
        self.seconds = 0.0  # drafting seconds so far, its share of lockstep calls included

    @classmethod
    def of(cls, decoder: "SpeculativeDecoder", session: Session, batch_size: int) -> "_Drafting":
        t0 = time.perf_counter()
        target, planner, params, tokens = decoder.target, decoder.planner, session.params, session.tokens
        remaining = params.max_new_tokens - len(session.generated)
        room = output_room(target.max_context, len(tokens))  # the cache would hold len(tokens) + n nodes
        # A path of depth d emits d + 1 tokens (the bonus one), and plain decoding stops at the window.
        budget = DraftBudget(max_nodes=max(0, min(decoder.config.max_tree_nodes, room)),
                             max_depth=max(0, min(remaining - 1, room - 1)))
        ctx = DraftContext(tokens, len(session.prompt), params, budget, session.generator, target=session.seq,
                           seed=session.seed)
        drafting = budget.max_nodes > 0 and budget.max_depth > 0 and planner.should_draft(session.planner_state,
                                                                                           batch_size)
        held = frozenset(planner.held(session.planner_state)) if drafting else frozenset()
        made = cls(session, ctx, drafting, held)
        made.seconds = time.perf_counter() - t0
        return made

    def context(self, planner: Planner, batch_size: int) -> DraftContext:
        """The context for the next drafter: with a cost view of this session's proposals so far
        (`planner.view`)."""
        view = planner.view(self.proposals, self.seconds, batch_size, self.session.planner_state)
        return replace(self.ctx, cost=view)

    def propose(self, drafter: Drafter, k: int, planner: Planner,
                batch_size: int) -> tuple["_Drafting", Proposal | Exception, float]:
        """Drafter k proposes for this session alone: (self, its proposal or the exception it raised, seconds)."""
        t1 = time.perf_counter()
        try:
            proposal: Proposal | Exception = drafter.propose(self.context(planner, batch_size),
                                                             self.session.drafter_states[k])
        except Exception as exc:  # one request's drafter failing must not fail the others
            proposal = exc
        return self, proposal, time.perf_counter() - t1

    def add(self, name: str, proposal: Proposal, seconds: float) -> None:
        self.proposals.append(proposal)
        self.seconds += seconds
        if len(proposal.tree):
            self.spent.append((name, seconds))

    def request(self, forced_drafts: bool) -> PlanRequest:
        """The planner's request (the grammar's forced chain added to the proposals of a constrained session)."""
        t1 = time.perf_counter()
        session, proposals, drafting = self.session, self.proposals, self.drafting
        if session.grammar is not None:
            proposals = constrained_proposals(session.grammar, proposals, self.ctx.budget, forced_drafts)
            drafting = drafting or bool(proposals)  # a forced chain is verified even while drafting pauses
        session.stats.proposed_tokens += sum(len(p.tree) for p in proposals)
        seconds = self.seconds + time.perf_counter() - t1
        return PlanRequest(proposals, self.ctx.budget, session.planner_state, seconds, drafting, tuple(self.spent))


class _Collected:
    """One request's chunks gathered into its `GenerationOutput`."""

    def __init__(self, params: SamplingParams) -> None:
        self.tokens: list[int] = []
        self.texts: list[str] = []
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.stats: GenerationStats | None = None

    def add(self, chunk: StreamChunk) -> None:
        self.tokens.extend(chunk.token_ids)
        self.texts.append(chunk.text)
        if self.logprobs is not None:
            self.logprobs.extend(chunk.logprobs or ())
        self.prompt_logprobs = self.prompt_logprobs or chunk.prompt_logprobs
        self.stats = chunk.stats

    def output(self) -> GenerationOutput:
        assert self.stats is not None
        return GenerationOutput(self.tokens, "".join(self.texts), self.stats, self.logprobs, self.prompt_logprobs)


def _argmax_only(session: Session, plan: Plan, target: TargetModel) -> bool:
    """Whether a step of `session` reads only an argmax of each row (`models.base.forward_trees`'
    `argmax_only`), without logprobs (which read whole rows; they would still get the exact logits,
    computed after the pass): greedy, or sampled with fixed candidates at a temperature, with or without a
    top-k (top-p within it), min-p or top-p over every id (the race in logit form, an argmax of each row changed,
    or of the few ids the truncation keeps: `verify.verify_raced_logits`; top-p over every id computes a row whose
    nucleus the screen's bounds leave open). A grammar's masks, penalties and a min_new_tokens mask
    change the argmax each row source takes (`TreeRows.exact_argmax`, `TreeRows.exact_top`).
    Children drawn from q are verified against the whole distribution: not screened; nor are truncated samples
    where the target's output layer is too small for their candidates to pay (`models.base.screens_argmax`' top and
    nucleus).
    """
    params = session.params
    if params.logprobs is not None:
        return False
    if params.greedy:
        return True
    return plan.proposal.sibling_mode == "deterministic" and (
        not params.truncates or screens_argmax(target, top=True, nucleus=params.ranks_every_id))


def feature_request(drafters) -> FeatureRequest:
    """The one `FeatureRequest` of an engine's drafters (False: none reads hidden states); a
    ConfigError when two ask for different features (one pass returns one set)."""
    asked = {d.feature_request for d in drafters if isinstance(d, FeatureDrafter) and d.needs_hidden}
    if len(asked) > 1:
        raise ConfigError(f"the drafters read different target features ({', '.join(sorted(map(str, asked)))}): "
                          "use heads of one kind together (eagle3 heads read layer inputs, the others the last state)")
    return asked.pop() if asked else False


def prefix_cache_for(target: TargetModel, mib: int | None) -> PrefixCache | None:
    """The prefix cache of an engine on `target` (`EngineConfig.prefix_cache_mib`): None when off; a
    ConfigError when asked for on a backend whose sequences cannot copy a prefix."""
    copies = getattr(target, "copies_prefixes", False)
    if mib is None:
        mib = DEFAULT_PREFIX_CACHE_MIB if copies and target.greedy_guarantee == "bitwise" else 0
    if mib == 0:
        return None
    if not copies:
        raise no_prefix_cache(f"{target.name}'s backend")
    return PrefixCache(mib << 20)


def no_prefix_cache(backend: str) -> ConfigError:
    """The error of a prefix cache asked for on `backend`, whose sequences cannot copy a prefix."""
    return ConfigError(f"{backend} cannot copy a sequence's cache, so it has no prefix cache: use the native "
                       "backend (--backend native), or prefix_cache_mib=0")
