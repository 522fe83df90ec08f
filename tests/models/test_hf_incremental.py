"""`HFSequence.forward_tree_incremental`: growing a pending tree level by level gives the same
logits as causal forwards over each node's path, and commit leaves an exact cache."""

import random

import pytest
import torch

from tiny import assert_cache_equals_plain_forward, assert_tree_logits_are_causal, random_tree, tiny_model
from specula.models.hf import HFCausalLM, HFSequence
from specula.tree import TokenTree


def grow(lm: HFSequence, root: int, tree: TokenTree, cuts: list[int]) -> torch.Tensor:
    """Run `tree` as forward_tree(root, first cuts[0] nodes) then increments; all logits."""
    rows = [lm.forward_tree(root, tree.subtree(range(cuts[0])))]
    for end in cuts[1:] + [len(tree)]:
        rows.append(lm.forward_tree_incremental(tree.subtree(range(end))))
    return torch.cat(rows)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_incremental_tree_logits_equal_causal_logits(arch, attn):
    model = tiny_model(arch, attn)
    lm = HFCausalLM(model).new_sequence()
    rng = random.Random(2)
    prompt = [rng.randrange(96) for _ in range(7)]
    lm.prefill(prompt[:-1], logits="none")
    tree = random_tree(rng, 15, 96)
    logits = grow(lm, prompt[-1], tree, [0, 4, 9, 9])  # empty first step and an empty increment
    assert_tree_logits_are_causal(model, prompt, tree, logits)


def test_commit_after_incremental_growth_leaves_an_exact_cache(arch):
    model = tiny_model(arch, "sdpa")
    lm = HFCausalLM(model).new_sequence()
    rng = random.Random(3)
    committed = [rng.randrange(96) for _ in range(5)]
    lm.prefill(committed, logits="none")
    for _ in range(6):
        root = rng.randrange(96)
        tree = random_tree(rng, rng.randrange(1, 12), 96)
        grow(lm, root, tree, [rng.randrange(len(tree) + 1)])
        path = tree.path_to(rng.randrange(len(tree))) if rng.random() < 0.8 else ()
        lm.commit(path)
        committed += [root, *tree.tokens_of(path)]
        assert_cache_equals_plain_forward(model, lm, committed)


def test_incremental_growth_needs_a_pending_prefix_tree():
    lm = HFCausalLM(tiny_model("llama")).new_sequence()
    lm.prefill([1, 2, 3], logits="none")
    with pytest.raises(RuntimeError, match="pending"):
        lm.forward_tree_incremental(TokenTree.chain([5]))
    lm.forward_tree(4, TokenTree.chain([5, 6]))
    with pytest.raises(ValueError, match="extend the pending tree"):
        lm.forward_tree_incremental(TokenTree.chain([5, 7, 8]))
