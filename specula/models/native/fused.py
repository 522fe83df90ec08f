"""The native decoder's layers in one C call (`kernels/layers.c`) for the few rows of a decoding step
or a verified tree, on specula's CPU kernels.

`NativeDecoder._forward` runs its layers from Python, one kernel call per op; on the 2-core machine
the glue between the calls (ctypes, tensor allocation, module calls) cost 0.3-0.45 ms a layer:
8-14 ms of a 33-45 ms one-token step of SmolLM2-135M or of the int8 Qwen2.5-Coder-0.5B draft. The C
loop makes the same kernel calls with the same operands in the same order, so its outputs are the
Python path's bit for bit (tests hold them together). It takes the passes it can: every linear a
`KernelLinear`, the ops `CpuKernelOps`, float32, at most MAX_ROWS rows, no trace (a long prompt's causal
attention in chunks of rows, cut as the Python loop cuts them: `ops.CpuKernelOps.attend`). Several
sequences' rows in one pass (a batched serving step) and skipped sub-layers (layer-skip self-drafts)
run here too.
"""

from __future__ import annotations

import ctypes

import torch

from specula.models.native.kernels import KernelLinear, _ptr, library
from specula.models.native import ops
from specula.models.native.ops import CpuKernelOps

KIND_CODES = {"f32": 0, "w8": 1, "i8": 2, "i4": 3, "c8": 4}
"""`KernelLinear.kind` -> the one-call passes' code (`refs.h`, `struct linear_ref`)."""

MAX_ROWS = 2048
"""Most rows a pass runs through the C loop: decoding steps, verified trees and a prompt's passes (SmolLM2's are of
up to 1,706 tokens: `backend.prefill_pass_of`). Its work buffers hold n x (2E + (H + 2G) D + 2 H D + 3 I) floats
(SmolLM2-135M 31 KB a row, Qwen2.5-Coder-1.5B 140 KB). Once 64: the Python loop's glue was thought spread thin over
a prompt's many rows, but that loop ran SmolLM2's 256-token prompt at 1.88 ms a token against 1.23 here, and the
int4 0.5B draft's at 1.67 against 1.47 (the 1.5B's within noise), best of 3 (session 132)."""


class LinearRef(ctypes.Structure):
    """`refs.h`'s `struct linear_ref`: one `KernelLinear`'s buffers and shape (a NULL `packed`: no
    layer)."""

    _fields_ = [("packed", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("kind", ctypes.c_int32), ("in_features", ctypes.c_int32), ("out_features", ctypes.c_int32),
                ("group", ctypes.c_int32)]


class SegmentRef(ctypes.Structure):
    """`layers.c`'s `struct segment_ref`: one sequence's rows, its caches and mask."""

    _fields_ = [("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("mask", ctypes.c_void_p),
                ("cap", ctypes.c_int32), ("start", ctypes.c_int32), ("row0", ctypes.c_int32),
                ("rows", ctypes.c_int32)]


class LayerRef(ctypes.Structure):
    """`layers.c`'s `struct layer_ref`: one decoder layer's norms and linears."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", LinearRef),
                ("o", LinearRef), ("gate_up", LinearRef), ("down", LinearRef)]


def linear_ref(lin: KernelLinear | None) -> LinearRef:
    """`lin`'s `LinearRef` (None: an absent layer, all zeros)."""
    if lin is None:
        return LinearRef()
    return LinearRef(lin.packed.data_ptr(), _ptr(lin.scale), _ptr(lin.bias), KIND_CODES[lin.kind], lin.in_features,
                     lin.out_features, lin.group if lin.kind == "c8" else 0)


LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")
"""A layer's linears, in `LayerRef`'s order."""


_registrations = [0]
"""How many modules, parameters and buffers have been assigned in this process (torch's global registration
hooks, below): a `FusedLayers` whose count is unchanged since it last looked holds current pointers without
gathering its decoder's hundreds of tensors again (`current`: 0.23 ms of a SmolLM2 step on the Zen 4, timed
inside plain decoding)."""


def assignments() -> int:
    """Modules, parameters and buffers assigned in this process so far (`_registrations`): what pointers gathered
    from modules are checked against (`FusedLayers.current`, the trained heads' `KernelHeadPass`)."""
    return _registrations[0]


def _count_registration(module, name, value) -> None:
    _registrations[0] += 1  # returns None: the assigned value is kept as it is


for _register in (torch.nn.modules.module.register_module_module_registration_hook,
                  torch.nn.modules.module.register_module_parameter_registration_hook,
                  torch.nn.modules.module.register_module_buffer_registration_hook):
    _register(_count_registration)  # setattr of a module, parameter or buffer, `load_state_dict(assign=True)`


def _held(decoder) -> list:
    """Every norm, linear and buffer the C loop reads from the decoder's layers, read from the modules'
    own dicts (nn.Module's attribute fallback costs about a microsecond a lookup; `current` makes
    hundreds a pass). A norm is a registered parameter and a `KernelLinear`'s tensors are registered
    buffers; a module of another kind reads as None there, so the key changes and `of` looks again."""
    out = []
    for layer in decoder.layers:
        norms = layer._parameters
        out += (norms.get("input_norm"), norms.get("post_norm"))
        for lin in map(layer._modules.get, LINEARS):
            b = lin._buffers
            out += (lin, b.get("packed"), b.get("scale"), b.get("bias"))
    return out


class FusedLayers:
    """The C loop over one decoder's layers: the weights' pointers, gathered once (`of`)."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder
        refs = [LayerRef(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(),
                         *(linear_ref(getattr(layer, name)) for name in LINEARS)) for layer in decoder.layers]
        self.refs = (LayerRef * len(refs))(*refs)
        self.held = _held(decoder)
        """The modules and tensors `refs` points into, held so their addresses stay theirs (`current`)."""
        self.key = tuple(map(id, self.held))
        self.registrations = _registrations[0]  # torch's assignments when `key` was last found current

    @staticmethod
    def of(decoder) -> "FusedLayers | None":
        """The decoder's C loop, or None where its layers cannot run there (another linear or ops
        implementation); kept on the decoder, rebuilt when a layer's modules or buffers change."""
        if not isinstance(decoder.ops, CpuKernelOps):
            return None
        fused = decoder.__dict__.get("_fused_layers")
        if fused is not None and fused.current():
            return fused
        for layer in decoder.layers:
            for lin in (getattr(layer, name) for name in LINEARS):
                if not isinstance(lin, KernelLinear) or lin.kind not in KIND_CODES:
                    return None
            if layer.input_norm.dtype != torch.float32 or layer.post_norm.dtype != torch.float32:
                return None
        fused = FusedLayers(decoder)
        decoder.__dict__["_fused_layers"] = fused
        return fused

    def current(self) -> bool:
        """Whether the decoder still holds the modules and buffers the pointers were read from (a
        replaced layer, or buffers assigned anew by `load_state_dict(assign=True)`, gather them again): looked
        up only where a module, parameter or buffer was assigned anywhere since the last look."""
        count = _registrations[0]
        if count == self.registrations:
            return True
        if tuple(map(id, _held(self.decoder))) != self.key:
            return False
        self.registrations = count
        return True

    @staticmethod
    def takes(segments, n: int) -> bool:
        """Whether a pass of n rows over `segments` (`model.Segment`) runs here: at most MAX_ROWS rows,
        each segment a slice of them."""
        if not 0 < n <= MAX_ROWS:
            return False
        for seg in segments:
            rows = seg.rows
            if not isinstance(rows, slice) or rows.step not in (None, 1) or not 0 <= (rows.start or 0) <= rows.stop <= n:
                return False
        return True

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments, taps: tuple[int, ...],
            skip: frozenset = frozenset()):
        """x [n, E] float32 embeddings (used as the residual stream), cos, sin [n, D / 2], `segments` the
        sequences' rows; returns the final-normed states [n, E], or with `taps` (states, features
        [n, len(taps) E]) as `NativeDecoder._forward`; `skip`: its (layer, "attn" | "mlp") sub-layers
        left out."""
        dec, cfg = self.decoder, self.decoder.cfg
        n, e = x.shape
        h, g, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        out = torch.empty_like(x)  # [n, E]
        tapped = torch.empty((n, len(taps) * e), dtype=torch.float32) if taps else None  # [n, k E]
        tap_ids = (ctypes.c_int32 * len(taps))(*taps) if taps else None
        masks, refs, most = [], [], 0
        for seg in segments:
            row0 = seg.rows.start or 0
            k = seg.rows.stop - row0
            mask = None if seg.prefill or seg.mask is None else seg.mask.contiguous()  # [k, start + k] bool
            masks.append(mask)  # bound for the call
            refs.append(SegmentRef(seg.cache.k.data_ptr(), seg.cache.v.data_ptr(), _ptr(mask), seg.cache.capacity,
                                   seg.start, row0, k))
            most = max(most, min(k, ops.attention_chunk(h, seg.start, k, mask is None)) * h * (seg.start + k))
        scores = dec.ops._scores(most)
        skipped = None
        if skip:
            kinds = ("attn", "mlp")
            skipped = (ctypes.c_uint8 * (2 * len(self.refs)))(
                *(int((i, k) in skip) for i in range(len(self.refs)) for k in kinds))
        status = library().specula_decoder_pass(
            x.data_ptr(), out.data_ptr(), n, e, len(self.refs), self.refs, dec.final_norm.data_ptr(),
            cfg.rms_norm_eps, cos.data_ptr(), sin.data_ptr(), (SegmentRef * len(refs))(*refs), len(refs), h, g, d,
            cfg.intermediate_size, d ** -0.5, scores.data_ptr(), ops.SCORES_SCRATCH, tap_ids, len(taps), _ptr(tapped),
            skipped, torch.get_num_threads())
        if status != 0:
            raise MemoryError(f"the native decoder's C loop could not allocate its work buffers or a layer's "
                              f"rows for {n} rows")
        return out if not taps else (out, tapped)
