"""Bring a memory-mapped file into the page cache before it is timed.

Why: a prepared model (`prepared.py`) is memory-mapped, so its pages are read from storage on first
use. When the page cache has lost them (a fresh boot, another large job in between, memory
pressure), the first forward pass of the first generation reads the whole file: on the 2-core
development machine the README's main job, right after a CI run, spent 6.8 s in its speculative
prefill against 1.3 s warm, and `--compare` (speculative first, plain decoding second on warm
pages) reported 0.85x where warm runs give ~2x. Reading the missing pages while the model loads
charges that cost to the load, where it belongs, and leaves both timed generations the same state.

How: `mincore(2)` over a private mapping of the file says which pages are resident; only the runs
of missing pages are read (`pread` into one reusable buffer), so a warm file costs a residency
check (milliseconds for GBs), not a copy. Linux only (elsewhere `prefetch` returns None and does
nothing); a file larger than the memory the kernel reports available is left alone (reading it
would only evict other pages, or its own).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import sys
from pathlib import Path

import numpy as np

_CHUNK = 64 << 20
"""Bytes per read: large enough for full-speed sequential reads, small enough to keep resident."""


@functools.cache
def _libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return lib


def resident_pages(path: str | Path) -> np.ndarray | None:
    """One bool per page of `path` (page size `mmap.PAGESIZE`), True where the page is in the page
    cache; None where the platform cannot tell (not Linux, or mincore failed)."""
    if not sys.platform.startswith("linux"):
        return None
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    if size == 0:
        return np.ones(0, dtype=bool)
    lib = _libc()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = np.zeros(pages, dtype=np.uint8)  # mincore writes one byte per page; bit 0 = resident
            if lib.mincore(addr, size, vec.ctypes.data) != 0:
                return None
        finally:
            lib.munmap(addr, size)
    finally:
        os.close(fd)
    return (vec & 1).astype(bool)


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where unreadable)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _missing_runs(resident: np.ndarray) -> list[tuple[int, int]]:
    """[(first page, page count)] of the maximal runs of False in `resident`."""
    missing = np.concatenate(([0], (~resident).astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(missing))  # starts at even positions, ends at odd ones
    return [(int(a), int(b - a)) for a, b in zip(edges[0::2], edges[1::2])]


def prefetch(path: str | Path) -> int | None:
    """Read the pages of `path` that are not in the page cache, so that later use of a memory map of
    it does not wait on storage. Returns the bytes read (0: it was all resident), or None where
    nothing was done (residency unknown on this platform, or the file exceeds available memory)."""
    resident = resident_pages(path)
    if resident is None:
        return None
    runs = _missing_runs(resident)
    if not runs:
        return 0
    size = os.path.getsize(path)
    available = _available_bytes()
    if available is not None and size > available:
        return None
    buffer = bytearray(min(_CHUNK, size))
    view = memoryview(buffer)
    read = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for first, count in runs:
            offset, end = first * mmap.PAGESIZE, min(size, (first + count) * mmap.PAGESIZE)
            while offset < end:
                n = os.preadv(fd, [view[: min(_CHUNK, end - offset)]], offset)
                if n <= 0:
                    break
                offset += n
                read += n
    finally:
        view.release()
        os.close(fd)
    return read
