"""The target's cost curve: forward latency against the number of tokens verified in one pass.

Size n means n tokens in the target's forward pass: the step's root plus a chain of n - 1
draft nodes, run through `HFCausalLM.forward_tree` after a prefix of `context` tokens in the
KV cache, then `commit(())` and `crop` back to the prefix. n = 1 is a plain decode step, so
`ratio(n)` is "verifying n tokens costs ratio(n) plain steps"; a tree of k nodes costs
`ratio(k + 1)` (see `CostCurve.tree_ratio`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from specula.bench.machine import sync_device
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.tree import TokenTree

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)
"""Sizes measured by `specula profile` and the bench (1 is always added)."""


@dataclass(frozen=True)
class CostCurve:
    """Median forward latency per number of tokens in the pass (root + draft nodes)."""

    sizes: tuple[int, ...]
    """Tokens per forward pass, ascending, starting at 1 (a plain decode step)."""
    seconds: tuple[float, ...]
    """Median latency of `forward_tree` + `commit` for each size."""
    context: int
    """Tokens already in the KV cache when measured."""
    repeats: int = 0
    """Timed repeats per size (after one warm-up pass)."""

    def __post_init__(self) -> None:
        if not self.sizes or self.sizes[0] != 1 or list(self.sizes) != sorted(set(self.sizes)):
            raise ConfigError(f"cost curve sizes must be ascending, distinct and start at 1, got {list(self.sizes)}")
        if len(self.seconds) != len(self.sizes) or any(s <= 0 for s in self.seconds):
            raise ConfigError("cost curve needs one positive latency per size")

    def latency(self, n: float) -> float:
        """Seconds for a pass of n tokens: piecewise-linear between measured sizes, extended
        beyond the largest with the last segment's slope (never decreasing)."""
        sizes, secs = self.sizes, self.seconds
        if n <= sizes[0]:
            return secs[0]
        for (x0, y0), (x1, y1) in zip(zip(sizes, secs), zip(sizes[1:], secs[1:])):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        if len(sizes) == 1:
            return secs[0]
        slope = max(0.0, (secs[-1] - secs[-2]) / (sizes[-1] - sizes[-2]))
        return secs[-1] + slope * (n - sizes[-1])

    def ratio(self, n: float) -> float:
        """Latency of an n-token pass relative to a plain decode step (n = 1)."""
        return self.latency(n) / self.seconds[0]

    def tree_ratio(self, nodes: int) -> float:
        """Relative cost of verifying a tree of `nodes` draft nodes (plus the root)."""
        return self.ratio(nodes + 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sizes": list(self.sizes),
            "seconds": [round(s, 7) for s in self.seconds],
            "ratio": [round(self.ratio(n), 4) for n in self.sizes],
            "context": self.context,
            "repeats": self.repeats,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostCurve":
        return cls(tuple(int(n) for n in data["sizes"]), tuple(float(s) for s in data["seconds"]),
                   int(data["context"]), int(data.get("repeats", 0)))


def _timed_pass(backend: HFCausalLM, root: int, tree: TokenTree, context: int) -> float:
    sync_device(backend.device)
    t0 = time.perf_counter()
    backend.forward_tree(root, tree)  # logits [n, vocab]
    backend.commit(())
    sync_device(backend.device)
    elapsed = time.perf_counter() - t0
    backend.crop(context)
    return elapsed


def measure_cost_curve(
    backend: HFCausalLM, sizes: Sequence[int] = DEFAULT_SIZES, context: int = 256, repeats: int = 3, seed: int = 0
) -> CostCurve:
    """Median latency of one verification pass of n tokens (root + chain of n-1 nodes) after a
    `context`-token prefix, for each n in `sizes` (1 added if missing). One warm-up pass per
    size, then `repeats` rounds over all sizes (interleaved, so drifts in machine speed hit
    every size alike). The backend is reset before and after."""
    sizes = sorted({1, *(int(n) for n in sizes)})
    if sizes[0] < 1:
        raise ConfigError(f"sizes must be >= 1 (tokens per forward pass), got {sizes[0]}")
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    if context < 1:
        raise ConfigError(f"context must be >= 1 token, got {context}")
    if context + sizes[-1] > backend.max_context:
        raise ConfigError(
            f"context {context} + {sizes[-1]} tokens exceeds the target's context window of {backend.max_context}; "
            "lower --context or the largest size"
        )
    vocab = backend.model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (context + sizes[-1],), generator=gen).tolist()  # prefix, root, chain
    prefix, root, chain = ids[:context], ids[context], ids[context + 1 :]
    trees = {n: TokenTree.chain(chain[: n - 1], source="profile") for n in sizes}

    backend.reset()
    times: dict[int, list[float]] = {n: [] for n in sizes}
    try:
        backend.append(prefix, logits="none")
        # commit(()) keeps prefix + root: each pass crops back to the `context`-token prefix.
        for n in sizes:
            _timed_pass(backend, root, trees[n], context)  # warm-up
        for _ in range(repeats):
            for n in sizes:
                times[n].append(_timed_pass(backend, root, trees[n], context))
    finally:
        backend.reset()
    return CostCurve(tuple(sizes), tuple(statistics.median(times[n]) for n in sizes), context, repeats)
