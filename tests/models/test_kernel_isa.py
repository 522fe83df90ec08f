"""The kernels' AVX-512 variants (`kernels/linear_avx512.c`): the same bits as the AVX2 code for
every kind, row count and shape, so a tree pass (many rows) and a one-token step (one row) compute
every row alike whichever items run them; the variant is chosen by the CPU flags or SPECULA_KERNEL_ISA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from specula.errors import ConfigError
from specula.models.native import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")

HAS_AVX512 = {"avx512f", "avx512bw", "avx512_vnni"} <= kernels.cpu_flags()
needs_avx512 = pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512 F/BW/VNNI")


def _has_amx() -> bool:
    if not (HAS_AVX512 and {"amx_tile", "amx_int8"} <= kernels.cpu_flags()):
        return False
    before = kernels.isa()
    try:
        return kernels.set_isa("amx") == "amx"  # the OS grants the tile state too
    finally:
        kernels.set_isa(before)


HAS_AMX = kernels.available() and _has_amx()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU or OS offers no AMX-INT8")


@needs_avx512
@pytest.mark.parametrize("kind", kernels.KINDS)
@pytest.mark.parametrize("shape,bias", [((70, 37), True), ((300, 515), False), ((1537, 16), True), ((3, 9), False),
                                        ((64, 1000), True), ((40, 667), False)])
def test_avx512_computes_the_bits_of_avx2(isa, kind, shape, bias):
    torch.manual_seed(shape[0] + shape[1])
    layer = kernels.KernelLinear(nn.Linear(*shape, bias=bias), kind)
    # 1-14: items of 4, 3 or 2 column blocks (a last item of fewer: 1000 and 667 outputs); 65, 200: panels
    # 15-63: rows where they lie, f32 / w8 up to 17 in one run, then even runs (33 = 11 + 11 + 11,
    # 63 = 15 + 16 + 16 + 16); i8 with VNNI: 1-8 rows in items of 4, 3 or 2 column blocks (a last
    # item of fewer), then even runs of at most 16 (17 = 8 + 9) over one block
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 15, 16, 17, 18, 20, 31, 33, 47, 63, 65, 200):
        x = torch.randn(rows, shape[0]) * 2  # [rows, in]
        assert isa("avx2") == "avx2"
        want = layer(x)
        assert isa("avx512") == "avx512"
        got = layer(x)
        assert torch.equal(got, want), (kind, shape, rows, (got - want).abs().max())
        # each row alone gives the same bits as in the call
        for r in (0, rows // 2, rows - 1):
            assert torch.equal(layer(x[r : r + 1])[0], got[r]), (kind, rows, r)


@needs_avx512
@pytest.mark.parametrize("kind", ["i8", "i4"])
def test_vnni_bits_do_not_depend_on_the_blocks_an_item(isa, kind):
    """Few-row VNNI calls run items of one column block (AMD) or of several (`kernels.set_several_block_items`):
    the same bits either way, and AVX2's, the last item of fewer blocks included (1000 and 667 outputs)."""
    assert isa("avx512") == "avx512"
    try:
        for out in (1000, 667):
            torch.manual_seed(out)
            layer = kernels.KernelLinear(nn.Linear(128, out, bias=True), kind)
            for rows in range(1, 11):
                x = torch.randn(rows, 128) * 2  # [rows, in]
                got = {}
                for several in (False, True):
                    assert kernels.set_several_block_items(several) is several
                    got[several] = layer(x)
                assert isa("avx2") == "avx2"
                want = layer(x)
                assert isa("avx512") == "avx512"
                assert torch.equal(got[False], want) and torch.equal(got[True], want), (kind, out, rows)
    finally:
        kernels.set_several_block_items(None)


@needs_avx512
def test_vnni_int8_is_the_exact_integer_dot_product(isa):
    """Activation and weight values at the int8 extremes (+-127, 0): the VNNI kernel's offset
    (u = q + 128, minus 128 x the column sums) must give sum(q_x * q_w) exactly."""
    isa("avx512")
    out_features, in_features = 32, 64
    q = torch.tensor([127, -127, 0, 1, -1, 64, -64, 3], dtype=torch.float32)
    weight = q.repeat(out_features * in_features // len(q)).reshape(out_features, in_features)
    weight[::2] *= -1  # mixed signs across columns
    layer = kernels.KernelLinear(_with_weight(weight), "i8")
    x = torch.stack([q.roll(k).repeat(in_features // len(q)) for k in range(9)])  # [9, 64], max |x| = 127
    exact = (x.double() @ weight.double().T)  # integers: every scale is 1
    got = layer(x)
    assert torch.equal(got.double(), exact), (got.double() - exact).abs().max()


@pytest.mark.parametrize("variant", ["avx2", pytest.param("avx512", marks=needs_avx512),
                                     pytest.param("amx", marks=needs_amx)])
@pytest.mark.parametrize("in_features", [37, 128, 1000])
def test_i8_is_the_int8_arithmetic_of_its_definition(isa, variant, in_features):
    """Random rows through i8, bit for bit the arithmetic written out in torch: each row quantized
    as q = round_half_even(x * (1 / (max|x| / 127))) (tails of 32 and of 8 inputs, an all-zero row),
    the int32 sum of q_x * q_w exact, then float(sum) * x_scale * w_scale + b in that order."""
    from specula.models.quantize import quantize_rows

    assert isa(variant) == variant
    torch.manual_seed(in_features)
    lin = nn.Linear(in_features, 40)
    layer = kernels.KernelLinear(lin, "i8")
    q_w, s_w = quantize_rows(lin.weight)  # [40, in] int8, [40]
    for rows in (1, 5, 17, 40):
        x = torch.randn(rows, in_features) * torch.logspace(-3, 3, rows)[:, None]  # [rows, in]
        x[rows // 2] = 0.0
        amax = x.abs().amax(dim=1)
        s_x = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))  # [rows]
        q_x = torch.round(x * (1.0 / s_x)[:, None])
        exact = (q_x.double() @ q_w.double().T).float()  # [rows, 40]: integers below 2^24
        want = exact * s_x[:, None] * s_w[None, :] + lin.bias.detach()
        got = layer(x)
        assert torch.equal(got, want), (variant, in_features, rows, (got - want).abs().max())


@needs_amx
@pytest.mark.parametrize("kind", ["i8", "i4"])
@pytest.mark.parametrize("shape,bias", [((64, 1000), True), ((128, 48), False), ((576, 17), True), ((70, 37), True)])
def test_amx_computes_the_bits_of_vnni_and_avx2(isa, kind, shape, bias):
    """int8 calls of AMX_ROWS (10) rows or more whose inputs are a multiple of 64 run on AMX tiles
    (pairs of column blocks, a lone last block, chunks of 128 rows, rows padded to tiles of 16); 70
    inputs stay on VNNI (i8) or run on tiles as two groups of 64, the second padded (i4, from 16
    rows on). Every output is the bits of the other variants, and of its row alone."""
    torch.manual_seed(shape[0] * 7 + shape[1])
    layer = kernels.KernelLinear(nn.Linear(*shape, bias=bias), kind)
    for rows in (1, 9, 10, 15, 16, 17, 31, 32, 33, 48, 127, 129, 300):
        x = torch.randn(rows, shape[0]) * 3  # [rows, in]
        want = {name: (isa(name), layer(x))[1] for name in ("avx2", "avx512")}
        assert isa("amx") == "amx"
        got = layer(x)
        for name, value in want.items():
            assert torch.equal(got, value), (name, shape, rows, (got - value).abs().max())
        for r in (0, rows // 2, rows - 1):
            assert torch.equal(layer(x[r : r + 1])[0], got[r]), (shape, rows, r)


@needs_amx
def test_amx_int8_is_the_exact_integer_dot_product(isa):
    """Values at the int8 extremes: the tiles' signed-by-signed sums are sum(q_x * q_w) exactly."""
    isa("amx")
    out_features, in_features = 48, 128
    q = torch.tensor([127, -127, 0, 1, -1, 64, -64, 3], dtype=torch.float32)
    weight = q.repeat(out_features * in_features // len(q)).reshape(out_features, in_features)
    weight[::2] *= -1
    layer = kernels.KernelLinear(_with_weight(weight), "i8")
    x = torch.stack([q.roll(k).repeat(in_features // len(q)) for k in range(20)])  # [20, 128], max |x| = 127
    exact = x.double() @ weight.double().T
    got = layer(x)
    assert torch.equal(got.double(), exact), (got.double() - exact).abs().max()


@pytest.mark.parametrize("variant", ["avx2", pytest.param("avx512", marks=needs_avx512),
                                     pytest.param("amx", marks=needs_amx)])
def test_i4_is_the_exact_integer_dot_product(isa, variant):
    """4-bit weights at their extremes (+-7, 0) with every group's largest at 7 (group scale 1) and
    activations at the int8 extremes (+-127: row scale 1): the nibbles' zero point (w + 8, minus 8 x
    each group's activation sum; AMX: the nibbles unpacked to signed bytes) must give sum(q_x * q_w)
    exactly, over 3 groups and a padded tail."""
    assert isa(variant) == variant
    out_features, in_features = 40, 150  # 150 inputs: two whole groups of 64 and 22 of a third
    q = torch.tensor([7, -7, 0, 1, -1, 4, -4, 3], dtype=torch.float32)
    weight = q.repeat(out_features * 152 // len(q)).reshape(out_features, 152)[:, :in_features].clone()
    weight[::2] *= -1  # mixed signs across columns
    weight[:, 128] = 7  # the tail group's largest is 7 too
    layer = kernels.KernelLinear(_with_weight(weight), "i4")
    xq = torch.tensor([127, -127, 0, 1, -1, 64, -64, 3], dtype=torch.float32)
    x = torch.stack([xq.roll(k).repeat(19)[:in_features] for k in range(17)])  # [17, 150]: AMX from 16 rows
    exact = x.double() @ weight.double().T  # integers: every scale is 1
    got = layer(x)
    assert torch.equal(got.double(), exact), (got.double() - exact).abs().max()


def _with_weight(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return lin


@pytest.mark.parametrize("value,want", [
    ("avx2", "avx2"), ("auto", "amx" if HAS_AMX else "avx512" if HAS_AVX512 else "avx2"),
    ("avx512", "avx512" if HAS_AVX512 else "lacks AVX-512 F/BW/VNNI; use auto or avx2"),
    ("amx", "amx" if HAS_AMX else "AMX_INT8 not offered" if HAS_AVX512 else "lacks AVX-512 F/BW/VNNI"),
    ("sse", "'sse' is not a kernel ISA; use auto, avx2, avx512 or amx")])
def test_the_environment_picks_the_variant(value, want):
    code = "from specula.models.native import kernels; print(kernels.isa())"
    env = {**os.environ, kernels.ISA_ENV: value}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if want == "AMX_INT8 not offered":  # AVX-512 without AMX: the CPU or the OS
        assert done.returncode != 0 and ("lacks AMX-INT8" in done.stderr or "tile state" in done.stderr), done.stderr
        assert "use auto or avx512" in done.stderr, done.stderr
    elif want not in kernels.ISAS:
        assert done.returncode != 0 and want in done.stderr, done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[-1] == want


def test_an_unknown_variant_is_refused():
    with pytest.raises(ConfigError, match="unknown kernel ISA 'avx1024'; choose avx2, avx512 or amx"):
        kernels.set_isa("avx1024")


def test_passes_of_zero_rows_return_nothing_on_every_isa_and_kind():
    """A linear of 0 rows ran its row switch's default (16 rows read and written past the buffers:
    a segfault on AVX-512 and AMX), and attention over 0 query rows divided by zero (SIGFPE): in a
    child process, every kind on every ISA this CPU has returns an empty result."""
    isas = ["avx2"] + (["avx512"] if HAS_AVX512 else []) + (["amx"] if HAS_AMX else [])
    code = f"""
import torch
from torch import nn
from specula.models.native import kernels
from specula.models.native.ops import kernel_attention
for isa in {isas!r}:
    kernels.set_isa(isa)
    for kind in kernels.KINDS:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert tuple(kernels.KernelLinear(nn.Linear(64, 40), kind)(torch.randn(0, 64)).shape) == (0, 40)
    assert tuple(kernel_attention(torch.randn(0, 4, 8), torch.randn(2, 16, 8), torch.randn(2, 16, 8), None, 5).shape)[0] == 0
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-500:])
