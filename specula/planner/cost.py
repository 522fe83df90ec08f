"""The target's cost model: forward latency against the number of tokens verified in one pass.

Size n means n tokens in the target's forward pass: the step's root plus a chain of n - 1
draft nodes, run through `forward_tree` after a prefix of `context` tokens in the KV cache,
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

import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from specula.errors import ConfigError
from specula.models.base import TargetModel, TargetSequence
from specula.models.device import sync_device
from specula.tree import TokenTree

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)
"""Sizes measured by `specula profile`, the bench and the planner (1 is always added)."""


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
        if len(self.seconds) != len(self.sizes) or any(s <= 0 for s in self.seconds):
            raise ConfigError("cost curve needs one positive latency per size")

    def latency(self, n: float) -> float:
        """Seconds for a pass of n tokens: piecewise-linear between measured sizes, extended
        beyond the largest with the last segment's slope (never decreasing)."""
        sizes, secs = self.sizes, self.seconds
        if n <= sizes[0]:
            return secs[0]
        for (x0, y0), (x1, y1) in zip(zip(sizes, secs), zip(sizes[1:], secs[1:])):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        if len(sizes) == 1:
            return secs[0]
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


def _timed_pass(seq: TargetSequence, device, root: int, tree: TokenTree, context: int) -> float:
    sync_device(device)
    t0 = time.perf_counter()
    seq.forward_tree(root, tree)  # logits [n, vocab]
    seq.commit(())
    sync_device(device)
    elapsed = time.perf_counter() - t0
    seq.crop(context)
    return elapsed


def measure_cost_curve(
    backend: TargetModel, sizes: Sequence[int] = DEFAULT_SIZES, context: int = 256, repeats: int = 3, seed: int = 0
) -> CostCurve:
    """Median latency of one verification pass of n tokens (root + chain of n-1 nodes) after a
    `context`-token prefix, for each n in `sizes` (1 added if missing). One warm-up pass per
    size, then `repeats` rounds over all sizes (interleaved, so drifts in machine speed hit
    every size alike). Runs on a sequence of its own, released at the end."""
    times = measure_pass_times(backend, sizes, context, repeats, seed)
    return CostCurve(tuple(times), tuple(statistics.median(t) for t in times.values()), context, repeats)


def measure_pass_times(backend: TargetModel, sizes: Sequence[int], context: int, repeats: int,
                       seed: int = 0) -> dict[int, list[float]]:
    """{n: [seconds of each round]} for `measure_cost_curve` (sizes ascending, 1 included)."""
    sizes = sorted({1, *(int(n) for n in sizes)})
    if sizes[0] < 1:
        raise ConfigError(f"sizes must be >= 1 (tokens per forward pass), got {sizes[0]}")
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    if context < 1:
        raise ConfigError(f"context must be >= 1 token, got {context}")
    if context + sizes[-1] > backend.max_context:
        raise ConfigError(
            f"context {context} + {sizes[-1]} tokens exceeds the target's context window of {backend.max_context}; "
            "lower --context or the largest size"
        )
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, backend.vocab_size, (context + sizes[-1],), generator=gen).tolist()  # prefix, root, chain
    prefix, root, chain = ids[:context], ids[context], ids[context + 1 :]
    trees = {n: TokenTree.chain(chain[: n - 1], source="profile") for n in sizes}

    seq = backend.new_sequence()
    times: dict[int, list[float]] = {n: [] for n in sizes}
    try:
        seq.prefill(prefix, logits="none")
        # commit(()) keeps prefix + root: each pass crops back to the `context`-token prefix.
        for n in sizes:
            _timed_pass(seq, backend.device, root, trees[n], context)  # warm-up
        for _ in range(repeats):
            for n in sizes:
                times[n].append(_timed_pass(seq, backend.device, root, trees[n], context))
    finally:
        seq.release()
    return times


class CostModel:
    """A measured cost curve, corrected online by observed step times.

    Two corrections, both ratios observed / curve: one global `scale` (every observation; it
    rescales sizes never verified yet, e.g. when the whole machine is slower than at start-up)
    and one per pass size actually verified. The per-size one matters on CPUs, where the curve
    is bumpy (a 3-token pass can cost more than a 4-token one) and a short start-up measurement
    misses such bumps; it is the running mean of a size's first 1 / correction observations,
    then an EMA (sizes not observed yet use the global scale)."""

    def __init__(self, curve: CostCurve, correction: float = 0.1) -> None:
        self.curve = curve
        self.correction = correction
        self.scale = 1.0
        self._size_scale: dict[int, list[float]] = {}  # n_tokens -> [ratio, observations]

    def verify_seconds(self, n_tokens: int) -> float:
        """Predicted latency of one target pass over n tokens (root + n - 1 nodes)."""
        entry = self._size_scale.get(n_tokens)
        return (entry[0] if entry is not None else self.scale) * self.curve.latency(n_tokens)

    def observe(self, n_tokens: int, seconds: float) -> None:
        ratio = seconds / max(self.curve.latency(n_tokens), 1e-9)
        self.scale = (1 - self.correction) * self.scale + self.correction * ratio
        entry = self._size_scale.setdefault(n_tokens, [0.0, 0.0])
        entry[1] += 1.0  # the first observation has weight 1: the start value never counts
        weight = max(self.correction, 1.0 / entry[1])
        entry[0] = (1 - weight) * entry[0] + weight * ratio


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


def curve_from_samples(samples: dict[str, Any], context: int, repeats: int) -> CostCurve:
    """The curve of a cache entry's samples: a plain step = the median of the step samples, size n =
    that times the median of n's ratio samples (each taken against a plain step of the same round,
    so a run on a busier machine shifts the step, not the shape)."""
    step = statistics.median(samples["step"])
    ratios = {int(n): statistics.median(r) for n, r in samples["ratio"].items() if r}
    sizes = sorted({1, *ratios})
    seconds = [step if n == 1 else step * max(ratios[n], 1e-6) for n in sizes]
    return CostCurve(tuple(sizes), tuple(seconds), context, repeats)


def _add_samples(samples: dict[str, Any], times: dict[int, list[float]]) -> None:
    """Fold one measurement's rounds into a cache entry's samples (each size's ratio against the
    plain step of its own round)."""
    samples["step"] = (samples.get("step", []) + list(times[1]))[-MAX_SAMPLES:]
    ratio = samples.setdefault("ratio", {})
    for n, secs in times.items():
        if n == 1:
            continue
        paired = [s / max(t1, 1e-12) for s, t1 in zip(secs, times[1])]
        ratio[str(n)] = (ratio.get(str(n), []) + paired)[-MAX_SAMPLES:]


def load_or_measure_curve(target: TargetModel, sizes: Sequence[int] = DEFAULT_SIZES, context: int = 256,
                          repeats: int = 2) -> CostCurve:
    """The target's cost curve from the on-disk cache, or measured now (and cached atomically).

    One measurement can be off (a busy moment, a cold cache): a cached curve is timed again on
    each load (one round of the sizes up to `VALIDATE_MAX_SIZE`) until every such size has
    `VALIDATE_SAMPLES` samples, and the curve is the median of the samples, so no single
    measurement steers the planner for good. Within a run the `CostModel` corrects it further from
    the verify times it observes."""
    from specula.paths import atomic_write_json, cache_dir

    context = max(1, min(context, target.max_context - max(sizes) - 1))
    path = cache_dir("cost") / f"{cost_cache_key(target, context)}.json"
    samples: dict[str, Any] | None = None
    if path.exists():
        try:
            data = json.loads(path.read_text())
            samples = data.get("samples") or _samples_of_curve(CostCurve.from_dict(data))
            curve_from_samples(samples, context, repeats)  # readable?
        except (ValueError, KeyError, TypeError, statistics.StatisticsError):
            path.unlink(missing_ok=True)  # unreadable cache entry: measure again
            samples = None
    if samples is None:
        samples = {}
        _add_samples(samples, measure_pass_times(target, sizes, context, repeats))
    else:
        stale = [n for n in sizes if 1 < n <= VALIDATE_MAX_SIZE
                 and len(samples["ratio"].get(str(n), [])) < VALIDATE_SAMPLES]
        if not stale:
            return curve_from_samples(samples, context, repeats)
        _add_samples(samples, measure_pass_times(target, stale, context, 1))
    curve = curve_from_samples(samples, context, repeats)
    atomic_write_json(path, {**curve.to_dict(), "samples": samples})
    return curve


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
        raise ConfigError(f"cannot read cost curve {path!r} ({exc}); "
                          "give the cost_curve.json written by `specula profile`") from exc
