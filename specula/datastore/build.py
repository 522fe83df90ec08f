"""Build a REST datastore: read a corpus, tokenize it, suffix-sort it, write it atomically.

Corpus sources (`--from`): text files, directories (walked recursively, files chosen by
extension, hidden entries skipped), JSONL / JSON files of records. A record is a string, an
object with a `text` string, or an object with a `conversations` / `messages` list whose items
carry `content` or `value` strings (each message is its own document). Documents are joined with
the separator id, so no match or continuation crosses a document boundary.

The suffix array comes from libdivsufsort (pydivsufsort, compiled): its integer-array entry point
writes the ids as fixed-width big-endian byte strings, sorts the bytes and keeps the suffixes that
start on a token boundary, which is exactly the order of the id sequences (ids above 65,535 work).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from specula.datastore.format import (
    DatastoreError, DatastoreHeader, crc32, index_dtype_for, token_dtype_for, write_datastore,
)
from specula.datastore.tokenizers import tokenizer_fingerprint, tokenizer_name, vocab_size
from specula.jsonl import json_lines
from specula.paths import atomic_file, check_not_input, check_output

DEFAULT_EXTENSIONS = (".py", ".txt", ".md", ".rst", ".jsonl", ".json")
"""File types read when walking a directory."""
_JSON_EXTENSIONS = (".jsonl", ".json")
_BATCH_CHARS = 1 << 20  # characters tokenized per batch


@dataclass(frozen=True)
class BuildConfig:
    """How a datastore is built."""

    max_tokens: int | None = None
    """Stop after this many tokens (separators included; at least 2: a token and the separator that ends its
    document); None = the whole corpus."""
    extensions: tuple[str, ...] = DEFAULT_EXTENSIONS
    """File name endings read when walking directories."""
    progress: bool = True
    """Show progress bars on stderr."""

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 2:  # 1 kept the separator alone: an empty store
            raise DatastoreError(f"max_tokens must be >= 2 (a token and the separator that ends its document), "
                                 f"got {self.max_tokens}; give more, or leave it out to keep the whole corpus")


@dataclass(frozen=True)
class BuildReport:
    """What a build produced."""

    path: Path
    """The datastore file written."""
    header: DatastoreHeader
    """Its header."""
    file_bytes: int
    """Size on disk."""
    files_read: int
    """Corpus files read."""
    files_skipped: int
    """Files found by walking a directory but skipped (not UTF-8, or not records)."""
    tokenize_seconds: float
    sort_seconds: float
    write_seconds: float


# --------------------------------------------------------------------------- corpus


def collect_files(sources: Sequence[str | os.PathLike], extensions: Sequence[str]) -> list[tuple[Path, bool]]:
    """(file, given explicitly) for every source; directories are walked in sorted order."""
    files: list[tuple[Path, bool]] = []
    for source in sources:
        path = Path(source).expanduser()
        if path.is_file():
            files.append((path, True))
        elif path.is_dir():
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                files.extend((Path(root, n), False) for n in sorted(names)
                             if not n.startswith(".") and n.endswith(tuple(extensions)))
        else:
            raise DatastoreError(f"corpus source {str(source)!r} does not exist; give text files, directories or JSONL")
    if not files:
        raise DatastoreError(f"no corpus files ending in {', '.join(extensions)} under {', '.join(map(str, sources))}")
    return files


def record_texts(record: Any) -> list[str]:
    """Documents in one JSON record (see the module docstring); [] if it holds none."""
    if isinstance(record, str):
        return [record]
    if not isinstance(record, dict):
        return []
    if isinstance(record.get("text"), str):
        return [record["text"]]
    for key in ("conversations", "messages"):
        turns = record.get(key)
        if isinstance(turns, list):
            out = []
            for turn in turns:
                if isinstance(turn, dict):
                    text = turn.get("content", turn.get("value"))
                    if isinstance(text, str) and text:
                        out.append(text)
            return out
    return []


def file_documents(path: Path, explicit: bool) -> list[str] | None:
    """Documents of one file, or None when a walked file is skipped (explicit files raise)."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors write one) is dropped
    except UnicodeDecodeError as exc:
        if explicit:
            raise DatastoreError(f"{str(path)!r} is not UTF-8 text ({exc.reason}); convert it or leave it out") from exc
        return None
    except OSError as exc:  # a dangling link, a file without read permission
        if explicit:
            raise DatastoreError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from exc
        return None
    if not path.name.endswith(_JSON_EXTENSIONS):
        return [text] if text else []
    if path.name.endswith(".jsonl"):
        lines = [(i + 1, line) for i, line in enumerate(json_lines(text)) if line.strip()]
    else:
        lines = [(1, text)]
    docs: list[str] = []
    found_record = False
    for number, line in lines:
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            if explicit:
                raise DatastoreError(f"{str(path)}:{number}: not valid JSON ({exc.msg}); fix the line or leave the file out") from exc
            return None
        records = value if (path.name.endswith(".json") and isinstance(value, list)) else [value]
        for record in records:
            texts = record_texts(record)
            found_record = found_record or bool(texts)
            # JSON may escape lone surrogates ("\\ud83d"), which no UTF-8 tokenizer takes: replaced
            docs.extend(t.encode("utf-8", "replace").decode("utf-8") for t in texts if t)
    if not found_record and lines:
        if explicit:
            raise DatastoreError(f"{str(path)!r} holds no records with `text`, `conversations` or `messages`")
        return None
    return docs


# --------------------------------------------------------------------------- tokenize / sort


def _plain_backend(tokenizer: Any):
    """The Rust tokenizer behind a fast tokenizer, with the truncation and padding a tokenizer.json
    may switch on turned off (transformers turns them off for each `encode`; called directly they
    cut every document to max_length, or stored pad ids as text); None for a slow tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or (backend.truncation is None and backend.padding is None):
        return backend
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(backend.to_str())  # the caller's tokenizer is left as it was
    plain.no_truncation()
    plain.no_padding()
    return plain


def _encode(tokenizer: Any, backend: Any, texts: list[str]) -> list[list[int]]:
    if backend is not None:  # the Rust tokenizer directly (`_plain_backend`): parallel, no length warnings
        return [enc.ids for enc in backend.encode_batch(texts, add_special_tokens=False)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _batches(files: list[tuple[Path, bool]], counts: dict[str, int], bar) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for path, explicit in files:
        docs = file_documents(path, explicit)
        bar.update(_file_size(path))
        if docs is None:
            counts["skipped"] += 1
            continue
        counts["read"] += 1
        for doc in docs:
            batch.append(doc)
            size += len(doc)
            if size >= _BATCH_CHARS:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def tokenize_corpus(tokenizer: Any, files: list[tuple[Path, bool]], config: BuildConfig,
                    separator: int, dtype: np.dtype) -> tuple[np.ndarray, int, dict[str, int]]:
    """Token ids of all documents, each followed by `separator`: ([n] dtype, documents, file counts)."""
    from tqdm import tqdm

    counts = {"read": 0, "skipped": 0}
    limit = config.max_tokens
    chunks: list[np.ndarray] = []
    total = n_docs = 0
    bar = tqdm(total=sum(_file_size(p) for p, _ in files), unit="B", unit_scale=True, desc="tokenize",
               disable=not config.progress, file=sys.stderr)
    backend = _plain_backend(tokenizer)
    with bar:
        for batch in _batches(files, counts, bar):
            ids = _encode(tokenizer, backend, batch)
            flat = np.fromiter(itertools.chain.from_iterable(itertools.chain(d, (separator,)) for d in ids),
                               dtype=np.int64, count=sum(len(d) + 1 for d in ids))
            if np.count_nonzero(flat >= separator) != len(ids):  # only the separators may reach it
                raise DatastoreError(f"the tokenizer produced an id >= {separator}, beyond the vocabulary it reports")
            if limit is not None and total + len(flat) >= limit:
                last = flat[: limit - total].astype(dtype)
                last[-1] = separator  # the store always ends with a separator (see format.py)
                ends = last == separator  # [len(last)]: the documents kept, whole or cut, end here ...
                ends[1:] &= last[:-1] != separator  # ... bar one cut down to nothing
                ends[0] = False  # (the chunk before ends with a separator)
                n_docs += int(np.count_nonzero(ends))
                chunks.append(last)
                total = limit
                break
            n_docs += len(ids)
            chunks.append(flat.astype(dtype))
            total += len(flat)
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype)
    if not np.any(tokens != separator):  # no document, or only documents the tokenizer turned into nothing
        cut = limit is not None and total == limit
        raise DatastoreError("the corpus holds no text the tokenizer turns into tokens"
                             + (f" in its first {limit} tokens (max_tokens)" if cut else "")
                             + ": nothing to build a datastore from; give files with text"
                             + (", or a larger max_tokens" if cut else ""))
    return tokens, n_docs, counts


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """[n] suffix array of an unsigned id array (libdivsufsort; see the module docstring)."""
    from pydivsufsort import divsufsort

    out_dtype = index_dtype_for(len(tokens))
    if len(tokens) == 0:
        return np.zeros(0, dtype=out_dtype)
    if len(tokens) == 1:
        return np.zeros(1, dtype=out_dtype)
    return np.asarray(divsufsort(tokens), dtype=out_dtype)


# --------------------------------------------------------------------------- build


def check_build(sources: Sequence[str | os.PathLike], out: str | os.PathLike,
                config: BuildConfig = BuildConfig()) -> list[tuple[Path, bool]]:
    """The corpus files of `sources` (as `collect_files`), once `out` is known to be writable and
    none of them: what a build refuses, found before any work (`specula datastore build` asks it
    before loading the tokenizer, which imports transformers: about 3 s)."""
    check_output(out, "out=", "file", DatastoreError)
    files = collect_files(sources, config.extensions)
    check_not_input(out, "out=", [("the corpus file", path) for path, _ in files], DatastoreError)
    return files


def build_datastore(tokenizer: Any, sources: Sequence[str | os.PathLike], out: str | os.PathLike,
                    config: BuildConfig = BuildConfig(), *,
                    files: Sequence[tuple[Path, bool]] | None = None) -> BuildReport:
    """Tokenize `sources` with `tokenizer`, suffix-sort, and write `out` atomically (temp + rename):
    an interrupted build leaves the previous file (or none), never a partial one. `files`: what
    `check_build(sources, out, config)` returned, when the caller checked already."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    if files is None:
        files = check_build(sources, out, config)  # before any work
    n_vocab = vocab_size(tokenizer)
    dtype = token_dtype_for(n_vocab)
    separator = int(np.iinfo(dtype).max)
    tokens, n_docs, counts = tokenize_corpus(tokenizer, files, config, separator, dtype)
    t1 = time.perf_counter()
    if config.progress:
        print(f"suffix array over {len(tokens):,} tokens ...", file=sys.stderr)
    index = suffix_array(tokens)
    t2 = time.perf_counter()
    header = DatastoreHeader(
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), tokenizer_name=tokenizer_name(tokenizer),
        vocab_size=n_vocab, token_dtype=str(dtype), index_dtype=str(index.dtype), separator=separator,
        n_tokens=len(tokens), n_documents=n_docs, tokens_crc32=crc32(tokens), index_crc32=crc32(index),
        sources=[str(s) for s in sources], build_seconds=round(t2 - t0, 3),
    )
    nbytes = tokens.nbytes + index.nbytes
    try:
        with tqdm(total=nbytes, unit="B", unit_scale=True, desc="write", disable=not config.progress,
                  file=sys.stderr) as bar, atomic_file(out, "wb") as handle:
            write_datastore(handle, header, tokens, index, progress=bar.update)
    except OSError as exc:
        raise DatastoreError(f"cannot write the datastore to {str(out)!r}: {exc.strerror or exc}") from exc
    t3 = time.perf_counter()
    path = Path(out)
    return BuildReport(path, header, path.stat().st_size, counts["read"], counts["skipped"],
                       round(t1 - t0, 3), round(t2 - t1, 3), round(t3 - t2, 3))

