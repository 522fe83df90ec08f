"""`layer-skip`: the target drafts for itself with some decoder sub-layers skipped (SWIFT).

No second model and no second copy of the weights: the draft runs the target's own layers,
minus a skip set of attention and MLP sub-layers, on the target's own cache of the committed
prefix (`LayerSkipSequence.speculate`: drafted rows go to scratch slots that the verification
pass overwrites), so there is nothing to catch up after a step. Drafting is a chain that stops
when the drafted token's probability falls below `stop_below` (SWIFT: 0.8; the unsure token is
kept) or when the planner's cost view says the next token does not pay.

The skip set is found on the fly (SWIFT's idea, a cheaper search than SWIFT's for a CPU):

1. importance: the last `search_window` committed tokens (the prompt's, at first) are run again
   through the full model (`replay`), recording how far each sub-layer turns the residual stream
   (1 - cos(x, x + delta)); the sub-layers that turn it least per weight they read come first. Layers 0 and L-1 are
   never skipped (SWIFT). The same replay gives the labels: the full model's argmax after each
   token (on generated greedy text these are the committed tokens, SWIFT's labels).
2. ladder: the first r of that order for each `search_ratios` fraction r of the 2 (L - 2)
   candidate sub-layers, each scored by teacher forcing on the same window (the fraction of
   positions where the skipped model's argmax is the label: SWIFT's top-1 match score), valued by
   the chain it would draft (expected tokens per second with per-token acceptance = the match
   rate, its cost = the fraction of the weights it reads, and the planner's verify cost).
3. refinement (SWIFT's accept-if-better loop, one candidate at a time): a neighbour of the best set
   (one sub-layer more, one fewer, or one swapped, by importance) is scored with the best set on
   the current window and kept when it is worth more; stops after `max_tolerance` candidates in a
   row that were not. When no set of the ladder beats plain decoding the search ends at once with
   no skip set: the drafter then proposes nothing (small models, where every layer matters).

The search advances one replay per step, only while its time stays under `search_fraction` of the
time since the drafter was first used (its first replay excepted), and persists across requests
(as SWIFT's does). A fixed
`skip_layers` set turns it off. The output is the target's whatever the set: the target verifies.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specula.drafters.base import DraftContext, Proposal, StepResult, method_config
from specula.drafters.chain import draft_chain
from specula.ema import Ema
from specula.errors import ConfigError
from specula.models.base import LayerSkippingModel, LayerSkipSequence, SubLayer
from specula.models.skipping import candidate_sublayers, format_skip_layers, parse_skip_layers

@dataclass(frozen=True)
class LayerSkipConfig:
    """Layer-skipping self-draft settings."""

    skip_layers: str | None = None
    """A fixed skip set (`parse_skip_layers` syntax, e.g. "attn:14-26,mlp:5-12"); None = search."""
    num_draft_tokens: int = 12
    """Most tokens drafted per step (SWIFT: 25)."""
    stop_below: float = 0.8
    """Stop drafting after a token whose draft probability is below this (SWIFT: 0.8); 0 = never."""
    search_window: int = 16
    """Committed tokens replayed to rank and score skip sets."""
    search_ratios: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5)
    """Fractions of the 2 (L - 2) candidate sub-layers tried as first skip sets."""
    search_fraction: float = 0.1
    """Most of the time since the drafter was first used that the search may take (its first replay aside)."""
    max_tolerance: int = 12
    """The refinement stops after this many candidates in a row that were not better."""
    timing_ema: float = 0.2
    """EMA weight of each measured draft-token time."""
    seed: int = 0
    """Seed of the refinement's random choices."""

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if not 0.0 <= self.stop_below < 1.0:
            raise ConfigError(f"stop_below must be in [0, 1), got {self.stop_below}")
        if self.search_window < 2:
            raise ConfigError(f"search_window must be >= 2, got {self.search_window}")
        if not self.search_ratios or not all(0.0 < r < 1.0 for r in self.search_ratios):
            raise ConfigError(f"search_ratios must be fractions in (0, 1), got {self.search_ratios}")


def best_chain_rate(alpha: float, token_cost: float, verify_cost: Callable[[int], float], max_tokens: int) -> float:
    """Expected tokens per unit of time of the best chain length n <= max_tokens from a drafter
    whose tokens are each accepted with probability `alpha` (given the one before) and cost
    `token_cost` each; verifying n + 1 tokens costs verify_cost(n + 1). n = 0 is plain decoding."""
    alpha = min(max(alpha, 0.0), 0.99)
    best = 1.0 / verify_cost(1)
    expected, run = 1.0, 1.0
    for n in range(1, max_tokens + 1):
        run *= alpha
        expected += run
        best = max(best, expected / (n * token_cost + verify_cost(n + 1)))
    return best


def match_rate(logits: torch.Tensor, labels: Sequence[int]) -> float:
    """Fraction of rows of logits [n, vocab] whose argmax is the label (SWIFT's score)."""
    predicted = logits.argmax(-1).tolist()
    return sum(int(p == t) for p, t in zip(predicted, labels)) / max(1, len(labels))


# --------------------------------------------------------------------------- search
@dataclass
class SkipSearch:
    """The skip-set search (shared by the drafter's requests; see the module docstring).

    It advances one replay at a time (`advance`), so its cost is spread over steps: a round opens
    a window (the full model's replay: labels and each sub-layer's turn), then scores its
    candidates on that same window (the ladder in the first round; the best set and one neighbour
    in later ones), then keeps the best."""

    config: LayerSkipConfig
    num_layers: int
    cost_of: Callable[[frozenset[SubLayer]], float]
    """Fraction of a full pass's weights a pass with this skip set reads (draft cost / step)."""
    best: frozenset[SubLayer] = frozenset()
    best_value: float = 0.0
    order: list[SubLayer] = field(default_factory=list)
    """Candidate sub-layers, most skippable first (empty before the first window)."""
    tolerance: int = 0
    done: bool = False
    seconds: float = 0.0
    """Time spent searching."""
    evaluations: int = 0
    history: list[dict] = field(default_factory=list)
    """Every scored candidate: skip set, match rate, cost, value (for reports and tests)."""
    owner: object | None = None
    """The request whose sequence the search replays on now (its drafter state): requests stepped
    together would each re-open the window on their own sequence and score nothing."""

    def __post_init__(self) -> None:
        self.random = random.Random(self.config.seed)
        if not candidate_sublayers(self.num_layers):
            self.done = True  # two layers or fewer: nothing SWIFT would skip
        self._window: tuple[object, int, int] | None = None  # (sequence, end, count)
        self._labels: list[int] = []
        self._candidates: list[frozenset[SubLayer]] = []  # the round's candidates
        self._queue: list[frozenset[SubLayer]] = []  # those still to score on the window
        self._round: dict[frozenset[SubLayer], float] = {}  # values scored on the window

    def advance(self, seq: LayerSkipSequence, committed: int, verify_cost: Callable[[int], float],
                owner: object | None = None) -> None:
        """Run the search's next replay on `seq` (which holds `committed` tokens) for request `owner`;
        nothing while another request owns the search (until it is `release`d)."""
        if self.done or (self.owner is not None and owner is not self.owner):
            return
        self.owner = owner
        t0 = time.perf_counter()
        if self._window is None or self._window[0] is not seq:
            self._open(seq, committed)
        else:
            skip = self._queue.pop(0)
            self._round[skip] = self._score(seq, skip, verify_cost)
            if not self._queue:
                self._close(1.0 / verify_cost(1))
        self.seconds += time.perf_counter() - t0

    def release(self, owner: object) -> None:
        """Request `owner` ended: another may take the search up (re-scoring the round on its own window)."""
        if self.owner is owner:
            self.owner = None

    def _open(self, seq: LayerSkipSequence, committed: int) -> None:
        count = min(self.config.search_window, committed)
        trace: dict[SubLayer, float] = {}
        self._labels = seq.replay(count, (), trace).argmax(-1).tolist()
        self._window = (seq, committed, count)
        self._round = {}
        self.evaluations += 1
        if self._queue:
            self._queue = list(self._candidates)  # a new request cut the round short: score all again here
        elif not self.order:
            candidates = candidate_sublayers(self.num_layers)
            self.order = sorted(candidates, key=lambda s: trace.get(s, 0.0) / self._saving(s))
            sizes = sorted({max(1, round(r * len(candidates))) for r in self.config.search_ratios})
            self._queue = [frozenset(self.order[:size]) for size in sizes]
        else:
            self._queue = [self.best, self._neighbour()]
        self._candidates = list(self._queue)

    def _close(self, plain_value: float) -> None:
        """The round's candidates are scored: keep the best (the incumbent on ties). When no set of
        the first round beats plain decoding (`plain_value`), layer skipping cannot pay on this
        model: the search ends with no skip set (the drafter proposes nothing)."""
        refine = bool(self.best) and self.best in self._round
        winner = max(self._round, key=lambda skip: (self._round[skip], skip == self.best))
        if refine:
            self.tolerance = 0 if winner != self.best else self.tolerance + 1
            self.done = self.tolerance >= self.config.max_tolerance
        elif self._round[winner] <= plain_value:
            winner, self.done = frozenset(), True
        self.best, self.best_value = winner, self._round.get(winner, plain_value)
        self._window = None

    def _score(self, seq: LayerSkipSequence, skip: frozenset[SubLayer], verify_cost: Callable[[int], float]) -> float:
        _, end, count = self._window
        match = match_rate(seq.replay(count, sorted(skip), end=end), self._labels)
        value = best_chain_rate(match, self.cost_of(skip), verify_cost, self.config.num_draft_tokens)
        self.evaluations += 1
        self.history.append({"skip": format_skip_layers(skip), "sub_layers": len(skip), "match": match,
                             "cost": self.cost_of(skip), "value": value})
        return value

    def _saving(self, sub_layer: SubLayer) -> float:
        """Fraction of a pass's weights that skipping this one sub-layer saves."""
        return max(1e-9, 1.0 - self.cost_of(frozenset([sub_layer])))

    def _neighbour(self) -> frozenset[SubLayer]:
        """One sub-layer more, one fewer, or one swapped (the added one from the most skippable
        half of those kept, the removed one at random)."""
        kept = [s for s in self.order if s not in self.best]
        skipped = sorted(self.best)
        move = self.random.choice(["add", "remove", "swap"] if kept and skipped else ["add"] if kept else ["remove"])
        out = set(self.best)
        if move in ("add", "swap"):
            out.add(self.random.choice(kept[: max(1, len(kept) // 2)]))
        if move in ("remove", "swap"):
            out.discard(self.random.choice(skipped))
        return frozenset(out) if out else self.best


# --------------------------------------------------------------------------- drafter
class LayerSkipDrafter:
    """Chain drafting by the target with sub-layers skipped (see the module docstring)."""

    name = "layer-skip"
    memory_bytes = 0
    """No weights of its own: the draft reads the target's."""

    def __init__(self, target: LayerSkippingModel, config: LayerSkipConfig = LayerSkipConfig()) -> None:
        self.config = config
        num_layers = target.num_layers
        self.search = SkipSearch(config, num_layers, target.layer_skip_cost)
        if config.skip_layers is not None:
            self.search.best = parse_skip_layers(config.skip_layers, num_layers)
            self.search.done = True
        self._token_seconds = Ema(config.timing_ema)
        self._since: float | None = None  # when the drafter was first used
        self._max_context = target.max_context

    @property
    def skip(self) -> frozenset[SubLayer]:
        """The skip set drafts use now."""
        return self.search.best

    def start(self) -> object:
        return object()  # the request, as the search's owner

    def finish(self, state: object) -> None:
        self.search.release(state)

    def observe(self, step: StepResult, state: object) -> None:
        return None

    def propose(self, ctx: DraftContext, state: object) -> Proposal:
        seq = ctx.target
        if not isinstance(seq, LayerSkipSequence):
            raise ConfigError('layer-skip drafting needs a backend that can skip layers: use backend="native" '
                              "(Llama, Qwen2, Mistral)")
        return self._propose(ctx, seq, state)

    def _propose(self, ctx: DraftContext, seq: LayerSkipSequence, request: object = None) -> Proposal:
        now = time.perf_counter()
        self._since = self._since if self._since is not None else now
        search = self.search
        # The search's first replay runs at once; later ones while the search's share of the time
        # since this drafter was first used stays under search_fraction.
        committed = len(ctx.tokens) - 1
        # A replay runs up to search_window rows in scratch slots after the committed tokens: none
        # where the window has no room for them (the search goes on in a later request).
        if (not search.done and len(ctx.tokens) > 2 and self._max_context - committed >= self.config.search_window
                and (search.evaluations == 0 or search.seconds <= self.config.search_fraction * (now - self._since))):
            search.advance(seq, committed, self._verify_cost(ctx), request)
        k = min(self.config.num_draft_tokens, ctx.budget.max_depth, ctx.budget.max_nodes)
        if k <= 0 or not self.search.best:
            return Proposal.empty()  # nothing worth skipping: the draft would be the target itself
        adaptive = ctx.cost is not None and self._token_seconds.value is not None
        if adaptive:
            k = ctx.cost.plan_chain(self.name, [], self._token_seconds.value, 0.0, k)
            if k <= 0:
                return Proposal.empty()
        skip = sorted(self.search.best)
        drafted = 1  # rows drafted so far this step (the root's first)
        t_start = time.perf_counter()
        logits = seq.speculate([ctx.tokens[-1]], skip)[0]  # [vocab]
        self._token_seconds.update(time.perf_counter() - t_start)

        def next_logits(token: int) -> torch.Tensor:
            nonlocal drafted
            out = seq.speculate([token], skip, drafted)[0]
            drafted += 1
            return out

        return draft_chain(ctx, self.name, k, logits, next_logits, self._token_seconds, t_start,
                           greedy=True, adaptive=adaptive, stop_below=self.config.stop_below or None)

    @staticmethod
    def _verify_cost(ctx: DraftContext) -> Callable[[int], float]:
        """Verify cost in plain steps, from the planner's cost view (flat without one)."""
        if ctx.cost is None:
            return lambda n: 1.0
        one = ctx.cost.verify_seconds(1)
        return lambda n: ctx.cost.verify_seconds(n) / one


CONFIG = LayerSkipConfig
"""The options `create` takes besides its keywords (`specula.methods`)."""


def create(*, target: LayerSkippingModel | None = None, draft=None, **options) -> LayerSkipDrafter:
    """options: LayerSkipConfig fields (skip_layers, num_draft_tokens, stop_below, search_window, ...)."""
    if not isinstance(target, LayerSkippingModel):
        raise ConfigError('layer-skip drafting needs a backend that can skip layers: use backend="native" '
                          "(Llama, Qwen2, Mistral models)")
    return LayerSkipDrafter(target, method_config(LayerSkipDrafter.name, LayerSkipConfig, options))
