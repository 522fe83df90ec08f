"""`draft-model` and `draft-tree` with a window on long prompts: what the draft cache reads (the
prompt's first and last halves of the window, then everything generated), greedy output still equal
to plain greedy decoding, and a window too small refused."""

from __future__ import annotations

import pytest

from tiny import perturbed_copy, reference_greedy, tiny_model
from specula.drafters import make_drafter
from specula.drafters.base import DraftBudget, DraftContext
from specula.drafters.draft_model import DEFAULT_WINDOW, MIN_WINDOW, DraftModelConfig, window_view
from specula.engine import SpeculativeDecoder
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.sampling import SamplingParams, make_generator

WINDOW = MIN_WINDOW + 2  # 33 opening and 33 closing prompt tokens


def long_prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 50 + 2 for i in range(n)]


def test_window_view_keeps_the_prompts_opening_and_tail_then_all_generated_tokens():
    prompt = list(range(100, 200))  # 100 prompt tokens
    generated = [1, 2, 3]
    view = window_view(prompt + generated, len(prompt), WINDOW)
    assert view == prompt[:33] + prompt[-33:] + generated
    assert window_view(prompt, len(prompt), WINDOW + 1) == prompt[:33] + prompt[-34:]  # an odd window
    assert len(view) == WINDOW + len(generated)


def test_a_prompt_that_fits_the_window_or_window_0_is_read_whole():
    tokens = list(range(WINDOW + 5))
    assert window_view(tokens, WINDOW, WINDOW) == tokens  # the prompt is exactly the window
    assert window_view(tokens, len(tokens), 0) == tokens


def test_the_draft_cache_holds_only_the_window_of_a_long_prompt():
    model = tiny_model("llama", seed=3)
    drafter = make_drafter("draft-model", draft=HFCausalLM(perturbed_copy(model, 0.1), "draft"), num_draft_tokens=3,
                           draft_window=WINDOW)
    seq = drafter.start()
    prompt = long_prompt(150)
    tokens = prompt + [11]  # the root: the first generated token
    ctx = DraftContext(tokens, len(prompt), SamplingParams(), DraftBudget(16, 8), make_generator(0))
    proposal = drafter.propose(ctx, seq)
    assert len(proposal.tree) == 3
    view = prompt[:33] + prompt[-33:] + [11]
    assert seq.tokens[:len(view)] == view  # then the drafted chain, bar its last token
    assert len(seq.tokens) == len(view) + 2
    drafter.finish(seq)


def test_the_draft_trees_cache_holds_only_the_window_of_a_long_prompt():
    model = tiny_model("llama", seed=3)
    drafter = make_drafter("draft-tree", draft=HFCausalLM(perturbed_copy(model, 0.1), "draft"), tree_top_k=2,
                           tree_depth=2, tree_nodes=4, draft_window=WINDOW)
    state = drafter.start()
    prompt = long_prompt(150)
    ctx = DraftContext(prompt + [11], len(prompt), SamplingParams(), DraftBudget(16, 8), make_generator(0))
    proposal = drafter.propose(ctx, state)
    assert len(proposal.tree) == 4
    state.finish(())  # the step accepted no node (what `observe` does with no accepted tokens)
    assert state.seq.tokens == prompt[:33] + prompt[-33:] + [11]
    drafter.finish(state)
    # the default window, narrowed to half the tiny draft's 256 tokens of context
    assert make_drafter("draft-tree", draft=HFCausalLM(model, "draft")).draft_window == min(DEFAULT_WINDOW, 128)
    with pytest.raises(ConfigError, match="draft_window must be at least 64"):
        make_drafter("draft-tree", draft=HFCausalLM(model, "draft"), draft_window=10)


@pytest.mark.parametrize("method, options", [("draft-model", {"num_draft_tokens": 4}),
                                             ("draft-tree", {"tree_top_k": 2, "tree_depth": 4, "tree_nodes": 6})])
@pytest.mark.parametrize("prompt_length", [20, 150])
def test_greedy_output_equals_plain_greedy_with_a_draft_window(arch, prompt_length, method, options):
    model = tiny_model(arch, seed=3)
    drafter = make_drafter(method, draft=HFCausalLM(perturbed_copy(model, 0.1), "draft"), draft_window=WINDOW,
                           **options)
    dec = SpeculativeDecoder(HFCausalLM(model, "target"), drafter, eos_token_ids=[])
    prompt = long_prompt(prompt_length)
    out = dec.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert out.token_ids == reference_greedy(model, prompt, 40)
    assert out.stats.accepted_tokens > 0  # the window's drafts were checked, and some kept


def test_the_window_defaults_to_512_tokens_and_one_too_small_is_refused():
    assert DraftModelConfig().draft_window == DEFAULT_WINDOW == 512
    assert DraftModelConfig(draft_window=0).draft_window == 0  # the whole prompt
    assert DraftModelConfig(draft_window=MIN_WINDOW).draft_window == MIN_WINDOW
    for bad in (MIN_WINDOW - 1, -1):
        with pytest.raises(ConfigError, match="draft_window"):
            DraftModelConfig(draft_window=bad)


@pytest.mark.parametrize("seed, greedy_proposals, mode", [(None, None, "iid"), (5, None, "deterministic"),
                                                          (5, False, "iid"), (None, True, "deterministic")])
def test_a_seeded_request_drafts_fixed_candidates_unless_told_to_draw(seed, greedy_proposals, mode):
    model = tiny_model("llama", seed=3)
    drafter = make_drafter("draft-model", draft=HFCausalLM(perturbed_copy(model, 0.1), "draft"), num_draft_tokens=3,
                           greedy_proposals=greedy_proposals)
    seq = drafter.start()
    params = SamplingParams(temperature=1.0, seed=seed)
    proposal = drafter.propose(DraftContext([5, 9, 11], 2, params, DraftBudget(16, 8), make_generator(0)), seq)
    assert len(proposal.tree) == 3 and proposal.sibling_mode == mode
    drafter.finish(seq)


def test_a_seed_gives_plain_samplings_output_whatever_the_planner_times():
    """A seeded sampled request: the draft model's chain is fixed candidates (coupled ones), so one noise
    vector per position decides every token, and the output is plain sampling's with that seed (the hardware planner,
    whose choices follow timings, included)."""
    from specula.api import build_decoder
    from specula.planner import CostCurve, HardwarePlanner

    model = tiny_model("llama", seed=3)
    draft = HFCausalLM(perturbed_copy(model, 0.1), "draft")
    target = HFCausalLM(model, "target")
    plain = build_decoder("none", target)
    dec = build_decoder("draft-model", target, None, draft, num_draft_tokens=4,
                        planner=HardwarePlanner(curve=CostCurve((1, 2, 4, 8), (1.0, 1.05, 1.1, 1.2), 64)))
    accepted = 0
    for seed in range(8):
        params = SamplingParams(temperature=0.8, max_new_tokens=24, seed=seed, ignore_eos=True)
        out = dec.generate(long_prompt(20), params)
        assert out.token_ids == plain.generate(long_prompt(20), params).token_ids, seed
        accepted += out.stats.accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("draft_vocab", [80, 128])
@pytest.mark.parametrize("method, options", [("draft-model", {}), ("draft-tree", {}),
                                             ("draft-model", {"greedy_proposals": False}),
                                             ("draft-tree", {"tree_sampling": "iid"})])
def test_a_draft_of_another_vocabulary_width_drafts_only_the_targets_ids(draft_vocab, method, options):
    """`check_compatible` lets a draft have fewer ids (the target's added special tokens) or more
    logits (a padded output layer) than the target: the draft reads an id it lacks as a placeholder
    and proposes only ids the target has, so greedy output is plain greedy's and sampling runs (both
    crashed: an IndexError in the draft's embedding or the target's, or q on ids the target lacks)."""
    from specula.api import build_decoder

    target = HFCausalLM(tiny_model("llama", seed=3), "target")
    draft = HFCausalLM(tiny_model("llama", seed=5, vocab=draft_vocab), "draft")
    prompt = [5, 17, 90, 33, 2, 5]  # 90: an id an 80-token draft has no row for
    plain = build_decoder("none", target)
    dec = build_decoder(method, target, None, draft, planner="none", **options)
    for params in (SamplingParams(max_new_tokens=20, ignore_eos=True),
                   SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, seed=4)):
        out = dec.generate(prompt, params)
        assert all(0 <= t < 96 for t in out.token_ids) and len(out.token_ids) == 20
        if params.greedy:
            assert out.token_ids == plain.generate(prompt, params).token_ids
            assert out.stats.drafted_tokens > 0


@pytest.mark.parametrize("method, options", [("draft-model", {"num_draft_tokens": 4}),
                                             ("draft-tree", {"tree_top_k": 2, "tree_depth": 4, "tree_nodes": 6})])
def test_a_window_wider_than_half_a_small_drafts_context_is_narrowed_to_it(method, options):
    """The default window (512) beside a draft of 128 tokens of context: a 150-token prompt fits the
    window, so it was read whole, filled the draft's context, and nothing was drafted."""
    model = tiny_model("llama", seed=3)
    draft = HFCausalLM(perturbed_copy(model, 0.1), "draft")
    draft.max_context = 128
    drafter = make_drafter(method, draft=draft, **options)
    assert (drafter.window if method == "draft-model" else drafter.draft_window) == 64
    dec = SpeculativeDecoder(HFCausalLM(model, "target"), drafter, eos_token_ids=[])
    prompt = long_prompt(150)
    out = dec.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert out.token_ids == reference_greedy(model, prompt, 40)
    assert out.stats.accepted_tokens > 0
    whole = make_drafter(method, draft=draft, draft_window=0, **options)  # the whole prompt, as asked
    assert (whole.window if method == "draft-model" else whole.draft_window) == 0


@pytest.mark.parametrize("planner", [False, "hardware"])
def test_a_packed_batch_drafts_its_chains_in_one_draft_pass_a_token_and_each_session_as_it_would_alone(
        planner, monkeypatch):
    """Sessions stepped together draft in lockstep (`drafters.lockstep`): each token of their chains
    (and each step's catch-up) is one packed pass of the draft model for the whole batch, and each
    session drafts exactly the chains it drafts alone (fixed plans: the same drafted and accepted
    counts) and outputs plain greedy."""
    from specula.api import build_decoder
    from specula.models.native import NativeCausalLM, NativeDecoder, configure

    def native(model):
        return NativeCausalLM(configure(NativeDecoder.from_hf(model), "onednn", "none", "sdpa"), "native",
                              eos_token_ids=[])

    model = tiny_model("llama", "eager", seed=4)
    target, draft = native(model), native(perturbed_copy(model, 0.02))
    packed = []
    forward_trees = NativeCausalLM.forward_trees
    monkeypatch.setattr(NativeCausalLM, "forward_trees", lambda self, items, hidden=False: (
        packed.append(len(items)) if self is draft else None) or forward_trees(self, items, hidden))
    dec = build_decoder("draft-model", target, None, draft, planner=planner)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompts = [long_prompt(9), [5, 17, 9, 33], long_prompt(14)[3:]]
    sessions = [dec.start(p, params) for p in prompts]
    while not all(s.finished for s in sessions):
        dec.step(sessions)
    assert packed and max(packed) == 3  # the draft passes of all three sessions in one packed pass
    for s, p in zip(sessions, prompts):
        assert s.generated == reference_greedy(model, p, 30)
    if planner is False:
        for s, p in zip(sessions, prompts):
            alone = dec.generate(p, params)
            assert (s.stats.drafted_tokens, s.stats.accepted_tokens, s.stats.steps) == (
                alone.stats.drafted_tokens, alone.stats.accepted_tokens, alone.stats.steps)
            assert s.stats.accepted_tokens > 0


def test_a_draft_pass_packs_only_short_passes_of_a_batching_backend_without_cuda_graphs():
    from specula.drafters.draft_model import PACKED_PASS_TOKENS, DraftPass

    class Batching:
        cuda_graphs = False

        def forward_trees(self, items, hidden=False):
            raise AssertionError("not run here")

    class Lone:
        pass

    batching, graphs, lone = Batching(), Batching(), Lone()
    graphs.cuda_graphs = True
    assert DraftPass(batching, None, (1,)).key is batching
    assert DraftPass(batching, None, tuple(range(PACKED_PASS_TOKENS))).key is batching
    assert DraftPass(batching, None, tuple(range(PACKED_PASS_TOKENS + 1))).key is None  # a prompt's catch-up
    assert DraftPass(graphs, None, (1,)).key is None
    assert DraftPass(lone, None, (1,)).key is None


def test_a_chains_vocabulary_rows_run_on_one_thread_and_its_draft_passes_on_all(monkeypatch):
    """The draft's softmax over a whole-vocabulary row runs with torch on one thread (`serial_cpu_ops`: its
    sleeping workers' wake-up cost more than the op), the draft's own passes with every thread, and the output
    is plain greedy decoding's."""
    import torch

    import specula.drafters.chain as chain_module

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = {"softmax": set(), "pass": set()}
    real_softmax = torch.softmax
    monkeypatch.setattr(chain_module.torch, "softmax",
                        lambda *a, **k: seen["softmax"].add(torch.get_num_threads()) or real_softmax(*a, **k))
    model = tiny_model("llama", seed=3)
    draft = perturbed_copy(model, 0.0)
    draft.register_forward_pre_hook(lambda module, args: seen["pass"].add(torch.get_num_threads()))
    target = HFCausalLM(model, "target")
    drafter = make_drafter("draft-model", target=target, draft=HFCausalLM(draft, "draft"))
    prompt = [5, 9, 13, 2, 7]
    try:
        out = SpeculativeDecoder(target, drafter, eos_token_ids=[]).generate(prompt, SamplingParams(max_new_tokens=12))
    finally:
        torch.set_num_threads(before)
    assert out.token_ids == reference_greedy(model, prompt, 12)
    assert seen["softmax"] == {1} and seen["pass"] == {2}
