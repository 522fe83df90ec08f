"""The Hugging Face backend: tree logits (in one pass or grown incrementally) equal causal logits,
the cache equals a plain forward's after any steps (incremental growth included), and sequences
of one backend are independent. The pending-tree guards both backends share: test_sequence.py."""

import random

import pytest

from tiny import assert_cache_equals_plain_forward, check_random_tree, random_steps, random_tree, tiny_model
from specula.errors import ConfigError
from specula.models.base import TargetModel, TargetSequence, check_context
from specula.models.hf import HFCausalLM
from specula.tree import TokenTree


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_logits_equal_causal_logits_over_each_path(arch, attn):
    model = tiny_model(arch, attn)
    tree = check_random_tree(model, HFCausalLM(model).new_sequence(), 0, 9, 14)
    assert not tree.is_chain()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_incremental_tree_logits_equal_causal_logits(arch, attn):
    model = tiny_model(arch, attn)
    # an empty first step and an empty increment
    check_random_tree(model, HFCausalLM(model).new_sequence(), 2, 7, 15, cuts=(0, 4, 9, 9))


def test_cache_equals_plain_forward_after_any_sequence_of_steps(arch):
    model = tiny_model(arch, "sdpa")
    lm = HFCausalLM(model).new_sequence()
    for committed in random_steps(lm, random.Random(1), 12):
        assert_cache_equals_plain_forward(model, lm, committed)


def test_commit_after_incremental_growth_leaves_an_exact_cache(arch):
    model = tiny_model(arch, "sdpa")
    lm = HFCausalLM(model).new_sequence()
    rng = random.Random(3)
    committed = [rng.randrange(96) for _ in range(5)]
    lm.prefill(committed, logits="none")
    for _ in range(6):
        root = rng.randrange(96)
        tree = random_tree(rng, rng.randrange(1, 12), 96)
        cut = rng.randrange(len(tree) + 1)
        lm.forward_tree(root, tree.subtree(range(cut)))
        lm.forward_tree_incremental(tree)
        path = tree.path_to(rng.randrange(len(tree))) if rng.random() < 0.8 else ()
        lm.commit(path)
        committed += [root, *tree.tokens_of(path)]
        assert_cache_equals_plain_forward(model, lm, committed)


def test_context_window_is_enforced_with_a_clear_error():
    lm = HFCausalLM(tiny_model("llama"))
    with pytest.raises(ConfigError, match="context window is 256"):
        check_context(lm, 257)
    check_context(lm, 256)
    seq = lm.new_sequence()  # past the one check, overflowing a sequence is a bug: refused loudly
    with pytest.raises(RuntimeError, match="context window of 256"):
        seq.prefill(list(range(257)), logits="none")
    assert seq.tokens == []


def test_sequences_of_one_backend_are_independent():
    model = tiny_model("qwen2")
    lm = HFCausalLM(model)
    assert isinstance(lm, TargetModel)
    a, b = lm.new_sequence(), lm.new_sequence()
    assert isinstance(a, TargetSequence)
    a.prefill([1, 2, 3, 4], logits="none")
    b.prefill([9, 8], logits="none")
    a.forward_tree(5, TokenTree.chain([6]))
    b.forward_tree(7, TokenTree.build([1, 2], [-1, -1]))
    a.commit([0])
    b.commit([1])
    assert_cache_equals_plain_forward(model, a, [1, 2, 3, 4, 5, 6])
    assert_cache_equals_plain_forward(model, b, [9, 8, 7, 2])
    b.release()
    assert b.tokens == [] and a.tokens == [1, 2, 3, 4, 5, 6]


def test_cost_key_names_what_latency_depends_on():
    key = HFCausalLM(tiny_model("llama")).cost_key()
    assert key["backend"] == "hf" and key["dtype"] == "torch.float32" and key["device"] == "cpu"
    assert key["quantize"] == "none" and key["linear_kernel"] == "aten" and key["attention"] == "sdpa"
    assert key["layers"] == 2 and key["threads"] >= 1
