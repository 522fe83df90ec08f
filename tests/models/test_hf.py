import random

import pytest

from tiny import assert_cache_equals_plain_forward, assert_tree_logits_are_causal, random_steps, random_tree, tiny_model
from specula.errors import ConfigError
from specula.models.base import TargetModel, TargetSequence, check_context
from specula.models.hf import HFCausalLM
from specula.tree import TokenTree


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_logits_equal_causal_logits_over_each_path(arch, attn):
    model = tiny_model(arch, attn)
    lm = HFCausalLM(model).new_sequence()
    rng = random.Random(0)
    prompt = [rng.randrange(96) for _ in range(9)]
    lm.prefill(prompt[:-1], logits="none")
    tree = random_tree(rng, 14, 96)
    assert not tree.is_chain()
    logits = lm.forward_tree(prompt[-1], tree)
    assert_tree_logits_are_causal(model, prompt, tree, logits)


def test_cache_equals_plain_forward_after_any_sequence_of_steps(arch):
    model = tiny_model(arch, "sdpa")
    lm = HFCausalLM(model).new_sequence()
    for committed in random_steps(lm, random.Random(1), 12):
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


def test_pending_tree_must_be_committed_before_more_work():
    lm = HFCausalLM(tiny_model("llama")).new_sequence()
    lm.prefill([1, 2, 3], logits="none")
    lm.forward_tree(4, TokenTree.chain([5, 6]))
    with pytest.raises(RuntimeError, match="pending"):
        lm.prefill([7])
    lm.commit([0])
    assert lm.tokens == [1, 2, 3, 4, 5]


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
