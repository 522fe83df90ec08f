"""The native decoder's layers in one C call (`models/native/fused.py`, `kernels/layers.c`): the
same bits as the Python loop over the same kernels, for every weight kind, pass shape and tap."""

from __future__ import annotations

import random

import pytest
import torch

from tiny import random_tree, tiny_model

from specula.models.native import NativeDecoder, configure, kernels
from specula.models.native.cache import KVCache
from specula.models.native.fused import MAX_ROWS, FusedLayers
from specula.models.native.model import Segment

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")


def decoder_of(arch: str, quantize: str, seed: int = 3, layers: int = 3) -> NativeDecoder:
    """A tiny decoder on the C kernels, its norms' weights random (a model's start at ones, which
    would hide norms swapped for each other)."""
    decoder = configure(NativeDecoder.from_hf(tiny_model(arch, seed=seed, layers=layers)), "specula", quantize, "sdpa")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for norm in [decoder.final_norm, *(w for layer in decoder.layers for w in (layer.input_norm, layer.post_norm))]:
            norm.copy_(torch.rand(norm.shape, generator=gen) + 0.5)
    return decoder


def python_loop(monkeypatch) -> None:
    """Make every pass run the layers from Python (the reference)."""
    monkeypatch.setattr(FusedLayers, "of", staticmethod(lambda decoder: None))


def new_cache(decoder) -> KVCache:
    cfg = decoder.cfg
    return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float32, device=torch.device("cpu"))


def assert_prompt_states_are_the_python_loops(decoder, monkeypatch) -> None:
    """A 5-token prompt's states on the C loop equal the Python loop's (which runs from then on)."""
    got = run(decoder, new_cache(decoder), [3, 1, 4, 1, 5], 0, None, True, ())
    python_loop(monkeypatch)
    assert torch.equal(got, run(decoder, new_cache(decoder), [3, 1, 4, 1, 5], 0, None, True, ()))


def filled_cache(decoder, slots: int, seed: int) -> KVCache:
    """A cache of `slots` slots of random keys and values (a sequence's earlier slots, alike on both paths)."""
    cache = new_cache(decoder)
    cache.reserve(slots, 0)
    gen = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    return cache


def assert_pass_is_the_python_loops(one_pass, monkeypatch) -> None:
    """`one_pass()` -> (states, caches, whether the C loop took it) on the C loop, then on the Python loop: the C loop
    took it, and the states and every cache are bitwise the same."""
    got, got_caches, taken = one_pass()
    assert taken
    python_loop(monkeypatch)
    want, want_caches, _ = one_pass()
    assert torch.equal(got, want)
    for a, b in zip(got_caches, want_caches):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def run(decoder, cache, tokens, start, mask, prefill, taps, positions=None, skip=frozenset()):
    n = len(tokens)
    seg = Segment(cache, start, slice(0, n), mask, prefill)
    positions = torch.arange(start, start + n) if positions is None else positions
    return decoder(torch.tensor(tokens), positions, [seg], taps=taps, skip=skip)


def passes(rng: random.Random, vocab: int):
    """(tokens, start, mask, prefill, positions) of a prompt, one-token steps and a tree (its root and
    9 nodes, each seeing the prefix, the root and its ancestors), in order on one cache."""
    prompt = [rng.randrange(vocab) for _ in range(11)]
    yield prompt, 0, None, True, None
    yield [rng.randrange(vocab)], 11, None, False, None
    yield [rng.randrange(vocab)], 12, None, False, None
    tree = random_tree(rng, 9, vocab)
    n = len(tree) + 1
    mask = torch.zeros((n, 13 + n), dtype=torch.bool)
    mask[:, :14] = True  # the prefix and the root
    mask[1:, 14:] = tree.ancestor_mask
    positions = torch.cat([torch.tensor([13]), 14 + tree.position_offsets])
    yield [rng.randrange(vocab), *tree.tokens], 13, mask, False, positions


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quantize", ["none", "w8", "int8"])
@pytest.mark.parametrize("taps,skip", [((), ()), ((0, 2, 3), ()), ((3, 1), ()), ((), ((0, "attn"), (1, "mlp"))),
                                       ((1, 2, 3), ((1, "attn"), (1, "mlp"), (2, "attn")))])
def test_c_loop_gives_the_python_loops_bits(arch, quantize, taps, skip, monkeypatch):
    """States, tapped features and every KV cache slot written are bitwise the Python loop's, over a
    prompt, one-token steps and a tree pass (the C loop is checked to run each of them), with and
    without taps and skipped sub-layers (a layer-skip self-draft)."""
    skip = frozenset(skip)
    decoder = decoder_of(arch, quantize)
    cfg = decoder.cfg
    caches = [new_cache(decoder) for _ in range(2)]
    shapes = list(passes(random.Random(5), cfg.vocab_size))
    fused = []
    for tokens, start, mask, prefill, positions in shapes:
        seg = Segment(caches[0], start, slice(0, len(tokens)), mask, prefill)
        assert decoder._c_loop([seg], len(tokens), None) is not None
        caches[0].reserve(start + len(tokens), start)
        fused.append(run(decoder, caches[0], tokens, start, mask, prefill, taps, positions, skip))
    python_loop(monkeypatch)
    for (tokens, start, mask, prefill, positions), got in zip(shapes, fused):
        caches[1].reserve(start + len(tokens), start)
        want = run(decoder, caches[1], tokens, start, mask, prefill, taps, positions, skip)
        for a, b in zip(got if taps else [got], want if taps else [want]):
            assert a.shape == b.shape and torch.equal(a, b)
    end = sum(len(t) for t, *_ in shapes[:3]) + len(shapes[3][0])
    written = [i for i in range(cfg.num_layers) if (i, "attn") not in skip]  # skipped: never written
    assert torch.equal(caches[0].k[written, :, :end], caches[1].k[written, :, :end])
    assert torch.equal(caches[0].v[written, :, :end], caches[1].v[written, :, :end])


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_c_loop_gives_the_python_loops_bits_for_several_sequences_in_one_pass(quantize, monkeypatch):
    """A batched step: three sequences' rows in one pass (a prompt, a one-token step, a tree), each
    on its own cache at its own start; states and caches are bitwise the Python loop's."""
    decoder = decoder_of("qwen2", quantize, seed=7)
    cfg = decoder.cfg
    rng = random.Random(8)
    vocab = cfg.vocab_size
    tree = random_tree(rng, 6, vocab)
    starts = [0, 9, 5]
    tokens = [[rng.randrange(vocab) for _ in range(5)], [rng.randrange(vocab)],
              [rng.randrange(vocab), *tree.tokens]]
    n = len(tree) + 1
    tree_mask = torch.zeros((n, 5 + n), dtype=torch.bool)
    tree_mask[:, :6] = True
    tree_mask[1:, 6:] = tree.ancestor_mask
    positions = torch.cat([torch.arange(5), torch.tensor([9, 5]), 6 + tree.position_offsets])

    def one_pass():
        caches = [filled_cache(decoder, start + 16, start) for start in starts]  # each sequence's earlier slots
        segs, row = [], 0
        for cache, start, toks, mask, prefill in zip(caches, starts, tokens, [None, None, tree_mask],
                                                     [True, False, False]):
            segs.append(Segment(cache, start, slice(row, row + len(toks)), mask, prefill))
            row += len(toks)
        flat = torch.tensor([t for toks in tokens for t in toks])
        taken = decoder._c_loop(segs, len(flat), None) is not None
        return decoder(flat, positions, segs), caches, taken

    assert_pass_is_the_python_loops(one_pass, monkeypatch)


def test_passes_the_c_loop_does_not_take_run_from_python(monkeypatch):
    """More than MAX_ROWS rows, a traced pass and other ops stay on the Python loop."""
    decoder = decoder_of("qwen2", "none")
    cfg = decoder.cfg
    cache = new_cache(decoder)
    one = Segment(cache, 0, slice(0, 4), None, True)
    assert decoder._c_loop([one], 4, None) is not None
    assert decoder._c_loop([one, Segment(cache, 0, slice(4, 6), None, True)], 6, None) is not None
    assert decoder._c_loop([Segment(cache, 0, slice(0, MAX_ROWS + 1), None, True)], MAX_ROWS + 1, None) is None
    assert decoder._c_loop([one], 4, {}) is None  # traced
    from specula.models.native.ops import CpuKernelOps, TorchOps

    decoder.ops = TorchOps()
    assert decoder._c_loop([one], 4, None) is None
    decoder.ops = CpuKernelOps()
    assert decoder._c_loop([one], 4, None) is not None
    decoder.layers[1].wo = torch.nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)  # not a kernel
    assert decoder._c_loop([one], 4, None) is None
    decoder = decoder_of("qwen2", "none")
    assert decoder._c_loop([one], 4, None) is not None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [1, 3, 100, None])
def test_a_long_prompts_attention_in_chunks_gives_the_python_loops_bits(arch, chunk, monkeypatch):
    """A prompt of MAX_ROWS rows after 20 slots and a one-token step, its causal attention cut into chunks of rows
    whose scores fit a small scratch (one row a chunk, a few, the whole prompt): the C loop takes every pass and its
    states and cache slots are bitwise the Python loop's, which cuts the rows alike."""
    from specula.models.native import fused, ops

    decoder = decoder_of(arch, "none", layers=2)
    if chunk is not None:  # the long prompt's chunks of `chunk` rows (the short one's of more)
        monkeypatch.setattr(ops, "SCORES_SCRATCH", chunk * decoder.cfg.num_heads * (20 + fused.MAX_ROWS) + 5)
    rng = random.Random(chunk)
    vocab = decoder.cfg.vocab_size
    rows = fused.MAX_ROWS
    shapes = [([rng.randrange(vocab) for _ in range(20)], 0), ([rng.randrange(vocab) for _ in range(rows)], 20),
              ([rng.randrange(vocab)], 20 + rows)]
    caches = [new_cache(decoder) for _ in range(2)]
    got = []
    for tokens, start in shapes:
        assert decoder._c_loop([Segment(caches[0], start, slice(0, len(tokens)), None, True)], len(tokens), None)
        caches[0].reserve(start + len(tokens), start)
        got.append(run(decoder, caches[0], tokens, start, None, len(tokens) > 1, ()))
    python_loop(monkeypatch)
    for (tokens, start), states in zip(shapes, got):
        caches[1].reserve(start + len(tokens), start)
        assert torch.equal(states, run(decoder, caches[1], tokens, start, None, len(tokens) > 1, ()))
    end = 21 + fused.MAX_ROWS
    assert torch.equal(caches[0].k[:, :, :end], caches[1].k[:, :, :end])
    assert torch.equal(caches[0].v[:, :, :end], caches[1].v[:, :, :end])


def test_a_prompt_in_chunks_beside_another_sequences_row_gives_the_python_loops_bits(monkeypatch):
    """A batched pass: one sequence's one-token step (row 0), then another's 300-token prompt after 10 slots whose
    causal attention runs in chunks of 7 rows (each chunk's rows offset by the segment's first row)."""
    from specula.models.native import ops

    decoder = decoder_of("qwen2", "none", seed=11, layers=2)
    cfg = decoder.cfg
    monkeypatch.setattr(ops, "SCORES_SCRATCH", 7 * cfg.num_heads * 310 + 3)
    rng = random.Random(12)
    step, prompt = [rng.randrange(cfg.vocab_size)], [rng.randrange(cfg.vocab_size) for _ in range(300)]
    positions = torch.cat([torch.tensor([4]), torch.arange(10, 310)])

    def one_pass():
        caches = [filled_cache(decoder, start + 300, seed) for start, seed in ((4, 1), (10, 2))]
        segs = [Segment(caches[0], 4, slice(0, 1), None, False), Segment(caches[1], 10, slice(1, 301), None, True)]
        taken = decoder._c_loop(segs, 301, None) is not None
        return decoder(torch.tensor(step + prompt), positions, segs), caches, taken

    assert_pass_is_the_python_loops(one_pass, monkeypatch)


def test_c_loop_follows_a_replaced_layer(monkeypatch):
    """Swapping a layer's linear after a pass (as `replace_linears` does) is seen by the next pass:
    its outputs are the Python loop's with the new weights."""
    from torch import nn

    from specula.models.native.kernels import KernelLinear

    decoder = decoder_of("llama", "none")
    cfg = decoder.cfg
    first = FusedLayers.of(decoder)
    assert first is not None and FusedLayers.of(decoder) is first
    torch.manual_seed(0)
    new = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
    decoder.layers[1].w_down = KernelLinear(new, "f32")
    assert FusedLayers.of(decoder) is not first
    assert_prompt_states_are_the_python_loops(decoder, monkeypatch)


def test_buffers_assigned_anew_are_gathered_again(monkeypatch):
    """A layer's buffers assigned anew (as `load_state_dict(assign=True)` does) under the same modules:
    the next pass reads the new ones (its outputs are the Python loop's with the new weights)."""
    decoder = decoder_of("qwen2", "int8")
    first = FusedLayers.of(decoder)
    lin = decoder.layers[1].w_gate_up
    lin.packed = lin.packed.flip(0).contiguous()  # other int8 weights, another buffer
    with torch.no_grad():
        decoder.layers[0].input_norm = torch.nn.Parameter(decoder.layers[0].input_norm.detach() * 1.5)
    fused = FusedLayers.of(decoder)
    assert fused is not first and fused.refs[1].gate_up.packed == lin.packed.data_ptr()
    assert_prompt_states_are_the_python_loops(decoder, monkeypatch)


def test_c_loop_gathers_its_layers_again_only_after_an_assignment(monkeypatch):
    """`current` walks the decoder's modules (hundreds of lookups a pass) only where torch saw a module,
    parameter or buffer assigned since its last look: none between passes, one walk after an assignment
    anywhere (here another module's)."""
    import specula.models.native.fused as fused_module

    decoder = decoder_of("llama", "none")
    first = FusedLayers.of(decoder)
    walks = []
    real = fused_module._held
    monkeypatch.setattr(fused_module, "_held", lambda d: walks.append(d) or real(d))
    for _ in range(3):
        assert FusedLayers.of(decoder) is first
    assert walks == []
    torch.nn.Linear(2, 2)  # registers its parameters: the next look walks once, then trusts the count again
    assert FusedLayers.of(decoder) is first and FusedLayers.of(decoder) is first
    assert len(walks) == 1
