"""The pages of a memory-mapped checkpoint that a loaded model's packed linears no longer read, let go.

transformers loads a safetensors checkpoint through a private memory map, and a float32 tensor of the
file's dtype stays a view of it. When `prepack_model` or `quantize_model` rebuilds the linear layers
into memory of their own, every page of the old weights the rebuild read stayed mapped and counted in
the process's resident memory for as long as the model lived (the embedding and the norms keep the
mapping). `replace_linears` now unmaps each old weight's pages once its layer is rebuilt
(`MappedPages.release`); the embedding's pages are read in as its rows are looked up. The pages were clean
page cache the kernel could reclaim under pressure, but the resident figure counted them: the bench's
peak RSS and `--backend hf`'s read as if the model were held twice. `generate --backend hf` on the
Qwen2.5-Coder-1.5B peaked at 12.0 GiB resident, now 7.1; the Hugging Face 1.5B and 0.5B loaded
beside `fusion` (the 1.5B's Spec-Bench bench with both peers; `scripts/peer_memory.py`) added 12.0
GiB, now 6.2-6.5 (session 120). Copying the embedding off the file as well (so that the mapping itself
could go) read all of its 0.93 GB in, 1.1 s of the load, to hold it in memory of its own: not done.
Linux only (/proc/self/smaps, madvise); elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from pathlib import Path

import torch

MAPS = Path("/proc/self/maps")
SMAPS = Path("/proc/self/smaps")
MADV_DONTNEED = 4
"""Linux's madvise advice that unmaps a range's pages from this process (a file's clean pages stay in the
page cache, and a later read of the range maps them again)."""


def file_mappings(clean: bool = False) -> list[tuple[int, int]]:
    """Address ranges [start, end) of this process's mappings of regular files (none where /proc cannot be
    read). `clean`: only those holding no page written since it was mapped (a private mapping's written
    page is the process's own copy, which `MappedPages.release` would throw away), read from the slower
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


class MappedPages:
    """This process's file mappings, for letting go of the pages of weights read from them: the mappings
    from /proc/self/maps when made, the clean ones (`file_mappings(clean=True)`) from the slower smaps
    only once a tensor lies in a mapping (a model loaded from specula's own files or from memory has
    none: its start-up reads no smaps)."""

    def __init__(self) -> None:
        self.files = file_mappings()
        self._clean: list[tuple[int, int]] | None = None

    def release(self, tensor: torch.Tensor) -> int:
        """Unmap the whole pages of `tensor`'s bytes from this process where they lie in a clean file
        mapping (a written page of a private mapping would be lost), so that a weight read once (a
        linear being packed into new memory) stops counting in the resident memory; its data is
        unchanged (a later read maps the file's pages back). Returns the bytes released (0: not a
        mapped file's, or no madvise here)."""
        if tensor.device.type != "cpu" or not _mapped(tensor, self.files):
            return 0
        if self._clean is None:
            self._clean = file_mappings(clean=True)
        if not _mapped(tensor, self._clean):
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
