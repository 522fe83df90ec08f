"""Greedy speculative decoding equals plain greedy on a real model (SmolLM2-135M, slow)."""

from __future__ import annotations

import pytest

from specula.api import LoadConfig, build_decoder, load_backend
from specula.models import install as inst
from specula.models.registry import QUICK_TARGET
from specula.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that reverses a string, then explain it.",
    "List three facts about the Moon, then repeat the list in reverse order.",
]


def _load(config: LoadConfig):
    status = inst.state(QUICK_TARGET).status
    if status != inst.CONVERTED:
        pytest.skip(f"{QUICK_TARGET} is {status}; run `specula models install {QUICK_TARGET}`")
    return load_backend(QUICK_TARGET, config, "target")


@pytest.fixture(scope="module")
def smollm2():
    return _load(LoadConfig())


@pytest.fixture(scope="module")
def smollm2_int8():
    return _load(LoadConfig(quantize="int8"))  # attention "auto": batch invariant


@pytest.mark.parametrize("method", ["prompt-lookup", "token-recycling", "fusion"])
def test_greedy_speculative_output_equals_plain_greedy(smollm2, method):
    _assert_equal_to_plain(smollm2, method)


@pytest.mark.parametrize("method", ["prompt-lookup", "token-recycling"])
def test_int8_speculative_output_equals_plain_int8_greedy(smollm2_int8, method):
    """The int8 model is the target: tree rows are bitwise one-token steps, so even activation
    quantization (which amplifies float noise into whole int8 steps) cannot make them differ."""
    _assert_equal_to_plain(smollm2_int8, method)


def _assert_equal_to_plain(backend, method):
    from specula.models.loading import apply_chat_template

    target, tokenizer = backend
    params = SamplingParams(max_new_tokens=48)
    plain = build_decoder("none", target, tokenizer)
    spec = build_decoder(method, target, tokenizer)
    drafted = 0
    for prompt in PROMPTS:
        ids = apply_chat_template(tokenizer, prompt)
        expected = plain.generate(ids, params)
        out = spec.generate(ids, params)
        assert out.token_ids == expected.token_ids, (method, prompt)
        assert out.text == expected.text
        drafted += out.stats.drafted_tokens
    assert drafted > 0  # the method really speculated
