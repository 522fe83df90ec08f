"""An eagle / eagle3 head's drafting pass in one call of specula's CPU kernels.

`EagleHead.forward` is the head (training, and drafting anywhere else); this is the same layer for
the one case that is hot: one sequence's rows drafting on the CPU kernels (`TrainedHead._use_kernel`).
One C call (`kernels/head.c`, `specula_head_pass`) runs a level's rows from token ids to logits over
the draft vocabulary: the embedding lookups, eagle3's feature fusion, the copy hints' term, the layer
and the output layer. On the 2-core machine a small torch op right after a kernel call waits for the
core the kernel pool's helper still polls, so the glue between separate calls cost more than the
kernels: SmolLM2's head pass took 1.6-1.8 ms as a dozen ctypes calls with torch ops between them
(session 82's profile). A draft needs no exactness; tests hold this pass to the module's forward
within float tolerance.

Shapes: T rows, E hidden, H query heads, G KV heads, D head dim, I MLP width, P cached keys seen,
V draft vocabulary.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from specula.drafters.heads.eagle import EagleHead, KVBuffer
from specula.models.native.fused import LinearRef, linear_ref
from specula.models.native.kernels import KernelLinear, _ptr, library
from specula.models.native.ops import kernel_attention_fits

LAYERS = ("fc", "wqkv", "wo", "w_gate_up", "w_down")
"""The linears every eagle layer has."""

NORMS = ("embed_norm", "feature_norm", "post_norm", "final_norm", "copy_gain", "copy_len", "inv_freq")
"""The head's own float vectors `HeadRef` points at (eagle: only post_norm and inv_freq)."""


class HeadRef(ctypes.Structure):
    """`head.c`'s `struct head_ref`: a head's weights."""

    _fields_ = ([(name, LinearRef) for name in ("fc", "qkv", "o", "gate_up", "down", "fuse", "copy_proj", "lm")]
                + [(name, ctypes.c_void_p) for name in NORMS + ("table",)]
                + [(name, ctypes.c_int32) for name in ("e", "heads", "kv_heads", "d", "inter", "unused")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)])


def _extra_linears(module: EagleHead) -> tuple[str, ...]:
    """The linears beside `LAYERS` that `module` has: eagle3's fuse, the copy hints' projection."""
    return (("fuse",) if module.cfg.feature_layers else ()) + (("copy_proj",) if module.cfg.copy_ngram else ())


def kernel_pass_fits(module: torch.nn.Module) -> bool:
    """Whether `module` can draft through `KernelHeadPass`: an eagle / eagle3 layer whose linear
    layers are kernels and whose attention shapes the attention kernel takes."""
    if not isinstance(module, EagleHead):
        return False
    cfg = module.cfg
    return (all(isinstance(getattr(module, name), KernelLinear) for name in LAYERS + _extra_linears(module))
            and all(t is None or t.dtype == torch.float32 for t in map(lambda n: getattr(module, n, None), NORMS))
            and kernel_attention_fits(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))


def embedding_table(target) -> torch.Tensor | None:
    """The target's input embeddings [V, E] as `KernelHeadPass` reads them (float32, contiguous, CPU),
    or None where its backend does not hand them out so (the rows are then looked up in torch)."""
    table = getattr(target, "input_embeddings", lambda: None)()
    ok = table is not None and table.dtype == torch.float32 and table.device.type == "cpu" and table.is_contiguous()
    return table if ok else None


class KernelHeadPass:
    """`EagleHead.forward` (plus the embedding, eagle3's fusion, the copy term and the output layer)
    for one sequence's drafting rows in one kernel call (see the module docstring)."""

    def __init__(self, module: EagleHead, lm: KernelLinear | None = None, table: torch.Tensor | None = None) -> None:
        """lm: the output layer over the draft vocabulary (None: no logits); table: the target's input
        embeddings [V_target, E] float32 (`embedding_table`; None: calls pass embedding rows)."""
        if not kernel_pass_fits(module):
            raise ValueError("KernelHeadPass needs an eagle head with kernel linears and attention shapes the "
                             "attention kernel takes (kernel_pass_fits)")
        self.module, self.lm, self.table = module, lm, table
        self.lib = library()
        cfg = module.cfg
        self.eagle3 = bool(cfg.feature_layers)
        self._scratch = threading.local()  # each thread's attention scores, grown on demand (a head serves many requests)
        self.ref, self.key = self._gather()

    def _held(self) -> list:
        """The modules and tensors `ref` points into (their identities tell a stale `ref`)."""
        m = self.module
        held = [m._modules.get(name) for name in LAYERS + ("fuse", "copy_proj")] + [self.lm]
        held += [lin._buffers.get(b) for lin in held if lin is not None for b in ("packed", "scale", "bias")]
        return held + [getattr(m, name, None) for name in NORMS] + [self.table]

    def _gather(self) -> tuple[HeadRef, tuple[int, ...]]:
        m, cfg = self.module, self.module.cfg
        get = lambda name: getattr(m, name, None)  # noqa: E731
        ref = HeadRef(*(linear_ref(get(name)) for name in LAYERS + ("fuse", "copy_proj")), linear_ref(self.lm),
                      *(_ptr(get(name)) for name in NORMS), _ptr(self.table),
                      cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, 0,
                      float(cfg.rms_norm_eps), cfg.head_dim ** -0.5)
        return ref, tuple(map(id, self._held()))

    @torch.inference_mode()
    def __call__(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 cache: KVBuffer, at: int, lo: int, hints: tuple[torch.Tensor, torch.Tensor] | None = None,
                 logits_from: int = 0, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """emb: [T, E] float embeddings, or [T] long token ids (looked up in `table`); feat: [T, E]
        features, or (`raw`) the target's [T, k E] (eagle3: its layer inputs, fused here); positions:
        [T] long; the rows are written at cache rows at .. at + T - 1 and see rows lo .. at + T - 1 through mask
        [T, P + T] (P = at - lo; None: causal); hints: (the hint tokens' embeddings [T, E] or ids [T],
        match lengths [T] long) of a head with copy hints, or None. Returns (out [T, E]: the layer's
        output, fed back as the next level's feature; states [T, E]: what the output layer reads;
        logits [T - logits_from, V] of rows logits_from .. T - 1, or None without `lm`)."""
        if tuple(map(id, self._held())) != self.key:  # a module or buffer replaced since: read them again
            self.ref, self.key = self._gather()
        cfg = self.module.cfg
        t, e = emb.shape[0], cfg.hidden_size
        h, g, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        emb_ids, emb_rows = self._rows(emb)
        feat = feat.float().contiguous()
        raw = raw and self.eagle3  # eagle's raw features are its features
        if feat.shape[-1] != (self.module.fuse.in_features if raw else e):
            raise ValueError(f"KernelHeadPass: features of {tuple(feat.shape)} do not fit the head (raw={raw})")
        if hints is not None:
            hint_ids, hint_rows = self._rows(hints[0])
            hint_len = hints[1].to(torch.long).contiguous()  # [T]
            if not cfg.copy_ngram or not 0 <= int(hint_len.min()) <= int(hint_len.max()) <= cfg.copy_ngram:
                raise ValueError(f"KernelHeadPass: copy hints of lengths 0..{cfg.copy_ngram} expected "
                                 f"(the head's copy_ngram), got {hint_len.tolist()}")
        else:
            hint_ids = hint_rows = hint_len = None
        positions = positions.to(torch.long).contiguous()
        mask = None if mask is None else mask.contiguous()  # bool, one byte per slot
        cache.reserve(at + t)
        keys, values = cache.keys[0], cache.values[0]  # [G, cap, D]
        out, states = torch.empty((t, e)), torch.empty((t, e))
        logits = torch.empty((t - logits_from, self.lm.out_features)) if self.lm is not None else None
        status = self.lib.specula_head_pass(
            ctypes.byref(self.ref), _ptr(emb_ids), _ptr(emb_rows), feat.data_ptr() if raw else None,
            None if raw else feat.data_ptr(), _ptr(hint_ids), _ptr(hint_rows), _ptr(hint_len), positions.data_ptr(),
            _ptr(mask), keys.data_ptr(), values.data_ptr(), cache.capacity, at, lo,
            self._scores(t * h * (at - lo + t)).data_ptr(), out.data_ptr(), states.data_ptr(),
            _ptr(logits), logits_from, t, torch.get_num_threads())
        if status != 0:
            raise MemoryError(f"the head's drafting pass could not allocate its work buffers or a layer's rows "
                              f"for {t} rows")
        return out, states, logits

    def _rows(self, rows: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Token ids [T] (long) or embedding rows [T, E] -> (ids, None) or (None, rows) as the C call reads them."""
        if rows.dtype == torch.long:
            if self.table is None:
                raise ValueError("KernelHeadPass was given token ids but no embedding table")
            if len(rows) and not 0 <= int(rows.min()) <= int(rows.max()) < len(self.table):
                raise ValueError(f"KernelHeadPass: token ids outside the target's vocabulary of {len(self.table)}")
            return rows.contiguous(), None
        return None, rows.float().contiguous()

    def _scores(self, size: int) -> torch.Tensor:
        """This thread's attention scratch of at least `size` floats."""
        buf = getattr(self._scratch, "scores", None)
        if buf is None or buf.numel() < size:
            buf = self._scratch.scores = torch.empty(max(size, 2 * (0 if buf is None else buf.numel())))
        return buf
