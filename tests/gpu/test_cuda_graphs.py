"""CUDA graphs on the native backend (`specula/models/native/graphs.py`; skipped without a GPU).

A replayed graph computes what the same fixed-shape pass computes eagerly (bit for bit) and what
the eager backend computes for the unpadded pass (to float32 rounding), for every row bucket, tree
and chain, after random commits; greedy output of every method on the graph path equals plain
greedy decoding on that path and on the eager path; the capture refuses shapes beyond the largest
bucket; graphs are captured once per cache and reused by the next request."""

from __future__ import annotations

import random

import pytest
import torch

from tiny import assert_tree_logits_are_causal, perturbed_copy, random_steps, random_tree, reference_greedy, tiny_model
from specula.api import build_decoder
from specula.models.native import NativeCausalLM, NativeDecoder, configure
from specula.models.native.graphs import ROW_BUCKETS, GraphShapeError
from specula.sampling import SamplingParams
from specula.tree import TokenTree

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
DEVICE = torch.device("cuda:0")


def native(model, graphs: bool = True, compile_ops: bool = False) -> NativeCausalLM:
    decoder = configure(NativeDecoder.from_hf(model.to(DEVICE)), "aten", "none", "sdpa")
    backend = NativeCausalLM(decoder, "native", eos_token_ids=[], cuda_graphs=False)
    if graphs:
        backend.set_cuda_graphs(True, compile_ops=compile_ops)
    return backend


def test_graphs_are_the_default_on_cuda_and_can_be_turned_off(monkeypatch):
    model = tiny_model("llama", seed=1).to(DEVICE)
    decoder = configure(NativeDecoder.from_hf(model), "aten", "none", "sdpa")
    assert NativeCausalLM(decoder, "on").cuda_graphs
    assert not NativeCausalLM(decoder, "off", cuda_graphs=False).cuda_graphs
    monkeypatch.setenv("SPECULA_CUDA_GRAPHS", "0")
    assert not NativeCausalLM(decoder, "env").cuda_graphs
    assert NativeCausalLM(decoder, "on").cost_key()["cuda_graphs"] is False


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_replayed_graphs_equal_eager_passes_for_every_bucket(arch):
    model = tiny_model(arch, seed=4)
    reference = tiny_model(arch, seed=4)  # the same weights, on the CPU
    eager, fixed = native(tiny_model(arch, seed=4), graphs=False), native(model)
    seq_e, seq_f = eager.new_sequence(), fixed.new_sequence()
    for _ in zip(random_steps(seq_e, random.Random(5), 10), random_steps(seq_f, random.Random(5), 10)):
        pass
    assert seq_e.tokens == seq_f.tokens
    rng = random.Random(6)
    for bucket in ROW_BUCKETS:
        for rows in sorted({bucket, bucket // 2 + 1}):  # a full bucket and a padded one
            for kind in ("chain", "tree"):
                n = rows - 1
                tree = (TokenTree.chain([rng.randrange(96) for _ in range(n)]) if kind == "chain"
                        else random_tree(rng, n, 96))
                root = rng.randrange(96)
                prompt = list(seq_f.tokens)
                a, b = seq_e.forward_tree(root, tree), seq_f.forward_tree(root, tree)
                assert b.device.type == "cuda"
                torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
                if kind == "tree" and bucket <= 16:
                    assert_tree_logits_are_causal(reference, prompt + [root], tree, b.float().cpu())
                # the replay equals the same padded pass run eagerly, bit for bit
                entry = _entry_of(seq_f, len(tree) + 1)
                replayed = entry.hidden.clone()
                with torch.inference_mode():
                    again = entry.forward()
                assert torch.equal(replayed, again), (bucket, rows, kind)
                path = tree.path_to(rng.randrange(len(tree))) if len(tree) and rng.random() < 0.7 else ()
                seq_e.commit(path)
                seq_f.commit(path)
    assert fixed.graphs.stats["captures"] >= len(ROW_BUCKETS)


def _entry_of(seq, rows: int):
    """The captured pass the last pass of `rows` rows ran on."""
    from specula.models.native.graphs import context_bucket, row_bucket

    bucket = row_bucket(rows)
    start = len(seq.tokens)
    return seq.cache.graphs[(bucket, context_bucket(start + bucket, seq.cache.capacity))]


def test_bfloat16_graphs_are_the_eager_model_up_to_rounding():
    model = tiny_model("qwen2", seed=4).to(torch.bfloat16)
    eager, fixed = native(tiny_model("qwen2", seed=4).to(torch.bfloat16), graphs=False), native(model)
    seq_e, seq_f = eager.new_sequence(), fixed.new_sequence()
    prompt = list(range(3, 30))
    seq_e.prefill(prompt, logits="none")
    seq_f.prefill(prompt, logits="none")
    tree = random_tree(random.Random(2), 20, 96)
    a, b = seq_e.forward_tree(7, tree), seq_f.forward_tree(7, tree)
    assert (b - a).abs().max() <= 0.05 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("method", ["prompt-lookup", "token-recycling", "draft-model", "draft-tree", "fusion"])
def test_greedy_output_on_the_graph_path_equals_plain_greedy(method):
    model = tiny_model("llama", seed=3)
    reference = tiny_model("llama", seed=3)
    draft_model = perturbed_copy(model, 0.2)
    target = native(model)
    draft = native(draft_model) if method in ("draft-model", "draft-tree", "fusion") else None
    dec = build_decoder(method, target, None, draft, planner=False)
    plain = build_decoder("none", target)
    plain_eager = build_decoder("none", native(tiny_model("llama", seed=3), graphs=False))
    for prompt in ([5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], [60, 61, 62, 63]):
        params = SamplingParams(max_new_tokens=30, ignore_eos=True)
        out = dec.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids, method
        assert out.token_ids == plain_eager.generate(prompt, params).token_ids == reference_greedy(reference, prompt, 30)
        assert out.stats.new_tokens == 30
    assert target.graphs.stats["replays"] > 0
    if draft is not None:
        assert draft.graphs.stats["replays"] > 0


def test_capture_refuses_shapes_beyond_the_largest_bucket_and_long_passes_run_eagerly():
    model = tiny_model("llama", seed=2)
    reference = tiny_model("llama", seed=2)
    backend = native(model)
    seq = backend.new_sequence()
    with pytest.raises(GraphShapeError, match="buckets are 1, 2, 4, 8, 16, 32, 64 rows"):
        backend.graphs.captured(seq.cache, 128, 256)
    ids = [random.Random(1).randrange(96) for _ in range(100)]
    logits = seq.prefill(ids, logits="all")  # 100 rows: eager, on the graph path's cache
    with torch.inference_mode():
        ref = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits.cpu(), ref, atol=1e-4, rtol=1e-4)
    assert backend.graphs.stats["passes"] == 0
    seq.forward_tree(5, TokenTree.chain([6, 7]))  # then a graph pass over the same cache
    assert backend.graphs.stats["passes"] == 1


def test_graphs_are_captured_once_and_reused_by_the_next_request():
    backend = native(tiny_model("llama", seed=5))
    plain = build_decoder("none", backend)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    first = plain.generate([3, 4, 5], params).token_ids
    captures = backend.graphs.stats["captures"]
    assert plain.generate([3, 4, 5], params).token_ids == first
    assert backend.graphs.stats["captures"] == captures  # the pooled cache kept its graphs


def test_compiled_element_wise_ops_keep_greedy_output():
    model = tiny_model("llama", seed=3)
    reference = tiny_model("llama", seed=3)
    target = native(model, compile_ops=True)
    dec = build_decoder("prompt-lookup", target, None, None, planner=False)
    prompt = [5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17]
    out = dec.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert out.token_ids == reference_greedy(reference, prompt, 30)
