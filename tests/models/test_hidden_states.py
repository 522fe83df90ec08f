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


def _backend(kind: str, arch: str, tie: bool = False, layers: int = 2):
    model = tiny_model(arch, "eager", seed=3, layers=layers)
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


@pytest.mark.parametrize("tie", [False, True])
def test_hf_output_rows_of_a_prepacked_head_are_its_rows(tie):
    """A Hugging Face model whose linears oneDNN prepacked (its head's weight on the meta device):
    the rows are the tied embedding's where the head is tied (no pass), else read through the head."""
    from specula.models.prepack import prepack_model

    backend, model = _backend("hf", "qwen2", tie=tie)
    ids = torch.tensor([0, 9, 3, 9])
    expected = model.lm_head.weight[ids].detach().clone()
    prepack_model(model, "onednn")
    assert model.get_output_embeddings().weight.device.type == "meta"
    assert torch.allclose(backend.output_rows(ids), expected, atol=1e-6)


@pytest.mark.parametrize("kernel,quantize", [("specula", "none"), ("specula", "int8"), ("onednn", "none"),
                                             ("aten", "none"), ("aten", "int8")])
def test_untied_native_output_rows_are_the_output_heads_rows(kernel, quantize):
    """Read from the head's own storage where it has one (a packed kernel's rows, a plain weight),
    else through the head: the rows it computes logits with."""
    from specula.models.native import kernels

    if kernel == "specula" and not kernels.available():
        pytest.skip("specula's CPU kernels cannot run here")
    model = tiny_model("qwen2", "eager", seed=3, layers=2)
    assert not model.config.tie_word_embeddings
    backend = NativeCausalLM(configure(NativeDecoder.from_hf(model), kernel, quantize, "sdpa"), "native")
    ids = torch.tensor([0, 9, 3, 9])
    eye = torch.eye(backend.hidden_size)
    with torch.inference_mode():
        through_head = backend.decoder.lm_head(eye).t()[ids]  # [k, E]
    assert torch.allclose(backend.output_rows(ids), through_head, atol=1e-6)


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


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_layer_features_are_the_inputs_of_those_layers(kind):
    """A tuple request (EAGLE-3's features) returns the residual stream entering each named layer,
    concatenated in the order asked (N = the final-normed state), on prefill, trees and packed
    batches: what a causal Hugging Face forward gives as hidden_states[i]."""
    backend, model = _backend(kind, "llama", layers=4)
    assert backend.num_layers == 4
    layers = (3, 0, 4, 2)
    rng = random.Random(5)
    vocab = model.config.vocab_size
    prompt = [rng.randrange(2, vocab) for _ in range(8)]

    def reference(ids):  # [len(ids), 4 E]
        with torch.no_grad():
            states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        return torch.cat([states[i][0] for i in layers], -1)

    seq = backend.new_sequence()
    logits, feats = seq.prefill(prompt[:-1], logits="all", hidden=layers)
    assert feats.shape == (7, 4 * backend.hidden_size)
    assert torch.allclose(feats, reference(prompt[:-1]), atol=1e-4)
    e = backend.hidden_size
    final = feats[:, 2 * e: 3 * e]  # layer 4 = the final-normed state: it gives the logits
    assert torch.allclose(final.float() @ backend.output_rows(torch.arange(vocab)).t().float(), logits, atol=1e-4)
    tree = random_tree(rng, 6, vocab)
    _, feats = seq.forward_tree(prompt[-1], tree, hidden=layers)
    for i in range(len(tree)):
        path = [prompt[-1], *tree.tokens_of(tree.path_to(i))]
        assert torch.allclose(feats[i + 1], reference(prompt[:-1] + path)[-1], atol=1e-4)
    seq.commit([])
    empty = backend.new_sequence().prefill([], logits="none", hidden=layers)[1]
    assert empty.shape == (0, 4 * e)
    if kind == "native":
        other = backend.new_sequence()
        other.prefill(prompt[:5], logits="none")
        tree2 = random_tree(rng, 3, vocab)
        seq.crop(len(seq.tokens))
        packed = forward_trees(backend, [(seq, 7, tree), (other, 9, tree2)], hidden=layers)
        for (s, root, t), (_, f) in zip([(seq, 7, tree), (other, 9, tree2)], packed):
            ref = reference([*s.tokens, root])[-1]
            assert torch.allclose(f[0], ref, atol=1e-4)


def test_a_layer_the_model_lacks_is_refused_by_name():
    from specula.errors import ConfigError

    backend, _ = _backend("native", "llama")
    with pytest.raises(ConfigError, match="layers \\[0, 5\\].*0..2"):
        backend.new_sequence().prefill([3, 4], logits="none", hidden=(0, 5))
