"""Calibrated acceptance: each drafter's raw edge score -> estimated acceptance probability.

Learned online from what the target accepted: for every verified node whose parent was
accepted, one trial in the bin of (source, raw edge score); accepted if the node is on the
accepted path. Each bin's estimate is a Beta-smoothed frequency whose prior mean is the raw
score itself (a draft probability is already a decent estimate), so fresh bins fall back to
the drafter's own belief and learn from there.

Beside the bins, each source's *best children* (the node its parent's highest-scored child of
that source) are counted on their own: a chain that drafts one level more extends its path by
the best child, so that, not the mean over every sibling of a wide tree, is what a level more is
worth (`mean(best=True)`). A top-8 head tree verified whole has seven unlikely siblings per
level; their mean acceptance (~0.27 for SmolLM2's head) once told the cost view that no chain
pays while its best children were accepted about half the time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CalibrationConfig:
    """Binning and smoothing of acceptance estimates."""

    bins: int = 10
    """Equal-width bins of the raw edge score in [0, 1]."""
    prior_strength: float = 4.0
    """Pseudo-trials of the prior (the raw score) in each bin."""
    max_trials: float = 2000.0
    """Counts are rescaled past this many trials per bin, so estimates follow drift."""


class Calibrator:
    """Per-source, per-bin acceptance counts, in Python lists: a step asks for dozens of estimates, and
    numpy's scalar indexing and arithmetic on ten-slot arrays cost several times what floats do. A
    count is a sum of ones halved now and then, exact in a float until its slot has been halved some
    forty times, so until then a source's totals are the same in any order of addition."""

    def __init__(self, config: CalibrationConfig = CalibrationConfig()) -> None:
        self.config = config
        self._acc: dict[str, list[float]] = {}
        self._trials: dict[str, list[float]] = {}
        self._best: dict[str, list[float]] = {}  # per source: [accepted, trials] of best children

    def _bin(self, raw: float) -> int:
        return min(self.config.bins - 1, max(0, int(raw * self.config.bins)))

    def _tables(self, source: str) -> tuple[list[float], list[float]]:
        acc = self._acc.get(source)
        if acc is None:
            acc = self._acc[source] = [0.0] * self.config.bins
            self._trials[source] = [0.0] * self.config.bins
        return acc, self._trials[source]

    def estimate(self, source: str, raw: float) -> float:
        """Estimated P(accept | parent accepted) for a node with this raw edge score."""
        raw = min(1.0, max(0.0, float(raw)))
        acc, trials = self._tables(source)
        b = self._bin(raw)
        k = self.config.prior_strength
        return (acc[b] + k * raw) / (trials[b] + k)

    def mean(self, source: str, prior: float = 0.5, best: bool = False) -> float:
        """Estimated P(accept | parent accepted) of this source's nodes whatever their score, or
        (`best`) of its best children only (`prior` smoothed in with `prior_strength` pseudo-trials)."""
        k = self.config.prior_strength
        if best:
            accepted, trials = self._best.get(source, (0.0, 0.0))
            return (accepted + k * prior) / (trials + k)
        acc, trials = self._tables(source)
        return (sum(acc) + k * prior) / (sum(trials) + k)

    def update(self, source: str, raw: float, accepted: bool, best: bool = False) -> None:
        """One trial of a node with this raw score; `best`: the node was its parent's best-scored
        child of this source (counted again among the best children)."""
        acc, trials = self._tables(source)
        self._count(acc, trials, self._bin(min(1.0, max(0.0, float(raw)))), accepted)
        if best:
            sums = self._best.setdefault(source, [0.0, 0.0])  # [accepted, trials]
            sums[0], sums[1] = self._counted(sums[0], sums[1], accepted)

    def _count(self, acc: list[float], trials: list[float], i: int, accepted: bool) -> None:
        """One trial in slot i (`_counted`)."""
        acc[i], trials[i] = self._counted(acc[i], trials[i], accepted)

    def _counted(self, acc: float, trials: float, accepted: bool) -> tuple[float, float]:
        """A slot's (accepted, trials) after one more trial; halved past `max_trials`, so estimates follow drift."""
        acc, trials = acc + float(accepted), trials + 1.0
        if trials > self.config.max_trials:
            acc, trials = acc * 0.5, trials * 0.5
        return acc, trials

    def table(self) -> dict[str, list[dict]]:
        """Per source: bin range, trials and estimate (for reports)."""
        out = {}
        for source, trials in self._trials.items():
            rows = []
            for b in range(self.config.bins):
                mid = (b + 0.5) / self.config.bins
                rows.append({"bin": [b / self.config.bins, (b + 1) / self.config.bins],
                             "trials": float(trials[b]), "estimate": round(self.estimate(source, mid), 4)})
            out[source] = rows
        return out
