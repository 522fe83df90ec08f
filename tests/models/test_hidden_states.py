"""Hidden states through the backend protocol (`FeatureModel`): the last hidden state of every
row comes from the same pass as the logits, on prefill, trees and packed batches, native and
Hugging Face backends alike; logits = hidden @ output_rows.T; embeddings are the model's."""

from __future__ import annotations

import random

import pytest
import torch

from tiny import random_tree, tiny_model
from specula.models.base import FeatureModel, forward_trees
from specula.models.hf import HFCausalLM
from specula.models.native import NativeCausalLM, NativeDecoder, configure


def _backend(kind: str, arch: str, tie: bool = False):
    model = tiny_model(arch, "eager", seed=3)
    if tie:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    if kind == "hf":
        return HFCausalLM(model, "hf"), model
    decoder = configure(NativeDecoder.from_hf(model), "onednn", "none", "sdpa")
    return NativeCausalLM(decoder, "native"), model


@pytest.mark.parametrize("kind", ["native", "hf"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hidden_states_give_the_logits_and_match_a_causal_forward(kind, arch):
    backend, model = _backend(kind, arch)
    assert isinstance(backend, FeatureModel)
    vocab = model.config.vocab_size
    rows = backend.output_rows(torch.arange(vocab))  # [V, E]
    assert torch.allclose(rows, model.lm_head.weight, atol=1e-6)
    rng = random.Random(0)
    prompt = [rng.randrange(2, vocab) for _ in range(9)]
    seq = backend.new_sequence()
    logits, hidden = seq.prefill(prompt[:-1], logits="all", hidden=True)
    assert hidden.shape == (8, backend.hidden_size)
    assert torch.allclose(hidden.float() @ rows.t().float(), logits, atol=1e-4)
    with torch.no_grad():
        ref = model(torch.tensor([prompt[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    assert torch.allclose(hidden, ref, atol=1e-4)
    tree = random_tree(rng, 7, vocab)
    logits, hidden = seq.forward_tree(prompt[-1], tree, hidden=True)
    assert hidden.shape == (len(tree) + 1, backend.hidden_size)
    assert torch.allclose(hidden.float() @ rows.t().float(), logits, atol=1e-4)
    # node i's hidden state = the causal forward's last state over its root-to-node path
    for i in range(len(tree)):
        path = [prompt[-1], *tree.tokens_of(tree.path_to(i))]
        with torch.no_grad():
            ref = model(torch.tensor([prompt[:-1] + path]), output_hidden_states=True).hidden_states[-1][0, -1]
        assert torch.allclose(hidden[i + 1], ref, atol=1e-4)
    emb = backend.embed_tokens(torch.tensor([2, 5]))
    assert torch.equal(emb, model.model.embed_tokens.weight[[2, 5]])


def test_tied_native_output_rows_are_the_embedding():
    backend, model = _backend("native", "llama", tie=True)
    ids = torch.tensor([0, 4, 7])
    assert torch.equal(backend.output_rows(ids), model.model.embed_tokens.weight[ids])


def test_packed_pass_returns_each_sequences_hidden_states():
    backend, model = _backend("native", "qwen2")
    rng = random.Random(1)
    vocab = model.config.vocab_size
    seqs, items = [], []
    for n in (5, 8):
        seq = backend.new_sequence()
        seq.prefill([rng.randrange(2, vocab) for _ in range(n)], logits="none")
        seqs.append(seq)
        items.append((seq, rng.randrange(2, vocab), random_tree(rng, 4, vocab)))
    packed = forward_trees(backend, items, hidden=True)
    alone = []
    for seq, root, tree in items:
        seq.commit([])
        seq.crop(len(seq.tokens) - 1)
        alone.append(seq.forward_tree(root, tree, hidden=True))
    for (pl, ph), (al, ah) in zip(packed, alone):
        assert torch.allclose(ph, ah, atol=1e-5) and torch.allclose(pl, al, atol=1e-4)
