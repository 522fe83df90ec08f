"""The pages of a memory-mapped checkpoint a loaded model no longer reads, let go.

transformers loads a safetensors checkpoint through a private memory map, and a float32 tensor of the
file's dtype stays a view of it. When `prepack_model` or `quantize_model` rebuilds the linear layers
into memory of their own, every page the rebuild read stays mapped and counts in the process's resident
memory, and the embedding and the norms keep the whole mapping alive. Two steps let go of it:
`replace_linears` unmaps each old weight's pages once its layer is rebuilt (`release_pages`), and
`load_model` then copies the tensors still reading the file into memory of their own (`copy_off_files`),
so the mapping is dropped. The pages were clean page cache the kernel could reclaim under pressure, but
the resident figure counted them: the bench's peak RSS and `--backend hf`'s read as if the model were
held twice. The Hugging Face 1.5B and 0.5B loaded beside `fusion` (the 1.5B's Spec-Bench bench with
both peers; `scripts/peer_memory.py`): 12.0 GiB more resident, 7.4 with both steps, and a process peak
of 9.3 GiB against 13.7 (session 120). Linux only (/proc/self/maps, madvise); elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from pathlib import Path

import torch
from torch import nn

MAPS = Path("/proc/self/maps")
SMAPS = Path("/proc/self/smaps")
MADV_DONTNEED = 4
"""Linux's madvise advice that unmaps a range's pages from this process (a file's clean pages stay in the
page cache, and a later read of the range maps them again)."""


def file_mappings(clean: bool = False) -> list[tuple[int, int]]:
    """Address ranges [start, end) of this process's mappings of regular files (none where /proc cannot be
    read). `clean`: only those holding no page written since it was mapped (a private mapping's written
    page is the process's own copy, which `release_pages` would throw away), read from the slower
    /proc/self/smaps."""
    try:
        lines = (SMAPS if clean else MAPS).read_text().splitlines()
    except OSError:
        return []
    ranges: list[tuple[int, int]] = []
    dirty: set[tuple[int, int]] = set()
    current: tuple[int, int] | None = None
    for line in lines:
        fields = line.split(maxsplit=5)
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            current = None
            if len(fields) == 6 and fields[5].startswith("/"):  # a path: a file (not [heap], [stack], anon)
                current = tuple(int(x, 16) for x in fields[0].split("-"))
                ranges.append(current)
        elif current is not None and fields[0] == "Anonymous:" and fields[1] != "0":  # copied on write
            dirty.add(current)
    return [r for r in ranges if r not in dirty]


def _mapped(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    ptr = tensor.data_ptr()
    return tensor.numel() > 0 and any(start <= ptr < end for start, end in ranges)


def release_pages(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> int:
    """Unmap the whole pages of `tensor`'s bytes from this process where they lie in a file mapping of
    `ranges` (`file_mappings(clean=True)`: a written page of a private mapping would be lost), so that a
    weight read once (a linear being packed into new memory) stops counting in the resident memory; its
    data is unchanged (a later read maps the file's pages back). Returns the bytes released (0: not a
    mapped file's, or no madvise here)."""
    if tensor.device.type != "cpu" or not _mapped(tensor, ranges):
        return 0
    page = mmap.PAGESIZE
    lo = -(-tensor.data_ptr() // page) * page  # whole pages only: a neighbour's bytes stay mapped
    hi = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    libc = _libc()
    if hi <= lo or libc is None:
        return 0
    return hi - lo if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) == 0 else 0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's symbols as this process has them loaded (None where madvise is not among them)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    return libc if hasattr(libc, "madvise") else None


@torch.no_grad()
def copy_off_files(model: nn.Module) -> int:
    """Copy every CPU parameter and buffer of `model` that reads a memory-mapped file into memory of its
    own (tied tensors stay tied: one copy per view of the file), so the file's mapping can be dropped.
    Returns the bytes copied."""
    ranges = file_mappings()
    if not ranges:
        return 0
    copies: dict[tuple, torch.Tensor] = {}  # a view of the file (address, dtype, shape, strides) -> its copy
    copied = 0
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or tensor.device.type != "cpu" or not _mapped(tensor, ranges):
                    continue
                key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
                if key not in copies:
                    copies[key] = torch.empty_like(tensor.data, memory_format=torch.preserve_format)
                    copies[key].copy_(tensor.data)
                    copied += tensor.data.nbytes
                if isinstance(tensor, nn.Parameter):
                    tensor.data = copies[key]
                else:
                    table[name] = copies[key]
    return copied
