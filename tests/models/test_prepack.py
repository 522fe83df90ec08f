"""oneDNN prepacked float32 linears: same numbers as F.linear, same greedy output, chosen by `auto`."""

import copy
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from tiny import assert_speculative_greedy_equals_plain, check_random_tree, perturbed_copy, tiny_model
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.models.loading import load_model
from specula.models.prepack import (
    MIN_ROWS,
    OneDNNLinear,
    linear_kernel_of,
    onednn_available,
    prepack_model,
    resolve_linear_kernel,
)
from specula.planner.cost import cost_cache_key

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")


def prepacked_tiny(arch: str, seed: int = 0):
    return prepack_model(tiny_model(arch, seed=seed), "onednn")


@torch.inference_mode()
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_matches_f_linear_for_every_row_count(bias):
    linear = nn.Linear(64, 48, bias=bias)
    packed = OneDNNLinear(linear)
    x = torch.randn(20, 64)
    for n in range(1, 21):  # below MIN_ROWS (padded), at it, above it
        torch.testing.assert_close(packed(x[:n]), linear(x[:n]), atol=1e-5, rtol=1e-5)
    batched = torch.randn(2, 3, 64)  # [batch, seq, in] as the model passes it
    assert packed(batched).shape == (2, 3, 48)
    torch.testing.assert_close(packed(batched), linear(batched), atol=1e-5, rtol=1e-5)
    assert MIN_ROWS > 1 and packed(x[:1]).shape == (1, 48)  # padding rows never leak out


def test_prepack_model_swaps_linears_and_keeps_embeddings():
    model = prepacked_tiny("qwen2")
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear" not in kinds and "OneDNNLinear" in kinds
    assert isinstance(model.get_input_embeddings(), nn.Embedding)
    assert model.get_input_embeddings().weight.device.type == "cpu"  # a tied embedding keeps its weights
    assert HFCausalLM(model).vocab_size == 96  # lm_head.weight.shape still reads the logit width
    assert linear_kernel_of(model) == "onednn"
    gpt2 = prepacked_tiny("gpt2")  # GPT-2's Conv1D layers ([in, out] weights) too
    assert "Conv1D" not in {type(m).__name__ for m in gpt2.modules()}
    untouched = tiny_model("llama")
    assert prepack_model(untouched, "aten") is untouched and linear_kernel_of(untouched) == "aten"
    with pytest.raises(ConfigError, match="resolved kernel"):
        prepack_model(tiny_model("llama"), "auto")


@torch.inference_mode()
def test_prepacked_model_logits_equal_the_original(arch):
    original = tiny_model(arch, seed=2)
    packed = prepack_model(copy.deepcopy(original), "onednn")
    ids = torch.tensor([[random.Random(i).randrange(96) for i in range(17)]])
    torch.testing.assert_close(packed(ids).logits, original(ids).logits, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_prepacked_tree_logits_equal_causal_logits_over_each_path(arch):
    model = prepacked_tiny(arch)
    check_random_tree(model, HFCausalLM(model).new_sequence(), 0, 9, 14, same_argmax=True)


@pytest.mark.parametrize("method", ["prompt-lookup", "draft-model"])
def test_speculative_greedy_on_prepacked_models_equals_plain_greedy_of_the_original(arch, method):
    original = tiny_model(arch, seed=3)
    model = prepack_model(copy.deepcopy(original), "onednn")
    draft = prepack_model(perturbed_copy(original, 0.05), "onednn") if method == "draft-model" else None
    assert_speculative_greedy_equals_plain(model, method, original, draft)


def test_auto_picks_onednn_for_float32_cpu_only():
    f32 = dict(dtype=torch.float32, device="cpu", quantize="none")
    assert resolve_linear_kernel("auto", **f32) == "onednn"
    assert resolve_linear_kernel("aten", **f32) == "aten"
    assert resolve_linear_kernel("auto", **{**f32, "dtype": torch.bfloat16}) == "aten"
    assert resolve_linear_kernel("auto", **{**f32, "quantize": "int8"}) == "aten"
    assert resolve_linear_kernel("auto", **{**f32, "device": "cuda"}) == "aten"
    with pytest.raises(ConfigError, match='use linear_kernel="auto" or linear_kernel="aten"'):
        resolve_linear_kernel("onednn", **{**f32, "quantize": "int8"})
    with pytest.raises(ConfigError, match="choose one of: auto, specula, onednn, aten"):
        resolve_linear_kernel("mkl", **f32)


def test_load_model_prepacks_float32_by_default(tmp_path: Path, tiny_tokenizer):
    tiny_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    auto, _ = load_model(str(tmp_path))
    aten, _ = load_model(str(tmp_path), linear_kernel="aten")
    bf16, _ = load_model(str(tmp_path), dtype="bfloat16")
    assert (linear_kernel_of(auto), linear_kernel_of(aten), linear_kernel_of(bf16)) == ("onednn", "aten", "aten")
    # a cost curve measured with one kernel is never reused for the other
    assert cost_cache_key(HFCausalLM(auto), 256) != cost_cache_key(HFCausalLM(aten), 256)
