"""A draft's output layer cut to a draft vocabulary (FR-Spec, `specula.models.draft_vocab`): the kept
rows' logits are the full head's bit for bit, every other logit is -inf, and speculative decoding
with the cut draft outputs what plain decoding outputs."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tiny import SPECULATIVE_PROMPTS, perturbed_copy, reference_greedy, tiny_model, word_tokenizer
from specula.errors import ConfigError
from specula.models import draft_vocab
from specula.models.draft_vocab import (
    apply_draft_vocab, check_draft_vocab, rank_tokens, ranking_for, read_ranking, restrict_output, write_ranking,
)
from specula.models.hf import HFCausalLM
from specula.models.native import NativeDecoder, configure, kernels
from specula.models.native.backend import NativeCausalLM

V = 96
KINDS = [("aten", "none"), ("onednn", "none"), ("aten", "int8"),
         pytest.param("specula", "none", marks=pytest.mark.skipif(not kernels.available(), reason="no C kernels")),
         pytest.param("specula", "int8", marks=pytest.mark.skipif(not kernels.available(), reason="no C kernels"))]
INT4 = pytest.param("specula", "int4", marks=pytest.mark.skipif(not kernels.available(), reason="no C kernels"))


def native(model, kernel="aten", quantize="none") -> NativeCausalLM:
    return NativeCausalLM(configure(NativeDecoder.from_hf(model), kernel, quantize, "sdpa"), "native", eos_token_ids=[1])


def logits_of(backend, prompt, tree_tokens=(7, 8, 9)):
    """The logits after the prompt but its last token, then of that token (the root) and a three-node chain."""
    from specula.tree import TokenTree

    seq = backend.new_sequence()
    last = seq.prefill(prompt[:-1], logits="last")
    tree = TokenTree.chain(list(tree_tokens))
    rows = seq.forward_tree(prompt[-1], tree)
    return torch.cat([last.reshape(1, -1), rows]).float()


@pytest.mark.parametrize("kernel,quantize", [*KINDS, INT4])
@pytest.mark.parametrize("tie", [False, True])
def test_a_cut_head_scores_its_rows_as_the_full_head_and_nothing_else(kernel, quantize, tie):
    model = tiny_model("qwen2", "eager", seed=3)
    if tie:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    full = native(copy.deepcopy(model), kernel, quantize)
    cut = native(copy.deepcopy(model), kernel, quantize)
    ids = torch.tensor(sorted(torch.randperm(V, generator=torch.Generator().manual_seed(0))[:40].tolist()))
    restrict_output(cut, ids)
    prompt = [5, 17, 33, 2, 5, 17, 40, 41, 42, 60, 17]
    expected, got = logits_of(full, prompt), logits_of(cut, prompt)
    assert got.shape == expected.shape == (5, V)  # the prompt's last row, the root and three nodes
    if kernel == "specula":  # bit for bit: the same kind of rows, each output row alone
        assert torch.equal(got[:, ids], expected[:, ids])
    else:  # a BLAS may block another output width otherwise
        assert torch.allclose(got[:, ids], expected[:, ids], atol=1e-5)
    context = torch.tensor(sorted(set(prompt) - set(ids.tolist())))  # read by the sequence: scored too
    # rows read from the float embedding (tied): int4's rounding of the full head is what differs
    atol = 0.5 if quantize == "int4" and tie else 0.05
    assert len(context) and torch.allclose(got[:, context], expected[:, context], rtol=0.02, atol=atol)
    others = torch.ones(V, dtype=torch.bool)
    others[ids] = False
    others[context] = False
    assert torch.isinf(got[:, others]).all() and (got[:, others] < 0).all()
    assert cut.vocab_size == V and cut.decoder.lm_head.weight.shape == (V, 32)
    if tie and (kernel, quantize) != ("aten", "none"):  # a packed head gone: rare rows come from the embedding
        assert cut.weight_bytes < full.weight_bytes
    else:  # the full head stays to read rare rows from (or is the embedding itself): the cut rows come on top
        assert cut.weight_bytes > full.weight_bytes


def test_a_cut_head_scores_the_rare_tokens_its_sequences_read_from_then_on():
    """A name in the prompt outside the ranking: scored after the prompt's prefill (by every sequence
    of the model), never before; the kept rows are untouched."""
    model = tiny_model("qwen2", "eager", seed=3)
    full, cut = native(copy.deepcopy(model)), native(copy.deepcopy(model))
    restrict_output(cut, torch.arange(0, 50))
    fresh = cut.new_sequence()
    before = fresh.prefill([3, 4], logits="last")
    assert torch.isinf(before[70])
    logits_of(cut, [3, 70, 71, 4])  # another sequence reads 70 and 71
    after = fresh.prefill([5], logits="last")
    reference = full.new_sequence()
    reference.prefill([3, 4], logits="none")
    expected = reference.prefill([5], logits="last")
    assert torch.allclose(after[[70, 71]], expected[[70, 71]], atol=1e-4)
    assert torch.allclose(after[:50], expected[:50], atol=1e-5) and torch.isinf(after[72:]).all()
    assert len(cut.decoder.lm_head.context_ids) == 2


@pytest.mark.parametrize("kernel,quantize", KINDS)
def test_an_untied_head_that_holds_the_embeddings_rows_lets_the_full_head_go(kernel, quantize):
    """Converted untied from tied weights (its head the embedding, quantized apart): rare rows come
    from the embedding and the full head is dropped; a head of other rows is kept to read them from."""
    model = tiny_model("qwen2", "eager", seed=3)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        model.lm_head.weight.copy_(emb + 1e-3 * emb.abs().amax(dim=1, keepdim=True) * torch.randn(emb.shape))
    full, cut = native(copy.deepcopy(model), kernel, quantize), native(copy.deepcopy(model), kernel, quantize)
    assert not cut.tied_output
    restrict_output(cut, torch.arange(0, 50))
    assert cut.decoder.lm_head.source is None and cut.weight_bytes < full.weight_bytes
    prompt = [3, 70, 71, 4]
    got, expected = logits_of(cut, prompt), logits_of(full, prompt)
    assert torch.allclose(got[:, [70, 71]], expected[:, [70, 71]], rtol=0.05, atol=0.05)
    other = native(tiny_model("qwen2", "eager", seed=3), kernel, quantize)  # a head of its own rows
    restrict_output(other, torch.arange(0, 50))
    assert other.decoder.lm_head.source is not None


def test_a_cut_head_adds_context_tokens_up_to_its_limit(monkeypatch):
    from specula.models import draft_vocab as dv

    monkeypatch.setattr(dv, "MAX_CONTEXT_TOKENS", 3)
    cut = native(tiny_model("qwen2", "eager", seed=3))
    restrict_output(cut, torch.arange(0, 50))
    cut.new_sequence().prefill([60, 61, 62, 63, 64], logits="none")
    assert cut.decoder.lm_head.context_ids.tolist() == [60, 61, 62]


def test_the_hf_backend_cuts_its_head_too():
    model = tiny_model("llama", seed=4)
    full, cut = HFCausalLM(copy.deepcopy(model)), HFCausalLM(copy.deepcopy(model))
    ids = torch.arange(0, V, 3)
    restrict_output(cut, ids)
    prompt = [3, 9, 27, 4]
    expected, got = logits_of(full, prompt), logits_of(cut, prompt)
    assert torch.allclose(got[:, ids], expected[:, ids], atol=1e-5)
    assert torch.isinf(got[:, 1]).all()  # 1 is not a multiple of 3


def test_a_cut_head_refuses_to_hand_out_rows_for_a_trained_head():
    model = tiny_model("qwen2", "eager", seed=3)
    backend = native(model)
    restrict_output(backend, torch.arange(10))
    with pytest.raises(ConfigError, match="draft vocabulary"):
        backend.output_rows(torch.tensor([1, 2]))


@pytest.mark.parametrize("method", ["draft-model", "fusion"])
def test_greedy_with_a_cut_draft_equals_plain_greedy(method):
    """The draft cannot propose tokens the plain output needs (some are cut away) and the output is
    still plain greedy's, token for token, with drafts accepted."""
    from specula.api import build_decoder
    from specula.sampling import SamplingParams

    model = tiny_model("llama", seed=5)
    target, draft = native(model), native(perturbed_copy(model, 0.05))
    refs = {tuple(p): reference_greedy(model, list(p), 24) for p in SPECULATIVE_PROMPTS}
    used = sorted({t for out in refs.values() for t in out})
    cut_away = used[::4]  # a quarter of the tokens plain decoding emits: never drafted
    keep = torch.tensor([t for t in range(V) if t not in cut_away])
    restrict_output(draft, keep)
    dec = build_decoder(method, target, None, draft, planner="none")
    accepted = 0
    for prompt in SPECULATIVE_PROMPTS:
        out = dec.generate(list(prompt), SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert out.token_ids == refs[tuple(prompt)], (method, prompt)
        accepted += out.stats.accepted_tokens
    assert accepted > 0


def test_rankings_order_by_count_and_apply_to_their_tokenizer_only(tmp_path):
    assert rank_tokens([[5, 3, 3], [7, 5, 3]]) == [3, 5, 7]
    assert rank_tokens([[2, 1]]) == [1, 2]  # ties: the smaller id first
    tok = word_tokenizer(V)
    write_ranking(tmp_path / "w.json", tok, "words", list(range(V - 1, -1, -1)), "test counts", 1234)
    found = ranking_for(tok, tmp_path)
    assert found is not None and found.ranked[:3] == (V - 1, V - 2, V - 3) and found.vocab_size == V
    other = word_tokenizer([f"x{i}" for i in range(V)])  # the same size, other tokens
    assert ranking_for(other, tmp_path) is None
    assert ranking_for(word_tokenizer(V + 1), tmp_path) is None


def test_a_broken_ranking_file_is_one_clear_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"tokenizer_fingerprint": "x", "vocab_size": 10, "ranked": [1, 2, 2]}))
    with pytest.raises(ConfigError, match="repeats"):
        read_ranking(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be read"):
        read_ranking(path)


def test_the_shipped_qwen_ranking_is_sound():
    ranking = read_ranking(draft_vocab.RANKINGS / "qwen2.5.json")
    assert ranking.vocab_size == 151936 and len(ranking.ranked) >= draft_vocab.DEFAULT_SIZE
    assert ranking.tokenizer_fingerprint.startswith("sha256:")


@pytest.mark.parametrize("value,parsed", [(None, "auto"), ("auto", "auto"), ("full", "full"), ("32768", 32768),
                                          (100, 100)])
def test_draft_vocab_options_parse(value, parsed):
    assert check_draft_vocab(value) == parsed


@pytest.mark.parametrize("value", ["1", "0", "-5", "lots", "3.5"])
def test_a_bad_draft_vocab_option_names_the_choices(value):
    with pytest.raises(ConfigError, match="auto, full, or a number"):
        check_draft_vocab(value)


def test_apply_cuts_where_a_ranking_ships_and_says_what_it_did(tmp_path, monkeypatch):
    tok = word_tokenizer(V)
    monkeypatch.setattr(draft_vocab, "RANKINGS", tmp_path)
    model = tiny_model("qwen2", "eager", seed=3)
    # no ranking for this tokenizer: auto keeps every row, a size is an error naming the fix
    backend = native(copy.deepcopy(model))
    assert apply_draft_vocab(backend, tok, "auto") is None
    with pytest.raises(ConfigError, match='^draft_vocab=40: no token ranking ships for this tokenizer .*; pass '
                                          'draft_vocab="full"$'):  # load's keyword, as a Python caller writes it
        apply_draft_vocab(backend, tok, 40)
    write_ranking(tmp_path / "w.json", tok, "words", list(range(2, V)), "test counts", 99)
    assert apply_draft_vocab(backend, tok, "auto") is None  # 96 tokens: too few to be worth a cut
    with pytest.raises(ConfigError, match="^draft_vocab=95: .*pass at most 94"):
        apply_draft_vocab(backend, tok, 95)
    done = apply_draft_vocab(backend, tok, 40, always=[1])
    assert done == {"size": 41, "of": V, "ranking": "w.json"}  # 2..41, and the end-of-sequence token 1
    assert len(backend.decoder.lm_head.ids) == 41
    monkeypatch.setattr(draft_vocab, "DEFAULT_SIZE", 20)  # as if the vocabulary were large
    auto = native(copy.deepcopy(model))
    assert apply_draft_vocab(auto, tok, "auto")["size"] == 20
    hf = HFCausalLM(copy.deepcopy(model))
    assert apply_draft_vocab(hf, tok, "auto") is None  # auto cuts the native backend only
    assert apply_draft_vocab(hf, tok, 30)["size"] == 30
    assert apply_draft_vocab(native(copy.deepcopy(model)), tok, "full") is None
