"""The target's cost across a batch: latency of one packed pass against (sequences, total tokens).

A batched step verifies every running session's tree in one target pass (`forward_trees`):
B sequences, each contributing its root and its n_i - 1 draft nodes, Σ n_i tokens in all. On a
CPU the linear layers dominate and their cost follows the total; attention and the per-sequence
bookkeeping follow B. So the model is measured as a table: for each batch size b, passes of b
sequences verifying n tokens each (b * n tokens in all), and read as

    latency(b, total)   piecewise-linear in `total` on each measured b (extended with the last
                        segment's slope), linear in b between measured batch sizes; beyond the
                        largest measured b, as several such batches side by side.

    measure_batch_curve       time it (`specula profile --batch-sizes`)
    load_or_measure_batch_curve   the same, cached on disk per backend `cost_key()`
"""

from __future__ import annotations

import bisect
import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from specula.errors import ConfigError
from specula.models.base import TargetModel, forward_trees
from specula.models.device import sync_device
from specula.tree import TokenTree

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)
"""Batch sizes measured by default (the server measures those up to its --max-batch-size)."""
DEFAULT_BATCH_TOKENS = (1, 2, 4, 8)
"""Tokens per sequence measured at each batch size (root + n - 1 draft nodes)."""


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending), flat below, last slope (>= 0) above."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0] if x <= xs[0] else ys[-1]
    i = bisect.bisect_left(xs, x)
    if i < len(xs):
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    return ys[-1] + slope * (x - xs[-1])


@dataclass(frozen=True)
class BatchCostCurve:
    """Median latency of one packed pass of b sequences, per batch size and total tokens."""

    batch_sizes: tuple[int, ...]
    """Measured batch sizes, ascending, starting at 1."""
    totals: tuple[tuple[int, ...], ...]
    """Per batch size: total tokens of each measured pass (b * n), ascending."""
    seconds: tuple[tuple[float, ...], ...]
    """Per batch size: median latency of each measured pass."""
    context: int
    """Tokens in each sequence's KV cache when measured."""

    def __post_init__(self) -> None:
        if not self.batch_sizes or self.batch_sizes[0] != 1 or list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise ConfigError(f"batch sizes must be ascending, distinct and start at 1, got {list(self.batch_sizes)}")
        if len(self.totals) != len(self.batch_sizes) or len(self.seconds) != len(self.batch_sizes):
            raise ConfigError("batch cost curve needs one row of totals and latencies per batch size")
        for totals, secs in zip(self.totals, self.seconds):
            if not totals or len(totals) != len(secs) or list(totals) != sorted(set(totals)) or min(secs) <= 0:
                raise ConfigError("each batch size needs ascending distinct totals with one positive latency each")

    def row_curve(self, batch: int, tokens: Sequence[int] = DEFAULT_BATCH_TOKENS) -> "CostCurve":
        """The table at one batch size as a `CostCurve` over extra tokens: size s = total - batch + 1
        (s = 1: every sequence verifies its root alone, a plain batched step)."""
        from specula.planner.cost import CostCurve

        sizes = sorted({1, *(batch * n - batch + 1 for n in tokens)})
        return CostCurve(tuple(sizes), tuple(self.latency(batch, s + batch - 1) for s in sizes), self.context)

    def latency(self, batch: int, total: float) -> float:
        """Seconds for one pass of `batch` sequences and `total` tokens in all."""
        sizes = self.batch_sizes
        row = lambda i: _interpolate(self.totals[i], self.seconds[i], total)  # noqa: E731
        if batch > sizes[-1]:  # beyond the table: as that many largest batches side by side
            scale = batch / sizes[-1]
            return scale * _interpolate(self.totals[-1], self.seconds[-1], total / scale)
        if batch == sizes[-1]:
            return row(len(sizes) - 1)
        i = bisect.bisect_left(sizes, batch)
        if sizes[i] == batch:
            return row(i)
        b0, b1 = sizes[i - 1], sizes[i]
        w = (batch - b0) / (b1 - b0)
        return (1 - w) * row(i - 1) + w * row(i)

    def to_dict(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes), "totals": [list(t) for t in self.totals],
                "seconds": [list(s) for s in self.seconds], "context": self.context}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BatchCostCurve":
        return cls(tuple(int(b) for b in data["batch_sizes"]), tuple(tuple(int(t) for t in r) for r in data["totals"]),
                   tuple(tuple(float(s) for s in r) for r in data["seconds"]), int(data["context"]))


def measure_batch_curve(backend: TargetModel, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                        tokens: Sequence[int] = DEFAULT_BATCH_TOKENS, context: int = 128, repeats: int = 2,
                        seed: int = 0) -> BatchCostCurve:
    """Median latency of a packed pass of b sequences verifying n tokens each (a root and a chain of
    n - 1 nodes), after `context` tokens in every sequence's cache, for each b in `batch_sizes` (1
    added) and n in `tokens` (1 added): one warm-up pass each, then `repeats` interleaved rounds.
    Runs on sequences of its own, released at the end."""
    batch_sizes = sorted({1, *(int(b) for b in batch_sizes)})
    tokens = sorted({1, *(int(n) for n in tokens)})
    if batch_sizes[0] < 1 or tokens[0] < 1:
        raise ConfigError("batch sizes and tokens per sequence must be >= 1")
    if repeats < 1 or context < 1:
        raise ConfigError(f"repeats and context must be >= 1, got {repeats} and {context}")
    if context + tokens[-1] > backend.max_context:
        raise ConfigError(f"context {context} + {tokens[-1]} tokens exceeds the target's context window of "
                          f"{backend.max_context}; lower the context or the tokens per sequence")
    gen = torch.Generator().manual_seed(seed)
    width = context + tokens[-1]
    ids = torch.randint(0, backend.vocab_size, (batch_sizes[-1], width), generator=gen).tolist()
    seqs = []
    times: dict[tuple[int, int], list[float]] = {(b, n): [] for b in batch_sizes for n in tokens}
    try:
        for row in ids:
            seq = backend.new_sequence()
            seqs.append(seq)
            seq.prefill(row[:context], logits="none")

        def timed(b: int, n: int) -> float:
            items = [(seqs[i], ids[i][context], TokenTree.chain(ids[i][context + 1: context + n], source="profile"))
                     for i in range(b)]
            sync_device(backend.device)
            t0 = time.perf_counter()
            forward_trees(backend, items)
            for seq, _, _ in items:
                seq.commit(())
            sync_device(backend.device)
            elapsed = time.perf_counter() - t0
            for seq, _, _ in items:
                seq.crop(context)
            return elapsed

        for key in times:
            timed(*key)  # warm-up
        for _ in range(repeats):
            for key in times:
                times[key].append(timed(*key))
    finally:
        for seq in seqs:
            seq.release()
    return BatchCostCurve(
        tuple(batch_sizes), tuple(tuple(b * n for n in tokens) for b in batch_sizes),
        tuple(tuple(statistics.median(times[b, n]) for n in tokens) for b in batch_sizes), context)


def load_or_measure_batch_curve(target: TargetModel, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                                tokens: Sequence[int] = DEFAULT_BATCH_TOKENS, context: int = 128,
                                repeats: int = 2) -> BatchCostCurve:
    """The batch cost table from the on-disk cache (per backend `cost_key()`, sizes and context),
    or measured now and cached atomically. Within a run the planner corrects it online."""
    from specula.paths import atomic_write_json, cache_dir

    batch_sizes = sorted({1, *batch_sizes})
    parts = {**target.cost_key(), "batch_sizes": batch_sizes, "tokens": sorted({1, *tokens}), "context": context}
    key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = cache_dir("cost") / f"batch-{key}.json"
    if path.exists():
        try:
            return BatchCostCurve.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError, ConfigError):
            path.unlink(missing_ok=True)  # unreadable cache entry: measure again
    curve = measure_batch_curve(target, batch_sizes, tokens, context, repeats)
    atomic_write_json(path, curve.to_dict())
    return curve
