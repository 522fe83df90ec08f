"""c8 layers: float32 weights held as a GGUF's exact codes (`native.codes`, `kernels/linear_codes.c`). Every
output must be the f32 kernels' bit for bit, for any row count, so a model on c8 layers decodes exactly as
on f32 ones."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from modelkit import QUANTIZED_GGUF_TYPES, random_gguf_blocks, write_tiny_gguf  # noqa: E402
from tiny import random_tree  # noqa: E402

from specula.models.native import kernels  # noqa: E402
from specula.models.native.codes import CODES_ENV, SPAN, Codes, GgufCodes, codes_source  # noqa: E402
from specula.models.native.kernels import KernelLinear, dequant  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")

T = gguf.GGMLQuantizationType


def random_codes(out: int, inp: int, group: int, gen: torch.Generator) -> Codes:
    """Codes of a weight [out, in] whose (a, b) pairs change every `group` inputs: 4- and 6-bit quants,
    offsets and none (-0), negative and subnormal scales among them."""
    q = torch.randint(-32, 32, (out, inp), generator=gen, dtype=torch.int8)
    a = torch.randn(out, inp // group, generator=gen) * 10.0 ** torch.randint(-6, 0, (out, inp // group), generator=gen)
    b = torch.where(torch.rand(out, inp // group, generator=gen) < 0.3, torch.tensor(-0.0),
                    torch.randn(out, inp // group, generator=gen) * 0.05)
    a[0, 0], b[-1, -1] = 1e-41, 0.0  # a subnormal scale, a positive zero offset
    step = group // SPAN
    return Codes(q, a.repeat_interleave(step, dim=1), b.repeat_interleave(step, dim=1))


def linear_of(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


@pytest.fixture(params=["avx512", "avx2"])
def isa(request):
    was = kernels.isa()
    got = kernels.set_isa(request.param)
    if got != request.param:
        kernels.set_isa(was)
        pytest.skip(f"this CPU runs {got}, not {request.param}")
    yield got
    kernels.set_isa(was)


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("shape", [(37, 64), (130, 96), (48, 256)])
def test_c8_outputs_are_f32s_bit_for_bit_for_any_rows(isa, group, shape):
    """Decoding steps, trees (inline rebuild up to MULTI_ROWS rows), larger trees and prompts (rebuilt
    blocks): one and two threads, with and without a bias, columns not a whole block."""
    gen = torch.Generator().manual_seed(group + shape[0])
    codes = random_codes(*shape, group, gen)
    weight = codes.rebuild()
    assert codes.group() == group
    for bias in (None, torch.randn(shape[0], generator=gen)):
        f32 = KernelLinear(linear_of(weight, bias), "f32")
        c8 = KernelLinear(linear_of(weight, bias), "c8", codes=codes)
        assert c8.group == group and c8.memory_bytes < f32.memory_bytes / 2
        for rows in [*range(1, 19), 24, 31, 40, 63, 64, 65, 200]:
            x = torch.randn(rows, shape[1], generator=gen)
            for threads in (1, 2):
                want = f32.into(x, torch.empty(rows, shape[0]), threads)
                got = c8.into(x, torch.empty(rows, shape[0]), threads)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (rows, threads)


@pytest.mark.parametrize("several", [False, True])
def test_c8_bits_do_not_depend_on_the_blocks_an_item(isa, several):
    """Few-row calls run items of one column block (AMD) or of several (`kernels.set_several_block_items`):
    the same f32 bits either way, the last item of fewer blocks included (67 and 250 outputs)."""
    gen = torch.Generator().manual_seed(7)
    try:
        assert kernels.set_several_block_items(several) is several
        for out in (67, 250):
            codes = random_codes(out, 64, 32, gen)
            f32 = KernelLinear(linear_of(codes.rebuild(), None), "f32")
            c8 = KernelLinear(linear_of(codes.rebuild(), None), "c8", codes=codes)
            for rows in range(1, 18):
                x = torch.randn(rows, 64, generator=gen)
                for threads in (1, 2):
                    want = f32.into(x, torch.empty(rows, out), threads)
                    got = c8.into(x, torch.empty(rows, out), threads)
                    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (out, rows, threads)
    finally:
        kernels.set_several_block_items(None)


def test_c8_weight_rows_are_the_weights():
    gen = torch.Generator().manual_seed(5)
    codes = random_codes(40, 64, 16, gen)
    layer = KernelLinear(linear_of(codes.rebuild(), None), "c8", codes=codes)
    ids = torch.tensor([0, 17, 39, 5])
    assert torch.equal(layer.weight_rows(ids).view(torch.int32), codes.rebuild()[ids].view(torch.int32))


def test_c8_needs_codes_of_its_weights_shape():
    gen = torch.Generator().manual_seed(6)
    codes = random_codes(16, 32, 16, gen)
    with pytest.raises(ValueError, match="codes"):
        KernelLinear(linear_of(torch.zeros(16, 32), None), "c8")
    with pytest.raises(ValueError, match="codes"):
        KernelLinear(linear_of(torch.zeros(16, 32), None), "f32", codes=codes)
    with pytest.raises(ValueError, match="codes of"):
        KernelLinear(linear_of(torch.zeros(32, 32), None), "c8", codes=codes)


def halves(n: int, rng: np.random.Generator) -> np.ndarray:
    values = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 2, n)).astype(np.float16)
    values[: 4] = np.array([0.0, -0.0, 6e-8, -3e-5], dtype=np.float16)[: min(4, n)]
    return values


@pytest.mark.parametrize("name", QUANTIZED_GGUF_TYPES)
def test_gguf_blocks_codes_rebuild_their_dequantised_bits(name):
    """Every block type of the embedded models: the codes `gguf.c` reads rebuild what it dequantises, bit
    for bit (negative zeros, subnormal scales and all)."""
    rng = np.random.default_rng(11)
    qtype = T[name]
    blocks = random_gguf_blocks(name, 24, rng, lambda n: halves(n, rng))
    values = kernels.library().specula_gguf_block_values(int(qtype))
    want = dequant.dequantize(blocks, qtype).reshape(-1)  # [24 x values]
    q = torch.empty(24 * values, dtype=torch.int8)
    a, b = torch.empty(24 * values // SPAN), torch.empty(24 * values // SPAN)
    assert kernels.library().specula_gguf_codes(blocks.ctypes.data, q.data_ptr(), a.data_ptr(), b.data_ptr(), 24,
                                                int(qtype), 1) == 0
    got = Codes(q.view(1, -1), a.view(1, -1), b.view(1, -1)).rebuild().reshape(-1).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("c8") / "q.gguf", tie=False, seed=7, hidden=256,
                           quantized=True)


def test_codes_are_found_for_rows_permuted_and_fused_and_not_for_other_weights(quantized_gguf):
    reader = gguf.GGUFReader(str(quantized_gguf))
    found = {t.name: torch.from_numpy(dequant.dequantize(np.ascontiguousarray(t.data), t.tensor_type).copy())
             for t in reader.tensors if t.name.startswith("blk.0.attn_") and t.name.endswith("weight")
             and len(t.shape) == 2}
    codes = GgufCodes(quantized_gguf)
    q, k, v = found["blk.0.attn_q.weight"], found["blk.0.attn_k.weight"], found["blk.0.attn_v.weight"]
    perm = torch.randperm(len(q), generator=torch.Generator().manual_seed(0))
    fused = torch.cat([q[perm], k, v])  # Llama's permuted query rows, then q|k|v fused, as the decoder holds them
    got = codes.lookup(fused)
    assert got is not None and torch.equal(got.rebuild().view(torch.int32), fused.view(torch.int32))
    flipped = fused.clone()
    flipped.view(torch.int32)[3, 5] ^= 1  # one bit off: no row has it
    assert codes.lookup(flipped) is None
    assert codes.lookup(torch.randn(8, 256)) is None
    assert codes.lookup(fused[:, :128]) is None  # another width


def test_a_gguf_model_runs_c8_layers_with_f32s_every_output(quantized_gguf, monkeypatch):
    """Loaded from a GGUF of every embedded block type, the decoder's layer linears are c8 (its output layer
    f32) and every logit of a prompt and of a tree pass is the f32 model's, bit for bit; so is greedy
    decoding, plain and speculative."""
    import specula.api as sp
    from specula.models.loading import LoadConfig

    def loaded(codes: bool):
        monkeypatch.setenv(CODES_ENV, "1" if codes else "0")
        return sp.load(str(quantized_gguf), method="prompt-lookup", config=LoadConfig(prepared_cache="off"))

    plain, coded = loaded(False), loaded(True)
    monkeypatch.setenv(CODES_ENV, "off")  # the project's other switches' spellings of off turn it off too
    assert codes_source(SimpleNamespace(gguf_file=quantized_gguf)) is None
    monkeypatch.setenv(CODES_ENV, "1")
    assert codes_source(SimpleNamespace(gguf_file=quantized_gguf)) == quantized_gguf
    kinds = {m.kind for m in coded.target.decoder.modules() if isinstance(m, KernelLinear)}
    assert kinds == {"c8", "f32"} and coded.target.decoder.lm_head.kind == "f32"
    assert {m.kind for m in plain.target.decoder.modules() if isinstance(m, KernelLinear)} == {"f32"}
    prompt = "the a the the a"
    want = plain.generate(prompt, max_new_tokens=24, ignore_eos=True)
    assert coded.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids == want.token_ids
    ids = (coded.tokenizer.encode(prompt) * 30)[:90]  # a prompt of many rows: the rebuilt blocks' path
    rng = random.Random(3)
    for _ in range(3):
        tree = random_tree(rng, rng.randrange(1, 24), coded.target.vocab_size)
        outs = []
        for model in (plain, coded):
            seq = model.target.new_sequence()
            first = seq.prefill(ids, logits="all")
            outs.append((first, seq.forward_tree(ids[-1], tree)))
            seq.release()
        for want_logits, got_logits in zip(*outs):
            assert torch.equal(torch.as_tensor(got_logits).view(torch.int32),
                               torch.as_tensor(want_logits).view(torch.int32))
