"""Give freed tensor memory back to the system while training (glibc's heap keeps it otherwise).

Why: glibc serves allocations below its mmap threshold from its heaps and keeps what is freed
there for reuse; the threshold starts at 128 KiB and rises to the size of each large block freed
(up to 32 MiB), so after the first batches most of a step's tensors come from the heaps. Training
batches change shape from step to step (length-grouped pieces, up to `seq_len` rows), the freed
blocks rarely fit the next step's, and the heaps only grow: an eagle3 fine-tune of the 1.5B grew
from 15 to 24 GB of anonymous memory over 270 steps and was killed for memory (session 76). Side by
side on the same 5-minute run (one data file, `runs/s77/variant.sh`), the process held 9.0-9.7 GB
of anonymous memory at the end with glibc's defaults and 6.0-6.3 GB with a fixed 64 KiB
threshold, at the same step rate (41 and 44 steps in 243 and 250 s).

How: `mallopt(M_MMAP_THRESHOLD, 64 KiB)` (a fixed threshold, which also turns the rise off), so
every tensor block above it is its own mapping, returned whole when freed. glibc on Linux only;
elsewhere nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameter number of the mmap threshold (malloc.h)."""

MMAP_THRESHOLD_BYTES = 64 * 1024
"""Allocations at or above this size get their own mapping, returned to the system when freed."""


def return_freed_memory() -> bool:
    """Set glibc's mmap threshold to `MMAP_THRESHOLD_BYTES` for this process (see the module
    docstring); True when it was set, False where the C library is not glibc on Linux."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # no C library found by that name, or one without mallopt (musl)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
