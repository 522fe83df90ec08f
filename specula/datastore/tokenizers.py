"""Tokenizer identity: a tokenizer's fingerprint, its vocabulary size and name.

Files built from token ids (REST datastores, Token Recycling states) record the fingerprint of
the tokenizer that produced the ids and refuse to be used with another one. A datastore reads the
tokenizer its caller gives it, never a backend's model (loading one by model name is
`specula.models.loading.load_tokenizer`)."""

from __future__ import annotations

import hashlib
from typing import Any


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over the tokenizer's sorted (token, id) pairs: equal iff the id<->token maps are equal."""
    items = sorted((str(tok), int(idx)) for tok, idx in tokenizer.get_vocab().items())
    digest = hashlib.sha256()
    for tok, idx in items:
        digest.update(tok.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
        digest.update(str(idx).encode())
        digest.update(b"\x01")
    return "sha256:" + digest.hexdigest()


def vocab_size(tokenizer: Any) -> int:
    """Number of ids the tokenizer can produce (added tokens included)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def tokenizer_name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
