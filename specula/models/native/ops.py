"""The per-layer ops of the native decoder, in two implementations behind one interface.

`TorchOps` (any device, any dtype) composes PyTorch ops: fused RMSNorm, RoPE as a complex
multiplication, SDPA attention (or, in invariant mode, each row alone). `CpuKernelOps` (CPU,
float32) calls specula's C kernels (`kernels/ops.c`): one call per op and no per-op overhead
worth measuring; every row is computed alone by the same loops, so a tree row is bitwise a
one-token step. Tests hold the two against each other and against Hugging Face.

Shapes: T rows, H query heads, G KV heads, D head dim, E hidden, I MLP width.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from specula.models.native.cache import KVCache
from specula.models.native.kernels import library


class TorchOps:
    """PyTorch implementation (the reference; CUDA and bfloat16 run here)."""

    name = "torch"

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rms_norm(x + delta) * weight); x, delta: [T, E]."""
        if delta is not None:
            x = x + delta
        return x, torch.rms_norm(x, (x.shape[-1],), weight, eps)

    def rope_write(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                   start: int, heads: int, kv_heads: int, d: int) -> torch.Tensor:
        """Rotate the q and k heads of qkv [n, (H + 2G) D] (pair layout) by cos, sin [n, D / 2], write
        k and v at slots start.. of the layer's cache; return q [n, H, D]."""
        n = qkv.shape[0]
        pairs = torch.view_as_complex(qkv[:, : (heads + kv_heads) * d].float().reshape(n, heads + kv_heads, d // 2, 2))
        qk = torch.view_as_real(pairs * torch.complex(cos, sin)[:, None]).reshape(n, heads + kv_heads, d).to(qkv.dtype)
        cache.write(layer, start, qk[:, heads:], qkv[:, (heads + kv_heads) * d :].reshape(n, kv_heads, d))
        return qk[:, :heads]

    def attend(self, q: torch.Tensor, cache: KVCache, layer: int, start: int, mask: torch.Tensor | None,
               invariant: bool, prefill: bool) -> torch.Tensor:
        """q [n, H, D] of rows written at slots start..; the rows see the slots `mask` [n, start + n]
        allows (None: one row, every slot). Returns [n, H, D]."""
        n = q.shape[0]
        keys, values = cache.k[layer, :, : start + n], cache.v[layer, :, : start + n]  # [G, S, D]
        if invariant and not (prefill and n > 1):
            return _attend_rows(q, keys, values, mask, start)
        return _attend(q, keys, values, mask)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of [T, 2I] = gate | up -> [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Fused attention of one sequence's rows: the H / G query heads of a KV group and the rows are
    laid out as the rows of one attention per group (no repeated keys), so one-row decoding runs
    unmasked and trees with the mask repeated per head. q: [n, H, D]; keys, values: [G, S, D];
    mask: bool [n, S] or None (one row); returns [n, H, D]."""
    n, h, d = q.shape
    g = keys.shape[0]
    per = h // g
    qg = q.reshape(n, g, per, d).permute(1, 2, 0, 3).reshape(1, g, per * n, d)  # [1, G, per * n, D]
    attn_mask = None
    if mask is not None:
        attn_mask = mask[None].expand(per, n, mask.shape[-1]).reshape(per * n, mask.shape[-1])  # [per * n, S]
    elif n > 1:
        raise ValueError("several rows of one sequence need a mask (causal or tree)")
    o = F.scaled_dot_product_attention(qg, keys[None], values[None], attn_mask=attn_mask)  # [1, G, per * n, D]
    return o.reshape(g, per, n, d).permute(2, 0, 1, 3).reshape(n, h, d)


def _attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                 start: int) -> torch.Tensor:
    """Batch-invariant attention: each query row alone, over the contiguous block of the slots it
    may see, with the same ops a one-row decoding step runs for that many keys; so a tree row is
    bitwise a one-token step. q: [n, H, D]; keys, values: [G, S, D]; returns [n, H, D]."""
    n, h, d = q.shape
    g = keys.shape[0]
    out = q.new_empty((n, h, d))
    scale = d ** -0.5
    for row in range(n):
        if mask is None:
            index = torch.arange(start + row + 1, device=keys.device)  # causal
        else:
            index = mask[row].nonzero().flatten()
        k_row, v_row = keys.index_select(1, index), values.index_select(1, index)  # [G, l, D], contiguous
        qr = q[row].reshape(g, h // g, d)  # [G, H / G, D]
        scores = torch.matmul(qr, k_row.transpose(1, 2)) * scale  # [G, H / G, l]
        probs = torch.softmax(scores.float(), dim=-1).to(v_row.dtype)
        out[row] = torch.matmul(probs, v_row).reshape(h, d)
    return out


def kernel_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, start: int,
                     out: torch.Tensor | None = None, scores: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of n rows on specula's C kernel (`kernels/ops.c`, float32, CPU). q [n, H, D]
    (contiguous); keys, values [G, >= start + n, D] with unit stride along D and D between slots
    (the group stride is free: a cache's [G, capacity, D] or a view of its later slots); the rows
    see slots 0 .. start + n - 1 through mask [n, start + n] (bool) or, None, causally (row r sees
    slots 0 .. start + r). Writes and returns out [n, H, D]; `scores`: a float scratch of at least
    n * H * (start + n) (None: allocated)."""
    n, heads, d = q.shape
    slots = start + n
    out = torch.empty_like(q) if out is None else out
    if keys.stride()[1:] != (d, 1) or values.stride() != keys.stride():
        raise ValueError(f"kernel_attention: keys and values need strides (*, {d}, 1), got {tuple(keys.stride())} "
                         f"and {tuple(values.stride())}")
    if not (q.is_contiguous() and out.is_contiguous()) or {q.dtype, out.dtype, keys.dtype, values.dtype} != {
            torch.float32}:
        raise ValueError("kernel_attention: q and out must be contiguous and everything float32")
    if mask is not None and tuple(mask.shape) != (n, slots):
        raise ValueError(f"kernel_attention: mask must be [{n}, {slots}], got {tuple(mask.shape)}")
    scores = torch.empty(n * heads * slots, dtype=torch.float32) if scores is None else scores
    if scores.numel() < n * heads * slots:
        raise ValueError(f"kernel_attention: scores scratch of {scores.numel()} floats, {n * heads * slots} needed")
    mask = None if mask is None else mask.contiguous()  # bool, one byte per slot; bound for the call
    library().specula_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                None if mask is None else mask.data_ptr(), out.data_ptr(), scores.data_ptr(), n,
                                heads, keys.shape[0], d, keys.stride(0) // d, slots, start, d ** -0.5,
                                torch.get_num_threads())
    return out


def kernel_attention_fits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the attention kernel takes these shapes (head_dim a multiple of 8 up to 256, at most 64
    query heads per KV head); `models.native.configure` refuses a model outside them."""
    return head_dim % 8 == 0 and head_dim <= 256 and heads % kv_heads == 0 and heads // kv_heads <= 64


SCORES_SCRATCH = 1 << 23
"""Floats of attention scores one kernel call may fill (32 MiB): a long prompt's causal attention
runs in chunks of rows within it."""


def attention_chunk(heads: int, start: int, n: int, causal: bool) -> int:
    """Rows per attention call of n rows written at slots start..: a causal call's (a prompt's) in chunks whose
    scores fit `SCORES_SCRATCH`, at least 1; a masked one's all at once. The C loop cuts its rows the same way
    (`kernels/layers.c`, `fused.FusedLayers.run`)."""
    return max(1, SCORES_SCRATCH // (heads * (start + n))) if causal else n


class CpuKernelOps:
    """specula's C kernels (CPU, float32): row-invariant by construction (see `kernels/ops.c`)."""

    name = "cpu-kernels"

    def __init__(self) -> None:
        self.lib = library()
        self._scratch = threading.local()

    def add_norm(self, x, delta, weight, eps):
        x = x.contiguous()
        delta = None if delta is None else delta.contiguous()  # bound: a temporary would be freed before the call
        out = torch.empty_like(x)
        self.lib.specula_add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(),
                                      weight.data_ptr(), eps, out.data_ptr(), x.shape[0], x.shape[1],
                                      torch.get_num_threads())
        return x, out

    def rope_write(self, qkv, cos, sin, cache, layer, start, heads, kv_heads, d):
        n = qkv.shape[0]
        q = torch.empty((n, heads, d), dtype=torch.float32)
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        self.lib.specula_rope_write(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                                    cache.k[layer].data_ptr(), cache.v[layer].data_ptr(), n, heads, kv_heads, d,
                                    cache.capacity, start, torch.get_num_threads())
        return q

    def attend(self, q, cache, layer, start, mask, invariant, prefill):
        n, heads, d = q.shape
        out = torch.empty_like(q)
        if prefill:  # a prompt's rows see the slots up to their own: the kernel's causal rule, no mask read
            mask = None
        step = attention_chunk(heads, start, n, mask is None)  # a long prompt's rows in chunks
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            kernel_attention(q[r0:r1], cache.k[layer], cache.v[layer], mask, start + r0, out[r0:r1],
                             self._scores((r1 - r0) * heads * (start + r1)))
        return out

    def _scores(self, size: int) -> torch.Tensor:
        """This thread's attention scratch of at least `size` floats, kept between calls (a new buffer
        for a long context's scores at every layer is new pages for the OS to map and clear)."""
        buf = getattr(self._scratch, "scores", None)
        if buf is None or buf.numel() < size:
            buf = self._scratch.scores = torch.empty(size, dtype=torch.float32)
        return buf

    def silu_mul(self, gate_up):
        n, width = gate_up.shape
        gate_up = gate_up.contiguous()
        out = torch.empty((n, width // 2), dtype=torch.float32)
        self.lib.specula_silu_mul(gate_up.data_ptr(), out.data_ptr(), n, width // 2, torch.get_num_threads())
        return out
