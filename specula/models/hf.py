"""Backend for any Hugging Face `AutoModelForCausalLM`: a KV cache we control, per sequence.

`HFCausalLM` (the `TargetModel`) holds the model; each `HFSequence` (`new_sequence()`) holds one
sequence's `DynamicCache` and the tokens it covers. The cache holds committed tokens only,
except between `forward_tree` and `commit`. The last emitted token (the *root*) is not in the
cache: `forward_tree(root, tree)` runs the root and every tree node in one forward pass with a
4D tree-attention mask (each node sees the committed prefix, the root and its own ancestors)
and position ids `len(cache) + depth`. `commit(path)` then keeps exactly prefix + root +
accepted path.

No forked modeling code: this relies on transformers passing a 4D float mask through
unchanged (`masking_utils`: "If the mask is already 4D, simply return as-is"), which
holds for eager and sdpa attention.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from specula.errors import ConfigError
from specula.models.attention import BATCH_INVARIANT, causal_prefill
from specula.models.base import FeatureRequest, LogitsMode, feature_layers, guarantee_of
from specula.models.cost_key import cost_key_of
from specula.models.linears import quantization_of
from specula.models.sequence import TreeSequence
from specula.tree import TokenTree


def context_window(config) -> int:
    """The model's maximum sequence length from its config."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ConfigError(f"cannot tell the context window of {type(config).__name__}: set max_position_embeddings")


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name under which `model`'s forward takes a KV cache: `cache` where it has one (transformers
    5.24's models do; there `past_key_values` warns, and goes in 5.40), else `past_key_values` (older or
    remote-code models)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def eos_ids_of(model: PreTrainedModel, tokenizer=None) -> frozenset[int]:
    """End-of-sequence ids from the generation config, the model config and the tokenizer."""
    ids: list[int] = []
    gen_cfg = getattr(model, "generation_config", None)
    for source in (getattr(gen_cfg, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        if source is None:
            continue
        ids.extend(source if isinstance(source, (list, tuple)) else [source])
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)


class HFCausalLM:
    """A Hugging Face causal LM as a `TargetModel` (sequences: `new_sequence()`)."""

    def __init__(self, model: PreTrainedModel, name: str = "model", *,
                 eos_token_ids: Sequence[int] | None = None, model_id: str = "") -> None:
        self.model = model.eval()
        self.name = name
        self._model_id = model_id  # the cost key's model id; default the config's _name_or_path
        self.config = model.config
        check_tree_attention(model.config, name)
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.max_context = context_window(model.config)
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids) if eos_token_ids is not None \
            else eos_ids_of(model)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if not self.dtype.is_floating_point:  # quantized weights: activations stay float32
            self.dtype = torch.float32
        self._min = torch.finfo(self.dtype).min
        invariant = quantization_of(model) == "int8" and getattr(self.config, "_attn_implementation", "") == \
            BATCH_INVARIANT  # int8 row linears + row-by-row attention
        self.greedy_guarantee = guarantee_of(self.dtype, invariant)
        self.num_parameters = sum(p.numel() for p in model.parameters())
        self.cache_config = tree_cache_config(model.config, self.max_context, name)
        self._cache_kwarg = cache_kwarg(model)

    def new_cache(self) -> DynamicCache:
        """An empty KV cache of plain key/value layers (`tree_cache_config`)."""
        return DynamicCache(config=self.cache_config)

    @property
    def weight_bytes(self) -> int:
        from specula.models.linears import weight_bytes

        return weight_bytes(self.model)

    # ------------------------------------------------------------------ TargetModel
    def new_sequence(self) -> "HFSequence":
        return HFSequence(self)

    def padded_tokens(self, n: int) -> int:
        return n

    def cost_key(self) -> dict[str, Any]:
        cfg = self.config
        named = str(getattr(cfg, "_name_or_path", ""))
        if named and os.path.isdir(named):  # a local directory, however it was spelled
            named = str(Path(named).resolve())
        return cost_key_of(self.model, model=self._model_id or named or self.name,
                           arch=type(self.model).__name__, layers=getattr(cfg, "num_hidden_layers", None),
                           hidden=getattr(cfg, "hidden_size", None), backend="hf", dtype=self.dtype,
                           device=self.device, attention=getattr(cfg, "_attn_implementation", None),
                           shape=(getattr(cfg, "vocab_size", None), getattr(cfg, "intermediate_size", None),
                                  getattr(cfg, "num_key_value_heads", None)))

    def reference_model(self) -> PreTrainedModel:
        return self.model

    # ------------------------------------------------------------------ one pass
    def tree_mask(self, prefix: int, tree: TokenTree) -> torch.Tensor:
        """Additive float mask [1, 1, n+1, prefix + n+1]: 0 where attention is allowed. Built on the
        device (one small copy of the tree's ancestor mask, no synchronisation)."""
        n = len(tree)
        mask = torch.zeros((n + 1, prefix + n + 1), dtype=self.dtype, device=self.device)
        blocked = ~tree.ancestor_mask.to(self.device, non_blocking=True)  # [n, n]
        mask[1:, prefix + 1 :].masked_fill_(blocked, self._min)
        mask[0, prefix + 1 :] = self._min  # the root sees the prefix and itself only
        return mask[None, None]

    @torch.inference_mode()
    def run(self, cache: DynamicCache, ids: Sequence[int], positions: torch.Tensor,
            mask: torch.Tensor | None, logits_to_keep: int = 0, hidden: FeatureRequest = False) -> Any:
        """One forward pass of `ids` at `positions` ([len(ids)] long) after `cache`, with an
        additive 4D `mask` (None: causal); returns logits [kept rows, vocab] (with `hidden`, a
        `FeatureRequest`: (logits, features [n, k E]); True = the last hidden states, the
        final-normed features the output head reads)."""
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions.unsqueeze(0).to(self.device),
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=hidden,
            **{self._cache_kwarg: cache},
        )
        if not hidden:
            return out.logits[0]
        states = out.hidden_states  # N + 1: the input of each layer, then the final-normed output
        layers = feature_layers(hidden, len(states) - 1)
        return out.logits[0], torch.cat([states[i][0] for i in layers], dim=-1)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    # ------------------------------------------------------------------ FeatureModel
    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """[n] long -> [n, E] input embeddings."""
        with torch.inference_mode():
            return self.model.get_input_embeddings()(ids.to(self.device))

    def input_embeddings(self) -> torch.Tensor:
        """The input embedding table [V, E], read-only (a drafting head's kernel pass looks its rows
        up in C: `heads.kernel_pass.embedding_table`)."""
        return self.model.get_input_embeddings().weight.detach()

    def output_layer(self) -> torch.nn.Module:
        """The output head ([.., E] -> [.., V] logits)."""
        return self.model.get_output_embeddings()

    @property
    def tied_output(self) -> bool:
        """Whether the output head's rows are the input embedding's (`output_rows` reads those)."""
        return bool(getattr(self.model.config, "tie_word_embeddings", False))

    def set_output_layer(self, layer: torch.nn.Module) -> None:
        """Replace the output head (`models.draft_vocab`: a draft's head over its draft vocabulary)."""
        self.model.set_output_embeddings(layer)

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[k] long -> [k, E] rows of the output head."""
        from specula.models.linears import head_rows

        head = self.model.get_output_embeddings()
        if head.weight.device.type == "meta" and self.tied_output:
            return self.model.get_input_embeddings().weight[ids.to(self.device)]  # tied: the same rows, unpacked
        return head_rows(head, ids, self.dtype, self.device)  # a draft vocabulary's head refuses (`weight_rows`)


ALIBI_CONFIGS = ("MptConfig", "BloomConfig")
"""Configs whose models take ALiBi biases from the sequence's length (Falcon's when `alibi` is set)."""


def check_tree_attention(config, name: str) -> None:
    """Refuse (ConfigError) a model whose attention a tree pass cannot reproduce row for row: ALiBi
    built from the sequence's length (MPT, Bloom, Falcon with alibi: wrong logits, or a crash), rotary
    factors chosen from a pass's largest position (Phi-3's longrope, past its original window: a tree
    crossing the threshold rotates every row with the long factors, and greedy output differs from
    plain decoding's; dynamic NTK changes only past max_position_embeddings, the context itself), and
    GPT-Neo's local attention, which counts its window in rows
    of the pass, not positions (a node after its branch loses keys)."""
    kind = type(config).__name__
    if kind in ALIBI_CONFIGS or getattr(config, "alibi", False) is True:
        raise ConfigError(f"{name}: ALiBi attention ({kind}) is not supported for tree decoding (its biases follow "
                          "the sequence's length, not each node's depth); use a model with rotary or learned positions")
    max_context = context_window(config)
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    original = (rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None) or \
        getattr(config, "original_max_position_embeddings", None)
    if rope_type == "longrope" and original is not None and original < max_context:
        raise ConfigError(f"{name}: {rope_type} rotary scaling picks its factors from a pass's longest position, "
                          "so a tree rotates rows unlike plain decoding; use a model without it, or set its "
                          "max_position_embeddings to its original window")
    local = [t for t in (getattr(config, "attention_layers", None) or []) if t == "local"]
    window = getattr(config, "window_size", None)
    if local and isinstance(window, int) and window < max_context:
        raise ConfigError(f"{name}: local attention over a window of {window} tokens, shorter than the context of "
                          f"{max_context}, is counted in rows of a pass, not positions: not supported for tree "
                          "decoding; use a model with full attention")


def tree_cache_config(config, max_context: int, name: str):
    """The config a tree's KV cache is built from: `config` where every cache layer it makes holds
    keys and values alone (`DynamicLayer`), which a commit can crop and gather; None (a cache of
    such layers) where its only other layers are sliding windows no shorter than `max_context`,
    which then attend to everything. Other layers are refused (ConfigError): a window shorter than
    the context drops positions a tree still needs, and recurrent or indexed layers keep state
    that cropping keys and values would not roll back."""
    layers = DynamicCache(config=config).layers
    if all(type(layer) is DynamicLayer for layer in layers):
        return config
    odd = [layer for layer in layers if type(layer) is not DynamicLayer]
    if all(type(layer) is DynamicSlidingWindowLayer and layer.sliding_window >= max_context for layer in odd):
        return None
    kinds = sorted({type(layer).__name__ for layer in odd})
    short = [layer.sliding_window for layer in odd if type(layer) is DynamicSlidingWindowLayer]
    why = (f"a sliding window of {min(short)} tokens, shorter than the context of {max_context}, drops positions "
           "a tree still needs" if short else "its state is not keys and values alone, which a rejected draft "
           "leaves behind")
    raise ConfigError(f"{name}: cache layer {', '.join(kinds)} is not supported for tree decoding ({why}); "
                      "use a model with full attention, or disable sliding window attention in its config")


class HFSequence(TreeSequence):
    """One sequence's `DynamicCache` on an `HFCausalLM` (see the module docstring); the pending-tree
    handshake is `TreeSequence`'s, this class runs the passes and edits the cache.

    `tokens` mirrors exactly what the cache holds (committed tokens)."""

    backend: HFCausalLM

    def __init__(self, backend: HFCausalLM) -> None:
        super().__init__(backend)
        self.cache = backend.new_cache()

    def __len__(self) -> int:
        return len(self._tokens)

    # ------------------------------------------------------------------ forward passes
    def _prefill_rows(self, ids: list[int], logits: LogitsMode, hidden: FeatureRequest) -> Any:
        start = len(self._tokens)
        positions = torch.arange(start, start + len(ids))
        with causal_prefill():  # every method prefills alike: no batch invariance needed (models/attention.py)
            out = self.backend.run(self.cache, ids, positions, None, logits_to_keep=0 if logits == "all" else 1,
                                   hidden=hidden)
        if self.cache.get_seq_length() != start + len(ids):  # a model that keeps no KV cache (OpenAI GPT)
            raise ConfigError(f"{self.backend.name} does not fill a KV cache, which tree decoding needs: use a "
                              "model that caches keys and values")
        out, states = out if hidden else (out, None)
        out = None if logits == "none" else out[-1] if logits == "last" else out
        return (out, states) if hidden else out

    def _tree_rows(self, root: int, tree: TokenTree, hidden: FeatureRequest) -> Any:
        return self._run_rows(root, tree, 0, hidden)

    def _grow_rows(self, root: int, tree: TokenTree, first: int) -> torch.Tensor:
        return self._run_rows(root, tree, first + 1)

    def _run_rows(self, root: int, tree: TokenTree, first_row: int, hidden: FeatureRequest = False) -> Any:
        """Run rows first_row.. of (root, tree) (row 0 = root, row i + 1 = node i) after the
        cache, which already holds the rows before first_row."""
        prefix = len(self._tokens)
        ids = [root, *tree.tokens][first_row:]
        positions = (torch.cat([torch.zeros(1, dtype=torch.long), tree.position_offsets]) + prefix)[first_row:]
        mask = self.backend.tree_mask(prefix, tree)[:, :, first_row:] if len(tree) else None
        return self.backend.run(self.cache, ids, positions, mask, hidden=hidden)

    # ------------------------------------------------------------------ cache edits
    def _keep_rows(self, prefix: int, tree: TokenTree, path: list[int]) -> None:
        if path != list(range(len(path))):  # a branch: gather its rows after the root
            index = torch.tensor([*range(prefix + 1), *(prefix + 1 + i for i in path)], device=self.backend.device)
            for layer in self._layers():
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)
        elif len(path) < len(tree):  # the first nodes: drop the rows after them
            self._crop_layers(len(tree) - len(path))

    def _drop_rows(self, length: int) -> None:
        self._crop_layers(len(self._tokens) - length)

    def _free(self) -> None:
        self.cache = self.backend.new_cache()

    # ------------------------------------------------------------------ cache internals
    def _layers(self) -> list[DynamicLayer]:
        return [layer for layer in self.cache.layers if layer.is_initialized]  # plain layers (`tree_cache_config`)

    def _crop_layers(self, remove: int) -> None:
        if remove <= 0:
            return
        for layer in self._layers():
            layer.keys = layer.keys[..., :-remove, :]
            layer.values = layer.values[..., :-remove, :]

    def cache_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each [1, heads, len, head_dim] (for tests and tools)."""
        return [(layer.keys, layer.values) for layer in self._layers()]
