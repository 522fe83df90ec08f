"""EAGLE's draft head: autoregression at the feature level with one decoder layer.

After SafeAILab/EAGLE `eagle/model/cnets1.py` (class `Model`, EAGLE-1/2): the token embedding and
the target's feature are concatenated (embedding first) and projected by `fc` (2E -> E, bias); one
Llama decoder layer follows with its input RMSNorm removed (`if self.index != 0`) and its
post-attention norm kept; there is no final norm: the output is a predicted *final-normed* target
feature and the target's own output head turns it into logits. Pair i of a sequence is
(feature f_i, token x_{i+1}) at position i; its output predicts f_{i+1}, hence x_{i+2}.

The target's embedding and output head are shared, frozen, and not stored in the head file; the
head keeps the output rows of its draft vocabulary (`lm_rows`, [V_draft, E], from the target at
load time). One `forward` serves training (batch, causal or training-time-test masks) and drafting
(one sequence against its head KV cache, tree masks); there is no second implementation.
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

    def write(self, at: int, k: torch.Tensor, v: torch.Tensor) -> KV:
        """Store k, v [1, G, T, D] at rows at .. at + T - 1; returns views of rows 0 .. at + T - 1."""
        end, old = at + k.shape[2], self.capacity
        if end > old:
            extra = torch.zeros((*self.keys.shape[:2], max(end, 2 * old) - old, self.keys.shape[3]),
                                dtype=self.keys.dtype, device=self.keys.device)
            self.keys = torch.cat([self.keys, extra], 2)
            self.values = torch.cat([self.values, extra], 2)
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
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
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

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor, past: KV | None = None,
                mask: torch.Tensor | None = None, cache: KVBuffer | None = None, at: int = 0
                ) -> tuple[torch.Tensor, KV]:
        """emb, feat: [B, T, E]; positions: [B, T] long; past: the cached (keys, values) [B, G, P, D]
        the rows attend to (None: none); or, drafting, `cache` (B = 1): these rows are written at
        rows at .. at + T - 1 and attend rows 0 .. at + T - 1 of it (P = at); mask: bool
        [B or 1, T, P + T] (True = may attend; None = causal over the T rows with every cached slot
        visible). Returns the predicted features [B, T, E] and these rows' (keys, values)
        [B, G, T, D] (RoPE applied)."""
        cfg = self.cfg
        b, t, _ = emb.shape
        h, g, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = self.fc(torch.cat([emb, feat], dim=-1))  # [B, T, E]
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
        else:
            keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        if mask is None:
            p = keys.shape[2] - t
            mask = torch.ones((t, p + t), dtype=torch.bool, device=x.device).tril(p)[None]
        rep = h // g
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])  # [B, H, T, D]
        x = x + self.wo(att.transpose(1, 2).reshape(b, t, h * d))
        gate, up = self.w_gate_up(rms_norm(x, self.post_norm, cfg.rms_norm_eps)).chunk(2, dim=-1)
        x = x + self.w_down(F.silu(gate) * up)
        return x, (k, v)
