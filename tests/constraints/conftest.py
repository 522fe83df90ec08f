"""Fixtures of the constraint tests."""

from __future__ import annotations

import pytest

from grammar_kit import JSON_CHARS, JSON_MERGES, byte_level_tokenizer


@pytest.fixture(scope="session")
def json_tokenizer():
    return byte_level_tokenizer(JSON_CHARS, JSON_MERGES)
