"""An eagle / eagle3 head's drafting pass in one call of specula's CPU kernels.

`EagleHead.forward` is the head (training, and drafting anywhere else); this is the same layer for
the one case that is hot: drafting on the CPU kernels (`TrainedHead._use_kernel`). One C call
(`kernels/head.c`, `specula_head_pass_seqs`) runs a level's rows from token ids to logits over the
draft vocabulary: the embedding lookups, eagle3's feature fusion, the copy hints' term, the layer
and the output layer; one sequence's rows, or (`KernelHeadPass.many`) a packed batch's sessions'
rows at once, each attending over its own cache, so the head's weights are read once a level for
the whole batch (session 120 measured one level of SmolLM2's head for 6 sessions at 0.90 ms in one
call against 2.45 ms as 6 calls). On the 2-core machine a small torch op right after a kernel call
waits for the core the kernel pool's helper still polls, so the glue between separate calls cost
more than the kernels: SmolLM2's head pass took 1.6-1.8 ms as a dozen ctypes calls with torch ops between them
(session 82's profile). A draft needs no exactness; tests hold this pass to the module's forward
within float tolerance.

Shapes: T rows, E hidden, H query heads, G KV heads, D head dim, I MLP width, P cached keys seen,
V draft vocabulary.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from specula.drafters.heads.eagle import EagleHead, KVBuffer
from specula.models.native.fused import LinearRef, assignments, linear_ref
from specula.models.native.kernels import KernelLinear, _ptr, library
from specula.models.native.ops import kernel_attention_fits

LAYERS = ("fc", "wqkv", "wo", "w_gate_up", "w_down")
"""The linears every eagle layer has."""

NORMS = ("embed_norm", "feature_norm", "post_norm", "final_norm", "copy_gain", "copy_len", "inv_freq")
"""The head's own float vectors `HeadRef` points at (eagle: only post_norm and inv_freq)."""


class HeadSeq(ctypes.Structure):
    """`head.c`'s `struct head_seq`: one sequence's rows of a pass (its caches, slots and mask)."""

    _fields_ = ([(name, ctypes.c_void_p) for name in ("mask", "k_cache", "v_cache")]
                + [(name, ctypes.c_int32) for name in ("cap", "at", "lo", "rows", "logits_from", "unused")])


@dataclass(frozen=True)
class HeadRows:
    """One sequence's rows of a head pass (`KernelHeadPass`)."""

    emb: torch.Tensor
    """[T, E] float embeddings, or [T] long token ids (looked up in the pass's `table`)."""
    feat: torch.Tensor
    """[T, E] features, or (`raw`) the target's [T, k E] (eagle3: its layer inputs, fused in the pass)."""
    positions: torch.Tensor
    """[T] long."""
    mask: torch.Tensor | None
    """[T, P + T] bool over cache rows lo .. at + T - 1 (P = at - lo), or None: causal."""
    cache: KVBuffer
    """The sequence's head cache: the rows are written at rows at .. at + T - 1."""
    at: int
    """The cache row of the first row."""
    lo: int
    """The first cache row the rows see."""
    hints: tuple[torch.Tensor, torch.Tensor] | None = None
    """(the hint tokens' embeddings [T, E] or ids [T], match lengths [T] long) of a head with copy hints."""
    logits_from: int = 0
    """Logits are computed for rows logits_from .. T - 1."""
    raw: bool = False
    """`feat` holds the target's raw features (eagle3's fusion runs in the pass)."""


@dataclass(frozen=True)
class HeadPass:
    """One sequence's rows waiting for a head's kernel pass (`drafters.lockstep.Pass`): a packed batch's
    sessions' passes of one head, alike in kind (raw features or not, hints or not), run as one call."""

    runner: "KernelHeadPass"
    rows: HeadRows

    @property
    def key(self) -> tuple:
        rows = self.rows
        return self.runner, rows.raw, rows.hints is None, rows.emb.dtype

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.runner.many([self.rows])[0]

    def run_many(self, passes: Sequence["HeadPass"]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        return self.runner.many([p.rows for p in passes])


class HeadRef(ctypes.Structure):
    """`head.c`'s `struct head_ref`: a head's weights."""

    _fields_ = ([(name, LinearRef) for name in ("fc", "qkv", "o", "gate_up", "down", "fuse", "copy_proj", "lm")]
                + [(name, ctypes.c_void_p) for name in NORMS + ("table",)]
                + [(name, ctypes.c_int32) for name in ("e", "heads", "kv_heads", "d", "inter", "table_rows")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(name, ctypes.c_int32) for name in ("max_hint", "unused")])


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


def _joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parts' rows as one tensor: the one part itself (a lone sequence's pass: no copy), else their
    concatenation."""
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))


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
        self._seen = (assignments(), self.lm, self.table)  # torch's assignments, `lm` and `table` at the last look

    def _held(self) -> list:
        """The modules and tensors `ref` points into (their identities tell a stale `ref`), read from the
        modules' own dicts: nn.Module's attribute fallback costs about a microsecond a lookup."""
        m = self.module
        linears = [*map(m._modules.get, LAYERS + ("fuse", "copy_proj")), self.lm]
        held = [b for lin in linears if lin is not None for b in map(lin._buffers.get, ("packed", "scale", "bias"))]
        tensors = (m._parameters, m._buffers)
        norms = [next((t[name] for t in tensors if name in t), m.__dict__.get(name)) for name in NORMS]
        return [*linears, *held, *norms, self.table]

    def _current(self) -> None:
        """Gather `ref` again where what it points into was replaced: looked up only where a module, parameter
        or buffer was assigned anywhere in the process since the last look (torch's registration hooks,
        `fused.assignments`), or `lm` or `table` were set anew. Walking the head's modules every pass took
        40-50 us of a SmolLM2 drafting pass (cold caches after the target's pass)."""
        seen = (assignments(), self.lm, self.table)
        if seen[0] == self._seen[0] and seen[1] is self._seen[1] and seen[2] is self._seen[2]:
            return
        if tuple(map(id, self._held())) != self.key:  # a module or buffer replaced since: read them again
            self.ref, self.key = self._gather()
        self._seen = seen

    def _gather(self) -> tuple[HeadRef, tuple[int, ...]]:
        m, cfg = self.module, self.module.cfg
        get = lambda name: getattr(m, name, None)  # noqa: E731
        ref = HeadRef(*(linear_ref(get(name)) for name in LAYERS + ("fuse", "copy_proj")), linear_ref(self.lm),
                      *(_ptr(get(name)) for name in NORMS), _ptr(self.table),
                      cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                      0 if self.table is None else len(self.table), float(cfg.rms_norm_eps), cfg.head_dim ** -0.5,
                      cfg.copy_ngram, 0)
        return ref, tuple(map(id, self._held()))

    def __call__(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 cache: KVBuffer, at: int, lo: int, hints: tuple[torch.Tensor, torch.Tensor] | None = None,
                 logits_from: int = 0, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One sequence's rows (`HeadRows`'s fields): (out [T, E]: the layer's output, fed back as the
        next level's feature; states [T, E]: what the output layer reads; logits [T - logits_from, V]
        of rows logits_from .. T - 1, or None without `lm`)."""
        return self.many([HeadRows(emb, feat, positions, mask, cache, at, lo, hints, logits_from, raw)])[0]

    @torch.inference_mode()
    def many(self, parts: Sequence[HeadRows]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Several sequences' rows in one kernel call (a packed batch's drafting level: the head's weights
        are read once for all of them), each written into and attending over its own cache: each part's
        (out, states, logits) as `__call__` gives it alone. The parts must agree on `raw` and on whether
        they carry hints, and give all token ids or all embedding rows."""
        self._current()
        cfg = self.module.cfg
        e, h = cfg.hidden_size, cfg.num_heads
        raws = {p.raw and self.eagle3 for p in parts}  # eagle's raw features are its features
        if len(raws) != 1 or len({p.hints is None for p in parts}) != 1 or len({p.emb.dtype for p in parts}) != 1:
            raise ValueError("KernelHeadPass.many: the parts must agree on raw features, hints and embedding kind")
        raw = raws.pop()
        width = self.module.fuse.in_features if raw else e
        for p in parts:
            if p.feat.shape[-1] != width:
                raise ValueError(f"KernelHeadPass: features of {tuple(p.feat.shape)} do not fit the head (raw={raw})")
        emb_ids, emb_rows = self._rows(_joined([p.emb for p in parts]))
        feat = _joined([p.feat.float() for p in parts]).contiguous()
        if parts[0].hints is not None:
            hint_ids, hint_rows = self._rows(_joined([p.hints[0] for p in parts]))
            hint_len = _joined([p.hints[1].to(torch.long) for p in parts]).contiguous()  # [T]
            if not cfg.copy_ngram:
                raise self._hint_error(hint_len)
        else:
            hint_ids = hint_rows = hint_len = None
        positions = _joined([p.positions.to(torch.long) for p in parts]).contiguous()
        sizes = [len(p.positions) for p in parts]  # T of each part
        masks = [None if p.mask is None else p.mask.contiguous() for p in parts]  # bool, one byte per slot
        seqs = (HeadSeq * len(parts))()
        for i, (p, mask, t) in enumerate(zip(parts, masks, sizes)):
            p.cache.reserve(p.at + t)
            seqs[i] = HeadSeq(_ptr(mask), p.cache.keys.data_ptr(), p.cache.values.data_ptr(),  # [1, G, cap, D]
                              p.cache.capacity, p.at, p.lo, t, p.logits_from, 0)
        n = len(positions)
        out, states = torch.empty((n, e)), torch.empty((n, e))
        wanted = [max(0, t - p.logits_from) for p, t in zip(parts, sizes)]
        logits = torch.empty((sum(wanted), self.lm.out_features)) if self.lm is not None else None
        scores = self._scores(max(t * h * (p.at - p.lo + t) for p, t in zip(parts, sizes)))
        status = self.lib.specula_head_pass_seqs(
            ctypes.byref(self.ref), _ptr(emb_ids), _ptr(emb_rows), feat.data_ptr() if raw else None,
            None if raw else feat.data_ptr(), _ptr(hint_ids), _ptr(hint_rows), _ptr(hint_len), positions.data_ptr(),
            len(parts), seqs, scores.data_ptr(), out.data_ptr(), states.data_ptr(), _ptr(logits), n,
            torch.get_num_threads())
        if status == -2:  # checked in the call, before anything is written (an aminmax a tensor cost more here)
            raise ValueError(f"KernelHeadPass: token ids outside the target's vocabulary of {len(self.table)}")
        if status == -3:
            raise self._hint_error(hint_len)
        if status != 0:
            raise MemoryError(f"the head's drafting pass could not allocate its work buffers or a layer's rows "
                              f"for {n} rows")
        if len(parts) == 1:  # one sequence's rows (a lone request's level): nothing to split
            return [(out, states, logits)]
        outs, stated = out.split(sizes), states.split(sizes)
        scored = logits.split(wanted) if logits is not None else [None] * len(parts)
        return list(zip(outs, stated, scored))

    def _rows(self, rows: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Token ids [T] (long) or embedding rows [T, E] -> (ids, None) or (None, rows) as the C call reads them."""
        if rows.dtype == torch.long:
            if self.table is None:
                raise ValueError("KernelHeadPass was given token ids but no embedding table")
            return rows.contiguous(), None  # each within the table: checked in the pass's call
        return None, rows.float().contiguous()

    def _hint_error(self, hint_len: torch.Tensor) -> ValueError:
        return ValueError(f"KernelHeadPass: copy hints of lengths 0..{self.module.cfg.copy_ngram} expected "
                          f"(the head's copy_ngram), got {hint_len.tolist()}")

    def _scores(self, size: int) -> torch.Tensor:
        """This thread's attention scratch of at least `size` floats."""
        buf = getattr(self._scratch, "scores", None)
        if buf is None or buf.numel() < size:
            buf = self._scratch.scores = torch.empty(max(size, 2 * (0 if buf is None else buf.numel())))
        return buf
