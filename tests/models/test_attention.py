"""Batch-invariant attention: correct attention, and tree rows bitwise equal to one-token steps."""

import random

import pytest
import torch

from tiny import check_random_tree, random_tree, tiny_model
from specula.errors import ConfigError
from specula.models.attention import BATCH_INVARIANT, resolve_attention, transformers_name
from specula.models.hf import HFCausalLM
from specula.models.quantize import quantize_model
from specula.tree import TokenTree


def invariant_tiny(arch: str, quantize: str = "none", seed: int = 0):
    return quantize_model(tiny_model(arch, attn=transformers_name("batch_invariant"), seed=seed), quantize)


def one_token_logits(model, prompt: list[int], path: list[int]) -> torch.Tensor:
    """Logits after prompt + path, computed the way plain decoding does: prefill, then one token per pass."""
    lm = HFCausalLM(model).new_sequence()
    lm.prefill(prompt[:-1], logits="none")
    tokens = [prompt[-1], *path]
    for token in tokens[:-1]:
        lm.forward_tree(token, TokenTree.empty())
        lm.commit([])
    return lm.forward_tree(tokens[-1], TokenTree.empty())[0]


def test_batch_invariant_attention_computes_tree_attention(arch):
    model = invariant_tiny(arch)
    assert model.config._attn_implementation == BATCH_INVARIANT
    tree = check_random_tree(model, HFCausalLM(model).new_sequence(), 1, 11, 14)
    assert not tree.is_chain()


@torch.inference_mode()
def test_int8_tree_rows_are_bitwise_one_token_steps(arch):
    """The property that makes int8 verification lossless: every row of a tree pass is bit for
    bit what a one-token decoding step computes after the same tokens."""
    model = invariant_tiny(arch, "int8", seed=2)
    rng = random.Random(2)
    prompt = [rng.randrange(96) for _ in range(10)]
    lm = HFCausalLM(model).new_sequence()
    lm.prefill(prompt[:-1], logits="none")
    tree = random_tree(rng, 12, 96)
    logits = lm.forward_tree(prompt[-1], tree)  # [13, 96]
    assert torch.equal(logits[0], one_token_logits(model, prompt, []))
    for i in range(len(tree)):
        assert torch.equal(logits[i + 1], one_token_logits(model, prompt, tree.tokens_of(tree.path_to(i)))), i


def test_auto_picks_batch_invariant_for_int8_only():
    assert resolve_attention("auto", "int8") == "batch_invariant"
    assert resolve_attention("auto", "none") == "sdpa"
    assert resolve_attention("eager", "int8") == "eager"  # an explicit choice is kept
    with pytest.raises(ConfigError, match="choose one of: auto, sdpa, eager, batch_invariant"):
        resolve_attention("flash", "none")


def test_prefill_runs_on_sdpa_and_tree_passes_on_the_row_loop(monkeypatch):
    import specula.models.attention as attention

    calls = []
    real = attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: calls.append(a[1].shape[2]) or real(*a, **k))
    model = invariant_tiny("qwen2", "int8")
    lm = HFCausalLM(model).new_sequence()
    lm.prefill(list(range(2, 20)), logits="none")  # prefill: 18 tokens, 2 layers
    assert calls == [18, 18]
    lm.forward_tree(5, TokenTree.chain([6, 7, 8]))  # a 4-token tree pass stays batch invariant
    lm.commit([0, 1, 2])
    assert calls == [18, 18]
