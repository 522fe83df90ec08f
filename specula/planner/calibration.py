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

import numpy as np


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
    """Per-source, per-bin acceptance counts."""

    def __init__(self, config: CalibrationConfig = CalibrationConfig()) -> None:
        self.config = config
        self._acc: dict[str, np.ndarray] = {}
        self._trials: dict[str, np.ndarray] = {}
        self._best: dict[str, np.ndarray] = {}  # per source: [accepted, trials] of best children

    def _bin(self, raw: float) -> int:
        return min(self.config.bins - 1, max(0, int(raw * self.config.bins)))

    def _tables(self, source: str) -> tuple[np.ndarray, np.ndarray]:
        if source not in self._acc:
            self._acc[source] = np.zeros(self.config.bins)
            self._trials[source] = np.zeros(self.config.bins)
        return self._acc[source], self._trials[source]

    def estimate(self, source: str, raw: float) -> float:
        """Estimated P(accept | parent accepted) for a node with this raw edge score."""
        raw = min(1.0, max(0.0, float(raw)))
        acc, trials = self._tables(source)
        b = self._bin(raw)
        k = self.config.prior_strength
        return float((acc[b] + k * raw) / (trials[b] + k))

    def mean(self, source: str, prior: float = 0.5, best: bool = False) -> float:
        """Estimated P(accept | parent accepted) of this source's nodes whatever their score, or
        (`best`) of its best children only (`prior` smoothed in with `prior_strength` pseudo-trials)."""
        k = self.config.prior_strength
        if best:
            accepted, trials = self._best.get(source, np.zeros(2))
            return float((accepted + k * prior) / (trials + k))
        acc, trials = self._tables(source)
        return float((acc.sum() + k * prior) / (trials.sum() + k))

    def update(self, source: str, raw: float, accepted: bool, best: bool = False) -> None:
        """One trial of a node with this raw score; `best`: the node was its parent's best-scored
        child of this source (counted again among the best children)."""
        acc, trials = self._tables(source)
        self._count(acc, trials, self._bin(min(1.0, max(0.0, float(raw)))), accepted)
        if best:
            sums = self._best.setdefault(source, np.zeros(2))  # [accepted, trials]
            self._count(sums[:1], sums[1:], 0, accepted)

    def _count(self, acc: np.ndarray, trials: np.ndarray, i: int, accepted: bool) -> None:
        """One trial in slot i; counts are halved past `max_trials`, so estimates follow drift."""
        acc[i] += float(accepted)
        trials[i] += 1.0
        if trials[i] > self.config.max_trials:
            acc[i] *= 0.5
            trials[i] *= 0.5

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
