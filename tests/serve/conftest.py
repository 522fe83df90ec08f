"""Fixtures for the server tests (helpers in serve_helpers.py)."""

from __future__ import annotations

import copy
import functools
from typing import Iterator

import pytest
import torch

from serve_helpers import EOS, make_spec, make_tokenizer, running
from tiny import output_text, perturbed_copy, reference_greedy, tiny_model

from specula.serve import SpeculaServer


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def target_model():
    return tiny_model("qwen2", seed=3)


@pytest.fixture(scope="session")
def draft_model(target_model):
    return perturbed_copy(target_model, scale=0.05)


@pytest.fixture(scope="module")
def server(target_model, draft_model, tokenizer) -> Iterator[SpeculaServer]:
    """draft-model speculation on the tiny target, no API key, 4 KiB body limit."""
    with running(make_spec(target_model, tokenizer, "draft-model", draft_model), max_body_bytes=4096) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def reference(target_model, tokenizer):
    """reference(prompt_ids, max_tokens) -> greedy text by plain full recomputation (HF forward,
    no specula code); reference.tokens(prompt_ids, max_tokens) -> the token ids."""
    model = copy.deepcopy(target_model)

    @functools.lru_cache(maxsize=None)
    def tokens(prompt_ids: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
        with torch.inference_mode():
            return tuple(reference_greedy(model, list(prompt_ids), max_tokens, eos=EOS))

    def text(prompt_ids: tuple[int, ...], max_tokens: int) -> str:
        return output_text(tokenizer, prompt_ids, tokens(prompt_ids, max_tokens))

    text.tokens = tokens
    return text
