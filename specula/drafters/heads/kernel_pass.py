"""An eagle / eagle3 head's drafting pass as direct calls of specula's CPU kernels.

`EagleHead.forward` is the head (training, and drafting anywhere else); this is the same layer for
the one case that is hot: one sequence's rows drafting on the CPU kernels (`TrainedHead._use_kernel`).
It calls the kernels the module's layers hold (`KernelLinear.into`) and the C ops of the decoder
and of the drafting loop (`kernels/ops.c`, `kernels/draft.c`) one after another, with no torch op
between them that would spread over threads: on the 2-core machine a small torch op right after a
kernel call waits for the core the kernel pool's helper still polls, so the torch glue of a level
(norms, RoPE, concatenations, attention masks) cost more than its kernels (SmolLM2's head: 1.0 ms a
level in the engine against 0.5 ms here). A draft needs no exactness; tests hold this pass to the
module's forward within float tolerance.

Shapes: T rows, E hidden, H query heads, G KV heads, D head dim, I MLP width, P cached keys seen.
"""

from __future__ import annotations

import threading

import torch

from specula.drafters.heads.eagle import EagleHead, KVBuffer
from specula.models.native.kernels import KernelLinear, library
from specula.models.native.ops import kernel_attention, kernel_attention_fits

LAYERS = ("fc", "wqkv", "wo", "w_gate_up", "w_down")


def kernel_pass_fits(module: torch.nn.Module) -> bool:
    """Whether `module` can draft through `KernelHeadPass`: an eagle / eagle3 layer whose linear
    layers are kernels and whose attention shapes the attention kernel takes."""
    if not isinstance(module, EagleHead):
        return False
    cfg = module.cfg
    return (all(isinstance(getattr(module, name), KernelLinear) for name in LAYERS)
            and kernel_attention_fits(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))


class KernelHeadPass:
    """`EagleHead.forward` for one sequence's drafting rows on the CPU kernels (see the module
    docstring)."""

    def __init__(self, module: EagleHead) -> None:
        if not kernel_pass_fits(module):
            raise ValueError("KernelHeadPass needs an eagle head with kernel linears and attention shapes the "
                             "attention kernel takes (kernel_pass_fits)")
        self.module = module
        self.lib = library()
        cfg = module.cfg
        self.eps = float(cfg.rms_norm_eps)
        self.eagle3 = bool(cfg.feature_layers)
        self._scratch = threading.local()  # each thread's attention scores, grown on demand (a head serves many requests)

    @torch.inference_mode()
    def __call__(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 cache: KVBuffer, at: int, lo: int, copy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """emb, feat: [T, E] float32 (eagle3: feat already fused); positions: [T] long; the rows are
        written at cache rows at .. at + T - 1 and see rows lo .. at + T - 1 through mask [T, P + T]
        (P = at - lo; None: causal); copy: the rows' `EagleHead.copy_term` [T, E] or None. Returns (out [T, E]: the layer's output, fed back as the next
        level's feature; states [T, E]: what the output rows read, `EagleHead.output_states(out)`)."""
        m, cfg, lib = self.module, self.module.cfg, self.lib
        t, e = emb.shape
        h, g, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        emb, feat = emb.float().contiguous(), feat.float().contiguous()
        joined = torch.empty((t, 2 * e))  # [T, 2E]: [norm(emb) ; norm(feat)] (eagle: as they are)
        lib.specula_head_input(emb.data_ptr(), feat.data_ptr(), m.embed_norm.data_ptr() if self.eagle3 else None,
                               m.feature_norm.data_ptr() if self.eagle3 else None, self.eps, joined.data_ptr(), t, e)
        x = m.fc.into(joined, torch.empty((t, e)))  # [T, E]: the residual stream
        if copy is not None:
            x.add_(copy)
        qkv = m.wqkv.into(x, torch.empty((t, (h + 2 * g) * d)))  # [T, (H + 2G) D]
        angles = positions.float()[:, None] * m.inv_freq  # [T, D / 2]
        cos, sin = angles.cos(), angles.sin()
        cache.reserve(at + t)
        keys, values = cache.keys[0], cache.values[0]  # [G, cap, D]
        q = torch.empty((t, h, d))
        lib.specula_rope_write_half(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), keys.data_ptr(),
                                    values.data_ptr(), t, h, g, d, cache.capacity, at)
        seen = at - lo  # cached keys these rows may see (P)
        att = kernel_attention(q, keys[:, lo:], values[:, lo:], mask, seen, torch.empty((t, h, d)),
                               self._scores(t * h * (seen + t)))
        o = m.wo.into(att.view(t, h * d), torch.empty((t, e)))  # [T, E]
        normed = torch.empty((t, e))
        lib.specula_add_rms_norm(x.data_ptr(), o.data_ptr(), m.post_norm.data_ptr(), self.eps, normed.data_ptr(), t, e)
        gate_up = m.w_gate_up.into(normed, torch.empty((t, 2 * cfg.intermediate_size)))  # [T, 2I]
        act = torch.empty((t, cfg.intermediate_size))
        lib.specula_silu_mul(gate_up.data_ptr(), act.data_ptr(), t, cfg.intermediate_size)
        down = m.w_down.into(act, torch.empty((t, e)))  # [T, E]
        if self.eagle3:  # x += down, and the output states: RMS-normed (final_norm)
            lib.specula_add_rms_norm(x.data_ptr(), down.data_ptr(), m.final_norm.data_ptr(), self.eps,
                                     normed.data_ptr(), t, e)
            states = normed
        else:  # eagle: the output is the predicted final-normed feature itself
            states = x.add_(down)
        return x, states

    def _scores(self, size: int) -> torch.Tensor:
        """This thread's attention scratch of at least `size` floats."""
        buf = getattr(self._scratch, "scores", None)
        if buf is None or buf.numel() < size:
            buf = self._scratch.scores = torch.empty(max(size, 2 * (0 if buf is None else buf.numel())))
        return buf
