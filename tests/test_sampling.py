"""`specula.sampling`: the processed target distribution against an independent reference
(transformers' logits processors), lazy rows, and the per-position uniforms."""

from __future__ import annotations

import pytest
import torch

from specula.sampling import SamplingParams, TargetRows, probabilities, request_seed


def hf_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What Hugging Face `generate` samples from: temperature, then top-k, top-p and min-p warpers."""
    from transformers import (
        LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0:
        warpers.append(MinPLogitsWarper(params.min_p))
    scores = warpers(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.clone())
    return torch.softmax(scores, -1)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (0.9, 0, 0.8, 0.0), (0.6, 20, 0.9, 0.0),
    (2.0, 3, 0.5, 0.0), (1.0, 0, 0.05, 0.0), (1.0, 0, 1.0, 0.1), (1.5, 10, 0.9, 0.05), (0.8, 0, 1.0, 0.9),
])
def test_probabilities_match_transformers_logits_processors(temperature, top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3  # [rows, vocab], no ties
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    ours = probabilities(logits, params)
    ref = hf_reference(logits, params)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(ours > 0, ref > 0)  # the same support, token for token


def test_greedy_is_the_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert probabilities(logits, SamplingParams()).tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_target_rows_are_processed_on_demand():
    logits = torch.randn(4, 30)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    rows = TargetRows(logits, params)
    assert rows.shape == logits.shape and rows.dim() == 2 and len(rows) == 4
    torch.testing.assert_close(rows[2], probabilities(logits[2], params))
    assert list(rows._rows) == [2]  # nothing else computed


def test_a_request_seed_is_its_own_or_a_fresh_one():
    assert request_seed(5) == 5 and request_seed(None) != request_seed(None)


@pytest.mark.parametrize("scale,top_p", [(6.0, 0.9), (6.0, 0.5), (0.05, 0.9), (0.5, 0.95)])
def test_top_p_over_a_large_vocabulary_matches_transformers(scale, top_p):
    """A 49k vocabulary as the real models': peaked rows (the nucleus is within the first
    NUCLEUS_FIRST_K ranked tokens) and near-flat ones (ranking must widen to the vocabulary)."""
    from specula.sampling import NUCLEUS_FIRST_K, nucleus

    torch.manual_seed(1)
    logits = torch.randn(3, 49152) * scale
    params = SamplingParams(temperature=1.0, top_p=top_p)
    ours, ref = probabilities(logits, params), hf_reference(logits, params)
    assert torch.equal(ours > 0, ref > 0)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
    kept = nucleus(logits.softmax(-1), top_p).sum(-1)
    assert bool((kept < NUCLEUS_FIRST_K).all()) == (scale > 1)  # both paths are exercised


@pytest.mark.parametrize("min_p", [-0.1, 1.5])
def test_min_p_out_of_range_is_refused(min_p):
    from specula.errors import ConfigError

    with pytest.raises(ConfigError, match="min_p must be in"):
        SamplingParams(min_p=min_p)


@pytest.mark.parametrize("kwargs, words", [
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"top_k": True}, "top_k must be an integer"),
    ({"seed": 2**64}, "seed must be an integer that fits in 64 bits"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"stop": ("ok", "")}, "stop must hold non-empty strings"),
    ({"stop": ""}, "stop must hold non-empty strings"),
    ({"frequency_penalty": True}, "frequency_penalty must be a number, got True"),
    ({"temperature": "0.5"}, "temperature must be a number"),
    ({"logit_bias": {3: True}}, "logit_bias values must be numbers"),
    ({"logit_bias": ((7, 100.0), (7, 100.0))}, "logit_bias names token 7 twice"),  # +200 applied
])
def test_values_that_would_fail_mid_generation_are_refused_up_front(kwargs, words):
    from specula.errors import ConfigError

    with pytest.raises(ConfigError, match=words):
        SamplingParams(**kwargs)


def test_a_temperature_too_small_to_divide_by_is_raised_to_vllms_floor():
    from specula.sampling import MIN_TEMPERATURE

    with pytest.warns(UserWarning, match="below 0.01"):
        params = SamplingParams(temperature=1e-40)
    assert params.temperature == MIN_TEMPERATURE
    assert bool(torch.isfinite(probabilities(torch.tensor([3.0, 1.0, -2.0]), params)).all())
    assert SamplingParams(seed=-(2**63)).seed == -(2**63) and SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(stop=None).stop == () and SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    import numpy as np

    assert SamplingParams(top_k=np.int64(3), seed=np.uint64(7)).seed == 7  # numpy's integers are integers
    ids = SamplingParams(stop_token_ids=[np.int64(5)], logit_bias={np.int64(3): 1.0})  # token ids too
    assert ids.stop_token_ids == (5,) and ids.logit_bias == ((3, 1.0),) and type(ids.stop_token_ids[0]) is int
    assert SamplingParams(stop_token_ids=(t for t in [1, 2])).stop_token_ids == (1, 2)


def test_a_zero_dim_tensor_reads_as_the_number_it_holds():
    """A temperature from a schedule (a 0-dim tensor) was taken before the number checks; it is
    read as its number, not refused."""
    params = SamplingParams(temperature=torch.tensor(0.7), top_p=torch.tensor(0.9))
    assert params.temperature == pytest.approx(0.7) and isinstance(params.temperature, float)
    assert params.top_p == pytest.approx(0.9)


def test_stop_token_ids_none_is_vllms_default_and_a_bare_id_is_refused():
    from specula.errors import ConfigError

    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    for bad in (2, "2"):
        with pytest.raises(ConfigError, match="stop_token_ids must be a list of token ids"):
            SamplingParams(stop_token_ids=bad)


def test_top_k_minus_one_means_every_token_as_vllm_and_the_server_take_it():
    """vLLM's top_k = -1 ("every token"): the server took it, SamplingParams (the API, --top-k) refused it."""
    from specula.errors import ConfigError

    assert SamplingParams(temperature=0.8, top_k=-1) == SamplingParams(temperature=0.8, top_k=0)
    logits = torch.tensor([3.0, 1.0, -2.0, 0.5])
    assert torch.equal(probabilities(logits, SamplingParams(temperature=0.8, top_k=-1)),
                       probabilities(logits, SamplingParams(temperature=0.8)))
    with pytest.raises(ConfigError, match="top_k must be an integer >= 1, or 0 or -1 for every token"):
        SamplingParams(top_k=-2)


def test_kept_special_tokens_are_token_ids():
    import numpy as np

    from specula.errors import ConfigError

    assert SamplingParams().kept_special_tokens == ()
    kept = SamplingParams(kept_special_tokens=(t for t in [np.int64(7), 9])).kept_special_tokens
    assert kept == (7, 9) and type(kept[0]) is int
    for bad in ("<tool_call>", 7, [-1], [1.5]):
        with pytest.raises(ConfigError, match="kept_special_tokens must be a list of token ids"):
            SamplingParams(kept_special_tokens=bad)
