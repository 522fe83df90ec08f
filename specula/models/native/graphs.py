"""CUDA graphs for the native decoder: every pass of up to 64 rows runs as a fixed-shape pass,
captured once with `torch.cuda.CUDAGraph` and replayed with new inputs.

A GPU step of a small or mid-sized model is launch-bound (docs/algorithms.md section 7): a pass is
hundreds of small kernels, each launched from Python. A captured pass replays all of them with one
call. Captures need fixed shapes and fixed addresses, so a pass is brought to a few shapes:

- Rows. A pass of n rows runs as one of B = `row_bucket(n)` rows (1, 2, 4, 8, 16, 32, 64): rows
  n .. B - 1 are padding (token 0, position 0, written to the scratch slots after the real rows,
  seeing only their own slot); the caller gets the first n rows. More than 64 rows (a long
  prompt's prefill) run eagerly.
- Context. Attention runs over a window of S = `context_bucket(start + B)` slots (a power of two,
  at least 256, at most the cache's capacity) with the slots a row may not see masked out, so one
  graph serves every pass whose rows end inside the window.
- Inputs. One small buffer on the device, refilled by one host-to-device copy per pass: tokens
  [B], positions [B], `start` (the slot of row 0: rows are written at start .. start + B - 1),
  `prefix` (every row sees slots 0 .. prefix - 1: the committed tokens) and `local` [B, W] (row i
  sees slot prefix + j iff local[i, j]; W = B + PENDING_MAX, so a pass may see up to PENDING_MAX
  rows written between the prefix and its own rows: a pending tree it extends, or earlier drafts).
  The mask is rebuilt inside the graph from these.
- The KV cache. Each sequence's static cache (`cache.KVCache`, zeroed) is written by position
  inside the graph (index_copy at start + i), so its buffers are the graph's. Graphs therefore
  belong to a cache; caches are pooled per backend (`GraphRunner.take_cache` / `give_back`) so a
  new request reuses a finished one's cache and graphs. A cache that has to grow (a context past
  its capacity) drops its graphs; they are captured again on the new buffers.

The logits are not part of the graph: it returns the final-normed hidden states of its rows, and
the output head runs on the real rows only (`NativeDecoder.logits`, as on the eager path), which
keeps the graph's memory small (a [64, vocab] float32 output per graph would be 39 MB for
Qwen2.5) and the logits exactly the eager head's of those hidden states.

The same passes run uncaptured with `capture=False` (the CPU tests: bucketing, padding and masks
checked without a GPU). `compile_ops=True` fuses the element-wise ops (add + RMSNorm, RoPE, SiLU
product) with `torch.compile` inside the captured pass (`docs/gpu.md` has the measurements).

Attention inside a captured pass is two batched matrix products over the window
(`attend_matmul`), not SDPA: SDPA's fused kernels give a pass of a few rows one thread block per
KV head and query tile, 2-4 of the H100's 132 SMs (`attention="sdpa"` keeps them, for comparison).

Exactness: a row computes what an eager row computes with the same element-wise ops; the shapes
differ (B rows instead of n, S keys instead of start + n, masked) and attention is computed by
matrix products, which changes the reduction order and so the rounding. float32: tree and chain
logits equal the eager pass's to float32 rounding (tested), greedy output equals plain greedy
decoding (guarantee "float32" unchanged); bfloat16 / float16: a draw of the same model up to
rounding ("near-ties"). A replay equals the same fixed-shape pass run eagerly bit for bit (tested).

Shapes: B rows of a captured pass, S slots of its window, W columns of its local mask, H query
heads, G KV heads, D head dim, E hidden size.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from specula.models.native.cache import KVCache

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Rows of the captured passes; a pass of n rows runs in the smallest bucket >= n."""
CONTEXT_MIN = 256
"""Smallest attention window of a captured pass (windows double from here)."""
PENDING_MAX = 64
"""Most rows between the committed prefix and a pass's first row that the pass may see."""
INITIAL_CAPACITY = 4096
"""Slots a graph-path cache starts with (or the context window, if smaller); it doubles beyond."""


class GraphShapeError(ValueError):
    """A pass shape the captured path cannot run (more rows than the largest bucket)."""


def row_bucket(n: int, buckets: Sequence[int] = ROW_BUCKETS) -> int:
    """The rows a pass of n rows runs as: the smallest bucket >= n (a `GraphShapeError` beyond the
    largest bucket)."""
    if n < 1:
        raise GraphShapeError(f"a pass needs at least one row, got {n}")
    for b in buckets:
        if b >= n:
            return b
    raise GraphShapeError(f"a pass of {n} rows exceeds the largest CUDA-graph bucket ({max(buckets)} rows); "
                          "such passes run eagerly")


def padded_rows(n: int, buckets: Sequence[int] = ROW_BUCKETS) -> int:
    """Rows a pass of n rows really costs on the graph path: its bucket, or n beyond the buckets."""
    return row_bucket(n, buckets) if 1 <= n <= max(buckets) else n


def context_bucket(end: int, capacity: int) -> int:
    """The attention window for a pass whose rows end at slot `end` (exclusive): the smallest power
    of two >= end and >= CONTEXT_MIN, at most `capacity` (which must hold `end`)."""
    if end > capacity:
        raise GraphShapeError(f"slots up to {end} exceed the cache's capacity of {capacity}")
    window = CONTEXT_MIN
    while window < end:
        window *= 2
    return min(window, capacity)


@dataclass(frozen=True)
class PassShape:
    """How a pass of `rows` real rows runs on the graph path."""

    rows: int
    """n: real rows."""
    bucket: int
    """B: rows of the captured pass."""
    window: int
    """W: columns of its local mask (B + PENDING_MAX)."""


def plan_pass(n: int, start: int, prefix: int, max_context: int,
              buckets: Sequence[int] = ROW_BUCKETS) -> PassShape | None:
    """The shape a pass of n rows written from slot `start`, seeing slots < `prefix` and its local
    block, runs as; None when it must run eagerly (more rows than the largest bucket, more than
    PENDING_MAX rows between the prefix and the pass, or padding rows past the context window)."""
    if not 1 <= n <= max(buckets) or not 0 <= prefix <= start or start - prefix > PENDING_MAX:
        return None
    b = row_bucket(n, buckets)
    if start + b > max_context:
        return None
    return PassShape(n, b, b + PENDING_MAX)


class StaticInputs:
    """The inputs of one captured pass: a host staging buffer (pinned on CUDA) and its device copy,
    tokens [B], positions [B], start, prefix as int64 and local [B, W] as bool (see the module
    docstring); `fill` writes the host side, `upload` copies it over (one copy)."""

    def __init__(self, rows: int, window: int, device: torch.device) -> None:
        self.rows, self.window = rows, window
        n_int = 2 * rows + 2
        size = 8 * n_int + rows * window
        cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.uint8, pin_memory=cuda)
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        self.ints = self.buffer[: 8 * n_int].view(torch.int64)  # [2B + 2]
        self.local = self.buffer[8 * n_int:].view(rows, window).view(torch.bool)  # [B, W]
        self._ints = self.host[: 8 * n_int].view(torch.int64).numpy()
        self._local = self.host[8 * n_int:].view(rows, window).view(torch.bool).numpy()
        self._copied = torch.cuda.Event() if cuda else None

    def fill(self, tokens: Sequence[int], positions: Any, start: int, prefix: int, local: Any) -> None:
        """tokens [n], positions [n] (list, array or CPU tensor), local [n, w] bool (w <= W): the real
        rows; padding rows get token 0, position 0 and their own slot."""
        if self._copied is not None:
            self._copied.synchronize()  # the last upload has left the staging buffer
        b, w = self.rows, self.window
        n = len(tokens)
        local = np.asarray(local, dtype=bool)
        off = start - prefix
        if n > b or local.shape[0] != n or local.shape[1] > w or off + b > w:
            raise GraphShapeError(f"{n} rows with a local mask of {local.shape[1]} columns and {off} rows before "
                                  f"the pass do not fit a pass of {b} rows and {w} columns")
        ints = self._ints
        ints[:n] = tokens
        ints[n:b] = 0
        ints[b: b + n] = np.asarray(positions)
        ints[b + n: 2 * b] = 0
        ints[2 * b] = start
        ints[2 * b + 1] = prefix
        mask = self._local
        mask[:] = False
        mask[:n, : local.shape[1]] = local
        pad = np.arange(n, b)
        mask[pad, off + pad] = True

    def upload(self) -> None:
        self.buffer.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class PassOps:
    """The element-wise ops of a captured pass: the eager ones (`TorchOps`' math, so a row computes
    exactly what an eager row computes), or, with `compiled`, the same functions fused by
    `torch.compile` (add + RMSNorm into one kernel, the SiLU product, RoPE as real arithmetic on
    the pairs; dynamic shapes: one compilation serves every bucket)."""

    def __init__(self, compiled: bool = False) -> None:
        self.compiled = compiled
        if compiled:
            import torch._dynamo

            config = torch._dynamo.config  # a target and a draft of other widths and dtypes recompile
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, max(getattr(config, name), 64))
            self.add_norm = torch.compile(_add_norm, fullgraph=True, dynamic=True)
            self.rope_qkv = torch.compile(_rope_qkv_real, fullgraph=True, dynamic=True)
            self.silu_mul = torch.compile(_silu_mul, fullgraph=True, dynamic=True)
        else:
            self.add_norm, self.rope_qkv, self.silu_mul = _add_norm, _rope_qkv, _silu_mul

    def rotation(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """What `rope_qkv` takes after qkv: cos + i sin once per pass (eager), or cos, sin (compiled)."""
        return (cos, sin) if self.compiled else (torch.complex(cos, sin)[:, None],)


def _add_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta) * weight); as `TorchOps.add_norm`."""
    if delta is not None:
        x = x + delta
    return x, torch.rms_norm(x, (x.shape[-1],), weight, eps)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rope_qkv(qkv: torch.Tensor, rot: torch.Tensor, heads: int, kv_heads: int, d: int):
    """q [n, H, D], k, v [n, G, D] of qkv [n, (H + 2G) D], q and k rotated by rot = cos + i sin
    [n, 1, D / 2]: `TorchOps.rope_write`'s math."""
    n = qkv.shape[0]
    pairs = torch.view_as_complex(qkv[:, : (heads + kv_heads) * d].float().reshape(n, heads + kv_heads, d // 2, 2))
    qk = torch.view_as_real(pairs * rot).reshape(n, heads + kv_heads, d).to(qkv.dtype)
    return qk[:, :heads], qk[:, heads:], qkv[:, (heads + kv_heads) * d:].reshape(n, kv_heads, d)


def _rope_qkv_real(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, d: int):
    """`_rope_qkv` with the complex product written out (what inductor fuses into one kernel)."""
    n = qkv.shape[0]
    pairs = qkv[:, : (heads + kv_heads) * d].float().reshape(n, heads + kv_heads, d // 2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None], sin[:, None]
    qk = torch.stack([a * c - b * s, a * s + b * c], dim=-1).reshape(n, heads + kv_heads, d).to(qkv.dtype)
    return qk[:, :heads], qk[:, heads:], qkv[:, (heads + kv_heads) * d:].reshape(n, kv_heads, d)


def attend_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`ops._attend` with the mask given as the additive bias [per * n, S] it becomes inside SDPA
    (0 where a row may attend, -inf elsewhere), built once per pass instead of once per layer.
    q: [n, H, D]; keys, values: [G, S, D]; returns [n, H, D]."""
    n, h, d = q.shape
    g = keys.shape[0]
    per = h // g
    qg = q.reshape(n, g, per, d).permute(1, 2, 0, 3).reshape(1, g, per * n, d)  # [1, G, per * n, D]
    o = F.scaled_dot_product_attention(qg, keys[None], values[None], attn_mask=bias.to(q.dtype))  # [1, G, per * n, D]
    return o.reshape(g, per, n, d).permute(2, 0, 1, 3).reshape(n, h, d)


def attend_matmul(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                  out_dtype: bool = False) -> torch.Tensor:
    """Attention as two batched matrix products over the window (the graph path's default): the
    fused SDPA kernels run one thread block per KV head and query tile, so a pass of a few rows
    keeps 2-4 of the H100's 132 SMs busy (measured: 36 us a layer in float32 for one row over 256
    keys), where cuBLAS spreads the S keys over the whole chip. Scores and softmax in float32 (with
    `out_dtype`, bfloat16 / float16 products accumulate into float32 directly; else the operands are
    upcast), probabilities in the model's dtype for the product with the values, as SDPA does.
    q: [n, H, D]; keys, values: [G, S, D]; bias: float32 [per * n, S]; returns [n, H, D]."""
    n, h, d = q.shape
    g = keys.shape[0]
    per = h // g
    qg = q.reshape(n, g, per, d).permute(1, 2, 0, 3).reshape(g, per * n, d)  # [G, per * n, D]
    kt = keys.transpose(1, 2)  # [G, D, S]
    scale = d ** -0.5
    if q.dtype == torch.float32:
        scores = torch.baddbmm(bias, qg, kt, alpha=scale)  # [G, per * n, S]
    elif out_dtype:
        scores = torch.baddbmm(bias, qg, kt, alpha=scale, out_dtype=torch.float32)
    else:
        scores = torch.baddbmm(bias, qg.float(), kt.float(), alpha=scale)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    o = torch.bmm(probs, values)  # [G, per * n, D]
    return o.reshape(g, per, n, d).permute(2, 0, 1, 3).reshape(n, h, d)


def _probe_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether baddbmm takes out_dtype=float32 for `dtype` operands here (CUDA, recent PyTorch)."""
    if device.type != "cuda" or dtype == torch.float32:
        return False
    try:
        a = torch.randn(2, 3, 8, device=device, dtype=dtype)
        b = torch.randn(2, 8, 5, device=device, dtype=dtype)
        bias = torch.zeros(3, 5, device=device)
        got = torch.baddbmm(bias, a, b, alpha=0.5, out_dtype=torch.float32)
        want = torch.baddbmm(bias, a.float(), b.float(), alpha=0.5)
        return got.dtype == torch.float32 and bool(torch.allclose(got, want, atol=1e-2, rtol=1e-2))
    except (RuntimeError, TypeError):
        return False


def static_forward(decoder, cache: KVCache, inputs: StaticInputs, consts: dict, ops: PassOps) -> torch.Tensor:
    """One fixed-shape pass (what is captured): reads `inputs`, writes the rows' keys and values into
    `cache`, returns the final-normed hidden states [B, E]. The layer loop is `NativeDecoder.forward`
    without skipping or tracing."""
    cfg = decoder.cfg
    h, g, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    b, w = inputs.rows, inputs.window
    rows, cols = consts["rows"], consts["cols"]  # arange(B), arange(S)
    s = cols.shape[0]
    ints = inputs.ints
    tokens, positions, start, prefix = ints[:b], ints[b: 2 * b], ints[2 * b], ints[2 * b + 1]
    slots = rows + start  # [B]
    rel = cols - prefix  # [S]
    visible = (inputs.local.index_select(1, rel.clamp(0, w - 1)) & ((rel >= 0) & (rel < w))) | (rel < 0)  # [B, S]
    per = h // g
    bias = torch.zeros((per * b, s), dtype=torch.float32, device=cols.device)
    bias = bias.masked_fill(~visible.repeat(per, 1), float("-inf"))  # [per * B, S], row p * B + i: row i

    x = decoder.embed(tokens)  # [B, E]
    rotation = ops.rotation(*decoder.rope(positions))
    attend = consts["attend"]
    delta = None
    for index, layer in enumerate(decoder.layers):
        x, hn = ops.add_norm(x, delta, layer.input_norm, eps)
        q, k, v = ops.rope_qkv(layer.wqkv(hn), *rotation, h, g, d)
        cache.k[index].index_copy_(1, slots, k.transpose(0, 1))
        cache.v[index].index_copy_(1, slots, v.transpose(0, 1))
        out = attend(q, cache.k[index, :, :s], cache.v[index, :, :s], bias)
        delta = layer.wo(out.reshape(b, h * d))
        x, hn = ops.add_norm(x, delta, layer.post_norm, eps)
        delta = layer.w_down(ops.silu_mul(layer.w_gate_up(hn)))
    return ops.add_norm(x, delta, decoder.final_norm, eps)[1]


class CapturedPass:
    """One (rows, window) pass on one cache: its inputs, and its graph once captured."""

    def __init__(self, runner: "GraphRunner", cache: KVCache, bucket: int, window: int, context: int) -> None:
        device = runner.device
        self.inputs = StaticInputs(bucket, window, device)
        self.consts = {"rows": torch.arange(bucket, device=device), "cols": torch.arange(context, device=device),
                       "attend": runner.attend}
        self.cache_ref = weakref.ref(cache)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None  # [B, E]: the graph's output
        self.runner = runner

    def forward(self) -> torch.Tensor:
        return static_forward(self.runner.decoder, self.cache_ref(), self.inputs, self.consts, self.runner.ops)

    def capture(self) -> None:
        """Warm up (the inputs already hold a real pass: the warm-up writes that pass's own slots),
        then capture. The caller replays to compute."""
        runner = self.runner
        stream = torch.cuda.Stream(device=runner.device)
        stream.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(runner.warmup):
                self.forward()
        torch.cuda.current_stream(runner.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=runner.pool):
            self.hidden = self.forward()
        self.graph = graph

    def run(self) -> torch.Tensor:
        """Hidden states [B, E] of the pass the inputs hold."""
        if not self.runner.capture:
            with torch.inference_mode():
                return self.forward()
        if self.graph is None:
            self.capture()
            self.runner.stats["captures"] += 1
        self.graph.replay()
        self.runner.stats["replays"] += 1
        return self.hidden


class GraphRunner:
    """The graph path of one `NativeDecoder`: pass shapes, captured passes per cache, and the pool of
    caches they belong to (see the module docstring). `capture=False` runs the same fixed-shape
    passes eagerly (CPU tests)."""

    def __init__(self, decoder, *, buckets: Sequence[int] = ROW_BUCKETS, capture: bool = True,
                 compile_ops: bool = False, attention: str = "matmul", warmup: int = 2) -> None:
        self.decoder = decoder
        self.device = decoder.final_norm.device
        self.dtype = decoder.final_norm.dtype
        self.buckets = tuple(sorted(int(b) for b in buckets))
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.ops = PassOps(compile_ops)
        if attention == "matmul":
            out_dtype = _probe_out_dtype(self.device, self.dtype)
            self.attend = lambda q, k, v, bias: attend_matmul(q, k, v, bias, out_dtype)
        elif attention == "sdpa":
            self.attend = attend_sdpa
        else:
            raise ValueError(f"attention must be matmul or sdpa, not {attention!r}")
        self.attention = attention
        self.warmup = warmup
        self._free: list[KVCache] = []
        self.stats = {"captures": 0, "replays": 0, "passes": 0}

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def padded(self, n: int) -> int:
        """Rows a pass of n rows costs here (`padded_rows`)."""
        return padded_rows(n, self.buckets)

    def plan(self, n: int, start: int, prefix: int, max_context: int) -> PassShape | None:
        return plan_pass(n, start, prefix, max_context, self.buckets)

    # ------------------------------------------------------------------ caches
    def take_cache(self, layers: int, kv_heads: int, head_dim: int, max_context: int) -> KVCache:
        """A zeroed cache of this pool for a new sequence (a finished sequence's, graphs included)."""
        if self._free:
            return self._free.pop()
        cache = KVCache(layers, kv_heads, head_dim, dtype=self.dtype, device=self.device,
                        capacity=min(INITIAL_CAPACITY, max_context), max_capacity=max_context, zero=True)
        cache.owner = self
        return cache

    def give_back(self, cache: KVCache) -> None:
        """A finished sequence's cache returns to the pool (its stale slots are masked out by every pass)."""
        if cache.owner is self and all(c is not cache for c in self._free):
            self._free.append(cache)

    def release_all(self) -> None:
        """Drop the pooled caches and their graphs (memory back to PyTorch's allocator)."""
        self._free.clear()

    # ------------------------------------------------------------------ one pass
    def captured(self, cache: KVCache, bucket: int, context: int) -> CapturedPass:
        """The pass of `bucket` rows over `context` slots on `cache` (created on first use, captured
        on its first run); a `GraphShapeError` beyond the largest bucket."""
        if bucket > self.max_rows or bucket not in self.buckets:
            raise GraphShapeError(f"cannot capture a pass of {bucket} rows: the CUDA-graph buckets are "
                                  f"{', '.join(map(str, self.buckets))} rows (larger passes run eagerly)")
        key = (bucket, context)
        entry = cache.graphs.get(key)
        if entry is None:
            entry = cache.graphs[key] = CapturedPass(self, cache, bucket, bucket + PENDING_MAX, context)
        return entry

    def run(self, cache: KVCache, shape: PassShape, tokens: Sequence[int], positions: Any, start: int, prefix: int,
            local: Any) -> torch.Tensor:
        """Hidden states [n, E] (a copy) of n rows written from slot `start`: every row sees slots <
        `prefix`, row i slot prefix + j iff local[i, j] (see the module docstring)."""
        b = shape.bucket
        cache.reserve(start + b, start)  # padding rows write up to start + B - 1 (growth drops graphs)
        entry = self.captured(cache, b, context_bucket(start + b, cache.capacity))
        entry.inputs.fill(tokens, positions, start, prefix, local)
        entry.inputs.upload()
        self.stats["passes"] += 1
        return entry.run()[: shape.rows].clone()


def graph_unsupported(decoder) -> str | None:
    """Why a decoder cannot run on the graph path (None when it can): it needs the PyTorch ops
    without batch-invariant attention or quantized linears."""
    from specula.models.native.ops import TorchOps

    if not isinstance(decoder.ops, TorchOps):
        return f"its ops are {getattr(decoder.ops, 'name', type(decoder.ops).__name__)}, not PyTorch's"
    if decoder.invariant:
        return "batch-invariant attention computes each row alone (data-dependent shapes)"
    from specula.models.linears import quantization_of

    if quantization_of(decoder) != "none":
        return "quantized linears run on the CPU only"
    return None
