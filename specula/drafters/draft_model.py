"""`draft-model`: a smaller model with the same tokenizer drafts a chain of k tokens.

Each request keeps its own draft KV cache (the drafter's per-request state). Before proposing
it is synchronised with the committed tokens: the cache is cropped to the longest common prefix
(this is the rollback of the previous step's rejected drafts) and the missing committed tokens
are appended. Greedy requests draft the argmax (deterministic candidates); sampled requests with
fixed candidates race the draft's processed q against the target's noise at each position (coupled
candidates, `DraftContext.coupled_candidate`); the others draw each token from the draft's processed
distribution q (same temperature / top-k / top-p as the target) and return q for the acceptance
rule. Greedy proposals carry the draft's softmax rows as `q` too (not used by the rule; the planner
prunes retrieval branches with them).

Adaptive (SpecDec++-style, with lookahead): with a planner, the cost view says before the first
token how long a chain is worth drafting (its expected tokens against drafting + verify time,
catching the draft cache up included and spread over the request), so a step skips the draft
model when no chain beats what the other drafters' trees reach, and after each token whether the
rest still pays. A drafter the planner has no data on is assumed to be accepted often
(`PlannerConfig.explore_prior`), so it is tried and its real acceptance learned.

A long prompt (`draft_window`): the draft cache reads the prompt's first and last `draft_window / 2`
tokens, then everything generated after it, at consecutive positions. The draft's prefill then costs
a fixed amount however long the prompt; its drafts may be worse, never the output (the target
verifies every one). Both ends, because what a long prompt's answer draws on sits at both: a news
article's lede and a question asked after a document (Spec-Bench summary 293: a window of the
opening 32 tokens and the last 480 cut the lede, and the 0.5B's acceptance fell from 0.72 to 0.26;
halves kept it at 0.72; docs/training.md, "The draft model's window on long prompts").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from specula.drafters.base import DraftContext, Proposal, StepResult, method_config
from specula.drafters.chain import chain_steps
from specula.drafters.lockstep import AfterOthers, Clock, Steps, drive
from specula.ema import Ema
from specula.errors import ConfigError
from specula.models.base import (
    BatchedTargetModel, TargetModel, TargetSequence, common_prefix_length, conforms, forward_trees,
    keep_common_prefix,
)
from specula.prefix_cache import PrefixCache
from specula.sampling import SamplingParams
from specula.tree import TokenTree

MIN_WINDOW = 64
"""The smallest `draft_window`: its first half holds a chat template's system turn and the start of
the user's."""
DEFAULT_WINDOW = 512
"""`draft_window` when none is given. Measured on Spec-Bench's long prompts (10 rag and summary
prompts of 363-1,147 tokens, 1.5B with the 0.5B in int4 on a 2-core CPU, in one bench run): the
0.5B's drafting took 26.9 s in all instead of 35.4 s, `fusion` ran 2.30x plain decoding after the
prefill instead of 2.08x reading the whole prompt (1.373x against 1.349x overall), mean accepted
5.11 against 4.92. On 8 code and docs prompts of 929-1,191 tokens written for the check: drafting
28.6 s against 50.6 s, 1.252x against 1.209x, mean accepted 3.07 against 3.10 (docs/training.md,
"The draft model's window on long prompts")."""


@dataclass(frozen=True)
class DraftModelConfig:
    """Draft-model chain settings."""

    num_draft_tokens: int | None = None
    """Tokens drafted per step (k); the most per step when adaptive. Default 5, or 12 adaptive."""
    adaptive: bool = False
    """Stop drafting early by the planner's cost-derived rule (SpecDec++-style)."""
    greedy_proposals: bool | None = None
    """True: always draft fixed candidates (the argmax; for a sampled request, q raced with the target's noise:
    `DraftContext.coupled_candidate`), also when the request samples. False: a
    sampled request's chain is drawn from q (speculative sampling), seeded or not. None: fixed
    candidates for greedy and seeded requests, so that a seed reproduces its output whatever the
    planner's timings let the draft draw (`SamplingParams.fixed_drafts`); draws for the others."""
    timing_ema: float = 0.2
    """EMA weight of each measured draft-token time (and catch-up time per token)."""
    draft_window: int | None = None
    """Most prompt tokens the draft model reads: of a longer prompt, its first and last
    `draft_window / 2` (what is generated after the prompt is always read). None: `DEFAULT_WINDOW`;
    0: the whole prompt."""

    def __post_init__(self) -> None:
        if self.num_draft_tokens is None:
            object.__setattr__(self, "num_draft_tokens", 12 if self.adaptive else 5)
        if self.num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        object.__setattr__(self, "draft_window", resolve_window(self.draft_window))


def resolve_window(window: int | None) -> int:
    """A `draft_window` as it runs (`draft-model`, `draft-tree`): None -> `DEFAULT_WINDOW`; 0 (the whole
    prompt) or at least `MIN_WINDOW`, else a `ConfigError`."""
    if window is None:
        return DEFAULT_WINDOW
    if window != 0 and window < MIN_WINDOW:
        raise ConfigError(f"draft_window must be at least {MIN_WINDOW} tokens (half of it holds the prompt's "
                          f"opening), got {window}; pass e.g. 512, or 0 for the whole prompt")
    return window


def fitted_window(window: int, max_context: int) -> int:
    """The `draft_window` a draft of `max_context` tokens reads with: `window`, narrowed to half its
    context (at least `MIN_WINDOW`) where it is wider, so that the output has the other half (a
    prompt within a wider window filled a small draft's context, and it drafted nothing); 0 (the
    whole prompt) as asked."""
    return max(MIN_WINDOW, max_context // 2) if window and window > max_context // 2 else window


def window_view(tokens: Sequence[int], prompt_length: int, window: int) -> Sequence[int]:
    """The committed tokens a draft model with `window` reads: `tokens` itself when the prompt (its
    first `prompt_length`) fits or the window is 0, else the prompt's first `window // 2` and last
    `window - window // 2` tokens followed by the rest of `tokens`."""
    if window == 0 or prompt_length <= window:
        return tokens
    head = window // 2
    return list(tokens[:head]) + list(tokens[prompt_length - (window - head):])


@dataclass(frozen=True)
class VocabFit:
    """A draft model beside a target of another vocabulary width (`loading.check_compatible` allows
    extra ids at either end: added special tokens, padded output layers). The draft reads an id it
    has no row for as `PLACEHOLDER_ID` (its drafts may be worse, never the output), and its logits
    are cut to the target's ids, so it never proposes one the target lacks."""

    draft_vocab: int
    """The draft's output width (its ids; an id at or past it is not read)."""
    target_vocab: int
    """The target's output width."""

    PLACEHOLDER_ID = 0

    @staticmethod
    def of(draft: TargetModel, target: TargetModel | None) -> "VocabFit | None":
        """The fit for `draft` beside `target`; None where the widths agree (or no target is known)."""
        if target is None or target.vocab_size == draft.vocab_size:
            return None
        return VocabFit(draft.vocab_size, target.vocab_size)

    def read(self, tokens: Sequence[int]) -> Sequence[int]:
        """`tokens` as the draft reads them."""
        if self.target_vocab <= self.draft_vocab:
            return tokens
        return [t if t < self.draft_vocab else self.PLACEHOLDER_ID for t in tokens]

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., draft_vocab] over the target's ids only."""
        return logits[..., : self.target_vocab] if self.draft_vocab > self.target_vocab else logits


PACKED_PASS_TOKENS = 16
"""Most tokens of a draft pass that a packed batch runs beside its other sessions' passes (a drafted
token, a step's catch-up); a longer catch-up (a prompt) is a prefill of its own."""


@dataclass(frozen=True)
class DraftPass:
    """A draft model's pass over `ids` appended to one request's draft cache, waiting to run
    (`drafters.lockstep.Pass`): logits [vocab] after the last. A packed batch's sessions' passes
    run as one packed pass (`forward_trees`, each a chain committed whole) where the draft model
    batches: its weights are read once for the whole batch."""

    model: TargetModel
    seq: TargetSequence
    ids: tuple[int, ...]

    @property
    def key(self) -> TargetModel | None:
        """The draft model where it packs this pass with others: a batching backend, a short pass, and
        no CUDA graphs (a captured one-token pass each may beat one eager packed pass there: unmeasured)."""
        packs = (conforms(self.model, BatchedTargetModel) and len(self.ids) <= PACKED_PASS_TOKENS
                 and not getattr(self.model, "cuda_graphs", False))
        return self.model if packs else None

    def run(self) -> torch.Tensor:
        return self.seq.prefill(list(self.ids), logits="last")

    def run_many(self, passes: Sequence["DraftPass"]) -> list[torch.Tensor]:
        rows = forward_trees(self.model, [(p.seq, p.ids[0], TokenTree.chain(list(p.ids[1:]))) for p in passes])
        for p in passes:
            p.seq.commit(list(range(len(p.ids) - 1)))  # the whole chain, as a prefill keeps it
        return [logits[-1] for logits in rows]  # [n + 1, vocab] each -> the last row


class DraftModelDrafter:
    """Chain drafting with a smaller causal LM (SpS)."""

    name = "draft-model"

    def __init__(self, draft: TargetModel, config: DraftModelConfig = DraftModelConfig(),
                 fit: VocabFit | None = None) -> None:
        self.draft = draft
        self.config = config
        self.fit = fit
        """How the draft reads and scores the target's ids where their widths differ (None: alike)."""
        self.window = fitted_window(config.draft_window, draft.max_context)
        """The prompt tokens the draft reads at most (`fitted_window`)."""
        self._token_seconds = Ema(config.timing_ema)  # one draft token (a one-token pass)
        self._catch_up_seconds = Ema(config.timing_ema)  # per token, for catch-ups of >= 16 tokens
        self.prefix_cache: PrefixCache | None = None
        """Finished requests' draft caches, for the requests that begin alike (`keep_prefixes`; None: off)."""
        self._catching_up: dict[int, Sequence[int]] = {}  # per draft cache whose pass is yielded, not run: its tokens

    def keep_prefixes(self, max_bytes: int) -> None:
        """Keep up to `max_bytes` of finished requests' draft caches, so that a request whose text begins with
        one's (a chat's next turn) catches up only the rest (the engine's prefix cache, `prefix_cache`); a
        draft backend that cannot copy a prefix keeps none."""
        if getattr(self.draft, "copies_prefixes", False):
            self.prefix_cache = PrefixCache(max_bytes)

    @property
    def memory_bytes(self) -> int:
        """Bytes of the draft model's weights (its per-request KV caches come on top)."""
        return self.draft.weight_bytes

    # ------------------------------------------------------------------ per request
    def start(self) -> TargetSequence:
        seq = self.draft.new_sequence()
        if self.prefix_cache is not None:
            self.prefix_cache.share(seq, None)  # once it has caught up, for the requests that start meanwhile
        return seq

    def finish(self, seq: TargetSequence) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.put(seq, None)
        else:
            seq.release()

    def observe(self, step: StepResult, seq: TargetSequence) -> None:
        return None  # rollback happens lazily in _sync_steps()

    # ------------------------------------------------------------------ drafting
    def _sync_steps(self, seq: TargetSequence, tokens, clock: Clock) -> Steps:
        """Bring the draft cache to `tokens` (root included): logits [vocab] after the root, its pass
        yielded as a `DraftPass` (lockstep steps), timed on `clock`."""
        keep = keep_common_prefix(seq, tokens[:-1])
        t0 = clock()
        self._catching_up[id(seq)] = tokens  # what it holds once this pass ran (`_copies_after_others`)
        try:
            logits = yield DraftPass(self.draft, seq, tuple(tokens[keep:]))
        finally:
            del self._catching_up[id(seq)]
        n = len(tokens) - keep
        if n >= 16:  # a prefill-sized catch-up: learn its cost per token
            self._catch_up_seconds.update((clock() - t0) / n)
        return logits if self.fit is None else self.fit.scores(logits)

    def _next_steps(self, seq: TargetSequence, token: int) -> Steps:
        """Logits [vocab] after one more drafted token, as lockstep steps (a `DraftPass`)."""
        logits = yield DraftPass(self.draft, seq, (token,))
        return logits if self.fit is None else self.fit.scores(logits)

    def _copies_after_others(self, tokens: Sequence[int]) -> bool:
        """Whether a new request should wait for this round's other passes before it copies from the prefix cache:
        another session's draft cache catches up in them (lockstep: its pass yielded, not yet run) on at least the
        cache's `min_tokens` of this request's opening (`tokens`, its root last): the `n` choices of a prompt, or
        requests on one system prompt, that start in one step. Alone, or one after another, nothing waits."""
        head = tokens[:-1]
        return any(common_prefix_length(other, head) >= self.prefix_cache.min_tokens
                   for other in self._catching_up.values())

    def _catch_up_estimate(self, seq: TargetSequence, tokens) -> float:
        """Seconds to bring the draft cache to `tokens` before the first draft token can be drafted."""
        missing = len(tokens) - common_prefix_length(seq.tokens, tokens[:-1])
        per_token = self._catch_up_seconds.get(self._token_seconds.get() / 4)  # unmeasured: a prefill guess
        return max(0, missing - 1) * per_token

    def _fixed(self, params: SamplingParams) -> bool:
        """Whether this request's chain is fixed candidates (the argmax, or coupled) or drawn from q."""
        if params.greedy or self.config.greedy_proposals:
            return True
        return params.fixed_drafts if self.config.greedy_proposals is None else False

    def propose(self, ctx: DraftContext, seq: TargetSequence) -> Proposal:
        return drive(self.propose_steps(ctx, seq, time.perf_counter))

    def propose_steps(self, ctx: DraftContext, seq: TargetSequence, clock: Clock) -> Steps:
        """`propose` as lockstep steps (`drafters.lockstep`): its draft passes yielded as `DraftPass`es,
        which a packed batch runs as one packed pass of the draft model; timed on `clock`."""
        tokens = window_view(ctx.tokens, ctx.prompt_len, self.window)  # what the draft reads
        if self.fit is not None:
            tokens = self.fit.read(tokens)
        if not seq.tokens and self.prefix_cache is not None:  # a new request: a finished one's cache may hold its start
            if self._copies_after_others(tokens):
                yield AfterOthers()  # a running one's catches up on it in this round: copied once that has run
            self.prefix_cache.take(tokens, seq)
        room = self.draft.max_context - len(tokens) + 1  # the draft cache holds tokens + k - 1 drafts
        k = min(self.config.num_draft_tokens, ctx.budget.max_depth, ctx.budget.max_nodes, room)
        if k <= 0:
            return Proposal.empty()
        # Adaptive (with a planner): the cost view says how many tokens are worth drafting, before the
        # first (catching the draft cache up included, spread over the request) and after each one.
        # Until a draft step has been timed, the chain runs in full once: that measures it.
        adaptive = self.config.adaptive and ctx.cost is not None and self._token_seconds.value is not None
        if adaptive:
            k = ctx.cost.plan_chain(self.name, [], self._token_seconds.value, 0.0, k,
                                    self._catch_up_estimate(seq, tokens), ctx.budget.max_depth + 1)
            if k <= 0:
                return Proposal.empty()  # not worth a draft pass this step (the cache catches up later)
        t_start = clock()
        logits = yield from self._sync_steps(seq, tokens, clock)
        return (yield from chain_steps(ctx, self.name, k, logits, lambda token: self._next_steps(seq, token),
                                       self._token_seconds, clock, t_start, greedy=self._fixed(ctx.params),
                                       adaptive=adaptive))


CONFIG = DraftModelConfig
"""The options `create` takes besides its keywords (`specula.methods`)."""


def create(*, target=None, draft: TargetModel | None = None, **options) -> DraftModelDrafter:
    """options: DraftModelConfig fields (num_draft_tokens, adaptive, greedy_proposals, draft_window)."""
    if draft is None:
        raise ConfigError("method 'draft-model' needs a draft model: pass draft=MODEL (same tokenizer as the target)")
    return DraftModelDrafter(draft, method_config("draft-model", DraftModelConfig, options), VocabFit.of(draft, target))
