"""Shared fixtures; the model factories live in `tiny.py`."""

from __future__ import annotations

import pytest

from tiny import ARCHES, VOCAB

@pytest.fixture(params=ARCHES)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A word-level tokenizer over VOCAB tokens named w0..w95 (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1")
