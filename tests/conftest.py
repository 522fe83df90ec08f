"""Shared fixtures; the model factories live in `tiny.py`. Every test runs on a sandbox specula cache
(`cache_sandbox.py`): none writes into the user's."""

from __future__ import annotations

import pytest

from cache_sandbox import pytest_configure, pytest_runtest_makereport, pytest_unconfigure  # noqa: F401
from tiny import ARCHES, VOCAB, word_tokenizer

@pytest.fixture(params=ARCHES)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A word-level tokenizer over VOCAB tokens named w0..w95 (offline)."""
    return word_tokenizer(VOCAB, decoder=True, unk_token="w0", eos_token="w1")
