"""The CUDA-graph path's bookkeeping, checked on the CPU (`graphs.py` with `capture=False`: the same
fixed-shape passes, run without capturing): row and context buckets, the padding rows and the mask
a pass rebuilds from its inputs, eager fallbacks, the cache pool, and that passes on the graph
path give the eager path's logits and greedy output. The captured passes themselves are tested on
a GPU (`tests/gpu/test_cuda_graphs.py`)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tiny import assert_cache_equals_plain_forward, perturbed_copy, random_steps, random_tree, reference_greedy, tiny_model
from specula.api import build_decoder
from specula.errors import ConfigError
from specula.models.native import NativeCausalLM, NativeDecoder, configure, graphs
from specula.models.native.graphs import (GraphShapeError, PENDING_MAX, StaticInputs, context_bucket, padded_rows,
                                          plan_pass, row_bucket)
from specula.sampling import SamplingParams
from specula.tree import TokenTree


def native(model, graph_path: bool, **options) -> NativeCausalLM:
    backend = NativeCausalLM(configure(NativeDecoder.from_hf(model), "aten", "none", "sdpa"), "native",
                             eos_token_ids=[1], cuda_graphs=False)
    if graph_path:
        backend.set_cuda_graphs(True, capture=False, **options)
    return backend


def test_row_buckets_round_up_and_refuse_beyond_the_largest():
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 9, 17, 33, 64)] == [1, 2, 4, 4, 8, 16, 32, 64, 64]
    assert [padded_rows(n) for n in (1, 3, 64, 65, 300)] == [1, 4, 64, 65, 300]
    with pytest.raises(GraphShapeError, match="largest CUDA-graph bucket"):
        row_bucket(65)
    with pytest.raises(GraphShapeError):
        row_bucket(0)
    assert row_bucket(3, (2, 6)) == 6


def test_context_windows_double_from_256_within_the_capacity():
    assert [context_bucket(e, 4096) for e in (1, 256, 257, 1000, 1025, 4096)] == [256, 256, 512, 1024, 2048, 4096]
    assert context_bucket(100, 200) == 200
    with pytest.raises(GraphShapeError, match="capacity"):
        context_bucket(300, 256)


def test_pass_plans_fall_back_to_eager_outside_the_buckets():
    assert plan_pass(5, 100, 100, 1000) == graphs.PassShape(5, 8, 8 + PENDING_MAX)
    assert plan_pass(65, 100, 100, 1000) is None  # a long prefill
    assert plan_pass(1, 100, 100 - PENDING_MAX - 1, 1000) is None  # sees too many pending rows
    assert plan_pass(3, 100, 100 - PENDING_MAX, 1000) is not None
    assert plan_pass(3, 997, 997, 1000) is None  # padding rows would pass the context window
    assert plan_pass(1, 999, 999, 1000) is not None


def test_static_inputs_pad_rows_and_place_the_local_mask():
    inputs = StaticInputs(4, 4 + PENDING_MAX, torch.device("cpu"))
    local = np.array([[1, 1, 0, 0], [1, 0, 1, 0]], dtype=bool)  # 2 real rows, 2 rows before them
    inputs.fill([7, 8], [50, 51], start=52, prefix=50, local=local)
    inputs.upload()
    ints = inputs.ints.tolist()
    assert ints[:4] == [7, 8, 0, 0] and ints[4:8] == [50, 51, 0, 0] and ints[8:] == [52, 50]
    mask = inputs.local
    assert mask[:2, :4].tolist() == local.tolist() and not mask[:2, 4:].any()
    # padding row i (2, 3) sees its own slot 52 + i, column 52 + i - 50 only
    assert mask[2].nonzero().flatten().tolist() == [4] and mask[3].nonzero().flatten().tolist() == [5]
    with pytest.raises(GraphShapeError):
        inputs.fill([1] * 5, [0] * 5, 0, 0, np.ones((5, 5), dtype=bool))


def test_the_mask_a_pass_rebuilds_is_the_eager_mask():
    """static_forward's mask (prefix | local block) over a window: each real row sees exactly what
    the eager tree mask shows it, padding rows their own slot, nothing past the rows."""
    rng = random.Random(3)
    tree = random_tree(rng, 6, 96)
    start, n = 40, len(tree) + 1
    from specula.models.native.backend import tree_mask

    eager = tree_mask(start, tree)  # [n, start + n]
    shape = plan_pass(n, start, start, 1000)
    inputs = StaticInputs(shape.bucket, shape.window, torch.device("cpu"))
    inputs.fill([0] * n, [0] * n, start, start, eager[:, start:])
    inputs.upload()
    s, w = 256, shape.window
    cols = torch.arange(s)
    rel = cols - inputs.ints[2 * shape.bucket + 1]
    visible = (inputs.local.index_select(1, rel.clamp(0, w - 1)) & ((rel >= 0) & (rel < w))) | (rel < 0)
    assert torch.equal(visible[:n, : start + n], eager)
    assert not visible[:n, start + n:].any()
    for i in range(n, shape.bucket):
        assert visible[i, start:].nonzero().flatten().tolist() == [i]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("compile_ops", [False])
def test_graph_path_tree_and_chain_logits_equal_the_eager_path(arch, compile_ops):
    model = tiny_model(arch, seed=4)
    eager, fixed = native(model, False), native(model, True, compile_ops=compile_ops)
    rng_e, rng_f = random.Random(5), random.Random(5)
    seq_e, seq_f = eager.new_sequence(), fixed.new_sequence()
    for committed_e, committed_f in zip(random_steps(seq_e, rng_e, 12), random_steps(seq_f, rng_f, 12)):
        assert committed_e == committed_f
    assert fixed.graphs.stats["passes"] > 0
    rng = random.Random(7)
    for n in (1, 2, 3, 5, 8, 13, 16, 31):
        for tree in (random_tree(rng, n, 96), TokenTree.chain([rng.randrange(96) for _ in range(n)])):
            root = rng.randrange(96)
            a, b = seq_e.forward_tree(root, tree), seq_f.forward_tree(root, tree)
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
            path = tree.path_to(0) if len(tree) else ()
            seq_e.commit(path)
            seq_f.commit(path)
    assert_cache_equals_plain_forward(model, seq_f, seq_f.tokens)


def test_prefills_incremental_trees_and_scratch_drafts_on_the_graph_path():
    model = tiny_model("llama", seed=2)
    eager, fixed = native(model, False), native(model, True)
    prompt = list(range(3, 30))
    for backend in (eager, fixed):
        backend.seq = backend.new_sequence()
        backend.out = [backend.seq.prefill(prompt[:7], logits="all"),  # a graph pass (8 rows)
                       backend.seq.prefill(prompt[7:], logits="last")]
    torch.testing.assert_close(fixed.out[0], eager.out[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fixed.out[1], eager.out[1], atol=1e-4, rtol=1e-4)
    tree = TokenTree.build([5, 6, 7, 8], [-1, 0, 0, 2])
    grown = TokenTree.build([5, 6, 7, 8, 9, 10, 11], [-1, 0, 0, 2, 1, 4, 3])
    for backend in (eager, fixed):
        backend.seq.forward_tree(40, tree)
        backend.out = [backend.seq.forward_tree_incremental(grown)]  # sees the pending tree's rows
        backend.seq.commit([0, 1, 4])  # 5 -> 6 -> 9 (node 4 hangs from node 1)
        backend.out.append(backend.seq.speculate([12, 13], offset=0))
        backend.out.append(backend.seq.speculate([14], offset=2))  # sees the two scratch rows
        backend.out.append(backend.seq.replay(3))
    for a, b in zip(eager.out, fixed.out):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert fixed.graphs.stats["passes"] >= 6


@pytest.mark.parametrize("method", ["prompt-lookup", "token-recycling", "draft-model", "draft-tree", "fusion"])
def test_greedy_output_on_the_graph_path_equals_plain_greedy(method):
    model = tiny_model("llama", seed=3)
    target = native(model, True)
    draft = native(perturbed_copy(model, 0.2), True) if method in ("draft-model", "draft-tree", "fusion") else None
    dec = build_decoder(method, target, None, draft, planner=False)
    plain = build_decoder("none", target)
    for prompt in ([5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], [60, 61, 62, 63]):
        params = SamplingParams(max_new_tokens=30, ignore_eos=True)
        out = dec.generate(prompt, params).token_ids
        assert out == plain.generate(prompt, params).token_ids == reference_greedy(model, prompt, 30), method


def test_caches_are_pooled_and_growth_drops_their_graphs(monkeypatch):
    monkeypatch.setattr(graphs, "INITIAL_CAPACITY", 256)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                         initializer_range=0.3)).eval()
    eager, fixed = native(model, False), native(model, True)
    plain_e, plain_f = build_decoder("none", eager), build_decoder("none", fixed)
    params = SamplingParams(max_new_tokens=300, ignore_eos=True)  # crosses 256 slots: the cache doubles
    prompt = [5, 6, 7]
    assert plain_f.generate(prompt, params).token_ids == plain_e.generate(prompt, params).token_ids
    pool = fixed.graphs._free
    assert len(pool) == 1 and pool[0].capacity == 512 and pool[0].zero
    assert {key[1] for key in pool[0].graphs} == {512}  # the 256-slot window went with the old buffers
    cache = pool[0]
    seq = fixed.new_sequence()
    assert seq.cache is cache and not pool  # the finished request's cache is reused
    del seq  # garbage-collected without release: back to the pool
    assert len(fixed.graphs._free) == 1


def test_padded_tokens_cost_key_and_switches():
    model = tiny_model("llama", seed=1)
    eager, fixed = native(model, False), native(model, True)
    assert [eager.padded_tokens(n) for n in (1, 3, 70)] == [1, 3, 70]
    assert [fixed.padded_tokens(n) for n in (1, 3, 70)] == [1, 4, 70]
    assert eager.cost_key()["cuda_graphs"] is False and fixed.cost_key()["cuda_graphs"] is False  # not captured
    assert NativeCausalLM(NativeDecoder.from_hf(model), "cpu").graphs is None  # default: CUDA only
    with pytest.raises(ConfigError, match=r"CUDA device.*; turn them off \(cuda_graphs=False\)$"):
        eager.set_cuda_graphs(True)  # captured graphs on the CPU
    ops = configure(NativeDecoder.from_hf(model), "aten", "none", "batch_invariant")
    with pytest.raises(ConfigError, match=r"batch-invariant.*; turn them off \(cuda_graphs=False\)$"):
        NativeCausalLM(ops, "inv", cuda_graphs=True)  # the keyword a Python caller wrote, not --no-cuda-graphs


def test_cuda_graphs_asked_for_on_a_decoder_that_cannot_run_them_is_refused_the_default_falls_back(monkeypatch):
    """`--cuda-graphs` (`device.set_cuda_graphs(True)`) on a decoder the graph path cannot run ran every pass eagerly
    without a word, as the default does; it is refused now, naming why, and the command shows --no-cuda-graphs."""
    from specula.cli import build_parser
    from specula.commands.common import in_command_flags
    from specula.models import device

    ops = configure(NativeDecoder.from_hf(tiny_model("llama", seed=1)), "aten", "none", "batch_invariant")
    backend = NativeCausalLM(ops, "inv", cuda_graphs=False)
    monkeypatch.setattr(backend, "device", torch.device("cuda"))  # as on a GPU: nothing runs before the check
    monkeypatch.setattr(device, "_CUDA_GRAPHS", None)  # the default (on): eager without a word
    monkeypatch.delenv("SPECULA_CUDA_GRAPHS", raising=False)
    backend.set_cuda_graphs()
    assert backend.graphs is None
    device.set_cuda_graphs(True)  # --cuda-graphs
    with pytest.raises(ConfigError) as caught:
        backend.set_cuda_graphs()
    message = str(caught.value)
    assert message == ("inv: CUDA graphs cannot run this decoder: batch-invariant attention computes each row alone "
                       "(data-dependent shapes); turn them off (cuda_graphs=False)"), message
    args = build_parser().parse_args(["generate", "--target", "t", "--prompt", "p", "--cuda-graphs"])
    assert in_command_flags(args)(message).endswith("; turn them off (--no-cuda-graphs)")
    device.set_cuda_graphs(False)  # --no-cuda-graphs
    backend.set_cuda_graphs()
    assert backend.graphs is None


def test_cuda_graphs_asked_for_by_the_environment_is_an_ask_too(monkeypatch):
    """SPECULA_CUDA_GRAPHS=1 counted as the default: on a decoder the graph path cannot run it fell back to eager
    passes without a word, where --cuda-graphs is refused. Set, it is an ask: refused, naming the variable and how
    to take it back; --no-cuda-graphs still overrides it."""
    from specula.models import device

    ops = configure(NativeDecoder.from_hf(tiny_model("llama", seed=1)), "aten", "none", "batch_invariant")
    backend = NativeCausalLM(ops, "inv", cuda_graphs=False)
    monkeypatch.setattr(backend, "device", torch.device("cuda"))
    monkeypatch.setattr(device, "_CUDA_GRAPHS", None)
    monkeypatch.setenv("SPECULA_CUDA_GRAPHS", "1")
    with pytest.raises(ConfigError) as caught:
        backend.set_cuda_graphs()
    assert str(caught.value) == ("inv: CUDA graphs cannot run this decoder (asked for by SPECULA_CUDA_GRAPHS=1): "
                                 "batch-invariant attention computes each row alone (data-dependent shapes); "
                                 "unset SPECULA_CUDA_GRAPHS (or set it to 0)"), caught.value
    monkeypatch.setenv("SPECULA_CUDA_GRAPHS", "0")
    backend.set_cuda_graphs()
    assert backend.graphs is None
    monkeypatch.setenv("SPECULA_CUDA_GRAPHS", "1")
    device.set_cuda_graphs(False)  # --no-cuda-graphs
    backend.set_cuda_graphs()
    assert backend.graphs is None
    assert device.cuda_graphs_asker() is None and device.cuda_graphs_asker(True) == "set_cuda_graphs(True)"


def test_cuda_graphs_switch_reads_the_flag_then_the_environment(monkeypatch):
    from specula.models import device

    monkeypatch.setattr(device, "_CUDA_GRAPHS", None)
    monkeypatch.setenv("SPECULA_CUDA_GRAPHS", "0")
    assert device.cuda_graphs_wanted() is False
    monkeypatch.setenv("SPECULA_CUDA_GRAPHS", "1")
    assert device.cuda_graphs_wanted() is True
    device.set_cuda_graphs(False)
    assert device.cuda_graphs_wanted() is False
    device.set_cuda_graphs(None)
    assert device.cuda_graphs_wanted() is True
