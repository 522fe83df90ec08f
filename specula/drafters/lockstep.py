"""Drafting in lockstep: a packed batch's sessions expand their trees level by level together, so
that their drafting passes of a level can run as one call.

A drafter that drafts through model passes may offer `propose_steps(ctx, state, clock)`: a generator
that yields a `Pass` wherever it needs one, receives the pass's result, and returns its `Proposal`
(`DraftTreeDrafter` and the trained heads built on it, `DraftModelDrafter`). `drive` runs one such
generator alone, each pass on its own (`propose`). `drive_many` runs several in step: each round,
every generator still drafting has yielded one pass; passes of one `key` run as one `Pass.run_many`
call (a trained head's level for every session in one kernel call, a drafted token of every
session's draft-model chain in one packed pass: the weights read once), the rest one by one, an
`AfterOthers` last (a session that copies what another's pass writes this round). A generator's
`clock` reads the seconds of its own code plus its share of each call it took part in, which is
what its cost view prices its drafting by; each generator's own state is touched only by its own
code, so the proposals are exactly those each would make alone.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Generator, Hashable, Protocol, Sequence

Clock = Callable[[], float]
"""Seconds on a clock that only advances while its drafter works for its session."""


class Pass(Protocol):
    """One session's model pass, waiting to run."""

    key: Hashable | None
    """Passes of equal non-None keys may run as one `run_many` call; None: this one runs alone."""

    def run(self) -> Any:
        """Run this pass alone: the result the generator receives."""
        ...

    def run_many(self, passes: Sequence["Pass"]) -> list[Any]:
        """Run `passes` (this one among them, all of its key) as one call: each one's result, in order."""
        ...


Steps = Generator[Pass, Any, Any]
"""A drafter's expansion: yields passes, receives their results, returns its proposal."""


class AfterOthers:
    """A pass that runs nothing: its generator resumes once every other pass of the round has run (a session that
    copies what another session's pass of this round writes: a draft cache caught up on the same prompt).
    Alone (`drive`), it returns at once."""

    key = None

    def run(self) -> None:
        return None

    def run_many(self, passes: Sequence["Pass"]) -> list[None]:
        return [None] * len(passes)


def immediate(fn: Callable[..., Any], *args: Any) -> Steps:
    """fn(*args) as steps that yield no pass (a drafting call with nothing to share)."""
    yield from ()
    return fn(*args)


def drive(steps: Steps) -> Any:
    """Run a generator alone, each of its passes on its own: what it returns."""
    try:
        request = next(steps)
        while True:
            request = steps.send(request.run())
    except StopIteration as stop:
        return stop.value


class ShareClock:
    """A session's drafting seconds in a lockstep batch: the time its own generator code ran, plus
    its share of each call it took part in (the call's seconds over the passes in it)."""

    def __init__(self) -> None:
        self.spent = 0.0
        self._since: float | None = None  # while its code runs: when it resumed

    def __call__(self) -> float:
        running = 0.0 if self._since is None else time.perf_counter() - self._since
        return self.spent + running

    def resume(self) -> None:
        self._since = time.perf_counter()

    def pause(self) -> None:
        if self._since is not None:
            self.spent += time.perf_counter() - self._since
            self._since = None


def drive_each(steps: Sequence[Steps], clocks: Sequence[ShareClock]) -> list[Any]:
    """`drive_many`'s results without the lockstep: each generator run alone, in turn (every pass on
    its own), its clock charged its own time. What a batch's drafting costs without sharing passes
    (`scripts/lockstep_speed.py` measures against it)."""
    results: list[Any] = []
    for run, clock in zip(steps, clocks):
        clock.resume()
        try:
            results.append(drive(run))
        except Exception as exc:  # this session's drafting fails; the others draft on
            results.append(exc)
        finally:
            clock.pause()
    return results


def drive_many(steps: Sequence[Steps], clocks: Sequence[ShareClock]) -> list[Any]:
    """Run generators in step (see the module docstring): each one's return value, or the exception it
    raised (one session's failure leaves the others drafting; a failed shared call is thrown into each
    generator that took part). `clocks[i]` is the clock generator i was built with."""
    results: list[Any] = [None] * len(steps)
    waiting: dict[int, Pass] = {}

    def advance(i: int, value: Any = None, error: BaseException | None = None) -> None:
        clocks[i].resume()
        try:
            request = steps[i].send(value) if error is None else steps[i].throw(error)
        except StopIteration as stop:
            results[i] = stop.value
        except Exception as exc:  # this session's drafting fails; the batch's others draft on
            results[i] = exc
        else:
            waiting[i] = request
        finally:
            clocks[i].pause()

    for i in range(len(steps)):
        advance(i)
    while waiting:
        groups: dict[Hashable, list[int]] = {}
        alone: list[int] = []
        for i, request in waiting.items():
            (alone if request.key is None else groups.setdefault(request.key, [])).append(i)
        alone.sort(key=lambda i: isinstance(waiting[i], AfterOthers))  # stable: those last, once the rest ran
        current, calls = dict(waiting), [*groups.values(), *([i] for i in alone)]
        waiting.clear()
        for group in calls:
            passes = [current[i] for i in group]
            t0 = time.perf_counter()
            try:
                outs = passes[0].run_many(passes) if len(passes) > 1 else [passes[0].run()]
            except Exception as exc:  # the shared call failed: thrown into each generator that took part
                for i in group:
                    advance(i, error=exc)
                continue
            share = (time.perf_counter() - t0) / len(group)
            for i, out in zip(group, outs):
                clocks[i].spent += share
                advance(i, out)
    return results
