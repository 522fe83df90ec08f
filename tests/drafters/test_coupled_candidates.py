"""Coupled candidates (`DraftContext.coupled_candidate`): a sampled request's fixed candidates raced with the noise
the target's own token at that position is raced with. A draft whose q equals p then proposes exactly the
target's tokens, so every drafted token is accepted; the output stays plain seeded sampling's."""

from __future__ import annotations

import pytest
import torch

from tiny import perturbed_copy, tiny_model
from specula.api import build_decoder
from specula.models.native import NativeCausalLM, NativeDecoder, configure, kernels
from specula.sampling import SamplingParams, make_generator, position_noise, race_token
from specula.step import DraftBudget, DraftContext

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels do not run here")

PROMPT = [5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17, 60]


def native(model) -> NativeCausalLM:
    """specula's C kernels: every row computed alone, so a draft with the target's weights gives its logits bit for
    bit, and q = p."""
    return NativeCausalLM(configure(NativeDecoder.from_hf(model), "specula", "none", "sdpa"), "native",
                          eos_token_ids=[])


def test_a_coupled_candidate_is_raced_with_the_noise_of_its_position():
    ctx = DraftContext([1, 2, 3, 9, 8], 3, SamplingParams(temperature=1.0), DraftBudget(8, 4), make_generator(0),
                       seed=11)
    q = torch.softmax(torch.randn(300), -1)
    for depth in range(3):  # two tokens generated before the root: position 2 + depth
        assert ctx.coupled_candidate(q, depth) == race_token(q, position_noise(11, 2 + depth, 300))
    assert DraftContext([1, 2], 1, SamplingParams(), DraftBudget(8, 4), make_generator(0), seed=11) \
        .coupled_candidate(q, 0) is None  # greedy: the argmax
    assert DraftContext([1, 2], 1, SamplingParams(temperature=1.0), DraftBudget(8, 4), make_generator(0)) \
        .coupled_candidate(q, 0) is None  # no seed given


@needs_kernels
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
@pytest.mark.parametrize("planner", [False, "hardware"])
def test_a_draft_equal_to_the_target_has_every_coupled_token_accepted(temperature, top_p, planner):
    """With the target's own weights as the draft (q = p bit for bit) the coupled candidates are the target's
    draws: every drafted token is accepted (with fixed chains of 4, every step accepts the whole chain); the output
    is plain seeded sampling's, with this draft and with one unlike the target."""
    model = tiny_model("llama", "eager", seed=4)
    params = SamplingParams(max_new_tokens=40, temperature=temperature, top_p=top_p, seed=3, ignore_eos=True)
    plain = build_decoder("none", native(model), None).generate(PROMPT, params)
    dec = build_decoder("draft-model", native(model), None, native(model), planner=planner, num_draft_tokens=4)
    out = dec.generate(PROMPT, params)
    assert out.token_ids == plain.token_ids
    assert out.stats.accepted_tokens == out.stats.drafted_tokens > 0
    if planner is False:
        assert out.stats.steps == 40 // 5  # each step: the chain of 4 and the bonus token
    far = build_decoder("draft-model", native(model), None, native(perturbed_copy(model, 0.3)), planner=planner,
                        num_draft_tokens=4)
    assert far.generate(PROMPT, params).token_ids == plain.token_ids  # a draft unlike the target: same output


@needs_kernels
def test_argmax_candidates_of_the_same_draft_are_rejected_where_coupled_ones_are_not():
    """The same draft without a seed in its context proposes its argmax (the drafters' behaviour before
    coupling): at temperature 1 far fewer of its tokens are accepted (the check has power)."""
    model = tiny_model("llama", "eager", seed=4)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    dec = build_decoder("draft-model", native(model), None, native(model), planner=False, num_draft_tokens=4)
    coupled = dec.generate(PROMPT, params).stats
    import specula.engine as engine

    real = engine.DraftContext
    engine.DraftContext = lambda *a, seed=None, **k: real(*a, **k)  # the context without the request's seed
    try:
        argmax = dec.generate(PROMPT, params).stats
    finally:
        engine.DraftContext = real
    assert coupled.accepted_tokens == coupled.drafted_tokens
    assert argmax.accepted_tokens < 0.8 * argmax.drafted_tokens


def test_a_coupling_noise_follows_a_draft_vocabulary_to_its_token_ids():
    """A head's q is over its draft vocabulary: column j is raced with the noise of token id vocab_index[j]."""
    ctx = DraftContext([1, 2, 3, 9], 3, SamplingParams(temperature=0.8), DraftBudget(8, 4), make_generator(0), seed=5)
    index = torch.tensor([7, 0, 299, 42])  # [columns] -> token ids
    assert torch.equal(ctx.coupling_noise(2, 4, index), position_noise(5, 3, 300)[index])  # one generated: 1 + 2
    assert torch.equal(ctx.coupling_noise(0, 10), position_noise(5, 1, 10))
    assert DraftContext([1, 2], 1, SamplingParams(temperature=0.8), DraftBudget(8, 4), make_generator(0)) \
        .coupling_noise(0, 10) is None


def test_a_sampled_trees_first_child_is_the_token_its_q_races_to():
    """Each row's coupled child comes first, scored as the row's best; the other top-k children follow best first,
    scored q(x) (1 - the best); a coupled child outside the top k takes the k-th's place; without noise (greedy
    requests, no seed) the top k as they are."""
    from specula.drafters.draft_tree import DraftTreeDrafter

    params = SamplingParams(temperature=1.0)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]]).log()  # q proportional to these
    q = torch.softmax(logits, -1)
    noise = torch.tensor([1.0, 1.0, 0.01, 1.0, 1.0])  # token 2 wins both rows' races
    probs, idx = DraftTreeDrafter._top_children(logits, params, 3, noise)
    assert idx == [[2, 0, 1], [2, 4, 3]]  # row 0: 2 was third, now first; row 1: 2 was outside the top 2 kept
    rest = 1 - q.max(-1).values  # [2]
    assert probs[0] == pytest.approx([float(q[0, 0]), float(q[0, 0] * rest[0]), float(q[0, 1] * rest[0])])
    assert probs[1] == pytest.approx([float(q[1, 4]), float(q[1, 4] * rest[1]), float(q[1, 3] * rest[1])])
    assert DraftTreeDrafter._top_children(logits, params, 3)[1] == [[0, 1, 2], [4, 3, 2]]
    assert DraftTreeDrafter._top_children(logits, params, 1, noise)[1] == [[2], [2]]


@needs_kernels
@pytest.mark.parametrize("top_k", [1, 2])
def test_a_draft_tree_equal_to_the_target_has_its_coupled_path_accepted(top_k):
    """`draft-tree` with the target's own weights (q = p): each node's first child is the target's token, so with
    one child a node every drafted token is accepted and with two every step accepts its whole depth; without the
    request's seed (argmax children) far fewer are. The output is plain seeded sampling's either way."""
    model = tiny_model("llama", "eager", seed=4)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    plain = build_decoder("none", native(model), None).generate(PROMPT, params)
    dec = build_decoder("draft-tree", native(model), None, native(model), planner=False, tree_top_k=top_k,
                        tree_depth=4, tree_nodes=64)
    out = dec.generate(PROMPT, params)
    assert out.token_ids == plain.token_ids
    assert out.stats.steps == 40 // 5  # each step: the depth-4 coupled path and the bonus token
    if top_k == 1:
        assert out.stats.accepted_tokens == out.stats.drafted_tokens
    import specula.engine as engine

    real = engine.DraftContext
    engine.DraftContext = lambda *a, seed=None, **k: real(*a, **k)  # the context without the request's seed
    try:
        argmax = dec.generate(PROMPT, params)
    finally:
        engine.DraftContext = real
    assert argmax.token_ids == plain.token_ids and argmax.stats.steps > 1.5 * out.stats.steps


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_heads_coupled_trees_sample_what_plain_decoding_samples_with_the_same_seed(kind):
    """A head's deterministic trees over a draft vocabulary without some ids, and the request's context ids
    joining it (coupled children raced with the noise of their token ids): each seed's output is plain
    decoding's, and drafts are accepted."""
    from specula.drafters.heads.runtime import new_head
    from specula.models.hf import HFCausalLM

    model = tiny_model("llama", seed=8, vocab=8)
    target = HFCausalLM(model, "target")
    head = new_head(kind, target, torch.tensor([0, 1, 2, 3, 5, 6]), seed=2)  # the draft vocabulary lacks 4 and 7
    head.context_vocab = 16
    dec = build_decoder(kind, target, None, head=head, planner=False, tree_top_k=2, tree_depth=3)
    plain = build_decoder("none", target, None)
    accepted = 0
    for seed in range(20):
        params = SamplingParams(temperature=1.5, max_new_tokens=10, seed=seed, ignore_eos=True)
        out = dec.generate([4, 5, 7, 3, 4], params)
        assert out.token_ids == plain.generate([4, 5, 7, 3, 4], params).token_ids, seed
        accepted += out.stats.accepted_tokens
    assert accepted > 0
