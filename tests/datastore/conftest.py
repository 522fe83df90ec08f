"""Helpers for datastore tests: a tiny corpus on disk and a word-level tokenizer of any size."""

from __future__ import annotations

import json

import pytest

from tiny import word_tokenizer


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="session")
def make_tokenizer():
    """Factory: make_tokenizer(n_words) -> word-level tokenizer over w0..w{n-1} (no special tokens:
    they would match inside words)."""
    return word_tokenizer


@pytest.fixture
def corpus(tmp_path):
    """A directory with .txt, .md, .jsonl (text / conversations / messages) and an ignored .bin."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(words([5, 6, 7, 8, 9, 5, 6, 7, 10, 11]))
    (root / "sub" / "b.md").write_text(words([5, 6, 7, 8, 12, 13, 5, 6, 40]))
    records = [
        {"text": words([20, 21, 22, 5, 6, 7, 8, 9])},
        {"conversations": [{"from": "human", "value": words([30, 31])}, {"from": "gpt", "value": words([32, 33, 34])}]},
        {"messages": [{"role": "user", "content": words([5, 6, 7, 50])}]},
    ]
    (root / "sub" / "c.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (root / "ignored.bin").write_bytes(b"\xff\xfe not text")
    (root / ".hidden.txt").write_text(words([90, 91]))
    return root
