"""The target's cost across a batch: latency of one packed pass against (sequences, total tokens).

A batched step verifies every running session's tree in one target pass (`forward_trees`):
B sequences, each contributing its root and its n_i - 1 draft nodes, Σ n_i tokens in all. On a
CPU the linear layers dominate and their cost follows the total; attention and the per-sequence
bookkeeping follow B. So the model is measured as a table: for each batch size b, passes of b
sequences verifying n tokens each (b * n tokens in all), and read as

    latency(b, total)   piecewise-linear in `total` on each measured b (extended with the last
                        segment's slope), linear in b between measured batch sizes at the same
                        draft nodes (total - b); beyond the largest measured b, as several such
                        batches side by side.

    measure_batch_times       time the cells: quiet rounds, each cell as a ratio to its round's plain step
    measure_batch_curve       the table of one timing (`specula profile --batch-sizes`)
    load_or_measure_batch_curve   cached on disk per backend `cost_key()`: the medians of every
                              sample kept, 5 for the cells a batch plan weighs most
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from specula.errors import ConfigError
from specula.models.base import TargetModel, forward_trees
from specula.models.device import sync_device
from specula.planner.cost import (MAX_SAMPLES, VALIDATE_SAMPLES, CostCurve, TimingConfig, check_samples,
                                  read_cached_samples, warm_up)
from specula.tree import TokenTree

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)
"""Batch sizes measured by default (the server measures those below its --max-batch-size, and that size)."""
DEFAULT_BATCH_TOKENS = (1, 2, 4, 8)
"""Tokens per sequence measured at each batch size (root + n - 1 draft nodes)."""


def timed_batch_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes start-up times for up to `max_batch_size` sequences a pass: those of
    `DEFAULT_BATCH_SIZES` below it and itself (at most six rows, whatever the size); the sizes between
    are read linearly between the rows (`BatchCostCurve.latency`). The largest row is timed, not
    extrapolated: on SmolLM2-135M (CPU, 2 cores) the rows of 1..64 sequences timed densely and read
    from these rows differed by a median 4-5% (a second dense timing: 4%); stopping at 32 and reading
    48 and 64 as batches side by side priced a node a sequence 33-49% low (the pass 16-24%), and a
    goodput choice drafted there where the dense table drafted none.
    So the timing's cost still grows with `max_batch_size`, in tokens (that row's passes and the
    prefill of that many sequences), not in passes."""
    if max_batch_size < 1:
        raise ConfigError(f"max_batch_size must be >= 1, got {max_batch_size}")
    return [b for b in DEFAULT_BATCH_SIZES if b < max_batch_size] + [max_batch_size]


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

    def row_curve(self, batch: int, tokens: Sequence[int] = DEFAULT_BATCH_TOKENS) -> CostCurve:
        """The table at one batch size as a `CostCurve` over extra tokens: size s = total - batch + 1
        (s = 1: every sequence verifies its root alone, a plain batched step)."""
        sizes = sorted({1, *(batch * n - batch + 1 for n in tokens)})
        return CostCurve(tuple(sizes), tuple(self.latency(batch, s + batch - 1) for s in sizes), self.context)

    def latency(self, batch: int, total: float) -> float:
        """Seconds for one pass of `batch` sequences and `total` tokens in all. Between two timed
        batch sizes b0 < batch < b1, linear in the batch size, each row read at the same draft nodes
        (`total - batch`): read at the same total, row b1 (flat below its plain pass) priced the first
        b1 - batch nodes at row b0's share of their cost alone (SmolLM2-135M, rows 1..64 timed
        densely: a goodput choice read from rows 1, 2, 4, 8, 16, 64 differed from the dense table's
        in 12-14 cases of 18, against 7-9 at the same nodes and 3 for a second dense timing)."""
        sizes = self.batch_sizes
        row = lambda i, at: _interpolate(self.totals[i], self.seconds[i], at)  # noqa: E731
        if batch > sizes[-1]:  # beyond the table: as that many largest batches side by side
            scale = batch / sizes[-1]
            return scale * row(-1, total / scale)
        i = bisect.bisect_left(sizes, batch)
        if sizes[i] == batch:
            return row(i, total)
        b0, b1 = sizes[i - 1], sizes[i]
        w, extra = (batch - b0) / (b1 - b0), total - batch
        return (1 - w) * row(i - 1, b0 + extra) + w * row(i, b1 + extra)

    def to_dict(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes), "totals": [list(t) for t in self.totals],
                "seconds": [list(s) for s in self.seconds], "context": self.context}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BatchCostCurve":
        return cls(tuple(int(b) for b in data["batch_sizes"]), tuple(tuple(int(t) for t in r) for r in data["totals"]),
                   tuple(tuple(float(s) for s in r) for r in data["seconds"]), int(data["context"]))


DEFAULT_BATCH_CONTEXT = 32
"""Tokens in each sequence's cache when the table is timed. Every timing prefills b sequences with
them first (16 x 128 tokens took 40 s of Qwen2.5-Coder-1.5B's prefill on 2 cores, more than the
passes timed after); the table's shape read alike at 32 and 128 within the machine's noise
(SmolLM2, 2 x 2 timings), and the planner corrects its level from the run's own passes."""
VALIDATE_MAX_TOTAL = 16
"""Cells of at most this many tokens in all get `cost.VALIDATE_SAMPLES` samples (the others
`repeats`): the passes a batch plan weighs most, a node or two per sequence beside a plain batched
step. Larger cells are rarely chosen and slow to time."""

Cell = tuple[int, int]
"""(b sequences, n tokens each) of one packed pass."""
PROGRESS_AFTER = 5.0
"""Seconds into a timing after which each of its steps is logged (a server's first start-up with a
large --max-batch-size on a large model: minutes of prefill and passes before it listens)."""


def _progress(start: float, message: str, *args: object) -> None:
    """Log one step of a timing begun at `start` (`time.perf_counter()`) once it has run `PROGRESS_AFTER` s."""
    elapsed = time.perf_counter() - start
    if elapsed >= PROGRESS_AFTER:
        log.info("timing packed passes, %.0f s: " + message, elapsed, *args)


@dataclass(frozen=True)
class BatchTimes:
    """The kept rounds of one timing: each round's plain step, and each cell's latency as a ratio to
    the plain step of its own round (a busier moment shifts the step, not the table's shape)."""

    steps: list[float]
    """Seconds of the plain step (1, 1) of each quiet round (of the least busy, if none was)."""
    ratios: dict[Cell, list[float]]
    """Per cell timed (other than (1, 1)): latency / its round's plain step, one per kept round."""
    busy: bool = False
    """Some cell got fewer quiet rounds than it needed: its least busy ones were kept."""
    discarded: int = 0
    """Rounds timed while other processes were busy."""


def measure_batch_times(backend: TargetModel, needed: dict[Cell, int], context: int = DEFAULT_BATCH_CONTEXT,
                        seed: int = 0, config: TimingConfig = TimingConfig()) -> BatchTimes:
    """Time packed passes of b sequences, each verifying its root and a chain of n - 1 nodes after
    `context` tokens in its cache, until each cell (b, n) of `needed` has that many quiet rounds.

    One pass of each batch size's largest cell first (its buffers), then plain steps until stable
    (`cost.warm_up`); then rounds of (1, 1) and every cell still short of quiet samples, cells in
    ascending order. A round during which other processes kept more than `config.busy_cores`
    cores busy does not count (a cell is timed in at most `config.max_round_factor` times the
    rounds it needs: on a machine busy throughout, the cells needing 2 had been timed in all 15
    rounds of those needing 5; SmolLM2's table for 64 sequences took 391 passes, 158 s, under load
    against 100 passes, 10 s, quiet). In the first round a cell costing more than
    `config.max_ratio` times its batch size's plain pass ends that batch size's row (larger passes
    cost more still and cannot pay; the table extends the row's last slope). Runs on sequences of
    its own, released at the end."""
    from specula.planner.machine import LoadProbe

    cells = sorted({(1, 1), *((int(b), int(n)) for b, n in needed)})
    need = {cell: int(needed.get(cell, 0)) for cell in cells}
    if min(min(cell) for cell in cells) < 1 or max(need.values()) < 1:
        raise ConfigError("batch sizes, tokens per sequence and repeats must be >= 1")
    if context < 1:
        raise ConfigError(f"context must be >= 1, got {context}")
    longest = max(n for _, n in cells)
    if context + longest > backend.max_context:
        raise ConfigError(f"context {context} + {longest} tokens exceeds the target's context window of "
                          f"{backend.max_context}; lower the context or the tokens per sequence")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, backend.vocab_size, (max(b for b, _ in cells), context + longest), generator=gen).tolist()
    seqs = []
    rounds: list[tuple[float, dict[Cell, float]]] = []  # (other processes' cores, seconds per cell)
    quiet: dict[Cell, int] = {cell: 0 for cell in cells}
    start = time.perf_counter()
    try:
        for row in ids:
            seq = backend.new_sequence()
            seqs.append(seq)
            seq.prefill(row[:context], logits="none")
        _progress(start, "%d sequences of %d tokens prefilled", len(seqs), context)

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

        for b in sorted({b for b, _ in cells}):  # warm-up: each batch size's largest pass (its buffers)
            timed(b, max(n for c, n in cells if c == b))
        _, passes, stable = warm_up(lambda: timed(1, 1), config)
        _progress(start, "warmed up after %d plain passes%s", passes, "" if stable else " (never steady)")
        tried: dict[Cell, int] = {cell: 0 for cell in cells}

        def short(cell: Cell) -> bool:  # still short of quiet rounds, and not yet timed in all it may take
            return quiet[cell] < need[cell] and tried[cell] < need[cell] * config.max_round_factor

        for _ in range(max(need.values()) * config.max_round_factor):
            todo = [cell for cell in cells if cell == (1, 1) or short(cell)]
            if len(todo) == 1 and not short((1, 1)):
                break
            probe = LoadProbe.start()
            secs: dict[Cell, float] = {}
            for b, n in todo:
                if not need[b, n] and (b, n) != (1, 1):
                    continue  # cut earlier in this round
                secs[b, n] = timed(b, n)
                plain = secs.get((b, 1))
                if not rounds and plain is not None and n > 1 and secs[b, n] > config.max_ratio * plain:
                    secs[b, n] = min(secs[b, n], timed(b, n))  # once more: one slow pass must not cut
                    if secs[b, n] > config.max_ratio * plain:
                        for cell in cells:  # this batch size's larger passes: not worth timing
                            if cell[0] == b and cell[1] > n:
                                need[cell] = 0
            others = probe.others()
            rounds.append((others if others is not None else 0.0, secs))
            for cell in secs:
                tried[cell] += 1
            if rounds[-1][0] <= config.busy_cores:
                for cell in secs:
                    quiet[cell] += 1
            _progress(start, "round %d (%d busy), %d of %d cells (sequences x tokens) have their samples",
                      len(rounds), sum(load > config.busy_cores for load, _ in rounds),
                      sum(quiet[cell] >= need[cell] for cell in cells), len(cells))
    finally:
        for seq in seqs:
            seq.release()
    kept: dict[Cell, list[dict[Cell, float]]] = {}
    for cell in cells:  # each cell's quiet rounds, else (every one busy) its least busy ones
        with_it = [r for r in rounds if cell in r[1]]
        calm = [secs for load, secs in with_it if load <= config.busy_cores]
        kept[cell] = calm if len(calm) >= need[cell] else [secs for _, secs in sorted(with_it, key=lambda r: r[0])]
        kept[cell] = kept[cell][: max(need[cell], 1)] if need[cell] or cell == (1, 1) else []  # a cut cell: none
    busy = any(quiet[cell] < need[cell] for cell in cells)
    calm_steps = [secs[1, 1] for load, secs in rounds if load <= config.busy_cores]
    return BatchTimes(calm_steps or [secs[1, 1] for secs in kept[1, 1]],
                      {cell: [secs[cell] / max(secs[1, 1], 1e-12) for secs in kept[cell]]
                       for cell in cells if cell != (1, 1) and kept[cell]},
                      busy, sum(1 for load, _ in rounds if load > config.busy_cores))


def _cells(batch_sizes: Sequence[int], tokens: Sequence[int]) -> list[Cell]:
    return [(b, n) for b in batch_sizes for n in tokens]


def add_batch_samples(samples: dict[str, Any], times: BatchTimes, asked: Sequence[Cell] = ()) -> None:
    """Fold one timing's rounds into a cache entry's samples (the last `MAX_SAMPLES` of each); cells
    `asked` for that the timing cut (too costly) are noted in `cut`, so no later load times them."""
    cut = {f"{b}x{n}" for b, n in asked if (b, n) != (1, 1) and (b, n) not in times.ratios}
    if cut or "cut" in samples:
        samples["cut"] = sorted(set(samples.get("cut", [])) | cut)
    samples["step"] = (samples.get("step", []) + list(times.steps))[-MAX_SAMPLES:]
    ratio = samples.setdefault("ratio", {})
    for (b, n), values in times.ratios.items():
        ratio[f"{b}x{n}"] = (ratio.get(f"{b}x{n}", []) + list(values))[-MAX_SAMPLES:]


def curve_from_batch_samples(samples: dict[str, Any], context: int) -> BatchCostCurve:
    """The table of a cache entry's samples: a cell = the median plain step times the median of the
    cell's ratios; each row holds the cells timed, made non-decreasing in tokens (a pass over more
    tokens does not cost less: a lower reading further along is noise, and the flat stretch it
    leaves reads as free nodes)."""
    check_samples(samples)
    step = statistics.median(samples["step"])
    cells: dict[int, dict[int, float]] = {1: {1: step}}
    for key, values in samples["ratio"].items():
        b, n = (int(x) for x in key.split("x"))
        cells.setdefault(b, {})[n] = step * statistics.median(values)
    rows = []
    for b in sorted(cells):
        row, floor = [], 0.0
        for n in sorted(cells[b]):
            floor = max(floor, cells[b][n])
            row.append(floor)
        rows.append(tuple(row))
    return BatchCostCurve(tuple(sorted(cells)), tuple(tuple(b * n for n in sorted(cells[b])) for b in sorted(cells)),
                          tuple(rows), context)


def _samples_of_batch_curve(curve: BatchCostCurve) -> dict[str, Any]:
    """Samples standing for a table cached without them (one sample per cell)."""
    step = curve.seconds[0][0]
    return {"step": [step], "ratio": {f"{b}x{total // b}": [s / step]
                                      for b, totals, secs in zip(curve.batch_sizes, curve.totals, curve.seconds)
                                      for total, s in zip(totals, secs) if (b, total) != (1, 1)}}


def measure_batch_curve(backend: TargetModel, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                        tokens: Sequence[int] = DEFAULT_BATCH_TOKENS, context: int = DEFAULT_BATCH_CONTEXT,
                        repeats: int = 2, seed: int = 0, config: TimingConfig = TimingConfig()) -> BatchCostCurve:
    """The packed-pass table of b sequences verifying n tokens each, for each b in `batch_sizes` (1
    added) and n in `tokens` (1 added), from `repeats` quiet rounds (`measure_batch_times`, with
    `config`)."""
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    batch_sizes, tokens = sorted({1, *(int(b) for b in batch_sizes)}), sorted({1, *(int(n) for n in tokens)})
    samples: dict[str, Any] = {}
    add_batch_samples(samples, measure_batch_times(backend, dict.fromkeys(_cells(batch_sizes, tokens), repeats),
                                                   context, seed, config))
    return curve_from_batch_samples(samples, context)


def load_or_measure_batch_curve(target: TargetModel, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                                tokens: Sequence[int] = DEFAULT_BATCH_TOKENS, context: int = DEFAULT_BATCH_CONTEXT,
                                repeats: int = 2) -> BatchCostCurve:
    """The batch cost table from the on-disk cache (per backend `cost_key()`, sizes and context),
    or measured now and cached atomically: `VALIDATE_SAMPLES` quiet rounds of the cells of up to
    `VALIDATE_MAX_TOTAL` tokens, `repeats` of the others, the table being the median of the
    samples. Two rounds were not enough: batch 8's plain pass read 45 ms against 31-38 ms in four
    later timings, which priced its first 8 nodes at nothing, and the cached table kept that price
    for every later run. A cached table short of samples (an older entry, a busy timing) is timed
    up to them on load; a busy timing is not added. Within a run the planner corrects it online."""
    from specula.paths import atomic_write_json, cache_dir

    batch_sizes, tokens = sorted({1, *batch_sizes}), sorted({1, *tokens})
    # one entry whatever batch sizes are asked (a server started with --max-batch-size 6 after 8 times
    # only the row of 6): the table holds every row timed, and the planner reads the rows it needs
    parts = {**target.cost_key(), "tokens": tokens, "context": context}
    key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = cache_dir("cost") / f"batch-{key}.json"
    samples = read_cached_samples(path, lambda data: _samples_of_batch_curve(BatchCostCurve.from_dict(data)),
                                  lambda samples: curve_from_batch_samples(samples, context))
    wanted = [cell for cell in _cells(batch_sizes, tokens) if cell != (1, 1)]
    first = {cell: VALIDATE_SAMPLES if cell[0] * cell[1] <= VALIDATE_MAX_TOTAL else repeats for cell in wanted}
    if samples is None:
        samples = {}
        add_batch_samples(samples, measure_batch_times(target, {(1, 1): VALIDATE_SAMPLES, **first}, context), wanted)
    else:
        ratio, cut = samples["ratio"], set(samples.get("cut", []))
        # cells never timed (rows of other batch sizes), and small cells short of samples; a cut stays cut
        short = {(b, n): first[b, n] if f"{b}x{n}" not in ratio else VALIDATE_SAMPLES - len(ratio[f"{b}x{n}"])
                 for b, n in wanted
                 if f"{b}x{n}" not in cut and (f"{b}x{n}" not in ratio or b * n <= VALIDATE_MAX_TOTAL)}
        short = {cell: k for cell, k in short.items() if k > 0}
        if not short:
            return curve_from_batch_samples(samples, context)
        timing = measure_batch_times(target, short, context)
        if not timing.busy:  # a busy timing would only add noise to the cached samples
            add_batch_samples(samples, timing, short)
    curve = curve_from_batch_samples(samples, context)
    atomic_write_json(path, {**curve.to_dict(), "samples": samples})
    return curve
