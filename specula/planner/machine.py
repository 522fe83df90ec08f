"""How busy the machine is while we time passes: CPU time other processes used in an interval.

Start-up timing must measure this machine, not a moment when something else ran on it: a round
of passes timed while another process took a core reads 1.5x slow and, cached, used to steer the
planner for good. On Linux the interval's CPU use of every process (`/proc/stat`) minus ours
(`/proc/self/stat`) is what the others took, in cores; elsewhere nothing is known (None) and no
round is discarded.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _total_busy_ticks() -> int | None:
    """Busy jiffies of all CPUs since boot (user + nice + system + irq + softirq + steal)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:]]
    # user nice system idle iowait irq softirq steal ...
    return sum(values[i] for i in (0, 1, 2, 5, 6, 7) if i < len(values))


def _own_ticks() -> int | None:
    """This process's user + system jiffies (all its threads)."""
    try:
        with open("/proc/self/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)


@dataclass
class LoadProbe:
    """Started before an interval; `others()` afterwards: the cores other processes kept busy."""

    t0: float = 0.0
    total0: int | None = None
    own0: int | None = None

    @classmethod
    def start(cls) -> "LoadProbe":
        return cls(time.perf_counter(), _total_busy_ticks(), _own_ticks())

    def others(self) -> float | None:
        """Mean number of cores other processes used since `start` (None where unknown, or when the
        interval was too short to read: under 5 jiffies)."""
        total, own = _total_busy_ticks(), _own_ticks()
        elapsed = time.perf_counter() - self.t0
        if None in (total, own, self.total0, self.own0) or elapsed * _TICKS < 5:
            return None
        other_ticks = (total - self.total0) - (own - self.own0)
        return max(0.0, other_ticks / _TICKS / elapsed)
