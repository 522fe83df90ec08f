"""Batch-invariant attention: a query's output does not depend on the other queries in the pass.

Tree verification is lossless only if the target computes, for every node, the same numbers
a one-token decoding step would. Float kernels do not promise that: `sdpa` and eager attention
reduce over the keys with a blocking that depends on how many queries and keys the pass has,
and a masked-out key sits between the visible ones, so the same logits come out rounded
differently (1e-6 in float32, harmless; amplified to whole units by int8 activation
quantization, see docs/cpu.md).

`batch_invariant_attention` computes each query row on its own: it gathers the keys the row may
see (committed prefix, then its ancestors, in order) into a contiguous `[kv_heads, l, head_dim]`
block and runs the same two matmuls and softmax a one-token step runs with the same `l`. A tree
node at depth k after a prefix of P tokens therefore sees exactly the tensors, shapes and
layouts that plain decoding sees at position P + k, so its output is bitwise the same. Together
with row-independent linears (`quantize.RowInt8Linear`) and row-wise norms, tree logits equal
one-token logits bit for bit (tests/models/test_attention.py). Float `F.linear` is not row
independent (a 1-row GEMV and an 8-row GEMM round differently, ~1e-6), so in float32 this
attention alone does not make the model bitwise invariant; float32 does not need it, because
nothing downstream amplifies such noise.

Registered with transformers' `AttentionInterface` and `AttentionMaskInterface` under
`BATCH_INVARIANT`; select it with `attn_implementation="batch_invariant"` (specula's name) when
loading. Cost: a Python loop over query rows, cheap for tree passes of a few dozen rows.

Prompt prefill does not need the loop: every method prefills the same prompt through
`HFCausalLM.append`, so its cache and logits are the same for plain and speculative decoding
whatever kernel computes them. `append` runs inside `causal_prefill()`, where passes of several
tokens go to sdpa; one-token passes always take the row loop (the loop with one row is what the
tree rows must match).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from specula.models.attention_names import (  # noqa: F401 (their home)
    ATTN_IMPLEMENTATIONS, BATCH_INVARIANT, resolve_attention,
)


_PREFILL = contextvars.ContextVar("specula_causal_prefill", default=False)


@contextlib.contextmanager
def causal_prefill() -> Iterator[None]:
    """Inside this block, multi-token passes are prefills that need no batch invariance (sdpa)."""
    token = _PREFILL.set(True)
    try:
        yield
    finally:
        _PREFILL.reset(token)


def visible_keys(mask: torch.Tensor | None, row: int, n_queries: int, n_keys: int) -> torch.Tensor:
    """Indices (ascending) of the keys query `row` may attend to.

    mask: None (causal), a bool `[n_queries, n_keys]` (True = allowed) or an additive float one (0 = allowed)."""
    if mask is None:
        return torch.arange(n_keys - n_queries + row + 1)
    allowed = mask[row] if mask.dtype == torch.bool else mask[row] == 0  # [n_keys]
    return allowed.nonzero().flatten()


class _RowIndexCache:
    """`visible_keys` for every row of the last mask seen: every layer of a forward pass gets the
    same mask object, so the indices are computed once per pass, not once per layer."""

    def __init__(self) -> None:
        self.key: tuple | None = None  # (mask object, batch, n_queries, n_keys); holding it keeps its id unique
        self.rows: list[torch.Tensor] = []

    def get(self, attention_mask: torch.Tensor | None, batch: int, n_queries: int, n_keys: int) -> list[torch.Tensor]:
        key = (attention_mask, batch, n_queries, n_keys)
        if self.key is None or self.key[0] is not attention_mask or self.key[1:] != key[1:]:
            mask = None if attention_mask is None else attention_mask[batch, 0]  # [n, L]
            self.key = key
            self.rows = [visible_keys(mask, row, n_queries, n_keys) for row in range(n_queries)]
        return self.rows


_ROW_INDEX = _RowIndexCache()


def batch_invariant_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers attention function. query [b, H, n, d], key/value [b, Hkv, L, d],
    attention_mask [b, 1, n, L] or None; returns ([b, n, H, d], None)."""
    if dropout and module.training:
        raise ValueError("batch_invariant attention is for inference: call model.eval()")
    if kwargs.get("softcap") or getattr(module, "sinks", None) is not None:
        raise ValueError("batch_invariant attention does not support logit soft-capping or attention sinks; "
                         "use attn_implementation='sdpa'")
    b, n_heads, n, d = query.shape
    if n > 1 and _PREFILL.get():
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_heads, n_keys = key.shape[1], key.shape[2]
    groups = n_heads // kv_heads
    out = query.new_empty((b, n, n_heads, d))
    for batch in range(b):
        for row, index in enumerate(_ROW_INDEX.get(attention_mask, batch, n, n_keys)):
            k = key[batch].index_select(1, index)  # [Hkv, l, d], contiguous
            v = value[batch].index_select(1, index)  # [Hkv, l, d]
            q = query[batch, :, row].reshape(kv_heads, groups, d)  # [Hkv, groups, d]
            scores = torch.matmul(q, k.transpose(1, 2)) * scaling  # [Hkv, groups, l]
            probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
            out[batch, row] = torch.matmul(probs, v).reshape(n_heads, d)  # [H, d]
    return out, None


def register() -> None:
    """Make `BATCH_INVARIANT` a valid `attn_implementation` (idempotent)."""
    AttentionInterface.register(BATCH_INVARIANT, batch_invariant_attention)
    AttentionMaskInterface.register(BATCH_INVARIANT, eager_mask)


def transformers_name(attn_implementation: str, quantize: str = "none") -> str:
    """The name to give transformers for `attn_implementation` (registering ours if needed)."""
    attn_implementation = resolve_attention(attn_implementation, quantize)
    if attn_implementation == "batch_invariant":
        register()
        return BATCH_INVARIANT
    return attn_implementation
