"""The native backend (`specula.models.native`): logits equal Hugging Face's on the same weights,
tree logits equal causal logits, the static cache equals a plain forward's after any steps,
every drafter's greedy output equals plain greedy, int8 rows are bitwise one-token steps, and an
unsupported architecture is refused with the fix named."""

from __future__ import annotations

import random

import pytest
import torch

from tiny import (assert_cache_equals_plain_forward, assert_tree_logits_are_causal, causal_logits, perturbed_copy,
                  random_tree, reference_greedy, tiny_model)
from specula.api import build_decoder
from specula.errors import ConfigError
from specula.models.base import TargetModel, TargetSequence
from specula.models.native import NativeCausalLM, NativeDecoder, supports
from specula.models.prepack import prepack_model
from specula.models.quantize import quantize_model
from specula.sampling import SamplingParams
from specula.tree import TokenTree

NATIVE_ARCHES = ("llama", "qwen2")


def native(model, *, kernel: str = "aten", quantize: str = "none", invariant: bool = False) -> NativeCausalLM:
    decoder = NativeDecoder.from_hf(model)
    quantize_model(decoder, quantize)
    decoder.invariant = invariant
    prepack_model(decoder, kernel)
    return NativeCausalLM(decoder, "native", eos_token_ids=[1])


@pytest.mark.parametrize("arch", NATIVE_ARCHES)
def test_prefill_logits_equal_hugging_face(arch):
    model = tiny_model(arch, "eager", seed=2)
    seq = native(model).new_sequence()
    assert isinstance(seq.backend, TargetModel) and isinstance(seq, TargetSequence)
    ids = list(range(3, 40))
    logits = seq.prefill(ids, logits="all")  # [n, vocab]
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    assert seq.tokens == ids


@pytest.mark.parametrize("arch", NATIVE_ARCHES)
@pytest.mark.parametrize("kernel", ["aten", "onednn"])
def test_tree_logits_equal_causal_logits_over_each_path(arch, kernel):
    model = tiny_model(arch, seed=4)
    seq = native(model, kernel=kernel).new_sequence()
    rng = random.Random(5)
    prompt = [rng.randrange(96) for _ in range(11)]
    seq.prefill(prompt[:-1], logits="none")
    tree = random_tree(rng, 16, 96)
    assert not tree.is_chain()
    assert_tree_logits_are_causal(model, prompt, tree, seq.forward_tree(prompt[-1], tree), same_argmax=True)


@pytest.mark.parametrize("arch", NATIVE_ARCHES)
def test_incremental_tree_logits_equal_causal_logits(arch):
    model = tiny_model(arch, seed=6)
    seq = native(model).new_sequence()
    rng = random.Random(7)
    prompt = [rng.randrange(96) for _ in range(6)]
    seq.prefill(prompt[:-1], logits="none")
    tree = random_tree(rng, 12, 96)
    rows = [seq.forward_tree(prompt[-1], tree.subtree(range(3)))]
    for end in (3, 8, 12):
        rows.append(seq.forward_tree_incremental(tree.subtree(range(end))))
    assert_tree_logits_are_causal(model, prompt, tree, torch.cat(rows))


@pytest.mark.parametrize("arch", NATIVE_ARCHES)
def test_cache_equals_plain_forward_after_any_sequence_of_steps(arch):
    model = tiny_model(arch, seed=8)
    seq = native(model).new_sequence()
    rng = random.Random(9)
    committed = [rng.randrange(96) for _ in range(5)]
    seq.prefill(committed, logits="none")
    for step in range(14):
        root = rng.randrange(96)
        tree = random_tree(rng, rng.randrange(0, 10), 96)
        seq.forward_tree(root, tree)
        path = tree.path_to(rng.randrange(len(tree))) if len(tree) and rng.random() < 0.8 else ()
        seq.commit(path)
        committed += [root, *tree.tokens_of(path)]
        if step % 4 == 3:
            drop = rng.randrange(0, 3)
            seq.crop(len(committed) - drop)
            committed = committed[: len(committed) - drop]
        assert_cache_equals_plain_forward(model, seq, committed)


def test_cache_grows_past_its_first_capacity():
    model = tiny_model("llama", seed=1)
    seq = native(model).new_sequence()
    ids = [random.Random(0).randrange(96) for _ in range(250)]
    for i in range(0, 250, 50):
        seq.prefill(ids[i : i + 50], logits="none")
    assert seq.cache.capacity >= 250
    assert_cache_equals_plain_forward(model, seq, ids)
    torch.testing.assert_close(seq.forward_tree(3, TokenTree.empty())[0], causal_logits(model, ids + [3]),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["prompt-lookup", "token-recycling", "draft-model", "draft-tree", "fusion"])
@pytest.mark.parametrize("arch", NATIVE_ARCHES)
def test_greedy_speculative_output_equals_plain_greedy(arch, method):
    model = tiny_model(arch, seed=3)
    target = native(model)
    draft = native(perturbed_copy(model, 0.2)) if method in ("draft-model", "draft-tree", "fusion") else None
    dec = build_decoder(method, target, None, draft, planner=False)
    drafted = 0
    for prompt in ([5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], [60, 61, 62, 63]):
        out = dec.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 30), (arch, method, prompt)
        drafted += out.stats.drafted_tokens
    assert drafted > 0


def test_int8_invariant_tree_rows_are_bitwise_one_token_steps():
    """int8 linears (row invariant) + batch-invariant attention: every tree row is computed with
    exactly the numbers a one-token decoding step uses, so tree logits equal them bit for bit."""
    model = tiny_model("qwen2", seed=11)
    backend = native(model, quantize="int8", invariant=True)
    rng = random.Random(12)
    prompt = [rng.randrange(96) for _ in range(9)]
    tree = random_tree(rng, 12, 96)
    seq = backend.new_sequence()
    seq.prefill(prompt[:-1], logits="none")
    logits = seq.forward_tree(prompt[-1], tree)
    for row, path in enumerate([()] + [tree.path_to(i) for i in range(len(tree))]):
        one = backend.new_sequence()
        one.prefill(prompt[:-1], logits="none")
        for tok in [prompt[-1], *tree.tokens_of(path)][:-1]:
            one.prefill([tok], logits="none")
        step = one.forward_tree(([prompt[-1], *tree.tokens_of(path)])[-1], TokenTree.empty())[0]
        assert torch.equal(logits[row], step), row


def test_unsupported_models_are_refused_with_the_fix_named():
    assert not supports(tiny_model("gpt2")) and supports(tiny_model("qwen2"))
    with pytest.raises(ConfigError, match="--backend hf"):
        NativeDecoder.from_hf(tiny_model("gpt2"))


def test_cost_key_names_the_native_backend():
    key = native(tiny_model("llama"), kernel="onednn").cost_key()
    assert key["backend"] == "native" and key["linear_kernel"] == "onednn" and key["quantize"] == "none"
