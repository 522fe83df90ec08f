import random

import pytest
import torch

from tiny import tiny_model
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.tree import TokenTree


def random_tree(rng: random.Random, n: int, vocab: int) -> TokenTree:
    parents = [-1]
    for i in range(1, n):
        parents.append(rng.randrange(-1, i))
    return TokenTree.empty().merge(TokenTree.build([rng.randrange(vocab) for _ in range(n)], parents))


@torch.inference_mode()
def causal_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1]


def assert_tree_logits_are_causal(model, prompt: list[int], tree: TokenTree, logits: torch.Tensor,
                                  *, same_argmax: bool = False) -> None:
    """logits [n+1, vocab]: row 0 equals the causal logits after the prompt, row i+1 those after
    the prompt plus node i's root-to-node path (and, with same_argmax, has the same argmax)."""
    assert logits.shape == (len(tree) + 1, model.config.vocab_size)
    for row, path in enumerate([()] + [tree.path_to(i) for i in range(len(tree))]):
        causal = causal_logits(model, prompt + tree.tokens_of(path))
        torch.testing.assert_close(logits[row], causal, atol=1e-4, rtol=1e-4)
        if same_argmax:  # what greedy verification reads
            assert logits[row].argmax() == causal.argmax(), row


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_logits_equal_causal_logits_over_each_path(arch, attn):
    model = tiny_model(arch, attn)
    lm = HFCausalLM(model)
    rng = random.Random(0)
    prompt = [rng.randrange(96) for _ in range(9)]
    lm.append(prompt[:-1], logits="none")
    tree = random_tree(rng, 14, 96)
    assert not tree.is_chain()
    logits = lm.forward_tree(prompt[-1], tree)
    assert_tree_logits_are_causal(model, prompt, tree, logits)


def test_cache_equals_plain_forward_after_any_sequence_of_steps(arch):
    model = tiny_model(arch, "sdpa")
    lm = HFCausalLM(model)
    rng = random.Random(1)
    committed = [rng.randrange(96) for _ in range(5)]
    lm.append(committed, logits="none")
    for step in range(12):
        root = rng.randrange(96)
        tree = random_tree(rng, rng.randrange(0, 10), 96)
        lm.forward_tree(root, tree)
        path = tree.path_to(rng.randrange(len(tree))) if len(tree) and rng.random() < 0.8 else ()
        lm.commit(path)
        committed += [root, *tree.tokens_of(path)]
        if step % 4 == 3:  # occasionally roll back
            drop = rng.randrange(0, 3)
            lm.rollback(drop)
            committed = committed[: len(committed) - drop]
        assert lm.tokens == committed
        with torch.inference_mode():
            ref = model(torch.tensor([committed]), use_cache=True).past_key_values
        for (k, v), layer in zip(lm.cache_tensors(), ref.layers):
            torch.testing.assert_close(k, layer.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, layer.values, atol=1e-4, rtol=1e-4)


def test_context_window_is_enforced_with_a_clear_error():
    lm = HFCausalLM(tiny_model("llama"))
    with pytest.raises(ConfigError, match="context window of 256"):
        lm.append(list(range(257)) * 1, logits="none")


def test_pending_tree_must_be_committed_before_more_work():
    lm = HFCausalLM(tiny_model("llama"))
    lm.append([1, 2, 3], logits="none")
    lm.forward_tree(4, TokenTree.chain([5, 6]))
    with pytest.raises(RuntimeError, match="pending"):
        lm.append([7])
    lm.commit([0])
    assert lm.tokens == [1, 2, 3, 4, 5]
