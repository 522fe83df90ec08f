import json

import pytest

from specula.errors import ConfigError
from specula.models.native import NativeCausalLM, NativeDecoder, configure
from specula.planner import batch_cost
from specula.planner.batch_cost import BatchCostCurve, load_or_measure_batch_curve, measure_batch_curve
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
    calls = []
    monkeypatch.setattr(batch_cost, "measure_batch_curve", lambda *a, **k: calls.append(1) or curve)
    first = load_or_measure_batch_curve(target, (2, 4), (2, 4), context=8)
    again = load_or_measure_batch_curve(target, (2, 4), (2, 4), context=8)
    assert first == again == curve and calls == [1]  # the second load reads the cache


def test_context_beyond_the_window_is_refused():
    target = native_target()
    with pytest.raises(ConfigError, match="context window"):
        measure_batch_curve(target, (2,), (4,), context=target.max_context)
