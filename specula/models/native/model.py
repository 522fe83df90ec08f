"""A small Llama / Qwen2 / Mistral decoder in the style of gpt-fast's `model.py`.

One config dataclass, fused projections (q|k|v and gate|up: one linear each), RoPE exactly as
Hugging Face computes it (inverse frequencies from transformers' own rope initialisers, the
rotate-half layout), RMSNorm in float32, tied or separate output head. The forward pass runs a
flat list of token rows that may belong to several sequences (`Segment`s): every linear layer
sees all rows at once, attention runs per segment against that segment's static KV cache
(`cache.KVCache`), written by position. A segment's rows see the cached prefix and whatever its
boolean mask allows among its own rows (causal for a prefill, ancestors for a tree).

Sub-layers can be skipped per call (`skip`: (layer, "attn" | "mlp") pairs) for self-drafting
(SWIFT): a skipped attention sub-layer neither reads nor writes the cache of that layer.

Shapes: T rows in a pass, H query heads, G KV heads, D head dim, E hidden size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specula.errors import ConfigError
from specula.models.native.cache import KVCache

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
"""Hugging Face architectures this model reproduces (others stay on the Hugging Face backend)."""


@dataclass(frozen=True)
class NativeConfig:
    """The decoder's shape, read from a Hugging Face config (`from_hf`)."""

    vocab_size: int
    """Rows of the output head (logit width)."""
    hidden_size: int
    """E: width of the residual stream."""
    intermediate_size: int
    """Width of the MLP."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """H: query heads."""
    num_kv_heads: int
    """G: key/value heads (grouped-query attention when G < H)."""
    head_dim: int
    """D: width of one head."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    qkv_bias: bool
    """Biases on the q, k, v projections (Qwen2: yes; Llama: `attention_bias`)."""
    o_bias: bool
    """Bias on the output projection of attention."""
    mlp_bias: bool
    """Biases on the MLP projections."""
    tie_embeddings: bool
    """The output head shares the input embedding."""
    max_position: int
    """Context window (max_position_embeddings)."""
    architecture: str
    """The Hugging Face class this mirrors."""

    @classmethod
    def from_hf(cls, config, architecture: str | None = None) -> "NativeConfig":
        """From a Hugging Face config; `architecture` (the model class name) defaults to the config's
        `architectures`. A `ConfigError` naming `--backend hf` for what this decoder cannot run."""
        arch = architecture or (getattr(config, "architectures", None) or [""])[0]
        if arch not in ARCHITECTURES:
            raise ConfigError(f"the native backend runs {', '.join(ARCHITECTURES)}, not {arch or 'this model'}; "
                              "use --backend hf")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise ConfigError("the native backend has no sliding-window attention; use --backend hf")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"the native backend runs SiLU MLPs, not {act}; use --backend hf")
        heads = config.num_attention_heads
        qwen = arch == "Qwen2ForCausalLM"
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=qwen or bool(getattr(config, "attention_bias", False)),
            o_bias=(not qwen) and bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position=config.max_position_embeddings,
            architecture=arch,
        )


def rope_inverse_frequencies(hf_config) -> tuple[torch.Tensor, float]:
    """(inv_freq [D / 2], attention scaling) exactly as transformers computes them for this config
    (default RoPE, or any `rope_type` transformers knows: llama3, yarn, ...)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    if rope_type == "dynamic":
        raise ConfigError("dynamic RoPE scaling changes with the sequence length; use --backend hf")
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config)


@dataclass
class Segment:
    """The rows of one sequence in a pass."""

    cache: KVCache
    """That sequence's KV cache; the rows' keys and values are written at slots start.. ."""
    start: int
    """Tokens already in the cache (the rows' first slot)."""
    rows: slice
    """Which rows of the pass belong to this sequence."""
    mask: torch.Tensor | None
    """Bool [n, start + n]: True where row i may attend to slot j; None = every slot up to
    start + n (one row)."""
    prefill: bool = False
    """A causal prefill of several rows: it runs the same for plain and speculative decoding, so it
    needs no batch invariance (fast attention even in invariant mode)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face computes it: in float32, then back to x's dtype, times weight."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half layout. x: [T, heads, D]; cos, sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Layer(nn.Module):
    """One decoder layer: pre-norm attention and pre-norm SiLU MLP, both residual."""

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        e, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_norm = nn.Parameter(torch.ones(e))
        self.post_norm = nn.Parameter(torch.ones(e))
        self.wqkv = nn.Linear(e, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * d, e, bias=cfg.o_bias)
        self.w_gate_up = nn.Linear(e, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.w_down = nn.Linear(cfg.intermediate_size, e, bias=cfg.mlp_bias)

    def attention(self, x: torch.Tensor, index: int, cos: torch.Tensor, sin: torch.Tensor,
                  segments: Sequence[Segment], invariant: bool) -> torch.Tensor:
        """x: [T, E] normed input; returns the attention output [T, E] (before the residual)."""
        cfg = self.cfg
        t, h, g, d = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.wqkv(x)  # [T, (H + 2G) D]
        q = qkv[:, : h * d].view(t, h, d)
        k = qkv[:, h * d : (h + g) * d].view(t, g, d)
        v = qkv[:, (h + g) * d :].view(t, g, d)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = q.new_empty((t, h, d))  # [T, H, D]
        for seg in segments:
            n = seg.rows.stop - seg.rows.start
            keys, values = seg.cache.write(index, seg.start, k[seg.rows], v[seg.rows])  # [G, start + n, D]
            if invariant and not (seg.prefill and n > 1):
                out[seg.rows] = _attend_rows(q[seg.rows], keys, values, seg.mask, seg.start)
            else:
                mask = None if seg.mask is None else seg.mask[None]  # [1, n, S]
                if seg.mask is None and n > 1:
                    raise ValueError("a segment of several rows needs a mask (causal or tree)")
                o = F.scaled_dot_product_attention(q[seg.rows].transpose(0, 1), keys, values, attn_mask=mask,
                                                   enable_gqa=g != h)  # [H, n, D]
                out[seg.rows] = o.transpose(0, 1)
        return self.wo(out.reshape(t, h * d))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # [T, I] each
        return self.w_down(F.silu(gate) * up)


def _attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                 start: int) -> torch.Tensor:
    """Batch-invariant attention: each query row alone, over the contiguous block of the slots it
    may see, with the same ops a one-row decoding step runs for that many keys; so a tree row is
    bitwise a one-token step (what an int8 model, whose activation rounding amplifies float noise,
    needs to stay lossless). q: [n, H, D]; keys, values: [G, S, D]; returns [n, H, D]."""
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


class NativeDecoder(nn.Module):
    """Embedding, decoder layers, final norm, output head (see the module docstring)."""

    def __init__(self, cfg: NativeConfig, inv_freq: torch.Tensor, rope_scaling: float = 1.0) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [D / 2]
        self.rope_scaling = rope_scaling
        self.invariant = False
        """Batch-invariant attention (each row alone; see `_attend_rows`)."""

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] for positions [T] (float32 math, as transformers)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scaling, emb.sin() * self.rope_scaling
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, segments: Sequence[Segment],
                skip: Iterable[tuple[int, str]] = ()) -> torch.Tensor:
        """tokens, positions: [T] long; returns the final-normed hidden states [T, E]."""
        cfg = self.cfg
        skip = frozenset(skip)
        x = self.embed(tokens)  # [T, E]
        cos, sin = self.rope(positions, x.dtype)
        for index, layer in enumerate(self.layers):
            if (index, "attn") not in skip:
                x = x + layer.attention(rms_norm(x, layer.input_norm, cfg.rms_norm_eps), index, cos, sin, segments,
                                        self.invariant)
            if (index, "mlp") not in skip:
                x = x + layer.mlp(rms_norm(x, layer.post_norm, cfg.rms_norm_eps))
        return rms_norm(x, self.final_norm, cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, E] -> [rows, V] (float32 for the rules)."""
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------------ weights
    @classmethod
    def from_hf(cls, model) -> "NativeDecoder":
        """The same weights as a Hugging Face Llama / Qwen2 / Mistral model (fused where the
        native layout fuses: q|k|v and gate|up are concatenated copies; everything else is shared)."""
        cfg = NativeConfig.from_hf(model.config, type(model).__name__)
        inv_freq, scaling = rope_inverse_frequencies(model.config)
        param = next(model.parameters())
        with torch.device("meta"):
            native = cls(cfg, torch.zeros(cfg.head_dim // 2), scaling)
        native.inv_freq = inv_freq.float().to(param.device)
        inner = model.model
        with torch.no_grad():
            native.embed = inner.embed_tokens
            native.final_norm = inner.norm.weight
            native.lm_head = model.lm_head
            for layer, src in zip(native.layers, inner.layers):
                attn, mlp = src.self_attn, src.mlp
                layer.input_norm = src.input_layernorm.weight
                layer.post_norm = src.post_attention_layernorm.weight
                layer.wqkv = _fused([attn.q_proj, attn.k_proj, attn.v_proj])
                layer.wo = attn.o_proj
                layer.w_gate_up = _fused([mlp.gate_proj, mlp.up_proj])
                layer.w_down = mlp.down_proj
        return native.eval().requires_grad_(False)


def _fused(linears: Sequence[nn.Linear]) -> nn.Linear:
    """One nn.Linear computing the concatenation of `linears`' outputs."""
    first = linears[0]
    out = nn.Linear(first.in_features, sum(lin.out_features for lin in linears), bias=first.bias is not None,
                    device=first.weight.device, dtype=first.weight.dtype)
    out.weight.copy_(torch.cat([lin.weight for lin in linears]))
    if first.bias is not None:
        out.bias.copy_(torch.cat([lin.bias for lin in linears]))
    return out
