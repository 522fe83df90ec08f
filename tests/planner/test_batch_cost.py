import json

import pytest

from specula.errors import ConfigError
from specula.models.native import NativeCausalLM, NativeDecoder, configure
from specula.planner import batch_cost
from specula.planner.batch_cost import (BatchCostCurve, load_or_measure_batch_curve, measure_batch_curve,
                                        timed_batch_sizes)
from specula.planner.cost import VALIDATE_SAMPLES
from tiny import tiny_model

def native_target() -> NativeCausalLM:
    return NativeCausalLM(configure(NativeDecoder.from_hf(tiny_model("qwen2", seed=1)), "aten", "none", "sdpa"), "native")


CURVE = BatchCostCurve((1, 2, 4), ((1, 2, 4), (2, 4, 8), (4, 8, 16)),
                       ((1.0, 1.2, 1.6), (1.3, 1.7, 2.5), (2.0, 2.8, 4.4)), 64)


def test_latency_interpolates_in_tokens_and_batch_size():
    assert CURVE.latency(2, 4) == pytest.approx(1.7)  # measured point
    assert CURVE.latency(2, 6) == pytest.approx(2.1)  # between totals 4 and 8
    assert CURVE.latency(4, 20) == pytest.approx(4.4 + 0.2 * 4)  # beyond: the last slope
    assert CURVE.latency(3, 8) == pytest.approx(0.5 * 2.5 + 0.5 * 2.8)  # between batch sizes 2 and 4
    assert CURVE.latency(8, 32) == pytest.approx(2 * 4.4)  # beyond the largest batch: two of them side by side
    assert BatchCostCurve.from_dict(json.loads(json.dumps(CURVE.to_dict()))) == CURVE


def test_between_timed_batch_sizes_each_row_is_read_at_the_same_draft_nodes():
    """Batch 3 lies halfway between rows 2 and 4: its pass is the mean of theirs at the same draft
    nodes. Read at the same total, row 4 (flat below its plain pass of 4 tokens) priced batch 3's
    first node at half its cost (0.1 where both rows charge 0.2)."""
    for nodes in (0, 1, 2, 5, 9, 30):
        assert CURVE.latency(3, 3 + nodes) == pytest.approx(0.5 * CURVE.latency(2, 2 + nodes)
                                                            + 0.5 * CURVE.latency(4, 4 + nodes))
    assert CURVE.latency(3, 3) == pytest.approx(0.5 * 1.3 + 0.5 * 2.0)
    assert CURVE.latency(3, 4) - CURVE.latency(3, 3) == pytest.approx(0.2)


def test_start_up_times_a_bounded_set_of_batch_sizes():
    """However large --max-batch-size, at most six rows: the default sizes below it and itself."""
    assert timed_batch_sizes(1) == [1] and timed_batch_sizes(2) == [1, 2] and timed_batch_sizes(6) == [1, 2, 4, 6]
    assert timed_batch_sizes(16) == [1, 2, 4, 8, 16] and timed_batch_sizes(64) == [1, 2, 4, 8, 16, 64]
    assert all(len(timed_batch_sizes(m)) <= 6 and timed_batch_sizes(m)[-1] == m for m in range(1, 300))
    with pytest.raises(ConfigError, match="max_batch_size"):
        timed_batch_sizes(0)


def test_a_table_timed_for_another_max_batch_size_still_loads(tmp_path, monkeypatch):
    """The cache entry holds every row timed: a table of rows 1..16 and 64 (a server of 64) serves
    one of 40 with its row 40 timed and row 64 kept (41..63 read between them); the one of 64 then times nothing."""
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    calls = fake_batch_times(monkeypatch, lambda b, n, i: 1.0 + 0.1 * (b * n - 1))
    load_or_measure_batch_curve(native_target(), timed_batch_sizes(64))
    forty = load_or_measure_batch_curve(native_target(), timed_batch_sizes(40))
    assert {b for b, _ in calls[1]} == {40} and forty.batch_sizes == (1, 2, 4, 8, 16, 40, 64)
    assert load_or_measure_batch_curve(native_target(), timed_batch_sizes(64)) == forty and len(calls) == 2


def test_bad_tables_are_refused():
    with pytest.raises(ConfigError, match="start at 1"):
        BatchCostCurve((2, 4), ((2,), (4,)), ((1.0,), (2.0,)), 64)
    with pytest.raises(ConfigError, match="positive"):
        BatchCostCurve((1,), ((1, 2),), ((1.0, 0.0),), 64)


def test_measured_on_packed_passes_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    target = native_target()
    curve = measure_batch_curve(target, (2, 4), (2, 4), context=8, repeats=1)
    assert curve.batch_sizes == (1, 2, 4)
    assert curve.totals == ((1, 2, 4), (2, 4, 8), (4, 8, 16))
    assert all(s > 0 for row in curve.seconds for s in row)
    first = load_or_measure_batch_curve(target, (2, 4), (2, 4), context=8)
    calls = []
    monkeypatch.setattr(batch_cost, "measure_batch_times", lambda *a, **k: calls.append(a[1]))
    again = load_or_measure_batch_curve(target, (2, 4), (2, 4), context=8)
    assert again == first and calls == []  # every cell had its samples: the second load reads the cache
    samples = json.loads(next((tmp_path / "cost").glob("batch-*.json")).read_text())["samples"]
    assert {k: len(v) for k, v in samples["ratio"].items()} == {"1x2": 5, "1x4": 5, "2x1": 5, "2x2": 5, "2x4": 5,
                                                               "4x1": 5, "4x2": 5, "4x4": 5}


def fake_batch_times(monkeypatch, ratio_of, busy_calls=()):
    """measure_batch_times replaced: on call i each cell costs `ratio_of(b, n, i)` plain steps of
    10 ms (as many samples as it needs); the calls listed in `busy_calls` come back busy."""
    calls: list[dict] = []

    def fake(target, needed, context=32, seed=0, config=None):
        i = len(calls)
        calls.append(dict(needed))
        ratios = {c: [ratio_of(*c, i)] * k for c, k in needed.items() if c != (1, 1)}
        return batch_cost.BatchTimes([0.010] * max(needed.values()), ratios, busy=i in busy_calls)

    monkeypatch.setattr(batch_cost, "measure_batch_times", fake)
    return calls


def test_a_noisy_cached_table_is_outvoted(tmp_path, monkeypatch):
    """A table cached from two bad readings (8 sequences' plain pass at 1.5 steps where it costs
    1.15: 8 -> 16 tokens looked free, as measured on this machine) before samples were kept is
    timed up to `VALIDATE_SAMPLES` on the next load, the cells a batch plan weighs most only; the
    table is the median of the samples, so the bad readings stop counting. A busy timing is not
    added, and once every such cell has its samples loading times nothing."""
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    target = native_target()
    true = {(1, 2): 1.02, (1, 4): 1.05, (8, 1): 1.15, (8, 2): 1.5, (8, 4): 2.5}
    calls = fake_batch_times(monkeypatch, lambda b, n, i: 1.5 if (b, n) == (8, 1) and i == 0 else true[b, n],
                             busy_calls=(1,))
    load = lambda: load_or_measure_batch_curve(target, (8,), (2, 4), context=8, repeats=2)  # noqa: E731
    first = load()
    assert calls[0] == {(1, 1): 5, (1, 2): 5, (1, 4): 5, (8, 1): 5, (8, 2): 5, (8, 4): 2}  # 5 up to 16 tokens
    assert first.latency(8, 8) == first.latency(8, 16) == pytest.approx(0.015)  # the bad readings: 8 nodes free
    path = next((tmp_path / "cost").glob("batch-*.json"))
    data = json.loads(path.read_text())
    data["samples"]["ratio"]["8x1"] = [1.5, 1.5]  # as an older entry: two samples a cell
    path.write_text(json.dumps(data))
    assert load() == first and calls[1] == {(8, 1): 3}  # busy: not added
    fixed = load()
    assert calls[2] == {(8, 1): 3} and fixed.latency(8, 8) == pytest.approx(0.0115)  # 3 good against 2 bad
    assert fixed.latency(8, 16) == pytest.approx(0.015)
    assert load() == fixed and len(calls) == 3  # then read


def test_cells_a_timing_cut_are_not_timed_on_later_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    calls = fake_batch_times(monkeypatch, lambda b, n, i: 1.0 + b * n)
    fake = batch_cost.measure_batch_times

    def cut(target, needed, context=32, seed=0, config=None):  # the first timing ends row 2 at 2 x 2
        times = fake(target, needed, context, seed, config)
        return batch_cost.BatchTimes(times.steps, {c: r for c, r in times.ratios.items() if c != (2, 4)})

    monkeypatch.setattr(batch_cost, "measure_batch_times", cut)
    first = load_or_measure_batch_curve(native_target(), (2,), (2, 4), context=8)
    assert first.totals[1] == (2, 4)
    monkeypatch.setattr(batch_cost, "measure_batch_times", fake)
    assert load_or_measure_batch_curve(native_target(), (2,), (2, 4), context=8) == first and len(calls) == 1


def test_other_batch_sizes_time_only_their_own_rows(tmp_path, monkeypatch):
    """A server started with --max-batch-size 6 after one with 8 timed the whole table again (78
    passes); now the one entry holds every row timed, and a load times only the rows it lacks."""
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    calls = fake_batch_times(monkeypatch, lambda b, n, i: 1.0 + 0.01 * b * n)
    eight = load_or_measure_batch_curve(native_target(), (2, 8), (2, 4), context=8)
    six = load_or_measure_batch_curve(native_target(), (2, 6), (2, 4), context=8)
    assert set(calls[1]) == {(6, 1), (6, 2), (6, 4)} and len(list((tmp_path / "cost").glob("batch-*.json"))) == 1
    assert six.latency(2, 4) == eight.latency(2, 4) and 6 in six.batch_sizes
    load_or_measure_batch_curve(native_target(), (2, 8), (2, 4), context=8)
    assert len(calls) == 2  # both rows cached


def test_rows_never_fall_with_more_tokens():
    samples = {"step": [0.01], "ratio": {"1x2": [1.1], "2x1": [1.2], "2x2": [1.1]}}  # 2 x 2 read below 2 x 1
    curve = batch_cost.curve_from_batch_samples(samples, 16)
    assert curve.seconds == ((0.01, pytest.approx(0.011)), (pytest.approx(0.012), pytest.approx(0.012)))


def test_a_table_cached_without_samples_is_read_and_timed_up_to_them(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    target = native_target()
    calls = fake_batch_times(monkeypatch, lambda b, n, i: 1.0 + 0.1 * (b * n - 1))
    load_or_measure_batch_curve(target, (2,), (2,), context=8)
    path = next((tmp_path / "cost").glob("batch-*.json"))
    data = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "samples"}))  # an entry from before samples
    again = load_or_measure_batch_curve(target, (2,), (2,), context=8)
    assert calls[1] == {(1, 2): 4, (2, 1): 4, (2, 2): 4} and again.latency(2, 4) == pytest.approx(0.013)
    assert len(json.loads(path.read_text())["samples"]["ratio"]["2x2"]) == 5


def fake_clock(monkeypatch, cost_of, loads):
    """Each packed pass of b sequences x n tokens takes `cost_of[b, n]` x 10 ms on a fake clock
    (the pass itself runs); round i's other processes use `loads(i)` cores. Returns the passes run
    per cell."""
    from specula.planner import machine

    now, passes, rounds = [0.0], {}, iter(range(10**6))
    real_forward = batch_cost.forward_trees

    def forward(backend, items):
        cell = len(items), len(items[0][2]) + 1
        now[0] += 0.01 * cost_of[cell]
        passes[cell] = passes.get(cell, 0) + 1
        return real_forward(backend, items)

    monkeypatch.setattr(batch_cost.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(batch_cost, "forward_trees", forward)
    monkeypatch.setattr(machine.LoadProbe, "others", lambda self: loads(next(rounds)))
    return passes


def test_timing_drops_busy_rounds_and_passes_that_cannot_pay(monkeypatch):
    """Rounds taken while other processes were busy do not count; a batch size's row ends at the
    first pass costing more than `max_ratio` of its plain pass."""
    target = native_target()
    cost_of = {(1, 1): 1.0, (1, 2): 1.1, (2, 1): 1.2, (2, 2): 1.5, (2, 4): 5.0, (2, 8): 9.0}
    loads = [1.0, 0.0, 0.0, 1.0, 0.0]
    passes = fake_clock(monkeypatch, cost_of, lambda i: loads[i] if i < len(loads) else 0.0)
    times = batch_cost.measure_batch_times(target, {(1, 2): 2, (2, 1): 2, (2, 2): 2, (2, 4): 2, (2, 8): 2}, context=8)
    assert set(times.ratios) == {(1, 2), (2, 1), (2, 2), (2, 4)}  # 2 x 4 costs 4.2 plain passes of 2: the row ends
    assert times.ratios[2, 2] == [pytest.approx(1.5), pytest.approx(1.5)]
    assert passes[2, 2] == 3 and times.discarded == 1  # the busy round, then two quiet ones
    assert not times.busy and len(times.steps) == 2


def test_one_slow_pass_in_the_first_round_cuts_nothing(monkeypatch):
    """2 x 4 reads 6 plain passes once (a time slice lost): it is timed again, reads 1.6, and the
    row goes on to 2 x 8 (the cut was cached and never timed again)."""

    class Spiky(dict):
        spikes = 1

        def __getitem__(self, cell):
            if cell == (2, 4) and self.spikes:
                self.spikes -= 1
                return 9.0
            return dict.__getitem__(self, cell)

    cost_of = Spiky({(1, 1): 1.0, (1, 2): 1.1, (2, 1): 1.2, (2, 2): 1.5, (2, 4): 1.6, (2, 8): 1.9})
    passes = fake_clock(monkeypatch, cost_of, lambda i: 0.0)
    times = batch_cost.measure_batch_times(native_target(), {(1, 2): 2, (2, 1): 2, (2, 2): 2, (2, 4): 2, (2, 8): 2},
                                           context=8)
    assert cost_of.spikes == 0 and set(times.ratios) == {(1, 2), (2, 1), (2, 2), (2, 4), (2, 8)}
    assert times.ratios[2, 4] == [pytest.approx(1.6 / 1.0)] * 2 and passes[2, 4] == 3


def test_a_cell_the_first_round_cuts_is_not_timed_nor_kept_nor_timed_again(tmp_path, monkeypatch):
    """Every round quiet: the first round ends row 2 at 2 x 4 (4.2 plain passes of 2), so 2 x 8 is
    timed only by the warm-up, is not in the table, and a later load does not time it."""
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    cost_of = {(1, 1): 1.0, (1, 2): 1.1, (1, 4): 1.15, (1, 8): 1.2, (2, 1): 1.2, (2, 2): 1.5, (2, 4): 5.0,
               (2, 8): 9.0}
    passes = fake_clock(monkeypatch, cost_of, lambda i: 0.0)
    target = native_target()
    times = batch_cost.measure_batch_times(target, {(1, 2): 2, (2, 1): 2, (2, 2): 2, (2, 4): 2, (2, 8): 2}, context=8)
    assert set(times.ratios) == {(1, 2), (2, 1), (2, 2), (2, 4)} and passes[2, 8] == 1  # the warm-up's
    first = load_or_measure_batch_curve(target, (2,), (2, 4, 8), context=8)
    assert first.totals[1] == (2, 4, 8)
    timed = []
    real = batch_cost.measure_batch_times
    monkeypatch.setattr(batch_cost, "measure_batch_times", lambda t, needed, *a, **k: timed.append(needed) or real(
        t, needed, *a, **k))
    assert load_or_measure_batch_curve(target, (2,), (2, 4, 8), context=8) == first and timed == []


@pytest.mark.parametrize("text", ["[]", "null", "{", '{"samples": {"step": [0.01], "ratio": []}}',
                                  '{"samples": {"step": [0.01], "ratio": {"2x2": 3}}}', '{"samples": 7}'])
def test_a_malformed_cached_table_is_measured_again(tmp_path, monkeypatch, text):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    calls = fake_batch_times(monkeypatch, lambda b, n, i: 1.0 + 0.1 * (b * n - 1))
    target = native_target()
    first = load_or_measure_batch_curve(target, (2,), (2,), context=8)
    path = next((tmp_path / "cost").glob("batch-*.json"))
    path.write_text(text)
    assert load_or_measure_batch_curve(target, (2,), (2,), context=8) == first and len(calls) == 2
    assert json.loads(path.read_text())["samples"]["ratio"]["2x2"]


def test_context_beyond_the_window_is_refused():
    target = native_target()
    with pytest.raises(ConfigError, match="context window"):
        measure_batch_curve(target, (2,), (4,), context=target.max_context)


def test_a_long_timing_logs_its_progress(monkeypatch, caplog):
    """A timing past `PROGRESS_AFTER` seconds (a large model's first start-up) logs its prefill, its
    warm-up and each round; a short one (passes of 10-15 ms, well under it) stays quiet."""
    needed = {(1, 2): 2, (2, 1): 2, (2, 2): 2}
    fake_clock(monkeypatch, {(1, 1): 1.0, (1, 2): 1.1, (2, 1): 1.2, (2, 2): 1.5}, lambda i: 0.0)
    with caplog.at_level("INFO", logger="specula.planner.batch_cost"):
        batch_cost.measure_batch_times(native_target(), needed, context=8)
        assert caplog.records == []
        monkeypatch.setattr(batch_cost, "PROGRESS_AFTER", 0.0)
        batch_cost.measure_batch_times(native_target(), needed, context=8)
    lines = [r.getMessage() for r in caplog.records]
    assert "2 sequences of 8 tokens prefilled" in lines[0] and "warmed up after 3 plain passes" in lines[1]
    assert "round 1 (0 busy), " in lines[2] and len(lines) == 4
    assert lines[-1].endswith("round 2 (0 busy), 4 of 4 cells (sequences x tokens) have their samples")


def test_on_a_machine_busy_throughout_each_cell_is_timed_its_own_rounds_at_most(monkeypatch):
    """Other processes busy in every round: a cell needing 2 quiet rounds is timed in 6 (2 x
    `max_round_factor`), not in all 15 of the cell needing 5, and keeps its 2 least busy rounds."""
    cost_of = {(1, 1): 1.0, (1, 2): 1.1, (2, 1): 1.2, (2, 2): 1.5, (2, 4): 2.0}
    passes = fake_clock(monkeypatch, cost_of, lambda i: 1.0 + 0.01 * (i % 4))
    times = batch_cost.measure_batch_times(native_target(), {(1, 2): 5, (2, 2): 2, (2, 4): 2}, context=8)
    assert passes[1, 1] >= 15 and passes[1, 2] == 1 + 15  # the warm-up's pass, then every round
    assert passes[2, 2] == 6 and passes[2, 4] == 1 + 6
    assert times.busy and times.discarded == 15 and len(times.ratios[2, 2]) == 2 and len(times.ratios[1, 2]) == 5
