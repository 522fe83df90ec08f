"""int8 quantization: batch invariance (the property lossless verification needs) and greedy equality;
int4's group-wise values and where it may run."""

import warnings

import pytest
import torch
from torch import nn

from tiny import assert_speculative_greedy_equals_plain, check_random_tree, perturbed_copy, tiny_model
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.models.attention import transformers_name
from specula.models.quantize import RowInt8Linear, quantize_groups, quantize_model, quantize_rows


def quantized_tiny(arch: str, seed: int = 0, **kwargs):
    """A tiny int8 model configured as users get it (`--quantize int8`: batch-invariant attention)."""
    return quantize_model(tiny_model(arch, attn=transformers_name("batch_invariant"), seed=seed, **kwargs), "int8")


def rows_with_varied_ranges(n: int, width: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=gen) * torch.logspace(-2, 2, n).unsqueeze(1)  # [n, width]


@torch.inference_mode()
def test_each_output_row_is_bit_identical_to_that_row_alone():
    linear = nn.Linear(64, 48)
    q = RowInt8Linear(linear)
    x = rows_with_varied_ranges(9, 64)
    x[4] = 0.0  # an all-zero row stays zero (plus bias)
    full = q(x)  # [9, 48]
    for i in range(len(x)):
        assert torch.equal(full[i], q(x[i : i + 1])[0]), i
        assert torch.equal(full[: i + 1], q(x[: i + 1]))  # every prefix too (verify 1..n tokens)
    torch.testing.assert_close(full[4], linear.bias)
    ref = linear(x)
    assert ((full - ref).norm(dim=1) / ref.norm(dim=1)).max() < 0.03  # int8 error, per row


@torch.inference_mode()
def test_torch_ao_dynamic_quantization_is_not_batch_invariant():
    """Why RowInt8Linear exists: quantize_dynamic uses one activation scale per input tensor."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(64, 48)), {nn.Linear}, dtype=torch.qint8)
    x = rows_with_varied_ranges(9, 64)
    assert not torch.equal(ao(x)[0], ao(x[:1])[0])


def test_quantize_model_swaps_linear_layers_and_keeps_the_rest():
    model = quantized_tiny("qwen2")
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear" not in kinds and "RowInt8Linear" in kinds
    assert isinstance(model.get_input_embeddings(), nn.Embedding)
    assert HFCausalLM(model).vocab_size == 96  # lm_head.weight.shape still reads the logit width
    gpt2 = quantized_tiny("gpt2")
    assert "Conv1D" not in {type(m).__name__ for m in gpt2.modules()}
    kept = quantize_model(tiny_model("llama"), "int8", skip=["lm_head"])
    assert isinstance(kept.lm_head, nn.Linear) and isinstance(kept.model.layers[0].mlp.up_proj, RowInt8Linear)
    untouched = tiny_model("llama")
    assert quantize_model(untouched, "none").lm_head.__class__ is nn.Linear
    with pytest.raises(ConfigError, match="choose one of: none, int8, int4"):
        quantize_model(tiny_model("llama"), "int3")
    with pytest.raises(ConfigError, match='^quantize="int4" runs on specula\'s CPU kernels only .* '
                                          'use quantize="int8"$'):
        quantize_model(tiny_model("llama"), "int4")  # the transformers and PyTorch-op paths have no 4-bit linears


def test_quantize_groups_scales_each_run_of_inputs_by_its_own_largest():
    w = torch.randn(5, 150) * torch.logspace(-2, 1, 150)  # [5, 150]: groups of very different ranges
    w[3] = 0.0  # an all-zero row stays zero
    q, scale = quantize_groups(w, 64)  # [5, 192], [5, 3]
    assert q.dtype == torch.int8 and q.shape == (5, 192) and scale.shape == (5, 3)
    assert q.abs().max() <= 7 and torch.all(q[:, 150:] == 0)  # padded inputs are zero weights
    back = (q.view(5, 3, 64).float() * scale[:, :, None]).view(5, 192)[:, :150]
    step = scale.repeat_interleave(64, dim=1)[:, :150]  # [5, 150] each input's group step
    assert torch.all((back - w).abs() <= step / 2 + 1e-6)  # rounded to the nearest step
    assert torch.equal(q[3], torch.zeros(192, dtype=torch.int8))
    for g in range(3):  # each group's largest magnitude maps to 7 (or the group is zero)
        amax = q[:, g * 64:(g + 1) * 64].abs().amax(dim=1)
        assert torch.all((amax == 7) | (w[:, g * 64:(g + 1) * 64].abs().amax(dim=1) == 0))


@torch.inference_mode()
def test_quantized_tree_logits_equal_causal_logits_over_each_path(arch):
    model = quantized_tiny(arch)
    check_random_tree(model, HFCausalLM(model).new_sequence(), 0, 9, 14, same_argmax=True)


@pytest.mark.parametrize("method", ["prompt-lookup", "draft-model"])
def test_speculative_greedy_equals_plain_greedy_of_the_quantized_model(arch, method):
    model = tiny_model(arch, attn=transformers_name("batch_invariant"), seed=3)
    draft = quantize_model(perturbed_copy(model, 0.05), "int8") if method == "draft-model" else None
    quantize_model(model, "int8")
    assert_speculative_greedy_equals_plain(model, method, model, draft)


def test_the_kernels_group_quantizer_gives_quantize_groups_bits():
    """`kernels.quantize_groups` (one C pass a row, what the i4 kernels' packing uses) is
    `quantize_groups` bit for bit: scales, values, ties rounded to even, clamping, zero groups and
    the zero padding of a width that is not a multiple of the group."""
    from specula.models.native import kernels

    if not kernels.available():
        pytest.skip(f"specula's CPU kernels cannot run here: {kernels.unavailable_reason()}")
    gen = torch.Generator().manual_seed(4)
    halves = (torch.arange(-14, 15).float() / 2).repeat(3, 1)  # scale exactly 1: every x.5 a tie
    cases = [(torch.randn(300, 777, generator=gen), 64), (rows_with_varied_ranges(64, 1536) * 1e-6, 64),
             (torch.zeros(5, 40), 64), (torch.tensor([[0.5, -0.5, 1.5, 2.5, -2.5, 7.0, 1e-13, 0.0]]), 4),
             (halves, 29), (halves, 8), (torch.randn(7, 130, generator=gen).t(), 64)]  # the last not contiguous
    for w, group in cases:
        q, scale = quantize_groups(w, group)
        q_c, scale_c = kernels.quantize_groups(w, group)
        assert torch.equal(q_c, q) and torch.equal(scale_c, scale), (tuple(w.shape), group)


def test_the_kernels_one_pass_quantizer_gives_quantize_rows_bits():
    """`kernels.quantize_rows` (one C pass a row, what the kernel linears and a head's load use) is
    `quantize_rows` bit for bit: scales, values, ties rounded to even, clamping, all-zero rows."""
    from specula.models.native import kernels

    if not kernels.available():
        pytest.skip(f"specula's CPU kernels cannot run here: {kernels.unavailable_reason()}")
    gen = torch.Generator().manual_seed(3)
    halves = (torch.arange(-254, 255).float() / 2).repeat(3, 1)  # scale exactly 1: every x.5 a tie
    cases = [torch.randn(300, 777, generator=gen), rows_with_varied_ranges(64, 1536) * 1e-6, torch.zeros(5, 40),
             torch.tensor([[0.5, -0.5, 1.5, 2.5, -2.5, 127.0], [1e-13, -1e-13, 0, 0, 0, 0]]), halves,
             torch.randn(7, 33, generator=gen).t()]  # not contiguous
    for w in cases:
        q, scale = quantize_rows(w)
        q_c, scale_c = kernels.quantize_rows(w)
        assert torch.equal(q_c, q) and torch.equal(scale_c, scale)
