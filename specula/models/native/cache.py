"""A static KV cache for one sequence, written by position.

Keys and values of every layer live in two buffers `[layers, G, capacity, D]`; a pass writes its
rows at slots `start .. start + n` (`write`) and attends over slots `0 .. start + n`. Nothing is
ever reallocated per step: the capacity grows by doubling (a copy, amortised) when a sequence
outgrows it, up to the model's context window. Committing a tree's accepted path moves the
path's rows next to the root (`keep`): a gather of at most the path's length, no copy when the
path is a prefix of the tree's rows (a chain).

A cache made for the CUDA-graph path (`zero=True`, `graphs.GraphRunner`) starts zeroed (a captured
pass attends over a fixed window of slots with the unwritten ones masked out, and a masked slot
must not hold NaN bit patterns) and carries the graphs captured on its buffers (`graphs`), which
are dropped whenever the buffers are reallocated.
"""

from __future__ import annotations

from typing import Sequence

import torch


class KVCache:
    """Keys and values of one sequence (see the module docstring)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype, device: torch.device,
                 capacity: int = 256, max_capacity: int | None = None, zero: bool = False) -> None:
        self.shape = (layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.max_capacity = max_capacity
        self.zero = zero
        """Allocate zeroed buffers (the graph path's caches)."""
        self.owner = None
        """The `graphs.GraphRunner` whose pool this cache belongs to (None: an eager-only cache)."""
        self.graphs: dict = {}
        """Graphs captured on these buffers, by (rows, context window); emptied on reallocation."""
        self.k = self.v = torch.empty(0)
        self._allocate(capacity)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def _allocate(self, capacity: int, keep: int = 0) -> None:
        layers, g, d = self.shape
        if self.max_capacity is not None:
            capacity = min(capacity, self.max_capacity)
        new = torch.zeros if self.zero else torch.empty
        k = new((layers, g, capacity, d), dtype=self.dtype, device=self.device)  # [L, G, C, D]
        v = new((layers, g, capacity, d), dtype=self.dtype, device=self.device)
        if keep:
            k[:, :, :keep] = self.k[:, :, :keep]
            v[:, :, :keep] = self.v[:, :, :keep]
        self.k, self.v = k, v
        self.graphs = {}  # captured on the old buffers

    def reserve(self, length: int, used: int) -> None:
        """Make room for `length` slots (the first `used` are kept)."""
        if length > self.capacity:
            capacity = max(self.capacity, 64)
            while capacity < length:
                capacity *= 2
            if self.max_capacity is not None and length > self.max_capacity:
                raise RuntimeError(f"KV cache: {length} slots exceed the context window of {self.max_capacity}")
            self._allocate(capacity, keep=used)

    def shrink_to_fit(self, used: int) -> None:
        """Free the slots past the first `used` (kept; a later pass grows the buffers again). A pooled cache
        (`owner`: the graph path's, its graphs captured on these buffers) keeps its size."""
        if self.owner is None and used < self.capacity:
            self._allocate(used, keep=used)

    def copy_from(self, other: "KVCache", length: int) -> None:
        """Slots 0 .. length - 1 of `other` (same shape and dtype) copied into this cache's first slots."""
        self.reserve(length, 0)
        self.k[:, :, :length] = other.k[:, :, :length]
        self.v[:, :, :length] = other.v[:, :, :length]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write rows k, v ([n, G, D]) at slots start.. of `layer`; return that layer's keys and
        values over slots 0 .. start + n, each [G, start + n, D] (views, no copy)."""
        n = k.shape[0]
        self.k[layer, :, start : start + n] = k.transpose(0, 1)
        self.v[layer, :, start : start + n] = v.transpose(0, 1)
        return self.k[layer, :, : start + n], self.v[layer, :, : start + n]

    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Move the given rows (slot offsets from `start`, ascending) to slots start, start + 1, ..."""
        rows = list(rows)
        if rows == list(range(len(rows))):
            return  # already in place
        index = torch.tensor([start + r for r in rows], device=self.device)
        n = len(rows)
        self.k[:, :, start : start + n] = self.k.index_select(2, index)
        self.v[:, :, start : start + n] = self.v.index_select(2, index)

    def tensors(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer over the first `length` slots, each [1, G, length, D] (tests)."""
        return [(self.k[i, :, :length][None], self.v[i, :, :length][None]) for i in range(self.shape[0])]
