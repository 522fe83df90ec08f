"""The native backend (`specula.models.native`): logits equal Hugging Face's on the same weights,
tree logits equal causal logits, the static cache equals a plain forward's after any steps,
every drafter's greedy output equals plain greedy, int8 rows are bitwise one-token steps, and an
unsupported architecture is refused with the fix named."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from tiny import (assert_cache_equals_plain_forward, causal_logits, check_random_tree, perturbed_copy, random_steps,
                  random_tree, reference_greedy, tiny_model)
from specula.api import build_decoder
from specula.errors import ConfigError
from specula.models.base import TargetModel, TargetSequence
from specula.models.hf import HFCausalLM
from specula.models.native import NativeCausalLM, NativeDecoder, configure, kernels, supports
from specula.sampling import SamplingParams
from specula.tree import TokenTree

NATIVE_ARCHES = ("llama", "qwen2")
KERNELS = ["aten", "onednn", pytest.param("specula", marks=pytest.mark.skipif(
    not kernels.available(), reason=f"specula's CPU kernels cannot run here: {kernels.unavailable_reason()}"))]
"""aten / onednn: PyTorch ops; specula: the C kernels (CpuKernelOps)."""


def native(model, *, kernel: str = "specula" if kernels.available() else "aten", quantize: str = "none",
           invariant: bool = False) -> NativeCausalLM:
    decoder = configure(NativeDecoder.from_hf(model), kernel, quantize, "batch_invariant" if invariant else "sdpa")
    return NativeCausalLM(decoder, "native", eos_token_ids=[1])


@pytest.mark.parametrize("arch", NATIVE_ARCHES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_prefill_logits_equal_hugging_face(arch, kernel):
    model = tiny_model(arch, "eager", seed=2)
    seq = native(model, kernel=kernel).new_sequence()
    assert isinstance(seq.backend, TargetModel) and isinstance(seq, TargetSequence)
    ids = list(range(3, 40))
    logits = seq.prefill(ids, logits="all")  # [n, vocab]
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    assert seq.tokens == ids


@pytest.mark.parametrize("arch", NATIVE_ARCHES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_tree_logits_equal_causal_logits_over_each_path(arch, kernel):
    model = tiny_model(arch, seed=4)
    tree = check_random_tree(model, native(model, kernel=kernel).new_sequence(), 5, 11, 16, same_argmax=True)
    assert not tree.is_chain()


@pytest.mark.parametrize("arch", NATIVE_ARCHES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_incremental_tree_logits_equal_causal_logits(arch, kernel):
    model = tiny_model(arch, seed=6)
    check_random_tree(model, native(model, kernel=kernel).new_sequence(), 7, 6, 12, cuts=(3, 3, 8))


@pytest.mark.parametrize("arch", NATIVE_ARCHES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_cache_equals_plain_forward_after_any_sequence_of_steps(arch, kernel):
    model = tiny_model(arch, seed=8)
    seq = native(model, kernel=kernel).new_sequence()
    for committed in random_steps(seq, random.Random(9), 14):
        assert_cache_equals_plain_forward(model, seq, committed)


def test_cache_grows_past_its_first_capacity():
    model = tiny_model("llama", seed=1)
    seq = native(model).new_sequence()
    ids = [random.Random(0).randrange(96) for _ in range(250)]
    for i in range(0, 250, 50):
        seq.prefill(ids[i : i + 50], logits="none")
    assert seq.cache.capacity >= 250
    assert_cache_equals_plain_forward(model, seq, ids)
    torch.testing.assert_close(seq.forward_tree(3, TokenTree.empty())[0], causal_logits(model, ids + [3]),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["prompt-lookup", "token-recycling", "draft-model", "draft-tree", "fusion"])
@pytest.mark.parametrize("arch", NATIVE_ARCHES)
def test_greedy_speculative_output_equals_plain_greedy(arch, method):
    model = tiny_model(arch, seed=3)
    target = native(model)
    draft = native(perturbed_copy(model, 0.2)) if method in ("draft-model", "draft-tree", "fusion") else None
    dec = build_decoder(method, target, None, draft, planner=False)
    drafted = 0
    for prompt in ([5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], [60, 61, 62, 63]):
        out = dec.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 30), (arch, method, prompt)
        drafted += out.stats.drafted_tokens
    assert drafted > 0


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
@pytest.mark.parametrize("method", ["draft-model", "fusion"])
@pytest.mark.parametrize("arch", NATIVE_ARCHES)
def test_an_int4_draft_leaves_greedy_output_unchanged(arch, method):
    """A draft on the i4 kernels (4-bit weights) proposes other tokens than its float32 self, and the
    float32 target's greedy output is still plain greedy's, token for token."""
    model = tiny_model(arch, seed=3)
    target = native(model)
    draft = native(perturbed_copy(model, 0.2), quantize="int4")
    assert draft.decoder.layers[0].wqkv.kind == "i4" and draft.decoder.lm_head.kind == "i4"
    dec = build_decoder(method, target, None, draft, planner=False)
    drafted = accepted = 0
    for prompt in ([5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], [60, 61, 62, 63]):
        out = dec.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 30), (arch, method, prompt)
        drafted += out.stats.drafted_tokens
        accepted += out.stats.accepted_tokens
    assert drafted > 0 and accepted > 0


@pytest.mark.parametrize("kernel,quantize,invariant", [
    ("aten", "int8", True),  # fbgemm per-row int8 linears + PyTorch attention row by row
    pytest.param("specula", "none", False, marks=KERNELS[-1].marks),  # C kernels, float32
    pytest.param("specula", "int8", False, marks=KERNELS[-1].marks),  # C kernels, int8 weights and activations
    pytest.param("specula", "int4", False, marks=KERNELS[-1].marks),  # C kernels, 4-bit weights, int8 activations
])
def test_invariant_tree_rows_are_bitwise_one_token_steps(kernel, quantize, invariant):
    """Row-invariant linears + batch-invariant attention: every tree row is computed with exactly
    the numbers a one-token decoding step uses, so tree logits equal them bit for bit (with the C
    kernels in float32 too: speculative output is plain decoding's, not only up to float noise)."""
    model = tiny_model("qwen2", seed=11)
    backend = native(model, kernel=kernel, quantize=quantize, invariant=invariant)
    rng = random.Random(12)
    prompt = [rng.randrange(96) for _ in range(9)]
    tree = random_tree(rng, 12, 96)
    seq = backend.new_sequence()
    seq.prefill(prompt[:-1], logits="none")
    logits = seq.forward_tree(prompt[-1], tree)
    for row, path in enumerate([()] + [tree.path_to(i) for i in range(len(tree))]):
        one = backend.new_sequence()
        one.prefill(prompt[:-1], logits="none")
        for tok in [prompt[-1], *tree.tokens_of(path)][:-1]:
            one.prefill([tok], logits="none")
        step = one.forward_tree(([prompt[-1], *tree.tokens_of(path)])[-1], TokenTree.empty())[0]
        assert torch.equal(logits[row], step), row


@pytest.mark.parametrize("arch", NATIVE_ARCHES)
@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
def test_compiled_kernels_and_eager_pytorch_agree(arch):
    """The "compiled" path on CPU is specula's C kernels (CpuKernelOps; torch.compile measured slower,
    docs/cpu.md); the eager path is PyTorch's ops (TorchOps). Same weights: tree logits agree to float
    tolerance and greedy speculative output is the same token for token."""
    model = tiny_model(arch, seed=5)
    compiled, eager = native(model, kernel="specula"), native(model, kernel="aten")
    assert type(compiled.decoder.ops).__name__ == "CpuKernelOps" and type(eager.decoder.ops).__name__ == "TorchOps"
    rng = random.Random(6)
    prompt = [rng.randrange(96) for _ in range(10)]
    tree = random_tree(rng, 10, 96)
    logits = []
    for backend in (compiled, eager):
        seq = backend.new_sequence()
        seq.prefill(prompt[:-1], logits="none")
        logits.append(seq.forward_tree(prompt[-1], tree))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    outs = [build_decoder("fusion", b, None, None, planner=False).generate(
        [5, 17, 33, 2, 5, 17, 40], SamplingParams(max_new_tokens=24, ignore_eos=True)).token_ids
        for b in (compiled, eager)]
    assert outs[0] == outs[1] == reference_greedy(model, [5, 17, 33, 2, 5, 17, 40], 24)


def test_unsupported_models_are_refused_with_the_fix_named():
    assert not supports(tiny_model("gpt2")) and supports(tiny_model("qwen2"))
    with pytest.raises(ConfigError, match='use backend="hf"$'):
        NativeDecoder.from_hf(tiny_model("gpt2"))


def _llama(**config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, initializer_range=0.3, **config)
    return LlamaForCausalLM(cfg).eval()


LONGROPE = {"rope_type": "longrope", "rope_theta": 100.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 3.5, 5.0, 6.5]}


def test_longrope_past_its_original_window_is_refused():
    """transformers switches longrope to its long factors once a pass reaches past the original
    window; one set of frequencies cannot follow it (logits differed from position 17 on)."""
    from specula.models.native import NativeUnsupported

    model = _llama(max_position_embeddings=64, rope_parameters=LONGROPE)
    assert not supports(model)
    with pytest.raises(NativeUnsupported, match='longrope.*past 16 positions; use backend="hf"$'):
        NativeDecoder.from_hf(model)
    within = _llama(max_position_embeddings=16, rope_parameters=LONGROPE)  # never past it: exact
    prompt = list(range(3, 16))
    torch.testing.assert_close(native(within).new_sequence().prefill(prompt, logits="all"),
                               within(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=1e-4)


def test_rope_rows_come_from_a_table_with_the_values_computed_for_them(monkeypatch):
    """`NativeDecoder.rope` on the CPU reads rows of a table of positions: each row equals the angles' cos and sin
    computed for the asked positions alone (bit for bit), from the first table, after it grows past a position it
    lacked, and after a new `inv_freq` or scaling (then made anew, not reused)."""
    import specula.models.native.model as native_model

    monkeypatch.setattr(native_model, "ROPE_TABLE_ROWS", 8)
    decoder = NativeDecoder.from_hf(tiny_model("llama", seed=1))
    gen = torch.Generator().manual_seed(3)
    sizes = []
    for top in (5, 8, 12, 7, 120, 64):
        positions = torch.cat([torch.randint(0, top, (11,), generator=gen), torch.tensor([top - 1])])
        cos, sin = decoder.rope(positions)
        want_cos, want_sin = decoder.rope_rows(positions)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        sizes.append(len(decoder._rope_table[2]))
    assert sizes == [8, 8, 16, 16, 120, 120]  # the first 8 rows, doubled, then what a pass asked past twice that
    decoder.inv_freq = decoder.inv_freq * 0.5
    decoder.rope_scaling = 0.75
    positions = torch.tensor([0, 3, 119, 2])
    cos, sin = decoder.rope(positions)
    assert torch.equal(cos, decoder.rope_rows(positions)[0]) and torch.equal(sin, decoder.rope_rows(positions)[1])
    assert decoder._rope_table[0] is decoder.inv_freq and len(decoder._rope_table[2]) == 120
    assert not torch.equal(cos, native_model.NativeDecoder.rope_rows(NativeDecoder.from_hf(tiny_model("llama", seed=1)),
                                                                       positions)[0])


def test_cost_key_names_the_native_backend():
    key = native(tiny_model("llama"), kernel="onednn").cost_key()
    assert key["backend"] == "native" and key["linear_kernel"] == "onednn" and key["quantize"] == "none"


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 17])
def test_kernel_linear_matches_f_linear_and_rows_are_independent(rows):
    from torch import nn

    from specula.models.native.kernels import KernelLinear

    torch.manual_seed(rows)
    lin = nn.Linear(70, 37)  # odd sizes: padded blocks and tails
    x = torch.randn(rows, 70)
    for kind, tol in (("f32", 1e-5), ("w8", 2e-2)):
        layer = KernelLinear(lin, kind)
        y = layer(x)
        torch.testing.assert_close(y, lin(x), atol=tol * 10, rtol=tol)
        for r in range(rows):  # each row alone gives the same bits
            assert torch.equal(layer(x[r : r + 1])[0], y[r]), (kind, r)
    assert KernelLinear(lin, "w8").memory_bytes == 48 * 70  # int8, 37 outputs padded to 48


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
@pytest.mark.parametrize("in_features", [300, 1537])
def test_avx2_verification_rows_in_chunks_give_each_row_its_own_bits(in_features):
    """AVX2 calls of 7-63 rows run each column block in chunks of 128 inputs, every even row group
    over a chunk before the next (`CHUNKED_ITEM` in linear.c): the bits of each row alone."""
    from torch import nn

    from specula.models.native.kernels import KernelLinear

    before = kernels.isa()
    kernels.set_isa("avx2")
    try:
        torch.manual_seed(in_features)
        lin = nn.Linear(in_features, 45)
        for kind, tol in (("f32", 1e-5), ("w8", 2e-2)):
            layer = KernelLinear(lin, kind)
            for rows in (7, 8, 12, 13, 19, 31, 63):
                x = torch.randn(rows, in_features)
                y = layer(x)
                torch.testing.assert_close(y, lin(x), atol=tol * 10, rtol=tol)
                for r in range(rows):
                    assert torch.equal(layer(x[r : r + 1])[0], y[r]), (kind, rows, r)
    finally:
        kernels.set_isa(before)


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
@pytest.mark.parametrize("kind", ["f32", "w8", "i8", "i4"])
def test_kernel_linear_reads_back_chosen_weight_rows_as_it_computes_with_them(kind):
    """`weight_rows` reads rows out of the packed layout (odd sizes: padded blocks, i8 quads, i4
    nibbles and group scales): the same values a pass over the identity gives (head(I) = W^T),
    without computing every row."""
    from torch import nn

    from specula.models.native.kernels import KernelLinear

    torch.manual_seed(3)
    lin = nn.Linear(37, 53, bias=False)
    layer = KernelLinear(lin, kind)
    ids = torch.tensor([52, 0, 17, 16, 5, 17])
    through_identity = layer(torch.eye(37)).t()[ids]
    if kind == "i4":  # the pass rounds (127 q) s / 127 in float: the same value to a rounding
        torch.testing.assert_close(layer.weight_rows(ids), through_identity, rtol=1e-6, atol=1e-8)
    else:
        assert torch.equal(layer.weight_rows(ids), through_identity)
    # i4: within half a step of its group (largest |w| / 7) of the float weight
    atol = {"f32": 0, "w8": 1e-3, "i8": 1e-3, "i4": lin.weight.abs().max().item() / 14 + 1e-6}[kind]
    torch.testing.assert_close(layer.weight_rows(ids), lin.weight[ids].detach(), atol=atol,
                               rtol=0 if kind in ("f32", "i4") else 1e-2)


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
@pytest.mark.parametrize("kind", ["f32", "w8", "i8", "i4"])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_linear_rows_taken_out_are_those_rows_packed_alone(kind, bias):
    """`take_rows` cuts rows out of the packed layout (odd sizes: padded blocks, i8 quads, i4 nibbles
    and group scales): the very bytes and scales packing those rows alone makes, padding included,
    and outputs the full layer's columns bit for bit."""
    from torch import nn

    from specula.models.native.kernels import KernelLinear

    torch.manual_seed(5)
    lin = nn.Linear(37, 53, bias=bias)
    layer = KernelLinear(lin, kind)
    block = kernels.library().specula_block()
    for ids in (torch.tensor([52, 0, 17, 16, 5, 33]), torch.arange(53), torch.arange(block, 2 * block)):
        alone = nn.Linear(37, len(ids), bias=bias)
        alone.weight = nn.Parameter(lin.weight[ids].detach().clone())
        if bias:
            alone.bias = nn.Parameter(lin.bias[ids].detach().clone())
        expected, got = KernelLinear(alone, kind), layer.take_rows(ids)
        assert (got.in_features, got.out_features) == (37, len(ids))
        assert torch.equal(got.packed, expected.packed)
        for name in ("scale", "bias"):
            want, have = getattr(expected, name), getattr(got, name)
            assert (want is None and have is None) or torch.equal(have, want)
        x = torch.randn(5, 37)
        assert torch.equal(got(x), layer(x)[:, ids])

OUT_OF_MEMORY = """
import resource, sys
import torch
from specula.models.native.kernels import KernelLinear
layer = KernelLinear(torch.nn.Linear(256, 64), sys.argv[1])
x = torch.randn(200_000, 256)  # packed (f32, w8) or quantized (i8, i4) copies: 51-205 MB
layer(x[:40])  # the thread pool started before the limit
out = torch.full((x.shape[0], 64), 7.0)
vm = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), resource.RLIM_INFINITY))
try:
    layer.into(x, out)
    print("no error")
except MemoryError as e:
    print(e)
print("untouched", bool((out == 7.0).all()))
"""


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and limits the address space")
@pytest.mark.parametrize("kind", kernels.KINDS)
def test_kernel_linear_out_of_memory_is_an_error_not_garbage(kind):
    """A kernel that cannot allocate its packed or quantized rows returns -1 and leaves y alone;
    `KernelLinear` raises MemoryError (the one-call passes stop and raise on the same return)."""
    done = subprocess.run([sys.executable, "-c", OUT_OF_MEMORY, kind], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"specula's {kind} kernel could not allocate its packed or quantized rows (200000 x 256)" in done.stdout
    assert "untouched True" in done.stdout and "no error" not in done.stdout


def kernel_attention(q, k, v, mask, start, threads=2):
    """`ops.kernel_attention` with torch's thread count set to `threads` for the call."""
    from specula.models.native.ops import kernel_attention as attend

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return attend(q, k, v, mask, start)
    finally:
        torch.set_num_threads(before)


def random_parents(rng: random.Random, n: int) -> list[int]:
    """A random tree of n nodes in topological order: parents[i] < i, or -1 for a child of the root."""
    return [rng.randrange(-1, i) for i in range(n)]


def tree_mask(parents: list[int], start: int) -> torch.Tensor:
    """Bool [n, start + n]: node i sees the prefix, its ancestors and itself."""
    n = len(parents)
    mask = torch.zeros(n, start + n, dtype=torch.bool)
    mask[:, :start] = True
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, start + j] = True
            j = parents[j]
    return mask


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (14, 2, 64), (12, 2, 128), (4, 4, 80), (8, 1, 8)])
@pytest.mark.parametrize("start,n", [(0, 1), (0, 7), (37, 1), (37, 16), (300, 9)])
def test_kernel_attention_is_softmax_attention(heads, kv_heads, d, start, n):
    """The attention kernel computes softmax(q . k / sqrt(d)) v over each row's visible slots, causal
    and under a tree mask, for grouped heads of any multiple of 8 dims (32-dim blocks and tails)."""
    torch.manual_seed(start + n + d)
    rng = random.Random(start * 31 + n)
    cap = start + n + 5
    q = torch.randn(n, heads, d)
    k, v = torch.randn(kv_heads, cap, d) * 2, torch.randn(kv_heads, cap, d)
    causal = torch.ones(n, start + n, dtype=torch.bool).tril(start)
    for mask in (None, tree_mask(random_parents(rng, n), start)):
        seen = causal if mask is None else mask
        kk = k[:, : start + n].repeat_interleave(heads // kv_heads, 0).double()  # [H, slots, D]
        vv = v[:, : start + n].repeat_interleave(heads // kv_heads, 0).double()
        logits = torch.einsum("nhd,hsd->nhs", q.double(), kk) * d ** -0.5
        logits = logits.masked_fill(~seen[:, None, :], float("-inf"))
        expected = torch.einsum("nhs,hsd->nhd", logits.softmax(-1), vv).float()
        torch.testing.assert_close(kernel_attention(q, k, v, mask, start), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
def test_kernel_attention_refuses_layouts_it_would_misread():
    from specula.models.native.ops import kernel_attention as attend

    q, k, v = torch.randn(3, 4, 16), torch.randn(2, 10, 16), torch.randn(2, 10, 16)
    assert attend(q, k, v, None, 2).shape == (3, 4, 16)
    strided_q = q.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, not row-major
    strided_k = k.transpose(1, 2).contiguous().transpose(1, 2)
    for args in ((strided_q, k, v), (q, strided_k, v), (q.double(), k, v), (q, k, v[:, :, :8].contiguous())):
        with pytest.raises(ValueError, match="kernel_attention"):
            attend(*args, None, 2)
    with pytest.raises(ValueError, match="mask must be"):
        attend(q, k, v, torch.ones(3, 4, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="scores scratch"):
        attend(q, k, v, None, 2, scores=torch.empty(3 * 4 * 5 - 1))


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
@pytest.mark.parametrize("heads,kv_heads,d,start", [(9, 3, 64, 37), (14, 2, 64, 203), (12, 2, 128, 64), (6, 3, 24, 9)])
def test_kernel_attention_tree_rows_are_bitwise_one_token_rows(heads, kv_heads, d, start):
    """A tree row, its ancestors in scattered slots and computed beside other rows and heads (item
    groupings of 1 and 2 threads), gives the bits of the one-token step of the same tokens: the
    ancestors in consecutive slots, the row alone and causal."""
    torch.manual_seed(start)
    rng = random.Random(start)
    n = 13
    parents = random_parents(rng, n)
    q = torch.randn(n, heads, d)
    k, v = torch.randn(kv_heads, start + n, d), torch.randn(kv_heads, start + n, d)
    mask = tree_mask(parents, start)
    rows = [kernel_attention(q, k, v, mask, start, threads) for threads in (1, 2)]
    assert torch.equal(rows[0], rows[1])
    for i in range(n):
        path = [j for j in range(i + 1) if mask[i, start + j]]  # ancestors then i, in slot order
        kk, vv = k[:, : start + len(path)].clone(), v[:, : start + len(path)].clone()
        kk[:, start:], vv[:, start:] = k[:, [start + j for j in path]], v[:, [start + j for j in path]]
        one = kernel_attention(q[i : i + 1].clone(), kk, vv, None, start + len(path) - 1)
        assert torch.equal(rows[0][i], one[0]), i


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
@pytest.mark.parametrize("heads,kv_heads,d,start,n", [(9, 3, 64, 0, 90), (9, 3, 64, 37, 61), (12, 2, 128, 5, 40),
                                                      (6, 3, 24, 16, 33), (8, 8, 8, 0, 20)])
def test_a_prompts_attention_rows_are_bitwise_one_token_rows_on_every_variant(isa, heads, kv_heads, d, start, n):
    """A prompt's rows (many queries an item: on AVX-512, scores 16 keys at a time from transposed blocks) give
    the bits of each row alone (one query row: scores 4 keys at a time) on AVX2 and AVX-512 alike, on one thread
    and two, causal and under a mask that hides a few keys."""
    torch.manual_seed(n + d)
    q = torch.randn(n, heads, d)
    k, v = torch.randn(kv_heads, start + n + 3, d), torch.randn(kv_heads, start + n + 3, d)
    hidden = torch.ones(n, start + n, dtype=torch.bool).tril(start)
    hidden[n // 2:, start // 2] = False  # later rows do not see one prefix key: the masked kernel path
    results: dict[bool, list[torch.Tensor]] = {False: [], True: []}  # masked -> each variant's rows
    for variant in ("avx2", "avx512"):
        if isa(variant) != variant:
            continue  # this CPU has no AVX-512
        for mask in (None, hidden):
            rows = [kernel_attention(q, k, v, mask, start, threads) for threads in (1, 2)]
            assert torch.equal(rows[0], rows[1])
            for i in range(0, n, 7):
                if mask is None:
                    one = kernel_attention(q[i: i + 1].clone(), k, v, None, start + i)
                else:
                    seen = mask[i: i + 1, : start + i + 1].clone()  # its row, up to its own slot
                    one = kernel_attention(q[i: i + 1].clone(), k, v, seen, start + i)
                assert torch.equal(rows[0][i], one[0]), (variant, i)
            results[mask is not None].append(rows[0])
    assert all(torch.equal(rows[0], other) for rows in results.values() for other in rows[1:])


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
def test_long_prefills_run_on_the_row_invariant_kernels(isa):
    """float32 calls of many rows (long prompts) run on the kernels, like tree passes: every row of a
    200-row call is bitwise the row alone (AVX-512 items then take panels of column blocks), a long
    prefill's logits equal Hugging Face's and, bit for bit, the one-token steps of the same tokens
    (its attention is the decoding kernel's too), and speculative output equals plain decoding."""
    from torch import nn

    from specula.models.native.kernels import KernelLinear

    torch.manual_seed(0)
    lin = nn.Linear(70, 300)  # 19 column blocks: panels of 4 with 2 threads
    layer = KernelLinear(lin, "f32")
    x = torch.randn(200, 70)
    for variant in ("avx2", "avx512"):
        isa(variant)
        got = layer(x)
        torch.testing.assert_close(got, lin(x), atol=1e-4, rtol=1e-5)
        for r in (0, 63, 64, 199):
            assert torch.equal(layer(x[r : r + 1])[0], got[r]), (variant, r)
    model = tiny_model("qwen2", "eager", seed=2)
    target = native(model, kernel="specula")
    ids = [(7 * k + 3) % 60 for k in range(140)]  # 140 rows, within the tiny vocabulary
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0]
    logits = target.new_sequence().prefill(ids, logits="all")
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    stepped = target.new_sequence()  # the prompt's last rows one token at a time: the same bits
    stepped.prefill(ids[:136], logits="none")
    for row in range(136, 140):
        assert torch.equal(stepped.prefill([ids[row]], logits="last"), logits[row]), row
    prompt = [5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17, 60, 61, 5, 17] * 6
    plain = build_decoder("none", target, None, None).generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
    spec = build_decoder("prompt-lookup", target, None, None, planner=False).generate(
        prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert spec.token_ids == plain.token_ids and spec.stats.accepted_tokens > 0


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
@pytest.mark.parametrize("logits", ["all", "last", "none"])
def test_a_prefill_longer_than_a_pass_runs_in_passes_bit_for_bit_as_one(logits):
    """On the row-invariant CPU kernels a long prompt runs in passes of `prefill_pass` tokens (faster where one
    pass's activations outgrow the caches): the same logits, hidden states (inner layers' too) and cache."""
    from specula.models.native.backend import prefill_pass_of

    model = tiny_model("qwen2", "eager", seed=2)
    target = native(model, kernel="specula")
    assert target.prefill_pass == prefill_pass_of(model.config.intermediate_size)
    assert native(model, kernel="aten").prefill_pass is None  # not row invariant: one pass
    assert (prefill_pass_of(8960), prefill_pass_of(1536), prefill_pass_of(10 ** 6)) == (292, 1706, 64)
    ids = [(7 * k + 3) % 60 for k in range(40)]
    target.prefill_pass = None
    one = target.new_sequence()
    want = one.prefill(ids, logits=logits, hidden=(1, 2))
    target.prefill_pass = 7  # 6 passes, the last of 5 tokens
    parts = target.new_sequence()
    got = parts.prefill(ids, logits=logits, hidden=(1, 2))
    assert (got[0] is None) == (want[0] is None) == (logits == "none")
    if logits != "none":
        assert got[0].shape == want[0].shape and torch.equal(got[0], want[0])
    assert got[1].shape[0] == len(ids) and torch.equal(got[1], want[1])
    assert parts.tokens == one.tokens == ids
    assert torch.equal(parts.prefill([9], logits="last"), one.prefill([9], logits="last"))


def test_native_kernels_unavailable_is_a_clear_error(monkeypatch):
    from specula.models.prepack import resolve_linear_kernel

    monkeypatch.setattr(kernels, "unavailable_reason", lambda: "no C compiler (cc) was found; install gcc")
    with pytest.raises(ConfigError, match="install gcc"):
        resolve_linear_kernel("specula", dtype=torch.float32, device="cpu", quantize="none", native=True)
    assert resolve_linear_kernel("auto", dtype=torch.float32, device="cpu", quantize="none", native=True) == "onednn"


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
@pytest.mark.parametrize("change", [{"head_dim": 12}, {"head_dim": 264}, {"num_heads": 65, "num_kv_heads": 1}])
def test_attention_kernel_limits_are_refused_with_the_fix_named(change):
    import dataclasses

    decoder = NativeDecoder.from_hf(tiny_model("qwen2"))
    decoder.cfg = dataclasses.replace(decoder.cfg, **change)
    with pytest.raises(ConfigError, match='use linear_kernel="onednn"$'):
        configure(decoder, "specula", "none", "sdpa")


def test_greedy_guarantee_of_each_backend_and_mode():
    model = tiny_model("qwen2", seed=1)
    assert HFCausalLM(model).greedy_guarantee == "float32"
    assert native(model, kernel="aten").greedy_guarantee == "float32"
    assert native(model, kernel="aten", quantize="int8", invariant=True).greedy_guarantee == "bitwise"
    assert native(tiny_model("qwen2", seed=1).to(torch.bfloat16), kernel="aten").greedy_guarantee == "near-ties"
    if kernels.available():
        assert native(model, kernel="specula").greedy_guarantee == "bitwise"


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
@pytest.mark.parametrize("method", ["prompt-lookup", "fusion"])
def test_batched_step_gives_every_session_what_it_gets_alone(method, monkeypatch):
    """Continuous batching: sessions joining and leaving, every step one packed pass for all running
    sessions (one decoder call), and each session's output exactly its solo output (greedy and
    seeded sampling)."""
    model = tiny_model("qwen2", seed=3)
    target = native(model, kernel="specula")
    draft = native(perturbed_copy(model, 0.2), kernel="specula") if method == "fusion" else None
    dec = build_decoder(method, target, None, draft, planner=False)
    requests = [([5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], SamplingParams(max_new_tokens=30, ignore_eos=True)),
                ([60, 61, 62, 63], SamplingParams(max_new_tokens=12, ignore_eos=True)),
                ([9, 8, 7, 9, 8], SamplingParams(max_new_tokens=25, ignore_eos=True, temperature=0.9, seed=4)),
                ([70, 71, 70, 71, 70], SamplingParams(max_new_tokens=20, ignore_eos=True))]
    alone = [dec.generate(prompt, params).token_ids for prompt, params in requests]
    assert alone[0] == reference_greedy(model, requests[0][0], 30)

    calls = []
    forward = target.decoder.forward
    monkeypatch.setattr(target.decoder, "forward", lambda *a, **k: calls.append(len(a[2])) or forward(*a, **k))
    sessions = [dec.start(*requests[0]), dec.start(*requests[1])]
    started = list(sessions)
    steps = 0
    while sessions:
        calls.clear()
        chunks = dec.step(sessions)
        assert calls == [len(sessions)], calls  # one pass holds every running session's rows
        for session, chunk in zip(list(sessions), chunks):
            if chunk.finished:
                dec.finish(session)
                sessions.remove(session)
        steps += 1
        if steps == 3:  # later requests join a running batch
            sessions += [dec.start(*requests[2]), dec.start(*requests[3])]
            started += sessions[-2:]
    assert [s.generated for s in started] == alone
