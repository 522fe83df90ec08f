"""EAGLE's draft head: autoregression at the feature level with one decoder layer.

After SafeAILab/EAGLE `eagle/model/cnets1.py` (class `Model`, EAGLE-1/2): the token embedding and
the target's feature are concatenated (embedding first) and projected by `fc` (2E -> E, bias); one
Llama decoder layer follows with its input RMSNorm removed (`if self.index != 0`) and its
post-attention norm kept; there is no final norm: the output is a predicted *final-normed* target
feature and the target's own output head turns it into logits. Pair i of a sequence is
(feature f_i, token x_{i+1}) at position i; its output predicts f_{i+1}, hence x_{i+2}.

EAGLE-3 (`eagle3`, after SafeAILab/EAGLE `eagle/traineagle3/cnets.py` and SpecForge's
`LlamaForCausalLMEagle3`): the feature is the target's inputs of three layers (low, middle,
high), concatenated and fused by `fuse` (3E -> E, no bias); embedding and feature are RMS-normed
before `fc` (its input_layernorm and hidden_norm); the layer's output is no longer a
predicted target feature (no feature regression): it is RMS-normed (`final_norm`) before the
output head, and fed back un-normed as the feature of the next draft level. Our choices against
the official head: the same `fc` over [embedding ; feature] instead of its input norms and
2E-wide attention input, and the target's own output rows of the draft vocabulary instead of a
trained output layer (a head file stays small: no [V_draft, E] matrix stored).

Copy hints (ours, `HeadConfig.copy_ngram`): a pair may also read the token prompt lookup would
propose after it (`heads.copy`: the continuation of the latest earlier match of its last 1 .. N
tokens, at any distance) and the match's length; `copy_term` adds them to the residual stream after
`fc` (weights that start at zero). The head's attention sees only its window of pairs, so a phrase
copied from further back was out of its reach; the hint hands it what to copy and it learns when.

The target's embedding and output head are shared, frozen, and not stored in the head file; the
head keeps the output rows of its draft vocabulary (`lm_rows`, [V_draft, E], from the target at
load time). One `forward` serves training (batch, causal or training-time-test masks) and drafting
(one sequence against its head KV cache, tree masks); a head drafting on specula's CPU kernels
runs a level's rows, token ids to logits, in one kernel call instead (`kernel_pass.KernelHeadPass`,
held to this forward by the tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specula.drafters.heads.config import HeadConfig

KV = tuple[torch.Tensor, torch.Tensor]
"""(keys, values), each [B, G, T, D]."""


class KVBuffer:
    """One sequence's head KV cache, written in place by position: rows [0, n) are what later rows
    attend to; a write past the end grows the buffer (doubling, one copy), never a per-pass concat."""

    def __init__(self, groups: int, head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 capacity: int = 256) -> None:
        self.keys = torch.zeros((1, groups, capacity, head_dim), dtype=dtype, device=device)  # [1, G, cap, D]
        self.values = torch.zeros_like(self.keys)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reserve(self, end: int) -> None:
        """Make room for rows 0 .. end - 1 (growing by doubling, the rows kept)."""
        old = self.capacity
        if end > old:
            extra = torch.zeros((*self.keys.shape[:2], max(end, 2 * old) - old, self.keys.shape[3]),
                                dtype=self.keys.dtype, device=self.keys.device)
            self.keys = torch.cat([self.keys, extra], 2)
            self.values = torch.cat([self.values, extra], 2)

    def write(self, at: int, k: torch.Tensor, v: torch.Tensor) -> KV:
        """Store k, v [1, G, T, D] at rows at .. at + T - 1; returns views of rows 0 .. at + T - 1."""
        end = at + k.shape[2]
        self.reserve(end)
        self.keys[:, :, at:end] = k
        self.values[:, :, at:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., E] -> [..., E] (float32 statistics, as Llama)."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class EagleHead(nn.Module):
    """fc + one decoder layer (see the module docstring)."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        e, d, h, g = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.cfg = cfg
        self.fc = nn.Linear(2 * e, e, bias=True)
        self.wqkv = nn.Linear(e, (h + 2 * g) * d, bias=True)
        self.wo = nn.Linear(h * d, e, bias=False)
        self.post_norm = nn.Parameter(torch.ones(e))
        self.w_gate_up = nn.Linear(e, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, e, bias=False)
        if cfg.feature_layers:  # eagle3
            self.fuse = nn.Linear(len(cfg.feature_layers) * e, e, bias=False)
            self.embed_norm = nn.Parameter(torch.ones(e))  # EAGLE-3's input_layernorm
            self.feature_norm = nn.Parameter(torch.ones(e))  # EAGLE-3's hidden_norm
            self.final_norm = nn.Parameter(torch.ones(e))
        if cfg.copy_ngram:  # the copy hint (`heads.copy`): zero at first, so a head given one drafts as before
            self.copy_proj = nn.Linear(e, e, bias=False)
            self.copy_len = nn.Parameter(torch.zeros(cfg.copy_ngram + 1, e))
            self.copy_gain = nn.Parameter(torch.zeros(cfg.copy_ngram + 1, e))  # per match length, on the hint itself
            self.reset_copy()
        # made on the CPU also where the module is built on the meta device (`load_head`): no file holds it
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d))
        self.register_buffer("inv_freq", inv, persistent=False)  # [D / 2]

    def reset_parameters(self, generator: torch.Generator) -> None:
        """Small normal weights (std 0.02); fc starts as the feature's identity (the first guess of
        the next feature is this one), a choice of ours that shortens CPU training."""
        with torch.no_grad():
            for lin in (self.fc, self.wqkv, self.wo, self.w_gate_up, self.w_down):
                lin.weight.normal_(0.0, 0.02, generator=generator)
                if lin.bias is not None:
                    lin.bias.zero_()
            e = self.cfg.hidden_size
            self.fc.weight[:, e:] += torch.eye(e)
            self.post_norm.fill_(1.0)
            if self.cfg.feature_layers:
                k = len(self.cfg.feature_layers)  # fuse starts as the mean of the layers' inputs
                self.fuse.weight.copy_(torch.eye(e).repeat(1, k) / k)
                self.fuse.weight.add_(torch.randn(self.fuse.weight.shape, generator=generator) * 0.02)
                for norm in (self.embed_norm, self.feature_norm, self.final_norm):
                    norm.fill_(1.0)
        if self.cfg.copy_ngram:
            self.reset_copy()

    def reset_copy(self) -> None:
        """The copy hint's weights at zero: the head computes what it did without them."""
        with torch.no_grad():
            self.copy_proj.weight.zero_()
            self.copy_len.zero_()
            self.copy_gain.zero_()

    def copy_term(self, hint_emb: torch.Tensor, hint_len: torch.Tensor) -> torch.Tensor:
        """What the copy hints add to the residual stream after `fc`: hint_emb [..., E] (the target's
        embeddings of the hint tokens), hint_len [...] long (0: no hint) -> [..., E]. Three terms:
        a projection of the hint's embedding, the embedding itself times a gain per match length
        (`copy_gain`: where the output rows are the embeddings, as in tied models, this carries the
        hint to its own logit directly, a few weights to learn instead of a matrix), and a bias per
        match length (`copy_len`)."""
        if self.cfg.feature_layers:
            hint_emb = rms_norm(hint_emb, self.embed_norm, self.cfg.rms_norm_eps)
        hint_emb = hint_emb * (hint_len > 0).to(hint_emb.dtype)[..., None]
        return (self.copy_proj(hint_emb) + self.copy_gain[hint_len].to(hint_emb.dtype) * hint_emb
                + self.copy_len[hint_len].to(hint_emb.dtype))

    def fuse_features(self, inputs: torch.Tensor) -> torch.Tensor:
        """eagle3: the target's layer inputs [..., k E] -> the feature [..., E] (identity for eagle,
        whose feature is the target's final-normed state itself)."""
        return self.fuse(inputs) if self.cfg.feature_layers else inputs

    def output_states(self, out: torch.Tensor) -> torch.Tensor:
        """The head's output [..., E] -> the state the output head reads: RMS-normed for eagle3, as
        is for eagle (its output already predicts a final-normed feature)."""
        return rms_norm(out, self.final_norm, self.cfg.rms_norm_eps) if self.cfg.feature_layers else out

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor, past: KV | None = None,
                mask: torch.Tensor | None = None, cache: KVBuffer | None = None, at: int = 0, lo: int = 0,
                copy: torch.Tensor | None = None) -> tuple[torch.Tensor, KV]:
        """emb, feat: [B, T, E]; positions: [B, T] long; past: the cached (keys, values) [B, G, P, D]
        the rows attend to (None: none); or, drafting, `cache` (B = 1): these rows are written at
        rows at .. at + T - 1 and attend rows lo .. at + T - 1 of it (P = at - lo: a sliding
        window leaves the rows below `lo` out); mask: bool [B or 1, T, P + T] (True = may attend;
        None = causal over the T rows with every cached slot visible); copy: the rows' `copy_term` [B, T, E]
        (a head with `copy_ngram`; None: none). Returns the predicted features [B, T, E] and these
        rows' (keys, values) [B, G, T, D] (RoPE applied)."""
        cfg = self.cfg
        b, t, _ = emb.shape
        h, g, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if cfg.feature_layers:  # eagle3: both inputs normed (fused target features and the head's own outputs)
            emb = rms_norm(emb, self.embed_norm, cfg.rms_norm_eps)
            feat = rms_norm(feat, self.feature_norm, cfg.rms_norm_eps)
        x = self.fc(torch.cat([emb, feat], dim=-1))  # [B, T, E]
        if copy is not None:
            x = x + copy
        qkv = self.wqkv(x)  # [B, T, (H + 2G) D]
        q, k, v = qkv.split([h * d, g * d, g * d], dim=-1)
        q = q.view(b, t, h, d).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, g, d).transpose(1, 2)  # [B, G, T, D]
        v = v.view(b, t, g, d).transpose(1, 2)
        angles = positions[..., None].float() * self.inv_freq  # [B, T, D / 2]
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None].to(q.dtype)  # [B, 1, T, D]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None].to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            keys, values = cache.write(at, k, v)
            keys, values = keys[:, :, lo:], values[:, :, lo:]
        else:
            keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        p = keys.shape[2] - t
        if mask is None:
            mask = torch.ones((t, p + t), dtype=torch.bool, device=x.device).tril(p)[None]
        rep = h // g
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])  # [B, H, T, D]
        x = x + self.wo(att.transpose(1, 2).reshape(b, t, h * d))
        gate, up = self.w_gate_up(rms_norm(x, self.post_norm, cfg.rms_norm_eps)).chunk(2, dim=-1)
        x = x + self.w_down(F.silu(gate) * up)
        return x, (k, v)
