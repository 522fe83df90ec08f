"""A tokenizer's fingerprint: the value every stored file (REST datastores, Token Recycling states,
draft-vocabulary rankings, head files) was written with, so a faster computation must give the
same digest."""

from __future__ import annotations

import hashlib

import pytest

from tiny import word_tokenizer
from specula.datastore.tokenizers import tokenizer_fingerprint, vocab_size


def digest_pair_by_pair(vocab) -> str:
    """The fingerprint's definition as first written (one hash update per field)."""
    digest = hashlib.sha256()
    for tok, idx in sorted((str(tok), int(idx)) for tok, idx in vocab.items()):
        digest.update(tok.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
        digest.update(str(idx).encode())
        digest.update(b"\x01")
    return "sha256:" + digest.hexdigest()


class Vocab:
    """A tokenizer reduced to what the fingerprint reads."""

    def __init__(self, vocab: dict) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict:
        return dict(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)


VOCABS = {
    "unicode": {"é": 3, "Ġthe": 0, "日本": 7, "\ud83d": 5, "a\x00b": 1, "": 2, "z": 10, "Z": 4},
    "non-string tokens": {b"ab": 0, 7: 1, "c": 2},
    "empty": {},
}


@pytest.mark.parametrize("name", sorted(VOCABS))
def test_the_fingerprint_is_the_pair_by_pair_digest(name):
    vocab = VOCABS[name]
    assert tokenizer_fingerprint(Vocab(vocab)) == digest_pair_by_pair(vocab)
    assert tokenizer_fingerprint(Vocab({}), vocab) == digest_pair_by_pair(vocab)  # a vocabulary the caller holds


def test_a_real_tokenizers_fingerprint_is_the_pair_by_pair_digest_and_tells_tokenizers_apart():
    tokenizer = word_tokenizer(["héllo", "wörld", "Ġthe", "日本", "x"])
    assert tokenizer_fingerprint(tokenizer) == digest_pair_by_pair(tokenizer.get_vocab())
    tokenizer.add_tokens(["<extra-token>"])
    assert tokenizer_fingerprint(tokenizer) == digest_pair_by_pair(tokenizer.get_vocab())
    assert tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(word_tokenizer(["héllo", "wörld", "Ġthe", "日本", "x"]))
    swapped = dict(VOCABS["unicode"], z=4, Z=10)  # the same tokens, two ids exchanged
    assert tokenizer_fingerprint(Vocab(swapped)) != tokenizer_fingerprint(Vocab(VOCABS["unicode"]))


def test_the_vocabulary_size_counts_the_largest_id_and_the_tokenizers_length():
    assert vocab_size(Vocab({"a": 0, "b": 9})) == 10
    assert vocab_size(Vocab({"a": 0, "b": 1})) == 2
    assert vocab_size(Vocab({})) == 0
    assert vocab_size(Vocab({}), {"a": 4}) == 5
