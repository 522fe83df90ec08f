"""Tokenizer identity: load a tokenizer by model name, fingerprint it, find a target's tokenizer.

Files built from token ids (REST datastores, Token Recycling states) record the fingerprint of
the tokenizer that produced the ids and refuse to be used with another one."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from specula.errors import SpeculaError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


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


def load_tokenizer(spec: str) -> Any:
    """A tokenizer by model spec (embedded alias, model directory, .gguf, cached hub id) or by a
    directory holding only tokenizer files. Offline; errors are SpeculaErrors naming the spec."""
    from transformers import AutoTokenizer

    path = Path(spec).expanduser()
    kwargs: dict[str, Any] = {"local_files_only": True}
    if path.is_dir() and any((path / name).is_file() for name in _TOKENIZER_FILES):
        directory = path
    else:
        from specula.models.loading import resolve

        resolved = resolve(spec)
        directory = resolved.path
        if resolved.gguf_file is not None:
            kwargs["gguf_file"] = str(resolved.gguf_file)
    try:
        return AutoTokenizer.from_pretrained(str(directory), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise SpeculaError(f"could not load a tokenizer for {spec!r} from {directory}: {exc}") from exc


@functools.lru_cache(maxsize=8)
def _fingerprint_of_directory(directory: str) -> str | None:
    path = Path(directory)
    if not (path.is_dir() and any((path / name).is_file() for name in _TOKENIZER_FILES)):
        return None
    return tokenizer_fingerprint(load_tokenizer(directory))


def target_fingerprint(target: Any, tokenizer: Any = None) -> str | None:
    """The fingerprint of the target's tokenizer: of `tokenizer` when given, else of the tokenizer
    saved beside the target's weights (the model's `name_or_path` directory). None when neither
    exists (e.g. a model built in memory): callers then check the vocabulary size only."""
    if tokenizer is not None:
        return tokenizer_fingerprint(tokenizer)
    model = getattr(target, "model", target)
    directory = getattr(model, "name_or_path", "") or ""
    return _fingerprint_of_directory(str(directory)) if directory else None
