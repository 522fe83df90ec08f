"""Backend for any Hugging Face `AutoModelForCausalLM`: a KV cache we control.

The cache holds committed tokens only, except between `forward_tree` and `commit`.
The last emitted token (the *root*) is not in the cache: `forward_tree(root, tree)` runs
the root and every tree node in one forward pass with a 4D tree-attention mask (each
node sees the committed prefix, the root and its own ancestors) and position ids
`len(cache) + depth`. `commit(path)` then keeps exactly prefix + root + accepted path.

No forked modeling code: this relies on transformers passing a 4D float mask through
unchanged (`masking_utils`: "If the mask is already 4D, simply return as-is"), which
holds for eager and sdpa attention.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from specula.errors import ConfigError
from specula.models.attention import causal_prefill
from specula.tree import TokenTree


def context_window(config) -> int:
    """The model's maximum sequence length from its config."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ConfigError(f"cannot tell the context window of {type(config).__name__}: set max_position_embeddings")


class HFCausalLM:
    """A causal LM plus the KV cache of one sequence (batch size 1).

    `tokens` mirrors exactly what the cache holds (committed tokens)."""

    def __init__(self, model: PreTrainedModel, name: str = "model") -> None:
        self.model = model.eval()
        self.name = name
        self.config = model.config
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.max_context = context_window(model.config)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._min = torch.finfo(self.dtype if self.dtype.is_floating_point else torch.float32).min
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        self.cache = DynamicCache(config=self.config)
        self.tokens: list[int] = []
        self._pending: tuple[int, TokenTree] | None = None  # (root, tree) run but not committed

    def __len__(self) -> int:
        return len(self.tokens)

    def _check_room(self, extra: int) -> None:
        if len(self.tokens) + extra > self.max_context:
            raise ConfigError(
                f"{self.name}: {len(self.tokens) + extra} tokens exceed the context window of "
                f"{self.max_context}; shorten the prompt or lower max_new_tokens"
            )

    # ------------------------------------------------------------------ forward passes
    @torch.inference_mode()
    def append(self, ids: Sequence[int], logits: str = "last") -> torch.Tensor | None:
        """Run `ids` causally after the cache and commit them.

        logits: "last" -> [vocab] for the last token, "all" -> [len(ids), vocab], "none" -> None."""
        if self._pending is not None:
            raise RuntimeError("append() while a tree is pending: commit() it first")
        ids = list(ids)
        if not ids:
            return None
        self._check_room(len(ids))
        start = len(self.tokens)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        keep = 1 if logits != "all" else 0  # logits_to_keep=0 keeps all
        with causal_prefill():  # every method prefills alike: no batch invariance needed (models/attention.py)
            out = self.model(
                input_ids=input_ids,
                position_ids=positions,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=keep,
            )
        self.tokens.extend(ids)
        if logits == "none":
            return None
        return out.logits[0, -1] if logits == "last" else out.logits[0]

    def tree_mask(self, tree: TokenTree) -> torch.Tensor:
        """Additive float mask [1, 1, n+1, prefix + n+1]: 0 where attention is allowed."""
        n, prefix = len(tree), len(self.tokens)
        allowed = torch.zeros((n + 1, prefix + n + 1), dtype=torch.bool)
        allowed[:, : prefix + 1] = True  # committed prefix and the root
        allowed[1:, prefix + 1 :] = tree.ancestor_mask
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, self._min)
        return mask[None, None].to(self.device)

    @torch.inference_mode()
    def forward_tree(self, root: int, tree: TokenTree) -> torch.Tensor:
        """Logits [n+1, vocab]: row 0 after the root, row i+1 after node i."""
        if self._pending is not None:
            raise RuntimeError("forward_tree() while a tree is pending: commit() it first")
        self._check_room(len(tree) + 1)
        prefix = len(self.tokens)
        input_ids = torch.tensor([[root, *tree.tokens]], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.zeros(1, dtype=torch.long), tree.position_offsets]) + prefix
        out = self.model(
            input_ids=input_ids,
            attention_mask=self.tree_mask(tree) if len(tree) else None,
            position_ids=positions.unsqueeze(0).to(self.device),
            past_key_values=self.cache,
            use_cache=True,
        )
        self._pending = (root, tree)
        return out.logits[0]

    @torch.inference_mode()
    def forward_tree_incremental(self, tree: TokenTree) -> torch.Tensor:
        """Grow the pending tree: `tree` must start with the pending tree's nodes (same tokens
        and parents, in order); only the new nodes run, with the same tree attention as
        `forward_tree`. Returns logits [len(tree) - len(pending), vocab] for the new nodes
        (row i after new node i). A drafter expands its tree level by level this way, then
        `commit`s the accepted path (or `[]`)."""
        if self._pending is None:
            raise RuntimeError("forward_tree_incremental() needs a pending tree: call forward_tree() first")
        root, old = self._pending
        start = len(old)
        if tree.tokens[:start] != old.tokens or tree.parents[:start] != old.parents:
            raise ValueError("forward_tree_incremental: the tree must extend the pending tree (same first nodes)")
        if len(tree) == start:
            return torch.empty((0, self.vocab_size), dtype=self.dtype, device=self.device)
        self._check_room(len(tree) + 1)
        prefix = len(self.tokens)
        input_ids = torch.tensor([tree.tokens[start:]], dtype=torch.long, device=self.device)
        positions = tree.position_offsets[start:] + prefix
        out = self.model(
            input_ids=input_ids,
            attention_mask=self.tree_mask(tree)[:, :, start + 1 :],  # rows of the new nodes
            position_ids=positions.unsqueeze(0).to(self.device),
            past_key_values=self.cache,
            use_cache=True,
        )
        self._pending = (root, tree)
        return out.logits[0]

    def commit(self, path: Sequence[int]) -> None:
        """Keep prefix + root + the accepted `path` (node indices, root to leaf)."""
        if self._pending is None:
            raise RuntimeError("commit() without a pending forward_tree()")
        root, tree = self._pending
        self._pending = None
        prefix = len(self.tokens)
        path = list(path)
        n = len(tree)
        if path != list(range(len(path))):
            index = torch.tensor([*range(prefix + 1), *(prefix + 1 + i for i in path)], device=self.device)
            for layer in self._layers():
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)
        elif len(path) < n:
            self._crop_layers(n - len(path))
        self.tokens.extend([root, *tree.tokens_of(path)])

    def crop(self, length: int) -> None:
        """Roll the cache back to its first `length` tokens."""
        if self._pending is not None:
            raise RuntimeError("crop() while a tree is pending: commit() it first")
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"crop({length}) outside 0..{len(self.tokens)}")
        self._crop_layers(len(self.tokens) - length)
        del self.tokens[length:]

    def rollback(self, n: int) -> None:
        """Drop the last `n` committed tokens."""
        self.crop(len(self.tokens) - n)

    # ------------------------------------------------------------------ cache internals
    def _layers(self) -> list[DynamicLayer]:
        layers = list(self.cache.layers)
        for layer in layers:
            if isinstance(layer, DynamicSlidingWindowLayer) or not isinstance(layer, DynamicLayer):
                raise ConfigError(
                    f"{self.name}: cache layer {type(layer).__name__} is not supported for tree decoding "
                    "(sliding-window caches cannot drop arbitrary positions); disable sliding window attention"
                )
        return [layer for layer in layers if layer.is_initialized]

    def _crop_layers(self, remove: int) -> None:
        if remove <= 0:
            return
        for layer in self._layers():
            layer.keys = layer.keys[..., :-remove, :]
            layer.values = layer.values[..., :-remove, :]

    def cache_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [1, heads, len, head_dim] (for tests and tools)."""
        return [(layer.keys, layer.values) for layer in self._layers()]
