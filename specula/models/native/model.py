"""A small Llama / Qwen2 / Mistral decoder in the style of gpt-fast's `model.py`.

One config dataclass, fused projections (q|k|v and gate|up: one linear each), RoPE with Hugging
Face's frequencies (transformers' own rope initialisers) applied as one complex multiplication:
the rows of the q and k projections are permuted at load so that each rotated pair (j, j + D/2)
of Hugging Face's rotate-half layout sits side by side (j -> 2j, j + D/2 -> 2j + 1), which leaves
every attention score unchanged (q and k get the same permutation); the cache holds keys in that
layout (`cache_tensors` of a sequence permutes them back). RMSNorm is one fused op; tied or
separate output head. The forward pass runs a
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
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from specula.errors import ConfigError
from specula.models.device import sdpa_without_cudnn


class NativeUnsupported(ConfigError):
    """A model the native backend (or its kernels) cannot run as transformers runs it: `--backend
    auto` then loads it with the Hugging Face backend; `--backend native` reports it."""
from specula.models.native.cache import KVCache
from specula.models.native.fused import FusedLayers
from specula.models.native.ops import TorchOps

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
"""Hugging Face architectures this model reproduces (others stay on the Hugging Face backend)."""
ROPE_TABLE_ROWS = 1024
"""The first size of `NativeDecoder.rope`'s table of positions (at most the model's context; grown by doubling)."""


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
        `architectures`. A `ConfigError` naming `backend="hf"` for what this decoder cannot run."""
        arch = architecture or (getattr(config, "architectures", None) or [""])[0]
        if arch not in ARCHITECTURES:
            raise NativeUnsupported(f"the native backend runs {', '.join(ARCHITECTURES)}, not {arch or 'this model'}; "
                              'use backend="hf"')
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise NativeUnsupported('the native backend has no sliding-window attention; use backend="hf"')
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise NativeUnsupported(f'the native backend runs SiLU MLPs, not {act}; use backend="hf"')
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
        raise NativeUnsupported('dynamic RoPE scaling changes with the sequence length; use backend="hf"')
    original = params.get("original_max_position_embeddings") or \
        getattr(hf_config, "original_max_position_embeddings", None)
    if rope_type == "longrope" and original is not None and original < hf_config.max_position_embeddings:
        # transformers switches to the long factors once a pass reaches past `original`; the frequencies
        # here are one set for every position (the short ones)
        raise NativeUnsupported(f"longrope RoPE scaling changes its factors past {original} positions; "
                                'use backend="hf"')
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


def rope_pairs_permutation(head_dim: int) -> torch.Tensor:
    """perm [D]: new position 2j holds Hugging Face's dim j, 2j + 1 holds dim j + D/2."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()


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
                  segments: Sequence[Segment], ops, invariant: bool) -> torch.Tensor:
        """x: [T, E] normed input; returns the attention output [T, E] (before the residual)."""
        cfg = self.cfg
        t, h, g, d = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.wqkv(x)  # [T, (H + 2G) D]
        out = qkv.new_empty((t, h, d))  # [T, H, D]
        for seg in segments:
            rows = seg.rows
            q = ops.rope_write(qkv[rows], cos[rows], sin[rows], seg.cache, index, seg.start, h, g, d)  # [n, H, D]
            out[rows] = ops.attend(q, seg.cache, index, seg.start, seg.mask, invariant, seg.prefill)
        return self.wo(out.reshape(t, h * d))


class NativeDecoder(nn.Module):
    """Embedding, decoder layers, final norm, output head (see the module docstring)."""

    def __init__(self, cfg: NativeConfig, inv_freq: torch.Tensor, rope_scaling: float = 1.0) -> None:
        super().__init__()
        self.cfg = cfg
        # built on the meta device only (`from_hf`, `prepared.load_entry` set every weight): an
        # embedding's random init there (`normal_`) imported torch._dynamo, 1.5 s of every load
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [D / 2]
        self.rope_scaling = rope_scaling
        self._rope_table: tuple[torch.Tensor, float, torch.Tensor, torch.Tensor] | None = None
        """(the `inv_freq` and `rope_scaling` it was made with, cos [P, D / 2], sin [P, D / 2]) of positions 0 .. P - 1:
        `rope`."""
        self.invariant = False
        """Batch-invariant attention with the PyTorch ops (each row alone; `ops._attend_rows`)."""
        self.ops = TorchOps()
        """The per-layer ops: `TorchOps`, or `CpuKernelOps` (C kernels, row-invariant)."""
        self.num_parameters = 0
        """Parameters of the model this decoder was built from (`from_hf`)."""

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D / 2] of positions [T] times the inverse frequencies, times the attention
        scaling (float32 math, as transformers: `rope_rows`). On the CPU they are rows of a table of every
        position up to the largest asked so far (grown by doubling, made anew for a new `inv_freq` or scaling), made by
        the same ops, so the same values (tested): a step's five elementwise ops took 0.08 ms of a SmolLM2
        step (each runs cold after the pass before), its two row reads less than half of that."""
        if positions.device.type != "cpu":
            return self.rope_rows(positions)
        inv_freq, scaling, table = self.inv_freq, self.rope_scaling, self._rope_table
        same = table is not None and table[0] is inv_freq and table[1] == scaling
        need = int(positions.max()) + 1 if len(positions) else 0
        if not same or len(table[2]) < need:
            size = max(need, min(max(2 * len(table[2]) if same else 0, ROPE_TABLE_ROWS), self.cfg.max_position))
            table = self._rope_table = (inv_freq, scaling, *self.rope_rows(torch.arange(size)))
        return table[2].index_select(0, positions), table[3].index_select(0, positions)

    def rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D / 2] computed for positions [T]: each angle position * inverse frequency in float32,
        its cos and sin times the attention scaling (elementwise: a row's values do not depend on the others)."""
        angles = positions[:, None].float() * self.inv_freq[None, :]  # [T, D / 2]
        return angles.cos() * self.rope_scaling, angles.sin() * self.rope_scaling

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, segments: Sequence[Segment],
                skip: Iterable[tuple[int, str]] = (), trace: dict[tuple[int, str], float] | None = None,
                taps: Sequence[int] = ()) -> Any:
        """tokens, positions: [T] long; returns the final-normed hidden states [T, E], or with `taps`
        (layer indices 0 .. N, N = the final-normed state; `models.base.FeatureRequest`)
        (final-normed states [T, E], the residual stream entering each tapped layer, concatenated in
        `taps` order [T, len(taps) E]).

        `trace`, if given, receives for every sub-layer run its change of direction of the residual
        stream, mean over rows of 1 - cos(x, x + delta): near 0 for a sub-layer that barely turns
        the stream (a good one to skip when drafting)."""
        with sdpa_without_cudnn(tokens.device):
            return self._forward(tokens, positions, segments, frozenset(skip), trace, tuple(taps))

    def _forward(self, tokens, positions, segments, skip, trace, taps) -> Any:
        cfg, ops = self.cfg, self.ops
        eps = cfg.rms_norm_eps
        x = self.embed(tokens)  # [T, E]
        cos, sin = self.rope(positions)
        fused = self._c_loop(segments, len(tokens), trace)
        if fused is not None:  # the same kernel calls from C, without the glue between them
            return fused.run(x, cos, sin, segments, taps, skip)
        delta = None  # the last sub-layer's output, not yet added to the residual stream
        tapped: dict[int, torch.Tensor] = {}  # layer -> its input [T, E] (copies: add_norm may write x in place)
        for index, layer in enumerate(self.layers):
            if index in taps:
                tapped[index] = (x if delta is None else x + delta).clone()
            if (index, "attn") not in skip:
                x, h = ops.add_norm(x, delta, layer.input_norm, eps)
                delta = layer.attention(h, index, cos, sin, segments, ops, self.invariant)
                if trace is not None:
                    trace[(index, "attn")] = _turn(x, delta)
            if (index, "mlp") not in skip:
                x, h = ops.add_norm(x, delta, layer.post_norm, eps)
                delta = layer.w_down(ops.silu_mul(layer.w_gate_up(h)))
                if trace is not None:
                    trace[(index, "mlp")] = _turn(x, delta)
        final = ops.add_norm(x, delta, self.final_norm, eps)[1]
        if not taps:
            return final
        tapped[len(self.layers)] = final
        return final, torch.cat([tapped[i] for i in taps], dim=-1)

    def _c_loop(self, segments: Sequence[Segment], n: int, trace) -> Any:
        """The C loop over the layers (`fused.FusedLayers`) where it runs this pass: specula's CPU
        kernels, at most `fused.MAX_ROWS` rows, not traced; else None."""
        if trace is not None or self.embed.weight.dtype != torch.float32:
            return None
        if not FusedLayers.takes(segments, n):
            return None
        return FusedLayers.of(self)

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
        native.num_parameters = sum(p.numel() for p in model.parameters())
        inner = model.model
        perm = rope_pairs_permutation(cfg.head_dim)
        with torch.no_grad():
            native.embed = inner.embed_tokens
            native.final_norm = inner.norm.weight
            native.lm_head = model.lm_head
            for layer, src in zip(native.layers, inner.layers):
                attn, mlp = src.self_attn, src.mlp
                layer.input_norm = src.input_layernorm.weight
                layer.post_norm = src.post_attention_layernorm.weight
                layer.wqkv = _fused([attn.q_proj, attn.k_proj, attn.v_proj],
                                    _qk_rows(perm, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
                layer.wo = attn.o_proj
                layer.w_gate_up = _fused([mlp.gate_proj, mlp.up_proj])
                layer.w_down = mlp.down_proj
        return native.eval().requires_grad_(False)


def _turn(x: torch.Tensor, delta: torch.Tensor) -> float:
    """Mean over rows of 1 - cos(x, x + delta); x, delta: [T, E]."""
    return float((1 - torch.cosine_similarity(x.float(), (x + delta).float(), dim=-1)).mean())


def _qk_rows(perm: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Row order of the fused q|k|v weight: q and k heads in pair layout, v unchanged."""
    qk = torch.cat([h * head_dim + perm for h in range(heads + kv_heads)])
    return torch.cat([qk, torch.arange((heads + kv_heads) * head_dim, (heads + 2 * kv_heads) * head_dim)])


def _fused(linears: Sequence[nn.Linear], rows: torch.Tensor | None = None) -> nn.Linear:
    """One nn.Linear computing the concatenation of `linears`' outputs (its rows reordered by `rows`)."""
    first = linears[0]
    out = nn.Linear(first.in_features, sum(lin.out_features for lin in linears), bias=first.bias is not None,
                    device="meta")  # no random init: the weights are set below
    weight = torch.cat([lin.weight for lin in linears])
    out.weight = nn.Parameter(weight if rows is None else weight[rows], requires_grad=False)
    if first.bias is not None:
        bias = torch.cat([lin.bias for lin in linears])
        out.bias = nn.Parameter(bias if rows is None else bias[rows], requires_grad=False)
    return out
