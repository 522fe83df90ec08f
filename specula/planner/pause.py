"""The planner's doubling pause: after a loss, sit out 1, 2, 4, ... steps up to a longest pause, then
probe again; a win halves the next pause. One type for every schedule of the kind (a request's
back-off, a batch size's back-off, a drafter held back in a request)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Pause:
    """One doubling schedule (mutable: it lives in a request's or a batch size's state)."""

    left: int = 0
    """Steps left in the current pause."""
    next: int = 1
    """Length of the next pause."""

    def waiting(self) -> bool:
        """Whether this step is sat out (counting it off the current pause)."""
        if self.left > 0:
            self.left -= 1
            return True
        return False

    def lose(self, longest: int) -> None:
        """Start a pause of `next` steps and double the one after it (at most `longest`)."""
        self.left = self.next
        self.next = min(2 * self.next, longest)

    def win(self) -> None:
        """Halve the next pause (at least one step)."""
        self.next = max(1, self.next // 2)
