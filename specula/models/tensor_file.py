"""A file of named tensors that large tensors are built in, and that is mapped back without a copy:
the weights format of the prepared-model cache (`models.prepared`).

Why not `torch.save`: a prepared model was packed into anonymous memory and then written, so its
bytes were placed twice: the float32 Qwen2.5-Coder-1.5B's first load spent 12-21 s packing and
20-30 s writing 6.6 GB on the 2-core machine, with every packed weight resident as anonymous memory
until the write ended (6.2 GiB at the peak; nothing can evict it on a machine without swap). Here a
writer hands out tensors that live in a writable shared mapping of the file itself
(`TensorFileWriter.empty`): the kernels' packing writes each weight straight into the page cache,
once, and the kernel writes it back to storage in the background. Measured on 1.3 GB of packed
float32 weights: 1.1-1.3 s to pack into the file and fsync it, against 7.3-9.2 s to pack into
memory and write it.

Layout (all offsets in bytes, little-endian):

    [header: MAGIC, zero padding to HEADER_BYTES]
    [tensor bytes: regions handed out by `empty` (and those `add` copies large tensors into) start
     on a page boundary; smaller tensors `add` writes start on a multiple of 64]
    [index: UTF-8 JSON {name: {"dtype": "float32", "shape": [...], "offset": n}}]
    [8 bytes: the index's length][MAGIC]

`read_index` checks both magics and the index against the file's size, so a file of zeros, a
truncated one or another format is refused (`TensorFileError`), never read as weights.
`map_tensors` maps the whole file once, privately (copy-on-write, `torch.UntypedStorage.from_file`),
and returns views: the pages are file-backed, shared with other processes, and dropped by the kernel
under memory pressure.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import torch

MAGIC = b"specula-tensors-1\n"
"""Opens and closes every file of this format (the `1` is the layout's version)."""
HEADER_BYTES = 4096
"""The header's size: tensor bytes start on a page boundary."""
ALIGN = 64
"""Alignment of tensors copied in by `add` (the kernels' widest vector loads)."""
_LENGTH = struct.Struct("<Q")
_CANNOT_MAP_HERE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS, errno.ENODEV, errno.EACCES}
"""`posix_fallocate` / `mmap` errors that mean the file system does not do it (not that the disk is
full): the writer then makes tensors in memory and writes them, as on a platform without it."""
_COPY_MAPPED = 1 << 20
"""`add` copies a tensor at least this large into a region (as `empty` makes) rather than writing
it: on the 2-core machine placing pages through a shared mapping cost a fraction of `write`'s
time (the 0.93 GB embedding of the 1.5B: see docs/cache.md)."""


class TensorFileError(ValueError):
    """A file that is not a whole tensor file of this format (the message says what is wrong)."""


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise TensorFileError(f"unknown dtype {name!r} in the index")
    return dtype


class TensorFileWriter:
    """Writes one tensor file at `path` (created; an existing file is an error). `empty` hands out
    tensors inside the file, `add` names a tensor (one handed out: its place is recorded; any other:
    copied in), `finish` writes the index and makes the file durable. Use as a context manager: the
    file is closed on the way out; tensors handed out stay valid (their mappings outlive the file
    descriptor, and a deleted file)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self._pwrite(MAGIC, 0)
        self._end = HEADER_BYTES
        self._regions: list[tuple[int, int, int, mmap.mmap]] = []  # (address, bytes, offset, mapping)
        self._index: dict[str, dict[str, Any]] = {}
        # (address, bytes) of a contiguous tensor copied in -> (its offset, the tensor, held so that
        # no other tensor can take that address while this writer lives)
        self._copied: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
        self._mappable = True  # False once the file system refused to preallocate or map
        self.in_memory = 0
        """Bytes `empty` handed out in ordinary memory (no preallocation or mapping here, or it failed)."""
        self.error: OSError | None = None
        """Why `empty` fell back to ordinary memory, when it did because of an error (a full disk):
        `finish` raises it, so the entry is not written and the caller keeps its tensors."""

    def __enter__(self) -> TensorFileWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _pwrite(self, data: bytes | memoryview, offset: int) -> None:
        done = 0
        while done < len(data):  # pwrite may write less than asked
            done += os.pwrite(self._fd, data[done:], offset + done)

    def _region(self, count: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A flat tensor of `count` elements over a new region at the file's end, preallocated and
        mapped writable and shared; None where that cannot be done (`error` set when the reason
        dooms the file, `_mappable` cleared when the file system does not do it)."""
        nbytes = count * dtype.itemsize
        if nbytes == 0 or not self._can_map():
            return None
        offset = _round_up(self._end, mmap.ALLOCATIONGRANULARITY)
        try:
            os.posix_fallocate(self._fd, offset, nbytes)
            mapping = mmap.mmap(self._fd, nbytes, access=mmap.ACCESS_WRITE, offset=offset)
        except OSError as exc:
            if exc.errno in _CANNOT_MAP_HERE:  # a file system without it: written later, as any tensor
                self._mappable = False
            else:  # a full disk, a quota, an I/O error: the file cannot be completed
                self.error = exc
            return None
        tensor = torch.frombuffer(mapping, dtype=dtype, count=count)  # keeps the mapping alive
        self._regions.append((tensor.data_ptr(), nbytes, offset, mapping))
        self._end = offset + nbytes
        return tensor

    def empty(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor whose memory is a region of the file (a writable shared
        mapping; the blocks preallocated first, so a full disk is an error here rather than a crash
        when a page is first written). Where the platform or file system cannot preallocate or map,
        or preallocation fails, an ordinary tensor (`add` copies it in later; `error` holds the
        reason of a failure that dooms the file, such as a full disk)."""
        shape = tuple(int(size) for size in shape)
        count = math.prod(shape)
        region = self._region(count, dtype)
        if region is None:
            self.in_memory += count * dtype.itemsize
            return torch.empty(shape, dtype=dtype)
        return region.view(shape)

    def _can_map(self) -> bool:
        return self.error is None and self._mappable and hasattr(os, "posix_fallocate")

    def _region_offset(self, tensor: torch.Tensor) -> int | None:
        """The file offset of `tensor`'s bytes when they lie in a region of this file."""
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            return None
        address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for start, size, offset, _ in self._regions:
            if start <= address and address + nbytes <= start + size:
                return offset + address - start
        return None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Record `tensor` (CPU) under `name`: in place when it lives in the file, else its bytes are
        copied to the end (into a mapped region when large; a contiguous tensor once however many
        names share it)."""
        if name in self._index:
            raise ValueError(f"tensor {name!r} added twice")
        tensor = tensor.detach()
        offset = self._region_offset(tensor)
        if offset is None:
            shared = tensor.device.type == "cpu" and tensor.is_contiguous()
            tensor = tensor.cpu().contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            key = (tensor.data_ptr(), nbytes)
            if shared and nbytes and key in self._copied:
                offset = self._copied[key][0]
            else:
                offset = self._copy_in(tensor, nbytes)
                if shared and nbytes:
                    self._copied[key] = (offset, tensor)
        self._index[name] = {"dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape), "offset": offset}

    def _copy_in(self, tensor: torch.Tensor, nbytes: int) -> int:
        """Place a contiguous tensor's bytes at the end of the file; returns their offset."""
        region = self._region(tensor.numel(), tensor.dtype) if nbytes >= _COPY_MAPPED else None
        if region is not None:  # large: through a mapping, not written
            region.copy_(tensor.reshape(-1))
            return self._region_offset(region)
        offset = _round_up(self._end, ALIGN)
        if nbytes:
            self._pwrite(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()), offset)
        self._end = offset + nbytes
        return offset

    def finish(self) -> dict[str, dict[str, Any]]:
        """Write the index and the closing magic, flush the regions and fsync the file; returns the
        index. Raises the `OSError` that made `empty` fall back to memory, if one did."""
        if self.error is not None:
            raise self.error
        index = json.dumps(self._index, sort_keys=True).encode()
        tail = index + _LENGTH.pack(len(index)) + MAGIC
        self._pwrite(tail, self._end)
        os.ftruncate(self._fd, self._end + len(tail))
        for *_, mapping in self._regions:
            mapping.flush()
        os.fsync(self._fd)
        return dict(self._index)


def read_index(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The index of the tensor file at `path`; `TensorFileError` when it is not a whole file of
    this format, `OSError` when it cannot be read."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        tail = len(MAGIC) + _LENGTH.size
        if size < HEADER_BYTES + tail or handle.read(len(MAGIC)) != MAGIC:
            raise TensorFileError("not a specula tensor file (no header)")
        handle.seek(size - tail)
        (length,) = _LENGTH.unpack(handle.read(_LENGTH.size))
        if handle.read(len(MAGIC)) != MAGIC:
            raise TensorFileError("the file is incomplete (no closing magic)")
        if length > size - HEADER_BYTES - tail:
            raise TensorFileError("the index length is out of range")
        handle.seek(size - tail - length)
        try:
            index = json.loads(handle.read(length))
        except ValueError as exc:
            raise TensorFileError(f"the index is not JSON ({exc})") from exc
    if not isinstance(index, dict):
        raise TensorFileError("the index is not an object")
    end = size - tail - length
    for name, entry in index.items():
        try:
            shape, offset = [int(s) for s in entry["shape"]], int(entry["offset"])
            itemsize = _dtype(entry["dtype"]).itemsize
        except (KeyError, TypeError, ValueError) as exc:
            raise TensorFileError(f"the index entry of {name!r} is malformed ({exc})") from exc
        if (min(shape, default=0) < 0 or offset < HEADER_BYTES or offset % itemsize
                or offset + math.prod(shape) * itemsize > end):
            raise TensorFileError(f"tensor {name!r} lies outside the file's data")
    return index


def map_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """{name: tensor} of the tensor file at `path`, every tensor a view of one private (copy-on-write)
    mapping of the whole file; `TensorFileError` / `OSError` as `read_index`."""
    index = read_index(path)
    size = os.stat(path).st_size
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    tensors = {}
    for name, entry in index.items():
        dtype = _dtype(entry["dtype"])
        shape = tuple(int(s) for s in entry["shape"])
        tensors[name] = torch.empty(0, dtype=dtype).set_(storage, int(entry["offset"]) // dtype.itemsize, shape)
    return tensors
