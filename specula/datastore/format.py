"""The REST datastore file: token ids plus their suffix array, memory-mapped at load.

Layout (all integers little-endian):

    offset 0   8 bytes   magic b"SPECREST"
    offset 8   uint32    format version (FORMAT_VERSION)
    offset 12  uint32    header length H
    offset 16  H bytes   header: UTF-8 JSON (see `DatastoreHeader`)
    16 + H     uint32    CRC-32 of the header bytes
    ...        padding to a multiple of 64
    tokens     n_tokens x token_dtype       documents joined by `separator`
    ...        padding to a multiple of 64
    index      n_tokens x index_dtype       suffix array: start positions in sorted suffix order

The suffix order is the lexicographic order of the token-id sequences, a shorter sequence
before any longer one it is a prefix of. `separator` is the largest value of `token_dtype`,
an id no token has, so no query can match across two documents. Every document is followed by
the separator, so the token array ends with one: a query (which never contains the separator)
differs from any suffix before running past the end, and readers may clip positions to n - 1. The arrays carry CRC-32s in
the header, checked at load (about 30 ms per 100 MB) unless the caller opts out.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import numpy as np

from specula.errors import SpeculaError

MAGIC = b"SPECREST"
FORMAT_VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
_CRC = struct.Struct("<I")
_REBUILD = "rebuild it with `specula datastore build`"


class DatastoreError(SpeculaError):
    """A datastore file that cannot be used (missing, corrupt, other tokenizer, other version)."""


@dataclass(frozen=True)
class DatastoreHeader:
    """What the header JSON holds."""

    tokenizer_fingerprint: str
    """`specula.datastore.tokenizers.tokenizer_fingerprint` of the tokenizer that produced the ids."""
    tokenizer_name: str
    """Human-readable tokenizer name (for messages only)."""
    vocab_size: int
    """Number of ids of that tokenizer (every stored id except the separator is below it)."""
    token_dtype: str
    """numpy dtype of the token array: "uint16" when the vocabulary fits, else "uint32"."""
    index_dtype: str
    """numpy dtype of the suffix array: "int32" below 2**31 tokens, else "int64"."""
    separator: int
    """Id placed between documents (the token dtype's maximum)."""
    n_tokens: int
    """Length of both arrays (separators included)."""
    n_documents: int
    """Documents joined."""
    tokens_crc32: int
    """CRC-32 of the token array's bytes."""
    index_crc32: int
    """CRC-32 of the suffix array's bytes."""
    sources: list[str] = field(default_factory=list)
    """Paths the corpus was read from (as given to the build)."""
    build_seconds: float = 0.0
    """Wall time of reading, tokenizing and suffix-sorting the corpus."""


def token_dtype_for(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id and a free separator value above them."""
    return np.dtype(np.uint16) if vocab_size < np.iinfo(np.uint16).max else np.dtype(np.uint32)


def index_dtype_for(n_tokens: int) -> np.dtype:
    return np.dtype(np.int32) if n_tokens < np.iinfo(np.int32).max else np.dtype(np.int64)


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _layout(header_len: int, header: DatastoreHeader) -> tuple[int, int, int]:
    """(tokens offset, index offset, file size) for a header of `header_len` bytes."""
    tokens_at = _align(_PREFIX.size + header_len + _CRC.size)
    index_at = _align(tokens_at + header.n_tokens * np.dtype(header.token_dtype).itemsize)
    return tokens_at, index_at, index_at + header.n_tokens * np.dtype(header.index_dtype).itemsize


def write_datastore(handle: BinaryIO, header: DatastoreHeader, tokens: np.ndarray, index: np.ndarray,
                    progress=None) -> None:
    """Write a complete datastore to an open binary file (the caller makes it atomic).

    tokens: [n] header.token_dtype; index: [n] header.index_dtype (the suffix array).
    progress: optional callable(bytes_written) for a progress bar."""
    assert tokens.dtype == np.dtype(header.token_dtype) and index.dtype == np.dtype(header.index_dtype)
    assert len(tokens) == len(index) == header.n_tokens
    blob = json.dumps(asdict(header), sort_keys=True).encode("utf-8")
    tokens_at, index_at, _ = _layout(len(blob), header)
    handle.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(blob)))
    handle.write(blob)
    handle.write(_CRC.pack(zlib.crc32(blob)))
    for at, array in ((tokens_at, tokens), (index_at, index)):
        handle.write(b"\x00" * (at - handle.tell()))
        view = memoryview(np.ascontiguousarray(array)).cast("B")
        step = 1 << 24
        for start in range(0, len(view), step):
            handle.write(view[start : start + step])
            if progress is not None:
                progress(len(view[start : start + step]))


def crc32(array: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(array)).cast("B"))


class Datastore:
    """A loaded datastore: `tokens` and `index` are read-only memory maps."""

    def __init__(self, path: Path, header: DatastoreHeader, tokens: np.ndarray, index: np.ndarray) -> None:
        self.path = path
        self.header = header
        # Plain ndarray views of the maps (fancy indexing on np.memmap objects is slower).
        self.tokens = np.asarray(tokens)  # [n] token_dtype
        self.index = np.asarray(index)  # [n] index_dtype, suffix array

    @property
    def separator(self) -> int:
        return self.header.separator

    @property
    def vocab_size(self) -> int:
        return self.header.vocab_size

    def __len__(self) -> int:
        return self.header.n_tokens

    def __repr__(self) -> str:
        return f"Datastore({str(self.path)!r}, {len(self)} tokens, {self.header.n_documents} documents)"


def read_header(path: str | Path) -> tuple[DatastoreHeader, int, int]:
    """Parse and check the header: returns (header, tokens offset, index offset)."""
    path = Path(path)
    if path.is_dir():
        raise DatastoreError(f"{str(path)!r} is a directory, not a datastore file; give the .specds file built "
                             "by `specula datastore build`")
    if not path.is_file():
        raise DatastoreError(f"datastore {str(path)!r} does not exist; build one with `specula datastore build`")
    try:
        return _read_header(path)
    except OSError as exc:  # unreadable (permissions, I/O): a one-line error, as for corpus files
        raise DatastoreError(f"cannot read datastore {str(path)!r}: {exc.strerror or exc}") from exc


def _read_header(path: Path) -> tuple[DatastoreHeader, int, int]:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size or prefix[:8] != MAGIC:
            raise DatastoreError(f"{str(path)!r} is not a specula datastore (bad magic bytes); {_REBUILD}")
        _, version, header_len = _PREFIX.unpack(prefix)
        if version != FORMAT_VERSION:
            raise DatastoreError(
                f"datastore {str(path)!r} has format version {version}, this specula reads version "
                f"{FORMAT_VERSION}; {_REBUILD}"
            )
        blob = handle.read(header_len)
        crc = handle.read(_CRC.size)
    if len(blob) < header_len or len(crc) < _CRC.size:
        raise DatastoreError(f"datastore {str(path)!r} is truncated (header cut short); {_REBUILD}")
    if _CRC.unpack(crc)[0] != zlib.crc32(blob):
        raise DatastoreError(f"datastore {str(path)!r} is corrupt (header checksum mismatch); {_REBUILD}")
    try:
        header = DatastoreHeader(**json.loads(blob))
        tokens_at, index_at, expected = _layout(header_len, header)
    except (ValueError, TypeError) as exc:
        raise DatastoreError(f"datastore {str(path)!r} has an unreadable header ({exc}); {_REBUILD}") from exc
    if size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        raise DatastoreError(f"datastore {str(path)!r} is {state} ({size} bytes, expected {expected}); {_REBUILD}")
    return header, tokens_at, index_at


def load_datastore(path: str | Path, *, expected_fingerprint: str | None = None, expected_name: str = "",
                   verify: bool = True) -> Datastore:
    """Memory-map a datastore after checking magic, version, size, tokenizer and (verify) checksums.

    expected_fingerprint: the tokenizer fingerprint the caller will query with; a datastore built
    with another tokenizer raises DatastoreError. None skips that check."""
    path = Path(path)
    header, tokens_at, index_at = read_header(path)
    if expected_fingerprint is not None and header.tokenizer_fingerprint != expected_fingerprint:
        other = f" ({expected_name})" if expected_name else ""
        raise DatastoreError(
            f"datastore {str(path)!r} was built with tokenizer {header.tokenizer_name!r}, not with this "
            f"model's tokenizer{other}; build one with `specula datastore build --tokenizer <this model>`"
        )
    n = header.n_tokens
    tokens = _memmap(path, header.token_dtype, tokens_at, n)
    index = _memmap(path, header.index_dtype, index_at, n)
    if verify and (crc32(tokens) != header.tokens_crc32 or crc32(index) != header.index_crc32):
        raise DatastoreError(f"datastore {str(path)!r} is corrupt (array checksum mismatch); {_REBUILD}")
    if n == 0 or int(tokens[-1]) != header.separator:
        raise DatastoreError(f"datastore {str(path)!r} is corrupt (empty, or not ending with a separator); {_REBUILD}")
    return Datastore(path, header, tokens, index)


def _memmap(path: Path, dtype: str, offset: int, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=np.dtype(dtype), mode="r", offset=offset, shape=(n,))


def describe(header: DatastoreHeader, sources_shown: int = 5) -> dict[str, Any]:
    """Header fields for `specula datastore info` (long source lists abbreviated)."""
    info = asdict(header)
    sources: Sequence[str] = info.pop("sources")
    info["sources"] = list(sources[:sources_shown]) + ([f"... {len(sources) - sources_shown} more"]
                                                        if len(sources) > sources_shown else [])
    return info
