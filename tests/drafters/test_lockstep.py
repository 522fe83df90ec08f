"""Drafting in lockstep (`drafters.lockstep`): passes of one key run as one call, each generator
gets its own result, a failure stays with the sessions it belongs to, and each clock is charged its
share of the calls it took part in."""

from __future__ import annotations

import time

import pytest

from specula.drafters.lockstep import AfterOthers, ShareClock, drive, drive_each, drive_many


class FakePass:
    """A pass that doubles its value; `calls` records each call's values (one list per call)."""

    def __init__(self, value, key, calls, sleep=0.0, fail=None):
        self.value, self.key, self.calls, self.sleep, self.fail = value, key, calls, sleep, fail

    def run(self):
        return self.run_many([self])[0]

    def run_many(self, passes):
        self.calls.append([p.value for p in passes])
        time.sleep(self.sleep)
        if self.fail is not None:
            raise self.fail
        return [2 * p.value for p in passes]


def expansion(values, key, calls, sleep=0.0, fail_at=None, raise_at=None):
    """Yields a pass per value (its key `key`), sums the results; raises at value `raise_at`."""
    total = 0
    for v in values:
        if v == raise_at:
            raise ValueError(f"drafter failed at {v}")
        total += yield FakePass(v, key, calls, sleep, RuntimeError("pass failed") if v == fail_at else None)
    return total


def test_drive_runs_each_pass_alone_and_returns_the_proposal():
    calls = []
    assert drive(expansion([1, 2, 3], "head", calls)) == 12
    assert calls == [[1], [2], [3]]


def test_passes_of_one_key_run_as_one_call_each_round_and_each_gets_its_own_result():
    calls = []
    steps = [expansion([1, 2], "head", calls), expansion([10, 20, 30], "head", calls),
             expansion([5], None, calls), expansion([], "head", calls)]
    results = drive_many(steps, [ShareClock() for _ in steps])
    assert results == [6, 120, 10, 0]
    assert sorted(calls) == sorted([[1, 10], [2, 20], [30], [5]])  # the keyless pass alone, the rest by round


def test_passes_of_different_keys_never_share_a_call():
    calls = []
    steps = [expansion([1], "a", calls), expansion([2], "b", calls), expansion([3], "a", calls)]
    assert drive_many(steps, [ShareClock() for _ in steps]) == [2, 4, 6]
    assert sorted(calls) == [[1, 3], [2]]


def test_a_drafter_that_raises_fails_its_session_alone():
    calls = []
    steps = [expansion([1, 2, 3], "head", calls), expansion([4, 5, 6], "head", calls, raise_at=5)]
    first, second = drive_many(steps, [ShareClock() for _ in steps])
    assert first == 12
    assert isinstance(second, ValueError) and "failed at 5" in str(second)
    assert calls == [[1, 4], [2], [3]]


def test_a_failed_shared_call_is_thrown_into_each_generator_that_took_part():
    calls = []
    steps = [expansion([1, 2], "head", calls, fail_at=2), expansion([3, 4], "head", calls),
             expansion([7, 8], None, calls)]
    results = drive_many(steps, [ShareClock() for _ in steps])
    assert isinstance(results[0], RuntimeError) and isinstance(results[1], RuntimeError)
    assert results[2] == 30  # its passes ran apart from the failed call


def test_a_generator_may_catch_its_failed_pass_and_go_on():
    calls = []

    def careful():
        try:
            yield FakePass(1, "head", calls, fail=RuntimeError("pass failed"))
        except RuntimeError:
            return "fell back"

    assert drive_many([careful()], [ShareClock()]) == ["fell back"]


def test_each_clock_is_charged_its_share_of_the_calls_it_took_part_in():
    calls = []
    clocks = [ShareClock() for _ in range(3)]
    steps = [expansion([1, 2], "head", calls, sleep=0.03), expansion([3, 4], "head", calls, sleep=0.03),
             expansion([5], "other", calls, sleep=0.03)]
    t0 = time.perf_counter()
    drive_many(steps, clocks)
    wall = time.perf_counter() - t0
    # head: two calls of two passes (~0.03 s each), a share of 0.015 s per pass; other: one call alone
    assert clocks[0]() == pytest.approx(0.03, abs=0.012) and clocks[1]() == pytest.approx(0.03, abs=0.012)
    assert clocks[2]() == pytest.approx(0.03, abs=0.012)
    assert sum(c() for c in clocks) <= wall + 1e-3  # no second is charged twice


def test_a_clock_advances_only_while_its_own_code_runs():
    clock = ShareClock()
    assert clock() == 0.0
    clock.resume()
    time.sleep(0.01)
    clock.pause()
    spent = clock()
    time.sleep(0.01)
    assert clock() == spent >= 0.01


def test_drive_each_gives_drive_manys_results_one_generator_at_a_time():
    calls = []
    steps = [expansion([1, 2], "head", calls), expansion([3, 4], "head", calls, raise_at=4)]
    clocks = [ShareClock() for _ in steps]
    first, second = drive_each(steps, clocks)
    assert first == 6 and isinstance(second, ValueError)
    assert calls == [[1], [2], [3]]  # no pass shared


def test_a_generator_after_others_resumes_once_the_rounds_other_passes_ran():
    calls, seen = [], []

    def copier():
        yield AfterOthers()
        seen.append(list(calls))  # what had run when it resumed
        return (yield FakePass(7, "head", calls))

    steps = [copier(), expansion([1, 2], None, calls), expansion([3], "head", calls)]
    assert drive_many(steps, [ShareClock() for _ in steps]) == [14, 6, 6]
    assert seen == [[[3], [1]]]  # the first round's passes, though it came first
    assert sorted(calls) == [[1], [2], [3], [7]]
    assert drive(copier()) == 14  # alone: it resumes at once
