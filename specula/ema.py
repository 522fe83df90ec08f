"""Exponential moving averages: one helper for every running estimate (weights live in configs)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Ema:
    """value <- (1 - weight) * value + weight * x; the first observation is taken as is."""

    weight: float
    """Weight of each new observation, in (0, 1]."""
    value: float | None = None
    """The current average (None before the first observation)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"EMA weight must be in (0, 1], got {self.weight}")

    def update(self, x: float) -> float:
        self.value = x if self.value is None else (1.0 - self.weight) * self.value + self.weight * x
        return self.value

    def get(self, default: float = 0.0) -> float:
        """The average, or `default` before any observation."""
        return default if self.value is None else self.value
