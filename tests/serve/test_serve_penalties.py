"""Penalties and logit_bias over HTTP: OpenAI's presence / frequency penalties and logit_bias,
vLLM's repetition_penalty; each response equals offline decoding with the same penalties."""

from __future__ import annotations

import pytest

from serve_helpers import MODEL, http_call, make_spec, text_ids

from specula.sampling import SamplingParams


@pytest.fixture(scope="module")
def offline(target_model, draft_model, tokenizer):
    return make_spec(target_model, tokenizer, "draft-model", draft_model)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_penalised_requests_equal_offline_penalised_decoding(client, tokenizer, offline, temperature):
    prompt = "w10 w11 w12 w10 w11"
    bias = {str(tokenizer.convert_tokens_to_ids("w12")): 5, str(tokenizer.convert_tokens_to_ids("w13")): -100}
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=temperature, seed=2,
                                    presence_penalty=0.6, frequency_penalty=0.3, logit_bias=bias,
                                    extra_body={"repetition_penalty": 1.2})
    params = SamplingParams(max_new_tokens=16, temperature=temperature, seed=2, presence_penalty=0.6,
                            frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={int(k): v for k, v in bias.items()})
    expected = offline.generate(list(text_ids(tokenizer, prompt)), raw=True, params=params)
    assert out.choices[0].text == expected.text
    assert tokenizer.convert_tokens_to_ids("w13") not in expected.token_ids  # -100: never chosen
    plain = offline.generate(list(text_ids(tokenizer, prompt)), raw=True,
                             params=SamplingParams(max_new_tokens=16, temperature=temperature, seed=2))
    assert plain.text != expected.text  # the penalties did something


@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": "high"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"w05": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
])
def test_bad_penalties_are_a_400_naming_the_parameter(server, extra, param):
    status, _, body = http_call(server, "POST", "/v1/completions",
                                {"model": MODEL, "prompt": "w05", "max_tokens": 2, **extra})
    assert status == 400 and body["error"]["param"] == param


def test_a_bias_outside_the_vocabulary_is_a_400(server):
    status, _, body = http_call(server, "POST", "/v1/completions",
                                {"model": MODEL, "prompt": "w05", "max_tokens": 2, "logit_bias": {"100000": 1}})
    assert status == 400 and "outside the model's vocabulary" in body["error"]["message"]
    assert body["error"]["param"] == "logit_bias"


def test_a_stop_token_id_outside_the_vocabulary_is_a_400(server):
    """It can never be emitted, so it never stops anything (a tokenizer's id sent to another model): it was
    taken without a word; vLLM answers 400 too."""
    status, _, body = http_call(server, "POST", "/v1/completions",
                                {"model": MODEL, "prompt": "w05", "max_tokens": 2, "stop_token_ids": [3, 100000]})
    assert status == 400 and body["error"]["param"] == "stop_token_ids"
    assert "stop_token_ids names token 100000, outside the model's vocabulary of" in body["error"]["message"]


def test_min_p_and_stop_token_ids_as_vllm_takes_them(client, tokenizer, offline):
    prompt = "w10 w11 w12 w10 w11"
    ids = list(text_ids(tokenizer, prompt))
    plain = offline.generate(ids, raw=True, params=SamplingParams(max_new_tokens=12, ignore_eos=True))
    stop = plain.token_ids[4]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"stop_token_ids": [stop], "ignore_eos": True})
    cut = plain.token_ids[: plain.token_ids.index(stop) + 1]
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == len(cut)
    past = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert past.usage.completion_tokens == 12 and past.choices[0].text == plain.text
    sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=9,
                                        extra_body={"min_p": 0.2})
    expected = offline.generate(ids, raw=True, params=SamplingParams(max_new_tokens=12, temperature=1.0, seed=9,
                                                                     min_p=0.2))
    assert sampled.choices[0].text == expected.text


def test_min_tokens_as_vllm_takes_it(client, tokenizer, offline):
    """vLLM's min_tokens: a stop id (or EOS) ends no shorter completion; the response equals offline
    decoding with min_new_tokens."""
    prompt = "w10 w11 w12 w10 w11"
    ids = list(text_ids(tokenizer, prompt))
    plain = offline.generate(ids, raw=True, params=SamplingParams(max_new_tokens=12, ignore_eos=True))
    stop = plain.token_ids[1]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"stop_token_ids": [stop], "ignore_eos": True, "min_tokens": 6})
    expected = offline.generate(ids, raw=True, params=SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                                     stop_token_ids=(stop,), min_new_tokens=6))
    assert out.choices[0].text == expected.text and out.usage.completion_tokens == len(expected.token_ids) >= 6
    assert stop not in expected.token_ids[:6] and expected.token_ids[:2] != plain.token_ids[:2]
