"""The target's cost model: forward latency against the number of tokens verified in one pass.

Size n means n tokens in the target's forward pass: the step's root plus a chain of n - 1
draft nodes, run through `forward_tree` (and its rows' greedy argmax) after a prefix of `context` tokens,
then `commit(())` and `crop` back to the prefix. n = 1 is a plain decode step, so `ratio(n)` is
"verifying n tokens costs ratio(n) plain steps"; a tree of k nodes costs `ratio(k + 1)` (see
`CostCurve.tree_ratio`).

    CostCurve            measured medians per size (from `measure_cost_curve` or a JSON file)
    CostModel            the curve corrected online by observed step times
    load_or_measure      the curve from the on-disk cache (keyed by the backend's `cost_key()`),
                         re-timed on each load until every size has 5 samples (the median
                         of the samples is the curve), or measured now and cached
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from specula.errors import ConfigError
from specula.models.base import TargetModel, TargetSequence, forward_trees
from specula.models.device import sync_device
from specula.paths import read_json_object
from specula.tree import TokenTree

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)
"""Sizes measured by `specula profile`, the bench and the planner (1 is always added)."""
DEFAULT_CONTEXT = 64
"""Tokens in the cache before each timed pass of the planner's cost curve. The prefix is prefilled
before the passes are timed: after 256 tokens the float32 1.5B's timing took 18 s on 2 cores,
after 64 tokens 13-14 s, and its passes cost the same within the machine's noise (the attention
reads 2% or less of the bytes the weights take; timed alternately, `docs/cache.md`). The planner
corrects the curve from every pass a run times."""
MIN_PASS_SECONDS = 1e-9
"""The least a timed pass counts for (a clock that read 0 s would price every later step at nothing)."""


LATENCY_MEMO = 1024
"""Most pass sizes a `CostCurve` keeps its latency for (then it starts its memo again)."""


@dataclass(frozen=True)
class CostCurve:
    """Median forward latency per number of tokens in the pass (root + draft nodes)."""

    sizes: tuple[int, ...]
    """Tokens per forward pass, ascending, starting at 1 (a plain decode step)."""
    seconds: tuple[float, ...]
    """Median latency of `forward_tree` + `commit` for each size."""
    context: int
    """Tokens already in the KV cache when measured."""
    repeats: int = 0
    """Timed repeats per size (after one warm-up pass)."""

    def __post_init__(self) -> None:
        if not self.sizes or self.sizes[0] != 1 or list(self.sizes) != sorted(set(self.sizes)):
            raise ConfigError(f"cost curve sizes must be ascending, distinct and start at 1, got {list(self.sizes)}")
        if len(self.sizes) < 2:  # read as flat, it priced a pass over any number of tokens at one plain step
            raise ConfigError("a cost curve needs a pass size above 1 (size 1 alone says nothing about what drafted "
                              "tokens cost to verify); measure one with e.g. `specula profile --sizes 1,2,4,8,16`")
        if len(self.seconds) != len(self.sizes) or not all(math.isfinite(s) and s > 0 for s in self.seconds):
            raise ConfigError(f"cost curve needs one positive, finite latency per size, got {list(self.seconds)}")
        object.__setattr__(self, "_latencies", {})  # n -> `latency(n)`: a step asks for a few sizes, many times

    def latency(self, n: float) -> float:
        """Seconds for a pass of n tokens: piecewise-linear between measured sizes, extended
        beyond the largest with the last segment's slope (never decreasing)."""
        seconds = self._latencies.get(n)
        if seconds is None:
            if len(self._latencies) >= LATENCY_MEMO:
                self._latencies.clear()
            seconds = self._latencies[n] = self._interpolated(n)
        return seconds

    def _interpolated(self, n: float) -> float:
        sizes, secs = self.sizes, self.seconds
        if n <= sizes[0]:
            return secs[0]
        for (x0, y0), (x1, y1) in zip(zip(sizes, secs), zip(sizes[1:], secs[1:])):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        slope = max(0.0, (secs[-1] - secs[-2]) / (sizes[-1] - sizes[-2]))
        return secs[-1] + slope * (n - sizes[-1])

    def ratio(self, n: float) -> float:
        """Latency of an n-token pass relative to a plain decode step (n = 1)."""
        return self.latency(n) / self.seconds[0]

    def tree_ratio(self, nodes: int) -> float:
        """Relative cost of verifying a tree of `nodes` draft nodes (plus the root)."""
        return self.ratio(nodes + 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sizes": list(self.sizes),
            "seconds": list(self.seconds),
            "ratio": [round(self.ratio(n), 4) for n in self.sizes],
            "context": self.context,
            "repeats": self.repeats,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostCurve":
        return cls(tuple(int(n) for n in data["sizes"]), tuple(float(s) for s in data["seconds"]),
                   int(data["context"]), int(data.get("repeats", 0)))


def _timed_pass(backend: TargetModel, seq: TargetSequence, root: int, tree: TokenTree, context: int) -> float:
    """One greedy verification pass's seconds: the pass, its rows' argmax (through an output screen
    where the backend has one: `forward_trees`' `argmax_only`) and the commit."""
    sync_device(backend.device)
    t0 = time.perf_counter()
    forward_trees(backend, [(seq, root, tree)], argmax_only=True)[0].argmax(-1)  # [n]
    seq.commit(())
    sync_device(backend.device)
    elapsed = time.perf_counter() - t0
    seq.crop(context)
    return elapsed


@dataclass(frozen=True)
class TimingConfig:
    """How start-up timing makes sure it measures the machine, not its warm-up or a busy moment."""

    stable_passes: int = 3
    """Warm-up ends when this many consecutive plain steps agree within `stable_spread`."""
    stable_spread: float = 0.10
    """Largest (max - min) / min among those plain steps for the timing to count as stable."""
    max_warmup_passes: int = 40
    """Most warm-up plain steps (after one pass of each size) before timing starts anyway."""
    busy_cores: float = 0.3
    """A round during which other processes kept more cores than this busy is discarded."""
    max_round_factor: int = 3
    """At most `repeats` * this many rounds are tried to get `repeats` quiet ones."""
    max_ratio: float = 4.0
    """Sizes above the first one whose pass costs more than this many plain steps are not timed
    (such passes cannot pay here; the curve extends its last slope), which keeps start-up short
    on CPUs where 64 tokens cost 12 steps."""


@dataclass(frozen=True)
class PassTimes:
    """Seconds of each kept round per size, and how the timing went."""

    times: dict[int, list[float]]
    """{n: [seconds of each kept round]}, sizes ascending, 1 included."""
    warmup_passes: int = 0
    """Plain steps run before timing until they were stable (after one pass of each size)."""
    stable: bool = True
    """Whether the warm-up reached `TimingConfig.stable_passes` agreeing plain steps."""
    discarded: int = 0
    """Rounds thrown away because other processes were busy during them."""
    busy: bool = False
    """Every round was busy: the least busy ones were kept (the curve may read slow)."""
    seconds: float = 0.0
    """Wall time the measurement took."""

    @property
    def spread(self) -> float:
        """(max - min) / median of the kept plain-step times: how steady the machine was."""
        steps = self.times.get(1) or [1.0]
        return (max(steps) - min(steps)) / max(statistics.median(steps), 1e-12)


def warm_up(plain_step: Callable[[], float], config: TimingConfig = TimingConfig()) -> tuple[float, int, bool]:
    """Run `plain_step` (one timed plain pass) until `config.stable_passes` in a row agree within
    `config.stable_spread`, at most `config.max_warmup_passes` times (a cold process reads up to
    1.5x slow for a while): (median of the last ones, passes run, whether they agreed)."""
    recent: list[float] = []
    for passes in range(1, config.max_warmup_passes + 1):
        recent = (recent + [plain_step()])[-config.stable_passes:]
        if len(recent) == config.stable_passes and max(recent) <= (1 + config.stable_spread) * min(recent):
            return statistics.median(recent), passes, True
    return statistics.median(recent), config.max_warmup_passes, False


def measure_cost_curve(
    backend: TargetModel, sizes: Sequence[int] = DEFAULT_SIZES, context: int = DEFAULT_CONTEXT, repeats: int = 3,
    seed: int = 0, config: TimingConfig | None = None,
) -> CostCurve:
    """Median latency of one verification pass of n tokens (root + chain of n-1 nodes) after a
    `context`-token prefix, for each n in `sizes` (1 added if missing). Warmed up until plain
    steps are stable, then `repeats` quiet rounds over all sizes (interleaved, so drifts in machine
    speed hit every size alike). Runs on a sequence of its own, released at the end. `config`:
    how the timing guards against warm-up and busy moments (default `TimingConfig()`)."""
    times = measure_pass_times(backend, sizes, context, repeats, seed, config or TimingConfig()).times
    return CostCurve(tuple(times), tuple(statistics.median(t) for t in times.values()), context, repeats)


def measure_pass_times(backend: TargetModel, sizes: Sequence[int], context: int, repeats: int,
                       seed: int = 0, config: TimingConfig = TimingConfig()) -> PassTimes:
    """Time `repeats` rounds of one pass per size (sizes ascending, 1 included).

    First one pass of each size (kernels compiled, weights paged in), then plain steps until
    `config.stable_passes` in a row agree within `config.stable_spread` (a cold process reads up to
    1.5x slow for a while). A round during which other processes kept more than
    `config.busy_cores` cores busy is discarded and run again (up to `repeats *
    config.max_round_factor` rounds); if every round was busy the least busy are kept and the
    result says so."""
    from specula.planner.machine import LoadProbe

    sizes = sorted({1, *(int(n) for n in sizes)})
    if sizes[0] < 1:
        raise ConfigError(f"sizes must be >= 1 (tokens per forward pass), got {sizes[0]}")
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    if context < 1:
        raise ConfigError(f"context must be >= 1 token, got {context}")
    if context + sizes[-1] > backend.max_context:
        raise ConfigError(
            f"context={context} + {sizes[-1]} tokens exceeds the target's context window of {backend.max_context}; "
            "lower context= or the largest of sizes="
        )
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, backend.vocab_size, (context + sizes[-1],), generator=gen).tolist()  # prefix, root, chain
    prefix, root, chain = ids[:context], ids[context], ids[context + 1 :]
    trees = {n: TokenTree.chain(chain[: n - 1], source="profile") for n in sizes}

    t_start = time.perf_counter()
    seq = backend.new_sequence()
    rounds: list[tuple[float, dict[int, float]]] = []  # (other processes' cores, seconds per size)
    try:
        seq.prefill(prefix, logits="none")
        # commit(()) keeps prefix + root: each pass crops back to the `context`-token prefix.
        def again(n: int, seconds: float) -> float:
            """A pass that read too costly to time larger ones, timed once more: the lesser (one slow
            pass, a page fault or another process's time slice, must not rule sizes out)."""
            return min(seconds, _timed_pass(backend, seq, root, trees[n], context))

        first = 0.0
        for n in sizes:  # warm-up, one pass each, ascending
            seconds = _timed_pass(backend, seq, root, trees[n], context)
            first = first or seconds
            if n > 1 and n < sizes[-1] and seconds > 2 * config.max_ratio * first \
                    and again(n, seconds) > 2 * config.max_ratio * first:
                sizes = sizes[: sizes.index(n) + 1]  # far beyond paying even cold: larger sizes not timed
                break
        step, warmup, stable = warm_up(lambda: _timed_pass(backend, seq, root, trees[1], context), config)
        for _ in range(repeats * config.max_round_factor):
            probe = LoadProbe.start()
            secs: dict[int, float] = {}
            for n in sizes:
                secs[n] = _timed_pass(backend, seq, root, trees[n], context)
                # larger passes cost even more: not worth timing. Judged against this round's own plain
                # pass (a burst that slows the whole round cuts nothing), never at the plain pass itself
                limit = config.max_ratio * max(step, secs[1])
                if not rounds and n > 1 and n < sizes[-1] and secs[n] > limit:
                    secs[n] = again(n, secs[n])
                    if secs[n] > limit:
                        sizes = sizes[: sizes.index(n) + 1]
                        break
            others = probe.others()
            rounds.append((others if others is not None else 0.0, secs))
            if sum(load <= config.busy_cores for load, _ in rounds) >= repeats:
                break
    finally:
        seq.release()
    quiet = [r for r in rounds if r[0] <= config.busy_cores]
    busy = len(quiet) < repeats
    kept = sorted(rounds, key=lambda r: r[0])[:repeats] if busy else quiet[:repeats]
    times = {n: [secs[n] for _, secs in kept] for n in sizes}
    return PassTimes(times, warmup, stable, len(rounds) - len(kept), busy, time.perf_counter() - t_start)


class CostModel:
    """The cost curve as a prior, corrected by the passes this run times.

    Decisions follow what the run observes, not a cached or start-up measurement (which can read
    1.5x slow on a busy or cold machine, and, trusted, kept the planner from ever trying the passes
    it believed too expensive):

    - each pass size keeps the ratios observed / prior of its last `window` passes; its estimate
      is the prior times their median (one noisy pass cannot flip a choice);
    - a multi-token size not timed yet takes the ratio of the nearest multi-token size that was
      (in log size), so one observed size corrects its neighbours at once, else the plain step's
      ratio (the machine's speed); before any observation the ratio is 1;
    - `verify_seconds` (what decisions read) is optimistic for multi-token passes this run has
      rarely timed lately: the estimate times 1 - `explore` / (1 + passes timed in the size's
      octave within the last `horizon` passes), so a pessimistic prior gets tried, and corrected,
      within a few steps instead of ruling a size out for good; the optimism fades as the octave
      is observed, and returns when it has not been for a while. `estimate` is the unbiased
      figure (back-off, reports);
    - a multi-token size's passes count for `horizon` passes of the run: a size timed only while
      the machine was slow (the first passes of a fresh process, another program busy) and not
      chosen since would otherwise keep that price for good, and the planner, believing it, would
      never verify it again (measured, SmolLM2 on this CPU from a fresh cache: 8-token passes
      priced at 1.7 plain steps all run long after they cost 1.1). Past the horizon the size
      takes its neighbours' recent ratio and is tried again. Plain steps keep their last `window`
      passes whatever their age: while drafting pays they are rare, and they are what every tree
      is weighed against."""

    def __init__(self, curve: CostCurve, explore: float = 0.4, window: int = 9,
                 padded: Callable[[int], int] | None = None, horizon: int = 64) -> None:
        self.curve = curve
        self.explore = explore
        self.window = window
        self.horizon = horizon
        self._padded = padded or (lambda n: n)
        """Rows a pass of n tokens really costs (the backend's `padded_tokens`: CUDA graph buckets)."""
        self._passes = 0  # passes observed so far (the clock of the horizon)
        self._ratios: dict[int, list[tuple[int, float]]] = {}  # n_tokens -> last `window` (pass, observed / prior)
        self._medians: dict[int, float] = {}  # n_tokens -> median of its recent ratios (read on every plan)
        self._recent: collections.deque[tuple[int, int]] = collections.deque()  # (pass, n_tokens) within the horizon
        self._octave_counts: dict[int, int] = {}  # octave of n -> passes observed within the horizon
        self._multi: list[int] = []  # the multi-token sizes with a recent median, ascending
        self._seconds: dict[tuple[int, bool], float] = {}
        """(n_tokens, optimistic) -> `estimate` / `verify_seconds`, until the next observation (a
        step asks hundreds of times: fusion's merged trees cost 0.5 ms of planning a step without it)."""

    @staticmethod
    def _octave(n_tokens: int) -> int:
        return max(0, int(n_tokens - 1).bit_length())  # 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...

    def ratio(self, n_tokens: int) -> float:
        """Observed / prior latency for passes of `n_tokens`: its own median; for a multi-token size
        not timed yet the nearest timed multi-token size's (the curve's shape), else the plain
        step's (the machine's speed); 1 before anything was timed. A plain step is judged by plain
        steps alone (the prior's ratios, not its step, are what a busy start-up gets wrong)."""
        medians = self._medians
        if n_tokens in medians:
            return medians[n_tokens]
        multi = self._multi
        if n_tokens == 1 or not multi:
            return medians.get(1, 1.0)
        i = bisect.bisect_left(multi, n_tokens)  # in log size the nearest is a neighbour in order
        if i == 0 or i == len(multi):  # below the smallest timed size or past the largest: that size
            return medians[multi[0 if i == 0 else -1]]
        below, above = multi[i - 1], multi[i]
        log_n = math.log(n_tokens)
        to_below, to_above = abs(math.log(below) - log_n), abs(math.log(above) - log_n)
        if to_below != to_above:
            return medians[below if to_below < to_above else above]
        return (medians[below] + medians[above]) / 2  # equally near: the median of the two

    @property
    def scale(self) -> float:
        """Median observed / prior ratio over every size observed (1 before any observation)."""
        recent = [x for r in self._ratios.values() for _, x in r]
        return statistics.median(recent) if recent else 1.0

    def observations(self, n_tokens: int) -> int:
        """Passes observed in the octave of `n_tokens`."""
        return self._octave_counts.get(self._octave(n_tokens), 0)

    def estimate(self, n_tokens: int) -> float:
        """Best estimate of one target pass over n tokens (root + n - 1 nodes), at its padded size."""
        key = (n_tokens, False)
        if key not in self._seconds:
            padded = self._padded(n_tokens)
            self._seconds[key] = self.ratio(padded) * self.curve.latency(padded)
        return self._seconds[key]

    def verify_seconds(self, n_tokens: int) -> float:
        """What decisions use: `estimate`, optimistic for multi-token passes rarely observed yet."""
        key = (n_tokens, True)
        if key not in self._seconds:
            seconds = self.estimate(n_tokens)
            if n_tokens > 1:  # never below a plain step: a pass over more tokens does not cost less
                seconds = max(seconds * (1.0 - self.explore / (1.0 + self.observations(n_tokens))),
                              self.estimate(1))
            self._seconds[key] = seconds
        return self._seconds[key]

    def observe(self, n_tokens: int, seconds: float) -> None:
        self._seconds.clear()
        self._passes += 1
        n_tokens = self._padded(n_tokens)
        # a pass timed at 0 s (a coarse clock, a stub backend) would price every step at nothing
        ratio = max(seconds, MIN_PASS_SECONDS) / max(self.curve.latency(n_tokens), 1e-12)
        self._ratios[n_tokens] = (self._ratios.get(n_tokens, []) + [(self._passes, ratio)])[-self.window:]
        octave = self._octave(n_tokens)
        self._recent.append((self._passes, n_tokens))
        self._octave_counts[octave] = self._octave_counts.get(octave, 0) + 1
        oldest = self._passes - self.horizon  # passes at or before it are past the horizon
        self._refresh(n_tokens, oldest)
        while self._recent and self._recent[0][0] <= oldest:  # only the sizes whose passes expired change
            _, expired = self._recent.popleft()
            self._octave_counts[self._octave(expired)] -= 1
            self._refresh(expired, oldest)

    def _refresh(self, n_tokens: int, oldest: int) -> None:
        """The median of one size's passes after `oldest` (a plain step's: all it kept), or none."""
        recent = [r for at, r in self._ratios[n_tokens] if n_tokens == 1 or at > oldest]
        if recent:
            self._medians[n_tokens] = statistics.median(recent)
            if n_tokens > 1 and n_tokens not in self._multi:
                bisect.insort(self._multi, n_tokens)
        elif self._medians.pop(n_tokens, None) is not None and n_tokens > 1:
            self._multi.remove(n_tokens)


def cost_cache_key(target: TargetModel, context: int) -> str:
    """Cost curves are cached per backend `cost_key()` (model, backend, dtype, kernels, threads,
    device) and context bucket."""
    parts = {**target.cost_key(), "context_bucket": context}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


VALIDATE_MAX_SIZE = 16
"""Sizes up to this one are timed again when a cached curve is loaded, until each has
`VALIDATE_SAMPLES` samples (larger trees are rare on the CPU and slow to time)."""
VALIDATE_SAMPLES = 5
"""Samples per size after which a cached curve is trusted without timing it again."""
MAX_SAMPLES = 9
"""Most recent samples kept per size."""


def read_cached_samples(path: Path, of_table: Callable[[dict[str, Any]], dict[str, Any]],
                        read: Callable[[dict[str, Any]], object]) -> dict[str, Any] | None:
    """A cost cache entry's samples ({"step": [...], "ratio": {key: [...]}}; `of_table` makes them
    from an entry cached without them), or None when there is no entry; an entry that is not JSON,
    not an object, or whose samples `read` cannot make a table of is removed (measured again)."""
    if not path.exists():
        return None
    data = read_json_object(path)
    try:
        if data is None:
            raise ValueError("not a JSON object")
        samples = data.get("samples") or of_table(data)
        if not isinstance(samples, dict) or not isinstance(samples.get("ratio"), dict):
            raise ValueError("samples are not a table")
        read(samples)
        return samples
    except (ValueError, KeyError, TypeError, AttributeError, ConfigError, statistics.StatisticsError):
        path.unlink(missing_ok=True)
        return None


def curve_from_samples(samples: dict[str, Any], context: int, repeats: int) -> CostCurve:
    """The curve of a cache entry's samples: a plain step = the median of the step samples, size n =
    that times the median of n's ratio samples (each taken against a plain step of the same round,
    so a run on a busier machine shifts the step, not the shape)."""
    check_samples(samples)
    untimed = samples.get("untimed_from")
    if untimed is not None and not (type(untimed) is int and untimed >= 2):
        raise ValueError(f"untimed_from {untimed!r} is not a pass size")
    step = statistics.median(samples["step"])
    ratios = {int(n): statistics.median(r) for n, r in samples["ratio"].items() if r}
    sizes = sorted({1, *ratios})
    seconds, floor = [], 1.0
    for n in sizes:  # a pass over more tokens does not cost less: a lower median further along is noise
        floor = max(floor, ratios.get(n, 1.0))
        seconds.append(step * floor)
    return CostCurve(tuple(sizes), tuple(seconds), context, repeats)


def check_samples(samples: dict[str, Any]) -> None:
    """ValueError unless a cache entry's samples are seconds and ratios, finite and > 0 (a damaged
    or hand-edited entry is measured again: a ratio of 0 priced passes at nothing)."""
    values = [samples["step"], *samples["ratio"].values()]
    if not samples["step"] or not all(isinstance(v, list) for v in values):
        raise ValueError("samples are not lists")
    for x in (x for v in values for x in v):
        if not (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0):
            raise ValueError(f"sample {x!r} is not a finite positive number")


def _add_samples(samples: dict[str, Any], times: dict[int, list[float]], asked: Sequence[int] = ()) -> None:
    """Fold one measurement's rounds into a cache entry's samples (each size's ratio against the
    plain step of its own round). Sizes `asked` for that the timing left out as too costly are noted
    (`untimed_from`: the smallest); the next load times them again (one slow pass may have cut
    them), and a second cut is trusted (`untimed_confirmed`: later loads do not time them)."""
    left_out = [n for n in asked if n > 1 and n not in times]
    if left_out:
        if "untimed_from" in samples:  # a second timing cut them too: trusted from now on
            samples["untimed_confirmed"] = True
        samples["untimed_from"] = min(left_out)
    elif samples.get("untimed_from") in asked:  # timed again and worth timing after all
        samples.pop("untimed_from")
        samples.pop("untimed_confirmed", None)
    samples["step"] = (samples.get("step", []) + list(times[1]))[-MAX_SAMPLES:]
    ratio = samples.setdefault("ratio", {})
    for n, secs in times.items():
        if n == 1:
            continue
        paired = [s / max(t1, 1e-12) for s, t1 in zip(secs, times[1])]
        ratio[str(n)] = (ratio.get(str(n), []) + paired)[-MAX_SAMPLES:]


CURVE_GIVEN = "planner=read_cost_curve(FILE)"
"""How a caller gives the planner a measured cost curve (`api.load`'s planner=), as messages name it: `--cost-curve
FILE` on the command line (`commands.common.command_flags`)."""
PLAIN_METHOD = 'method="none"'
"""Plain decoding as the planner's messages name it (`methods.PLAIN`, which the planner does not import: it knows no
drafter; `--method none` on the command line)."""


def check_room_for_curve(target: TargetModel, sizes: Sequence[int]) -> None:
    """Refuse (ConfigError) a target whose context window cannot hold a prefix and a pass of the largest of `sizes`:
    its cost curve cannot be timed here. The advice is what the planner's callers take: a curve of passes that fit
    (`CURVE_GIVEN`, from `specula profile`), or plain decoding (`PLAIN_METHOD`)."""
    window = target.max_context
    if max(sizes) + 1 <= window:
        return
    fits = sorted({1, *(n for n in sizes if 2 * n <= window)})
    profile = (f" of `specula profile --target MODEL --sizes {','.join(map(str, fits))} --context {fits[-1]}`"
               if len(fits) > 1 else " of `specula profile`")
    raise ConfigError(f"the target's context window of {window} tokens is too short to time the planner's cost curve "
                      f"(passes of up to {max(sizes)} tokens after a prefix); give a curve of passes that fit, "
                      f'{CURVE_GIVEN} with the cost_curve.json{profile}, or decode plainly ({PLAIN_METHOD})')


def load_or_measure_curve(target: TargetModel, sizes: Sequence[int] = DEFAULT_SIZES, context: int = DEFAULT_CONTEXT,
                          repeats: int = 2, report: bool = True) -> CostCurve:
    """The target's cost curve from the on-disk cache, or measured now (and cached atomically).

    The curve is a prior: the planner's `CostModel` corrects it from the passes each run times.
    One measurement can still be off (a busy moment, a cold cache): a cached curve is timed again
    on each load (one round of the sizes up to `VALIDATE_MAX_SIZE`) until every such size has
    `VALIDATE_SAMPLES` samples, and the curve is the median of the samples. `report`: say on stderr
    where the curve came from and how steady the timing was."""
    from specula.paths import atomic_write_json, cache_dir

    check_room_for_curve(target, sizes)
    context = max(1, min(context, target.max_context - max(sizes) - 1))
    path = cache_dir("cost") / f"{cost_cache_key(target, context)}.json"
    samples = read_cached_samples(path, lambda data: _samples_of_curve(CostCurve.from_dict(data)),
                                  lambda samples: curve_from_samples(samples, context, repeats))
    timing: PassTimes | None = None
    if samples is None:
        samples = {}
        timing = measure_pass_times(target, sizes, context, repeats)
        _add_samples(samples, timing.times, sizes)
    else:
        # sizes with too few samples, sizes a timing left out other than as too costly (an entry of
        # before `untimed_from` that lost them to one slow pass is timed again), and those it left out
        # as too costly until a second timing agrees
        untimed = samples.get("untimed_from") or float("inf")
        stale = [n for n in sizes if 1 < n <= VALIDATE_MAX_SIZE and (
            len(samples["ratio"][str(n)]) < VALIDATE_SAMPLES if str(n) in samples["ratio"] else n < untimed)]
        if not samples.get("untimed_confirmed"):
            stale = sorted({*stale, *(n for n in sizes if n >= untimed)})
        if not stale:
            curve = curve_from_samples(samples, context, repeats)
            if report:
                _report(curve, samples, None, path)
            return curve
        timing = measure_pass_times(target, stale, context, 1)
        if not timing.busy:  # a busy round would only add noise to the cached samples
            _add_samples(samples, timing.times, stale)
    curve = curve_from_samples(samples, context, repeats)
    atomic_write_json(path, {**curve.to_dict(), "samples": samples})
    if report:
        _report(curve, samples, timing, path)
    return curve


def _report(curve: CostCurve, samples: dict[str, Any], timing: PassTimes | None, path) -> None:
    """One line on stderr: where the cost curve came from, how steady its timing was, its shape."""
    import sys

    shape = ", ".join(f"{n}: {curve.ratio(n):.2f}" for n in curve.sizes[1:5])
    fewest = min((len(r) for r in samples.get("ratio", {}).values()), default=0)
    if timing is None:
        how = f"from the cache ({fewest}+ samples per size, {path})"
    else:
        busy = f"; {timing.discarded} round(s) discarded, machine busy" if timing.discarded else ""
        busy += "; every round was busy: read as a rough prior" if timing.busy else ""
        warm = f"{timing.warmup_passes} warm-up steps" + ("" if timing.stable else " (never stable)")
        how = (f"timed now in {timing.seconds:.1f} s ({warm}, plain step {1e3 * curve.seconds[0]:.1f} ms, "
               f"spread {100 * timing.spread:.0f}%{busy}; cached, {fewest} samples per size)")
    print(f"specula: cost curve {how}; tokens per pass -> cost in plain steps {{{shape}}}; "
          "a prior that this run's timed passes correct", file=sys.stderr)


def _samples_of_curve(curve: CostCurve) -> dict[str, Any]:
    """Samples standing for a curve cached without them (one sample per size)."""
    return {"step": [curve.seconds[0]], "ratio": {str(n): [curve.ratio(n)] for n in curve.sizes[1:]}}


def read_cost_curve(path: str) -> CostCurve:
    """A cost curve from a `cost_curve.json` (from `specula profile`) or a bench's results.json."""
    try:
        with open(path) as f:
            data = json.load(f)
        return CostCurve.from_dict(data.get("cost_curve", data) or data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        reason = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ConfigError(f"cannot read cost curve {path!r} ({reason}); "
                          "give the cost_curve.json written by `specula profile`") from exc
