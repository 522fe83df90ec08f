"""`layer-skip` (SWIFT): the target drafts for itself with sub-layers skipped, on its own cache.

Scratch rows (`speculate`, `replay`) give the logits a causal forward gives and leave the
committed cache untouched; a skipped layer is exactly a model without it; greedy output equals
plain greedy for fixed and searched skip sets, through the engine and `--draft skip` in fusion;
the sampled law is the target's; the search finds sub-layers that change nothing and drops
layer skipping where nothing pays; bad skip sets are refused with the fix named."""

from __future__ import annotations

import argparse
import copy
import re

import pytest
import torch

from laws import exact_first_two, sample_first_two, tv, tv_bound
from tiny import assert_cache_equals_plain_forward, reference_greedy, tiny_model
from specula.api import build_decoder
from specula.drafters.layer_skip import LayerSkipConfig, SkipSearch, best_chain_rate, match_rate
from specula.errors import ConfigError
from specula.models.base import LayerSkippingModel, LayerSkipSequence
from specula.models.native import NativeCausalLM, NativeDecoder, configure, kernels
from specula.models.skipping import (
    candidate_sublayers, check_draft_skip, check_skip_layers, format_skip_layers, parse_skip_layers,
)
from specula.planner import CostCurve, HardwarePlanner
from specula.sampling import SamplingParams

KERNEL = "specula" if kernels.available() else "aten"
FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1e-3,) * 7, 64)  # verifying is free: drafting pays when accepted
PROMPTS = ([5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17, 3, 4, 5, 6, 7, 8, 9, 10, 11], [60, 61, 62, 63])


def native(model) -> NativeCausalLM:
    return NativeCausalLM(configure(NativeDecoder.from_hf(model), KERNEL, "none", "sdpa"), "native", eos_token_ids=[1])


def identity_layers(model, layers: tuple[int, ...]):
    """A copy of `model` whose `layers` add nothing to the residual stream (zero output projections):
    skipping them changes no logit."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for i in layers:
            model.model.layers[i].self_attn.o_proj.weight.zero_()
            model.model.layers[i].mlp.down_proj.weight.zero_()
    return model.eval()


# ---------------------------------------------------------------------------- scratch rows
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_speculate_and_replay_without_skipping_are_causal_forwards_that_commit_nothing(arch):
    model = tiny_model(arch, seed=2, layers=3)
    seq = native(model).new_sequence()
    assert isinstance(seq, LayerSkipSequence)
    prompt = [5, 9, 13, 2, 7, 11, 3]
    seq.prefill(prompt)
    with torch.inference_mode():
        full = model(torch.tensor([prompt + [20, 21, 22]])).logits[0]  # [10, V]: row i after token i
    first = seq.speculate([20], ())
    rest = seq.speculate([21, 22], (), offset=1)
    torch.testing.assert_close(torch.cat([first, rest]), full[len(prompt):], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(seq.replay(4, ()), full[3:7], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(seq.replay(3, (), end=5), full[2:5], atol=1e-4, rtol=1e-4)
    assert seq.tokens == prompt
    assert_cache_equals_plain_forward(model, seq, prompt)


def test_a_skipped_layer_is_the_model_without_that_layer():
    model = tiny_model("llama", seed=4, layers=4)
    pruned = copy.deepcopy(model)
    pruned.model.layers = torch.nn.ModuleList([layer for i, layer in enumerate(model.model.layers) if i != 2])
    pruned.config.num_hidden_layers = 3
    for i, layer in enumerate(pruned.model.layers):
        layer.self_attn.layer_idx = i
    ids = [5, 9, 13, 2, 7, 11, 3, 8]
    seq = native(model).new_sequence()
    seq.prefill(ids)
    with torch.inference_mode():
        expected = pruned(torch.tensor([ids]), use_cache=False).logits[0].float()
    torch.testing.assert_close(seq.replay(len(ids), [(2, "attn"), (2, "mlp")]), expected, atol=1e-4, rtol=1e-4)


def test_scratch_rows_are_refused_while_a_tree_is_pending():
    from specula.tree import TokenTree

    seq = native(tiny_model("qwen2", layers=3)).new_sequence()
    seq.prefill([1, 2, 3])
    seq.forward_tree(4, TokenTree.chain([5], [1.0], "t"))
    with pytest.raises(RuntimeError, match="pending"):
        seq.speculate([6], ())
    with pytest.raises(RuntimeError, match="pending"):
        seq.replay(2, ())
    seq.commit([])
    with pytest.raises(ValueError, match="at least one token"):  # no rows: the kernels' attention divided by 0
        seq.speculate([], ())


# ---------------------------------------------------------------------------- greedy equality
def faint_layers(model, layers: tuple[int, ...], scale: float):
    """A copy of `model` whose `layers` add `scale` times what they did to the residual stream: skipping
    them changes the logits a little (drafts are accepted, and some rejected)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for i in layers:
            model.model.layers[i].self_attn.o_proj.weight.mul_(scale)
            model.model.layers[i].mlp.down_proj.weight.mul_(scale)
    return model.eval()


SLOW = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0,) * 7, 64)  # a pass costs 1 s whatever its size: drafting pays


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("skip_layers", [None, "1", "attn:1-2,mlp:3"])
@pytest.mark.parametrize("planner", [False, "slow"])
def test_greedy_output_equals_plain_greedy(arch, skip_layers, planner, monkeypatch):
    """On the random 5-layer model the search found no skip set (nothing drafted: the case passed
    whatever the verification did), and under a planner whose passes cost 1 ms the fixed sets drafted
    a token or two and had none accepted. Layers 1-3 turned down (faintly for the search, which must
    find a set that beats plain decoding) and a planner under which drafting pays: drafts are
    verified, accepted and rejected, in every case (every clock read advances 0.1 ms: the planner's
    and the search's timing-driven choices do not depend on the machine's load)."""
    ticks = iter(range(10**12))
    monkeypatch.setattr("time.perf_counter", lambda: next(ticks) * 1e-4)
    model = faint_layers(tiny_model(arch, seed=3, layers=5), (1, 2, 3), 0.02 if skip_layers is None else 0.3)
    target = native(model)
    dec = build_decoder("layer-skip", target, None, planner=HardwarePlanner(curve=SLOW) if planner else False,
                        skip_layers=skip_layers, search_fraction=1.0)  # the search advances every step
    drafted = accepted = 0
    for prompt in PROMPTS:
        out = dec.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 30), (arch, skip_layers, prompt)
        drafted += out.stats.drafted_tokens
        accepted += out.stats.accepted_tokens
    assert accepted > 0, (drafted, accepted)
    if skip_layers is not None:
        assert accepted < drafted, (drafted, accepted)  # the rejection path ran too


def test_the_search_finds_the_identity_layers_and_their_drafts_are_all_accepted():
    """`--draft skip` with the draft-model method: the search finds the layers that change nothing;
    the drafts are then the target's own tokens (every one accepted) and the output plain greedy's."""
    model = identity_layers(tiny_model("qwen2", seed=5, layers=6), (2, 3))
    target = native(model)
    # search_fraction 1: the search advances every step, so what it finds does not depend on how fast
    # this machine runs the replays (at the default 10% time share the test was timing-dependent)
    dec = build_decoder("draft-model", target, None, draft_skip=True, planner=False, search_fraction=1.0)
    accepted = drafted = 0
    for prompt in PROMPTS:
        out = dec.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 40)
        accepted += out.stats.accepted_tokens
        drafted += out.stats.drafted_tokens
    skip = dec.drafters[0].skip
    assert skip and skip <= {(2, "attn"), (2, "mlp"), (3, "attn"), (3, "mlp")}, skip
    assert drafted > 20 and accepted == drafted


def test_the_search_advances_when_requests_are_stepped_together():
    """Two requests in one batch (`generate_many`): one owns the search until it ends, so the search
    scores its candidates and finds the identity layers (each request re-opened the window on its
    own sequence and nothing was ever scored)."""
    model = identity_layers(tiny_model("qwen2", seed=5, layers=6), (2, 3))
    dec = build_decoder("layer-skip", native(model), None, planner=False, search_fraction=1.0)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    outs = dict(dec.generate_many([(i, p, params) for i, p in enumerate(PROMPTS[:2])], max_batch_size=2))
    assert all(outs[i].token_ids == reference_greedy(model, p, 40) for i, p in enumerate(PROMPTS[:2]))
    search = dec.drafters[0].search
    assert search.history and search.best and search.best <= {(2, "attn"), (2, "mlp"), (3, "attn"), (3, "mlp")}
    assert sum(o.stats.drafted_tokens for o in outs.values()) > 0 and search.owner is None  # released at the end


def test_fusion_with_draft_skip_adds_the_layer_skip_drafter_and_stays_lossless():
    model = tiny_model("qwen2", seed=5, layers=6)
    target = native(model)
    dec = build_decoder("fusion", target, None, draft_skip=True, planner=HardwarePlanner(curve=FLAT))
    assert [d.name for d in dec.drafters] == ["prompt-lookup", "token-recycling", "layer-skip"]
    for prompt in PROMPTS:
        out = dec.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 40)


def test_fusion_with_draft_skip_reads_num_draft_tokens_and_refuses_draft_window():
    """Layer skipping reads fusion's num_draft_tokens (not refused as a draft model's option); draft_window, which
    only a draft model reads, was ignored without a word."""
    target = native(tiny_model("qwen2", layers=4))
    dec = build_decoder("fusion", target, None, draft_skip=True, skip_layers="2", num_draft_tokens=3, planner=False)
    assert dec.drafters[-1].name == "layer-skip" and dec.drafters[-1].config.num_draft_tokens == 3
    with pytest.raises(ConfigError, match="draft_window is for a draft model, and fusion drafts with the target's own "
                                          "layers skipped here, not a draft model; drop draft_window, or give a draft "
                                          "model with draft=MODEL instead"):
        build_decoder("fusion", target, None, draft_skip=True, skip_layers="2", draft_window=256, planner=False)


def test_fusion_refuses_skip_layers_without_draft_skip():
    """skip_layers goes to fusion's layer-skip member, which joins only for draft="skip": without it the option was
    ignored without a word (`make_drafters` / `Specula`, a bench's fusion:skip_layers=1); `api.load` refused it."""
    target = native(tiny_model("qwen2", layers=4))
    with pytest.raises(ConfigError, match=r'^skip_layers is for layer skipping, and fusion drafts without it here '
                                          r'\(no draft_skip=True\); add draft_skip=True \(the target drafting with '
                                          r'layers skipped\) or drop skip_layers$'):  # what its caller writes
        build_decoder("fusion", target, None, skip_layers="2", planner=False)
    dec = build_decoder("layer-skip", target, None, skip_layers="2", planner=False)  # the method itself reads it
    assert dec.drafters[0].skip == {(2, "attn"), (2, "mlp")}


def test_a_draft_model_with_draft_skip_is_refused_naming_the_keywords_and_on_the_command_line_the_flag():
    """make_drafters' refusal of a draft model given with draft_skip named neither as its caller writes them ("give a
    draft model or draft_skip"); it names draft=MODEL and draft_skip=True, which the commands show as --draft MODEL
    and --draft skip (their one --draft never gives both)."""
    from specula.cli import build_parser
    from specula.commands.common import in_command_flags

    target = native(tiny_model("qwen2", layers=4))
    message = "draft_skip=True drafts with the target itself: give draft=MODEL or draft_skip=True, not both"
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        build_decoder("fusion", target, None, draft=target, draft_skip=True, planner=False)
    args = build_parser().parse_args(["generate", "--target", "m", "--prompt", "p"])
    assert in_command_flags(args)(message) == ("--draft skip drafts with the target itself: give --draft MODEL or "
                                               "--draft skip, not both")
    assert in_command_flags(argparse.Namespace(target="m"))(message) == message  # a command without --draft


def test_draft_model_method_with_draft_skip_is_the_layer_skip_drafter_and_draft_tree_is_refused():
    target = native(tiny_model("qwen2", layers=4))
    dec = build_decoder("draft-model", target, None, draft_skip=True, skip_layers="2", planner=False)
    assert [d.name for d in dec.drafters] == ["layer-skip"] and dec.drafters[0].skip == {(2, "attn"), (2, "mlp")}
    # the keyword given here, not load's draft="skip" (which load's own message names: tests/test_api.py)
    with pytest.raises(ConfigError, match='^draft_skip=True drafts chains: use method="draft-model", '
                                          r'method="layer-skip" or method="fusion" with it \(draft-tree needs a draft '
                                          r'model\)$'):
        build_decoder("draft-tree", target, None, draft_skip=True, skip_layers="2", planner=False)
    with pytest.raises(ConfigError, match="draft_window is for a draft model, and draft-model drafts with the "
                                          "target's own layers skipped here, not a draft model; drop draft_window, "
                                          "or give a draft model with draft=MODEL instead"):  # not layer-skip's refusal
        build_decoder("draft-model", target, None, draft_skip=True, skip_layers="2", draft_window=64, planner=False)
    # methods that draft without a draft model ignore it (and its skip set)
    dec = build_decoder("prompt-lookup", target, None, draft_skip=True, skip_layers="2", planner=False)
    assert [d.name for d in dec.drafters] == ["prompt-lookup"]


# ---------------------------------------------------------------------------- sampling law
def test_sampled_output_follows_the_target_law():
    """First two tokens at temperature 1.5 over an 8-token vocabulary: the target's exact law."""
    vocab, temp, prompt, trials = 8, 1.5, [3, 5, 1, 3, 5], 1500
    model = tiny_model("llama", seed=8, vocab=vocab, layers=3)
    exact = exact_first_two(model, prompt, temp)
    dec = build_decoder("layer-skip", native(model), None, planner=False, skip_layers="mlp:1", stop_below=0.0)
    codes, accepted = sample_first_two(dec, prompt, temp, vocab, trials)
    assert accepted > trials // 10, accepted
    assert tv(codes, exact) < tv_bound(exact, trials, c=2.0)
    assert tv(codes, torch.roll(exact, 1)) > 3 * tv_bound(exact, trials, c=2.0)  # the check has power


# ---------------------------------------------------------------------------- search
class FakeSequence:
    """A `LayerSkipSequence` whose skipped model agrees with the full one on a fraction of the
    window that falls with the number of skipped sub-layers (`agreement(skip)`)."""

    def __init__(self, agreement, num_layers: int = 10, vocab: int = 4) -> None:
        self.agreement, self.num_layers, self.vocab = agreement, num_layers, vocab
        self.replays: list[tuple[int, frozenset, int | None]] = []

    def speculate(self, ids, skip=(), offset=0):
        raise AssertionError("the search does not draft")

    def replay(self, count, skip=(), trace=None, end=None):
        self.replays.append((count, frozenset(skip), end))
        if trace is not None:  # MLPs of high layers turn the stream least
            trace.update({(layer, kind): (1.0 if kind == "attn" else 0.1) / (1 + layer)
                          for layer in range(self.num_layers) for kind in ("attn", "mlp")})
        right = round(self.agreement(frozenset(skip)) * count)
        labels = torch.zeros(count, dtype=torch.long)
        predicted = torch.where(torch.arange(count) < right, labels, labels + 1)
        return torch.nn.functional.one_hot(predicted, self.vocab).float()


def uniform_cost(num_layers: int):
    return lambda skip: 1.0 - len(skip) / (2 * num_layers + 1)


def run_search(seq, config=LayerSkipConfig(search_window=10), rounds: int = 40, verify=lambda n: 1.0):
    search = SkipSearch(config, seq.num_layers, uniform_cost(seq.num_layers))
    for _ in range(rounds):
        search.advance(seq, 50, verify)
    return search


def test_search_opens_one_window_scores_the_ladder_on_it_and_keeps_the_best():
    seq = FakeSequence(lambda skip: 1.0 if len(skip) <= 5 else 0.2)
    search = SkipSearch(LayerSkipConfig(search_window=10, search_ratios=(0.2, 0.3, 0.5)), 10, uniform_cost(10))
    for _ in range(4):  # importance replay + 3 ladder sets
        search.advance(seq, 50, lambda n: 1.0)
    count, full, end = seq.replays[0]
    assert (count, full, end) == (10, frozenset(), None)
    sizes = [len(skip) for _, skip, _ in seq.replays[1:]]
    assert sizes == [3, 5, 8] and all(e == 50 for _, _, e in seq.replays[1:])  # the same window
    assert len(search.best) == 5  # the largest set that still agrees fully
    assert all(kind == "mlp" for _, kind in search.best)  # the sub-layers that turn the stream least per weight
    assert all(1 <= layer <= 8 for layer, _ in search.best)  # never the first or last layer


def test_search_ends_with_no_skip_set_when_nothing_beats_plain_decoding():
    search = run_search(FakeSequence(lambda skip: 0.0 if skip else 1.0))
    assert search.done and search.best == frozenset()


def test_refinement_keeps_only_better_neighbours_and_stops_after_its_tolerance():
    seq = FakeSequence(lambda skip: 1.0 if len(skip) <= 5 else 0.0)
    search = run_search(seq, LayerSkipConfig(search_window=10, search_ratios=(0.2, 0.3), max_tolerance=3),
                        rounds=200)
    assert len(search.best) == 5 and search.done
    assert search.tolerance == 3


def test_chain_rate_and_match_rate():
    assert best_chain_rate(0.0, 0.5, lambda n: 1.0, 8) == 1.0  # never worth drafting: plain decoding
    assert best_chain_rate(0.9, 0.1, lambda n: 1.0, 8) > 3.0
    assert best_chain_rate(0.9, 0.1, lambda n: 1.0, 8) > best_chain_rate(0.9, 0.5, lambda n: 1.0, 8)
    logits = torch.eye(4)
    assert match_rate(logits, [0, 1, 3, 3]) == 0.75


# ---------------------------------------------------------------------------- skip sets
def test_skip_layer_syntax_round_trips_and_bad_sets_name_the_fix():
    skip = parse_skip_layers("attn:3-5,mlp:1,7", 8)
    assert skip == {(3, "attn"), (4, "attn"), (5, "attn"), (1, "mlp"), (7, "attn"), (7, "mlp")}
    assert parse_skip_layers(format_skip_layers(skip), 8) == skip
    with pytest.raises(ConfigError, match="names layer 8, but the model has 8 layers"):
        parse_skip_layers("2-8", 8)
    with pytest.raises(ConfigError, match="cannot read 'ffn:2'"):
        parse_skip_layers("ffn:2", 8)
    with pytest.raises(ConfigError, match="runs backwards"):
        parse_skip_layers("5-3", 8)
    with pytest.raises(ConfigError, match="skips every layer"):
        parse_skip_layers("0-1", 2)
    assert candidate_sublayers(2) == [] and len(candidate_sublayers(5)) == 6


def test_draft_skip_needs_the_native_backend_and_no_draft_quantize():
    from specula.models.hf import HFCausalLM

    model = tiny_model("qwen2", layers=3)
    with pytest.raises(ConfigError, match=r'^draft="skip" needs the native backend .*: use backend="native", or '
                                          r'another draft \(draft=MODEL\)$'):  # load's keywords
        check_draft_skip(HFCausalLM(model))
    with pytest.raises(ConfigError, match='drop draft_quantize, or use draft="self" with draft_quantize="int8"$'):
        check_draft_skip(native(model), quantize="int8")
    with pytest.raises(ConfigError, match="^skip_layers names layer 7, but the model has 3 layers"):
        check_draft_skip(native(model), "7")
    with pytest.raises(ConfigError, match='^skip_layers applies to draft="skip" only .*add draft="skip" or drop '
                                          'skip_layers$'):
        check_skip_layers("self", "3")
    check_draft_skip(native(model), "1")
    assert isinstance(native(model), LayerSkippingModel) and not isinstance(HFCausalLM(model), LayerSkippingModel)


def test_a_prompt_near_the_window_is_decoded_while_the_search_waits_for_room():
    """The search replays up to search_window committed tokens in scratch slots after them: where
    the window has no room for that the search waits, and the request decodes as plain decoding."""
    model = tiny_model("llama", seed=3, layers=4)
    model.config.max_position_embeddings = 64
    target = native(model)
    for n in (40, 50, 60):
        prompt = [(7 * i + 3) % 50 + 2 for i in range(n)]
        dec = build_decoder("layer-skip", target, planner=False)
        out = dec.generate(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 2), n
    seq = target.new_sequence()
    seq.prefill(list(range(2, 50)), logits="none")  # 48 committed of 64: 16 scratch slots fit exactly
    assert seq.replay(16).shape[0] == 16
