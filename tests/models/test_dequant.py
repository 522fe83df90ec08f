"""GGUF blocks dequantised in C (`kernels.dequant`): the same bits as gguf-py's numpy for every type
`gguf.c` knows, gguf-py's own result for any other."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from modelkit import QUANTIZED_GGUF_TYPES, random_gguf_blocks  # noqa: E402

from specula.models.native import kernels  # noqa: E402
from specula.models.native.kernels import dequant  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")

T = gguf.GGMLQuantizationType
KNOWN = [T[name] for name in QUANTIZED_GGUF_TYPES]
"""Each type gguf.c knows: those of the embedded models' GGUFs."""


def halves(n: int, rng: np.random.Generator) -> np.ndarray:
    """n finite float16 values: normal ones of both signs and magnitudes, with zeros, negative
    zeros, subnormals and the largest finite values among them."""
    values = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 4, n)).astype(np.float16)
    special = np.array([0.0, -0.0, 6e-8, -6e-8, 3e-5, 65504.0, -65504.0], dtype=np.float16)
    values[: min(n, len(special))] = special[: min(n, len(special))]
    values[~np.isfinite(values)] = 1.0
    return values


def random_tensor(qtype, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """A tensor's bytes [rows, row bytes] as the GGUF reader gives them: random quants and scales,
    finite float16 fields."""
    rng = np.random.default_rng(seed)
    blocks = random_gguf_blocks(qtype.name, rows * blocks_per_row, rng, lambda n: halves(n, rng))
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", KNOWN, ids=lambda t: t.name)
def test_same_bits_as_gguf_py(qtype):
    data = random_tensor(qtype, rows=37, blocks_per_row=3, seed=int(qtype))
    assert dequant.known(qtype)
    ours = dequant.dequantize(data, qtype)  # [37, 3 * block values]
    theirs = gguf.dequantize(data, qtype)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert np.isfinite(ours).all() and (ours != 0).mean() > 0.5  # real values, not a zero buffer


def test_a_row_slice_of_the_file_map_gives_the_same_bits():
    """The reader's tensors are views of the file's map, not always contiguous in numpy's sense."""
    data = random_tensor(T.Q4_K, rows=8, blocks_per_row=2)
    view = data[::2]
    assert not view.flags.c_contiguous
    assert np.array_equal(dequant.dequantize(view, T.Q4_K).view(np.uint32),
                          gguf.dequantize(view, T.Q4_K).view(np.uint32))


def test_other_types_go_to_gguf_py():
    rng = np.random.default_rng(1)
    f16 = rng.standard_normal((4, 64)).astype(np.float16)
    assert not dequant.known(T.F16)
    assert np.array_equal(dequant.dequantize(f16.view(np.uint8), T.F16), gguf.dequantize(f16.view(np.uint8), T.F16))
    q5k = rng.integers(0, 256, size=(2, gguf.GGML_QUANT_SIZES[T.Q5_K][1]), dtype=np.uint8)
    q5k[:, 0:4] = halves(4, rng).view(np.uint8).reshape(2, 4)
    assert not dequant.known(T.Q5_K)
    assert np.array_equal(dequant.dequantize(q5k, T.Q5_K), gguf.dequantize(q5k, T.Q5_K), equal_nan=True)


def test_without_the_kernels_gguf_py_dequantises(monkeypatch):
    monkeypatch.setattr(dequant, "_library", lambda: None)
    data = random_tensor(T.Q8_0, rows=3, blocks_per_row=2)
    assert not dequant.known(T.Q8_0)
    assert np.array_equal(dequant.dequantize(data, T.Q8_0), gguf.dequantize(data, T.Q8_0))


def test_a_failed_build_is_tried_once_and_gguf_py_dequantises(monkeypatch):
    from specula.errors import ConfigError

    attempts = []

    def failing_build():
        attempts.append(1)
        raise ConfigError("compiling specula's CPU kernels failed")

    dequant._library.cache_clear()
    monkeypatch.setattr(kernels, "library", failing_build)
    try:
        data = random_tensor(T.Q4_K, rows=2, blocks_per_row=1)
        for _ in range(3):
            assert np.array_equal(dequant.dequantize(data, T.Q4_K), gguf.dequantize(data, T.Q4_K))
        assert attempts == [1]
    finally:
        dequant._library.cache_clear()
