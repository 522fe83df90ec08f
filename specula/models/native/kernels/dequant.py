"""GGUF tensors to float32 in one C pass per block (`gguf.c`), for `models install`'s conversion.

`dequantize(data, qtype)` is `gguf.dequantize` (gguf-py's numpy) with the same bits for the block
types the embedded models use (Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) and gguf-py itself for any other type,
or where the kernels cannot run here. numpy dequantised the 1.5B's Q4_K/Q6_K weights in 24 s and the
0.5B's Q5_0/Q8_0 in 11 s on the 2-core machine, a third of the install of both."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from specula.errors import ConfigError


@functools.cache
def _library() -> Any | None:
    """The kernels' library, or None where they cannot be built or run here (asked once a process:
    a failed build is not tried again for every tensor)."""
    from specula.models.native import kernels

    if not kernels.available():
        return None
    try:
        return kernels.library()
    except ConfigError:  # the build failed: gguf-py's numpy still converts, only slower
        return None


def known(qtype: int) -> bool:
    """Whether `gguf.c` dequantises the ggml type `qtype` (a `gguf.GGMLQuantizationType` value)."""
    lib = _library()
    return lib is not None and lib.specula_gguf_block_bytes(int(qtype)) > 0


def dequantize(data: np.ndarray, qtype: Any) -> np.ndarray:
    """`gguf.dequantize(data, qtype)`: `data` is a tensor's bytes as the GGUF reader gives them
    ([..., row bytes] uint8); returns float32 [..., row values], in C where `gguf.c` knows the type
    (the same bits as gguf-py's numpy, `tests/models/test_dequant.py`), else by gguf-py (its
    `gguf.quants.dequantize`: `models install` puts this function in place of `gguf.dequantize`)."""
    from gguf.quants import dequantize as gguf_dequantize

    lib = _library()
    bytes_per_block = lib.specula_gguf_block_bytes(int(qtype)) if lib is not None else 0
    if bytes_per_block == 0 or data.dtype != np.uint8 or data.ndim == 0 or data.shape[-1] % bytes_per_block:
        return gguf_dequantize(data, qtype)
    values = lib.specula_gguf_block_values(int(qtype))
    src = np.ascontiguousarray(data)
    blocks = src.size // bytes_per_block
    out = np.empty((*src.shape[:-1], src.shape[-1] // bytes_per_block * values), dtype=np.float32)
    status = lib.specula_gguf_dequantize(src.ctypes.data, out.ctypes.data, blocks, int(qtype),
                                         torch.get_num_threads())
    if status != 0:
        raise ValueError(f"gguf.c does not know ggml type {int(qtype)}")
    return out
