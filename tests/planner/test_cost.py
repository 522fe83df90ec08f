"""Cost curve: measurement shape on a tiny model, interpolation, the on-disk cache, the
`specula profile` command."""

from __future__ import annotations

import json

import pytest
import torch

from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.planner.cost import CostCurve, TimingConfig, _timed_pass, load_or_measure_curve, measure_cost_curve
from specula.tree import TokenTree
from tiny import tiny_model


def test_measure_shape_and_backend_left_clean():
    backend = HFCausalLM(tiny_model("qwen2"))
    # sizes are never dropped for reading slow (a scheduler hiccup on a shared machine would)
    curve = measure_cost_curve(backend, sizes=[8, 2, 4], context=16, repeats=2,
                               config=TimingConfig(max_ratio=float("inf")))
    assert curve.sizes == (1, 2, 4, 8)  # 1 added, sorted
    assert len(curve.seconds) == 4 and all(s > 0 for s in curve.seconds)
    assert curve.context == 16 and curve.repeats == 2
    assert curve.ratio(1) == 1.0
    data = curve.to_dict()
    assert data["sizes"] == [1, 2, 4, 8] and data["ratio"][0] == 1.0 and len(data["seconds"]) == 4
    assert CostCurve.from_dict(json.loads(json.dumps(data))).sizes == curve.sizes


def test_measured_pass_is_a_real_verification():
    """The timed pass is forward_tree over root + chain after `context` cached tokens: the cache
    is back to exactly `context` tokens after each pass (checked by running one more step)."""
    model = tiny_model("llama")
    backend = HFCausalLM(model)
    seq = backend.new_sequence()
    seq.prefill(list(range(5, 15)), logits="none")
    assert _timed_pass(backend, seq, 3, TokenTree.chain([4, 5]), 10) > 0
    assert seq.tokens == list(range(5, 15))
    logits = seq.forward_tree(20, TokenTree.empty())
    full = model(torch.tensor([[*range(5, 15), 20]])).logits[0, -1]
    torch.testing.assert_close(logits[0], full, atol=1e-4, rtol=1e-4)


def test_curves_are_cached_per_backend_cost_key(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    backend = HFCausalLM(tiny_model("qwen2"))
    first = load_or_measure_curve(backend, sizes=(1, 2), context=8, repeats=1)
    files = list((tmp_path / "cost").glob("*.json"))
    assert len(files) == 1
    assert load_or_measure_curve(backend, sizes=(1, 2), context=8, repeats=1).sizes == first.sizes  # read back
    other = HFCausalLM(tiny_model("qwen2", layers=3))  # another cost key: measured and cached apart
    load_or_measure_curve(other, sizes=(1, 2), context=8, repeats=1)
    assert len(list((tmp_path / "cost").glob("*.json"))) == 2


def test_one_bad_cached_measurement_is_outvoted_by_later_loads(tmp_path, monkeypatch):
    """A curve cached from one bad measurement (verifying 8 tokens at 3x a step where it costs
    1.2x) is timed again on the next loads; the curve is the median of the samples, so the bad
    one stops counting, and once every size has enough samples loading times nothing."""
    import specula.planner.cost as cost

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    backend = HFCausalLM(tiny_model("qwen2"))
    true_ratio = {1: 1.0, 2: 1.05, 8: 1.2}
    calls: list[list[int]] = []

    def fake_times(target, sizes, context, repeats, seed=0):
        sizes = sorted({1, *sizes})
        calls.append(sizes)
        bad = not calls[:-1]  # the very first measurement is the bad one
        return cost.PassTimes({n: [0.01 * (3.0 if bad and n == 8 else true_ratio[n])] * repeats for n in sizes})

    monkeypatch.setattr(cost, "measure_pass_times", fake_times)
    first = load_or_measure_curve(backend, sizes=(1, 2, 8), context=8, repeats=1)
    assert first.ratio(8) == pytest.approx(3.0)
    curves = [load_or_measure_curve(backend, sizes=(1, 2, 8), context=8, repeats=1) for _ in range(6)]
    assert curves[1].ratio(8) == pytest.approx(1.2)  # three samples: the bad one is outvoted
    assert len(calls) == 1 + cost.VALIDATE_SAMPLES - 1  # timed again until 5 samples per size ...
    assert curves[-1].ratio(8) == pytest.approx(1.2) and curves[-1].ratio(2) == pytest.approx(1.05)  # ... then read


@pytest.mark.parametrize("text", ["[]", "null", "{", '{"samples": {"step": [0.01], "ratio": []}}', '{"samples": 7}',
                                  '{"samples": {"step": [0.01], "ratio": {"2": "x"}}}',
                                  '{"samples": {"step": [Infinity], "ratio": {"2": [1.1]}}}',
                                  '{"samples": {"step": [0.01], "ratio": {"2": [NaN]}}}'])
def test_a_malformed_cached_curve_is_measured_again(tmp_path, monkeypatch, text):
    """A cache entry that is not JSON, not an object or not a table of samples is removed and
    the curve measured again, not a crash."""
    import specula.planner.cost as cost

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    backend = HFCausalLM(tiny_model("qwen2"))
    calls = []

    def fake_times(target, sizes, context, repeats, seed=0):
        calls.append(sizes)
        return cost.PassTimes({n: [0.01 * (1 + 0.1 * (n - 1))] * repeats for n in sorted({1, *sizes})})

    monkeypatch.setattr(cost, "measure_pass_times", fake_times)
    first = load_or_measure_curve(backend, sizes=(1, 2), context=8, repeats=1)
    path = next((tmp_path / "cost").glob("*.json"))
    path.write_text(text)
    again = load_or_measure_curve(backend, sizes=(1, 2), context=8, repeats=1)
    assert again.ratio(2) == pytest.approx(first.ratio(2)) and len(calls) == 2
    assert json.loads(path.read_text())["samples"]["ratio"]["2"]


def test_a_pass_timed_at_zero_seconds_leaves_every_price_positive():
    """A coarse clock or a stub backend may time a pass at 0 s: the cost model still prices each
    size above zero, so the planner never divides by a free step."""
    from specula.planner.cost import CostModel

    model = CostModel(CostCurve((1, 2, 4), (0.01, 0.011, 0.013), context=8), 0.0, 8)
    for n in (1, 2, 4):
        model.observe(n, 0.0)
    assert all(model.estimate(n) > 0 for n in (1, 2, 3, 4, 8))


def test_interpolation_and_extrapolation():
    curve = CostCurve((1, 2, 4, 8), (0.010, 0.012, 0.016, 0.032), context=64)
    assert curve.ratio(1) == 1.0
    assert curve.ratio(3) == pytest.approx(1.4)  # halfway between 1.2 and 1.6
    assert curve.latency(6) == pytest.approx(0.024)
    assert curve.latency(16) == pytest.approx(0.032 + 8 * 0.004)  # last slope continued
    assert curve.tree_ratio(3) == curve.ratio(4) == pytest.approx(1.6)
    assert curve.latency(0.5) == 0.010


def test_latencies_asked_again_are_the_interpolations_and_their_memo_is_bounded(monkeypatch):
    """A step asks the curve for a few sizes many times: each answer is kept, the same value the piecewise-linear
    formula gives (ints and floats, within the sizes and past them, each asked twice), and no more than
    `LATENCY_MEMO` sizes are kept."""
    import specula.planner.cost as cost

    sizes, secs = (1, 2, 4, 8, 16), (0.010, 0.0102, 0.0127, 0.0201, 0.0356)

    def formula(n):
        if n <= 1:
            return secs[0]
        for (x0, y0), (x1, y1) in zip(zip(sizes, secs), zip(sizes[1:], secs[1:])):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        return secs[-1] + (secs[-1] - secs[-2]) / (sizes[-1] - sizes[-2]) * (n - sizes[-1])

    curve = CostCurve(sizes, secs, 64)
    asked = [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 40, 1.5, 3.25, 12.75, 20.5]
    for n in asked + asked[::-1]:
        assert curve.latency(n) == formula(n)
        assert curve.ratio(n) == formula(n) / secs[0]
    monkeypatch.setattr(cost, "LATENCY_MEMO", 8)
    curve = CostCurve(sizes, secs, 64)
    for n in range(1, 100):
        assert curve.latency(n) == formula(n) and len(curve._latencies) <= 8
    assert curve == CostCurve(sizes, secs, 64)  # the memo is not part of what a curve is


def test_curve_validation():
    with pytest.raises(ConfigError, match="start at 1"):
        CostCurve((2, 4), (0.1, 0.2), context=8)
    with pytest.raises(ConfigError, match="one positive, finite latency per size"):
        CostCurve((1, 2), (0.1,), context=8)
    for bad in (float("nan"), float("inf"), 0.0):
        with pytest.raises(ConfigError, match="one positive, finite latency per size"):
            CostCurve((1, 2), (0.1, bad), context=8)
    # size 1 alone was read as flat: every pass, however many tokens, priced at one plain step
    with pytest.raises(ConfigError, match="needs a pass size above 1"):
        CostCurve((1,), (0.1,), context=8)
    backend = HFCausalLM(tiny_model("gpt2"))  # 256 positions
    with pytest.raises(ConfigError, match="^context=200 \\+ 64 tokens exceeds the target's context window of 256; "
                       "lower context= or the largest of sizes=$"):  # its keywords; profile: its flags
        measure_cost_curve(backend, sizes=[64], context=200, repeats=1)
    with pytest.raises(ConfigError, match="repeats must be >= 1"):
        measure_cost_curve(backend, sizes=[2], context=8, repeats=0)


def test_profile_command(tmp_path, monkeypatch, capsys):
    import specula.api
    from specula.cli import main

    backend = HFCausalLM(tiny_model("qwen2"))
    monkeypatch.setattr(specula.api, "load_backend", lambda spec, config, name="model": (backend, None))
    code = main(["profile", "--target", "tiny", "--context", "32", "--sizes", "1,4,16", "--repeats", "1",
                 "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "cost_curve.json").read_text())
    assert data["sizes"] == [1, 4, 16] and data["context"] == 32 and data["target"] == "tiny"
    assert len(data["seconds"]) == 3 and data["ratio"][0] == 1.0
    assert {"cpu", "torch", "transformers", "torch_threads"} <= set(data["machine"])
    assert (tmp_path / "cost_curve.png").stat().st_size > 1000
    assert "ratio" in capsys.readouterr().out
    assert main(["profile", "--target", "tiny", "--sizes", "1,x", "--out", str(tmp_path)]) == 2
    assert main(["profile", "--target", "tiny", "--sizes", "1", "--out", str(tmp_path)]) == 2
    assert "--sizes needs a pass size above 1" in capsys.readouterr().err
    # the batch dimension: packed passes of b sequences x n tokens each
    code = main(["profile", "--target", "tiny", "--context", "32", "--sizes", "1,4", "--repeats", "1",
                 "--batch-sizes", "2,4", "--out", str(tmp_path)])
    assert code == 0
    batch = json.loads((tmp_path / "cost_curve.json").read_text())["batch"]
    assert batch["batch_sizes"] == [1, 2, 4] and batch["totals"][2] == [4, 8, 16]
    assert all(s > 0 for row in batch["seconds"] for s in row)
    assert "packed passes" in capsys.readouterr().out
    assert main(["profile", "--target", "tiny", "--batch-sizes", "0", "--out", str(tmp_path)]) == 2
    capsys.readouterr()
    # measure_cost_curve names its keywords (context=); profile shows its flags
    assert main(["profile", "--target", "tiny", "--context", str(backend.max_context), "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --context {backend.max_context} + 64 tokens exceeds the target's context window of "
        f"{backend.max_context}; lower --context or the largest of --sizes")


def test_profile_times_every_size_asked_for(tmp_path, monkeypatch):
    """The planner's start-up rule (sizes past the first costing over 4 plain steps are not timed) dropped
    sizes `profile --sizes` asked for from cost_curve.json and its batch table, without a word."""
    import time

    import specula.api
    import specula.planner.batch_cost as batch_cost
    import specula.planner.cost as cost
    import specula.planner.machine as machine
    from specula.cli import main

    backend = HFCausalLM(tiny_model("qwen2"))
    monkeypatch.setattr(specula.api, "load_backend", lambda spec, config, name="model": (backend, None))
    monkeypatch.setattr(machine.LoadProbe, "others", lambda self: 0.0)
    # a pass of n tokens costs max(1, n / 4) plain steps: 32 tokens cost 8
    monkeypatch.setattr(cost, "_timed_pass", lambda seq, device, root, tree, context:
                        0.01 * max(1.0, (len(tree) + 1) / 4))
    real = batch_cost.forward_trees

    def slow_packed_pass(target, items):  # b sequences of n tokens: b * n * n ms more (4 tokens: ~8 plain passes)
        out = real(target, items)
        time.sleep(0.001 * len(items) * (len(items[0][2]) + 1) ** 2)
        return out

    monkeypatch.setattr(batch_cost, "forward_trees", slow_packed_pass)
    code = main(["profile", "--target", "tiny", "--context", "32", "--sizes", "1,4,16,32,64", "--repeats", "1",
                 "--batch-sizes", "2", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "cost_curve.json").read_text())
    assert data["sizes"] == [1, 4, 16, 32, 64] and data["ratio"] == [1.0, 1.0, 4.0, 8.0, 16.0]
    assert data["batch"]["totals"] == [[1, 2, 4, 8], [2, 4, 8, 16]]


def test_cost_curves_of_several_options_plot_to_one_png(tmp_path):
    from specula.bench.plots import plot_cost_curves

    curves = {
        "float32": {"sizes": [1, 2, 4, 8], "seconds": [0.4, 0.9, 0.9, 0.85], "ratio": [1.0, 2.25, 2.25, 2.12]},
        "int8": {"sizes": [1, 2, 4, 8], "seconds": [0.08, 0.08, 0.09, 0.115], "ratio": [1.0, 1.01, 1.09, 1.39]},
    }
    path = plot_cost_curves(curves, tmp_path / "curves.png", "two options")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


class FakeSequence:
    """A sequence whose passes 'take' the given seconds per size (recorded, not slept)."""

    def __init__(self, seconds_of):
        self.seconds_of, self.sizes = seconds_of, []

    def prefill(self, ids, logits="none"):
        return None

    def forward_tree(self, root, tree):
        self.sizes.append(len(tree) + 1)

    def commit(self, path):
        return None

    def crop(self, n):
        return None

    def release(self):
        return None


def fake_timing(monkeypatch, seconds_of, loads=()):
    """measure_pass_times on a fake backend: each pass takes seconds_of(n, index); other processes'
    load per round from `loads`."""
    import specula.planner.cost as cost
    import specula.planner.machine as machine

    seq = FakeSequence(seconds_of)
    backend = type("B", (), {"max_context": 4096, "vocab_size": 50, "device": "cpu",
                             "new_sequence": lambda self: seq})()
    monkeypatch.setattr(cost, "_timed_pass", lambda backend, s, root, tree, context:
                        (s.forward_tree(root, tree), seconds_of(len(tree) + 1, len(s.sizes)))[1])
    load_iter = iter(loads)
    monkeypatch.setattr(machine.LoadProbe, "others", lambda self: next(load_iter, 0.0))
    return backend, seq


def test_start_up_timing_warms_up_until_plain_steps_agree(monkeypatch):
    """A cold process: the first plain steps read 1.6x, 1.4x, 1.2x slow; timing starts once three
    agree within 10%, so the curve's step is the warm one."""
    from specula.planner.cost import measure_pass_times

    cold = [1.6, 1.4, 1.2, 1.05]
    backend, seq = fake_timing(monkeypatch, lambda n, i: (cold[i - 3] if 3 <= i < 7 else 1.0) * (0.1 if n == 1 else 0.12))
    timing = measure_pass_times(backend, (1, 2, 4), context=8, repeats=2)
    assert timing.stable and timing.warmup_passes >= 5
    assert timing.times[1] == [0.1, 0.1] and timing.times[4] == [0.12, 0.12]


def test_start_up_timing_discards_rounds_taken_while_the_machine_is_busy(monkeypatch):
    from specula.planner.cost import measure_pass_times

    def seconds_of(n, i):
        return 0.1 * (1.0 if n == 1 else 1.1)

    backend, seq = fake_timing(monkeypatch, seconds_of, loads=[1.0, 0.0, 1.2, 0.0])
    timing = measure_pass_times(backend, (1, 2), context=8, repeats=2)
    assert timing.discarded == 2 and not timing.busy
    backend, seq = fake_timing(monkeypatch, seconds_of, loads=[1.0] * 10)
    timing = measure_pass_times(backend, (1, 2), context=8, repeats=2)
    assert timing.busy and len(timing.times[1]) == 2  # every round busy: the least busy kept, and said so


def test_start_up_timing_stops_at_sizes_that_cannot_pay(monkeypatch):
    from specula.planner.cost import measure_pass_times

    backend, seq = fake_timing(monkeypatch, lambda n, i: 0.1 * max(1.0, n / 4))  # 32 tokens: 8 steps
    timing = measure_pass_times(backend, (1, 2, 4, 8, 16, 32, 64), context=8, repeats=2)
    assert sorted(timing.times) == [1, 2, 4, 8, 16, 32]  # 32 costs 8 steps: 64 is never timed
    assert max(seq.sizes) == 64  # (only its single warm-up pass)


def test_one_slow_plain_pass_does_not_cut_the_curve(monkeypatch):
    """The first timed round's plain pass reads 6x slow (a burst): sizes are judged against that
    round's own plain pass and never at the plain pass itself, so every size is still timed (the
    curve was cut to [1], pricing every tree as free)."""
    from specula.planner.cost import measure_pass_times

    def seconds_of(n, i):  # passes 1-4: one warm-up each; 5-7: warm-up steps; 8: round one's plain pass
        spike = 6.0 if i == 8 else 1.0
        return spike * 0.1 * (1.0 if n == 1 else 1.0 + 0.05 * n)

    backend, seq = fake_timing(monkeypatch, seconds_of)
    timing = measure_pass_times(backend, (1, 2, 4, 8), context=8, repeats=2)
    assert sorted(timing.times) == [1, 2, 4, 8]


def test_one_slow_multi_token_pass_does_not_cut_the_curve(monkeypatch):
    """The first round's 4-token pass reads 6 plain steps once (a page fault, another process's
    time slice): it is timed again before larger sizes are ruled out (they were cut, and the cache
    kept them cut for every later run)."""
    from specula.planner.cost import measure_pass_times

    slow = {}

    def seconds_of(n, i):
        if n == 4 and i > 8 and not slow:  # the first timed round's 4-token pass, once
            slow[i] = True
            return 0.6
        return 0.1 * (1.0 if n == 1 else 1.0 + 0.05 * n)

    backend, seq = fake_timing(monkeypatch, seconds_of)
    timing = measure_pass_times(backend, (1, 2, 4, 8, 16), context=8, repeats=2)
    assert slow and sorted(timing.times) == [1, 2, 4, 8, 16]
    assert timing.times[4] == pytest.approx([0.12, 0.12])  # the lesser of the two readings


@pytest.mark.parametrize("damage", [{"ratio": {"2": [0.0]}}, {"ratio": {"2": [-1.0]}}, {"step": [0]},
                                    {"untimed_from": "8", "ratio": {}}, {"untimed_from": 1.5}, {"ratio": {"2": [True]}}])
def test_a_cached_entry_with_impossible_samples_is_measured_again(tmp_path, monkeypatch, damage):
    """A ratio of 0 priced every tree of that size at nothing (and, spread to its neighbours, once
    corrected, at a million plain steps); an untimed_from that is not a size crashed every later
    run. Such an entry is removed and measured again."""
    import specula.planner.cost as cost

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    backend = HFCausalLM(tiny_model("qwen2"))
    calls = []

    def fake_times(target, sizes, context, repeats, seed=0):
        calls.append(sizes)
        return cost.PassTimes({n: [0.01 * (1 + 0.1 * (n - 1))] * repeats for n in sorted({1, *sizes})})

    monkeypatch.setattr(cost, "measure_pass_times", fake_times)
    first = load_or_measure_curve(backend, sizes=(1, 2), context=8, repeats=1)
    path = next((tmp_path / "cost").glob("*.json"))
    entry = json.loads(path.read_text())
    entry["samples"].update(damage)
    path.write_text(json.dumps(entry))
    again = load_or_measure_curve(backend, sizes=(1, 2), context=8, repeats=1)
    assert again.ratio(2) == pytest.approx(first.ratio(2)) and len(calls) == 2


def test_a_curve_from_noisy_samples_never_costs_less_for_more_tokens():
    """Medians of 1.45 at 2 tokens and 1.0 at 4 made a 4-token pass cheaper than a 2-token one, so
    the planner preferred larger trees; a ratio under 1 priced a tree below a plain step."""
    from specula.planner.cost import curve_from_samples

    curve = curve_from_samples({"step": [0.01], "ratio": {"2": [1.45], "4": [1.0], "8": [0.9], "16": [2.0]}},
                               context=8, repeats=1)
    assert [round(curve.ratio(n), 6) for n in (2, 4, 8, 16)] == [1.45, 1.45, 1.45, 2.0]
    low = curve_from_samples({"step": [0.01], "ratio": {"2": [0.97]}}, context=8, repeats=1)
    assert low.ratio(2) == pytest.approx(1.0)


def test_sizes_a_cached_curve_lacks_are_timed_unless_left_out_as_too_costly_twice(tmp_path, monkeypatch):
    """A cached entry that lost sizes to a bad cut is repaired on the next load; sizes the timing
    left out because they cost too much (`untimed_from`) are timed once more on the next load (one
    slow pass may have cut them, and the note kept them untimed for good), and not again once a
    second timing agrees."""
    import specula.planner.cost as cost

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    backend = HFCausalLM(tiny_model("qwen2"))
    calls: list[list[int]] = []
    cut = {"at": 2}  # the timing keeps sizes up to 2 only

    def fake_times(target, sizes, context, repeats, seed=0):
        sizes = sorted({1, *sizes})
        calls.append(sizes)
        kept = [n for n in sizes if n <= cut["at"]]
        return cost.PassTimes({n: [0.01 * (1 + 0.05 * n)] * repeats for n in kept})

    monkeypatch.setattr(cost, "measure_pass_times", fake_times)
    load_or_measure_curve(backend, sizes=(1, 2, 4, 8), context=8, repeats=1)
    path = next((tmp_path / "cost").glob("*.json"))
    entry = json.loads(path.read_text())
    assert entry["samples"]["untimed_from"] == 4 and "untimed_confirmed" not in entry["samples"]
    load_or_measure_curve(backend, sizes=(1, 2, 4, 8), context=8, repeats=1)
    assert {4, 8} <= set(calls[-1])  # timed again: cut again, so trusted from now on ...
    assert json.loads(path.read_text())["samples"]["untimed_confirmed"] is True
    load_or_measure_curve(backend, sizes=(1, 2, 4, 8), context=8, repeats=1)
    assert 4 not in calls[-1]
    entry = json.loads(path.read_text())
    del entry["samples"]["untimed_from"]  # ... but an entry that merely lacks them (a bad cut before) is repaired
    path.write_text(json.dumps(entry))
    cut["at"] = 8
    curve = load_or_measure_curve(backend, sizes=(1, 2, 4, 8), context=8, repeats=1)
    assert {4, 8} <= set(calls[-1]) and 8 in curve.sizes


def test_a_cut_the_next_load_finds_cheap_is_timed_and_forgotten(tmp_path, monkeypatch):
    """One slow pass cut the first timing at 2; the next load times 4 and 8 again, finds them
    cheap, keeps their samples and drops the note (they were never timed again before)."""
    import specula.planner.cost as cost

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    backend = HFCausalLM(tiny_model("qwen2"))
    cut = {"at": 2}

    def fake_times(target, sizes, context, repeats, seed=0):
        kept = [n for n in sorted({1, *sizes}) if n <= cut["at"]]
        return cost.PassTimes({n: [0.01 * (1 + 0.05 * n)] * repeats for n in kept})

    monkeypatch.setattr(cost, "measure_pass_times", fake_times)
    first = load_or_measure_curve(backend, sizes=(1, 2, 4, 8), context=8, repeats=1)
    assert first.sizes == (1, 2)
    cut["at"] = 8
    curve = load_or_measure_curve(backend, sizes=(1, 2, 4, 8), context=8, repeats=1)
    samples = json.loads(next((tmp_path / "cost").glob("*.json")).read_text())["samples"]
    assert curve.sizes == (1, 2, 4, 8) and "untimed_from" not in samples and "untimed_confirmed" not in samples


def test_a_window_too_short_for_the_curve_names_a_curve_to_give_not_the_measurements_keywords():
    """load_or_measure_curve (the planner's, on load) clamps its prefix to the window; a window of <= 64 tokens left
    none for a 64-token pass, and the message named measure_cost_curve's context= / sizes=, which no caller of
    load() or the planner wrote."""
    from types import SimpleNamespace

    with pytest.raises(ConfigError) as caught:
        load_or_measure_curve(SimpleNamespace(max_context=20), sizes=(1, 2, 4, 8, 16, 32), context=64)
    assert str(caught.value) == (
        "the target's context window of 20 tokens is too short to time the planner's cost curve (passes of up to 32 "
        "tokens after a prefix); give a curve of passes that fit, planner=read_cost_curve(FILE) with the "
        "cost_curve.json of `specula profile --target MODEL --sizes 1,2,4,8 --context 8`, or decode plainly "
        '(method="none")'), caught.value


def test_the_planners_name_for_plain_decoding_is_the_methods_own():
    """The planner names plain decoding in its advice without importing the methods (it knows no drafter): the
    name it writes must stay the method's."""
    from specula.methods import PLAIN
    from specula.planner.cost import PLAIN_METHOD

    assert PLAIN_METHOD == f'method="{PLAIN}"'
