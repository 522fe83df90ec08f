import random

import pytest
import torch

from specula.bench.profile import CostCurve
from specula.drafters import make_drafter
from specula.drafters.base import DraftBudget, DraftContext, Proposal, StepResult
from specula.engine import SpeculativeDecoder
from specula.models.hf import HFCausalLM
from specula.planner import HardwarePlanner
from specula.sampling import SamplingParams, make_generator
from specula.tree import TokenTree
from tiny import perturbed_copy, reference_greedy, successor_model, tiny_model

FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64, 128), (1.0,) * 8, 64)  # GPU-like
STEEP = CostCurve((1, 2, 4, 8, 16, 32, 64, 128), (1.0, 1.17, 1.4, 2.0, 2.6, 4.0, 7.0, 13.0), 64)  # 2-core CPU


def ctx(tokens=(1, 2, 3)) -> DraftContext:
    return DraftContext(list(tokens), 2, SamplingParams(), DraftBudget(64, 32), make_generator(0))


def engine_step(planner, tree, draft_seconds, verify_seconds=STEEP.latency):
    """One decode step driven as the engine drives the planner: should_draft, plan, observe, with
    nothing accepted. A step the back-off skips proposes nothing. Returns (drafting, planned)."""
    drafting = planner.should_draft(ctx())
    seconds = draft_seconds if drafting else 1e-5
    planned, _ = planner.plan(Proposal(tree) if drafting else Proposal.empty(), ctx(), seconds)
    n = len(planned.tree)
    planner.observe(StepResult(3, planned, (), 9, torch.zeros(n + 1, 16)), seconds, verify_seconds(n + 1))
    return drafting, planned


def wide_tree() -> TokenTree:
    # 4 chains of 8 tokens with decreasing confidence.
    paths = [[10 * b + i for i in range(8)] for b in range(4)]
    scores = [[(0.9 - 0.2 * b) ** (i + 1) for i in range(8)] for b in range(4)]
    return TokenTree.from_paths(paths, scores, source="draft-model")


def test_flat_cost_curve_plans_bigger_trees_than_a_steep_one():
    flat, steep = HardwarePlanner(curve=FLAT), HardwarePlanner(curve=STEEP)
    proposal = Proposal(wide_tree())
    p_flat, e_flat = flat.plan(proposal, ctx(), 0.0)
    p_steep, e_steep = steep.plan(proposal, ctx(), 0.0)
    assert len(p_flat.tree) > len(p_steep.tree) > 0
    assert e_flat > e_steep > 1.0
    assert flat.last_plan["rate"] > steep.last_plan["rate"]
    for planned in (p_flat.tree, p_steep.tree):  # ancestor-closed selections
        assert all(par < i for i, par in enumerate(planned.parents))


def test_observe_calibrates_and_corrects_the_cost_scale():
    planner = HardwarePlanner(curve=STEEP)
    tree = TokenTree.chain([5, 6, 7], [0.9, 0.81, 0.729], "prompt-lookup")
    before = planner.calibrator.estimate("prompt-lookup", 0.9)
    for _ in range(50):  # the target never accepts the first node
        planner.plan(Proposal(tree), ctx(), 0.0)
        planner.observe(StepResult(3, Proposal(tree), (), 9, torch.zeros(4, 16)), 0.0, 2.0 * STEEP.latency(4))
    assert planner.calibrator.estimate("prompt-lookup", 0.9) < 0.2 < before
    assert planner.cost.scale == pytest.approx(2.0, rel=0.05)
    # Such a source is no longer worth verifying: the planner takes plain steps.
    planned, expected = planner.plan(Proposal(tree), ctx(), 0.0)
    assert len(planned.tree) == 0 and expected == 1.0


def test_cost_model_learns_a_bump_the_start_up_curve_missed():
    """On CPU a 3-token pass can cost more than a 4-token one; the start-up curve (sizes 1, 2, 4,
    ...) interpolates it. Observed step times correct each size on its own."""
    from specula.planner.planner import CostModel

    cost = CostModel(STEEP)
    true = {1: 1.0, 2: 1.17, 3: 1.9, 4: 1.4}  # 3 tokens: a slow kernel the curve cannot see
    for _ in range(30):
        for n, seconds in true.items():
            cost.observe(n, seconds)
    for n, seconds in true.items():
        assert cost.verify_seconds(n) == pytest.approx(seconds, rel=0.02)
    assert cost.verify_seconds(8) == pytest.approx(cost.scale * STEEP.latency(8))  # unseen size: global scale


def test_backoff_skips_drafting_when_it_does_not_pay_and_probes_again():
    planner = HardwarePlanner(curve=STEEP)
    tree = TokenTree.chain([5], [0.01], "prompt-lookup")
    skipped = 0
    for _ in range(40):  # drafting costs 5% of a step, the tree is useless
        skipped += not engine_step(planner, tree, 0.05, lambda n: STEEP.latency(1))[0]
    # Back-off pauses of 1, 2, 4, 8, 16 plain steps between probes: the plain steps themselves must
    # not count as drafting that paid (they once halved the pause again at every probe).
    assert 30 < skipped < 40


@pytest.mark.parametrize("curve", [FLAT, STEEP], ids=["flat", "steep"])
def test_fusion_with_planner_is_lossless(curve):
    model = tiny_model("qwen2", seed=3)
    draft = HFCausalLM(perturbed_copy(model, 0.3), "draft")
    target = HFCausalLM(model, "target")
    drafter = make_drafter("fusion", target=target, draft=draft)
    planner = HardwarePlanner(curve=curve)
    drafter.set_stop_rule(planner.chain_stop_rule("draft-model"))
    dec = SpeculativeDecoder(target, drafter, eos_token_ids=[], planner=planner)
    for prompt in ([5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], [60, 61, 62]):
        out = dec.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 40)
        assert out.stats.predicted_accepted > 0


def test_fusion_on_a_copying_target_accepts_long_runs_and_predicts_them():
    model = successor_model()
    target = HFCausalLM(model, "target")
    planner = HardwarePlanner(curve=FLAT)
    dec = SpeculativeDecoder(target, make_drafter("fusion", target=target), eos_token_ids=[], planner=planner)
    prompt = list(range(10, 90)) + [20]
    out = dec.generate(prompt, SamplingParams(max_new_tokens=60, ignore_eos=True))
    assert out.token_ids == list(range(21, 81))
    assert out.stats.mean_accepted_tokens > 5
    predicted = out.stats.predicted_accepted / out.stats.steps
    assert predicted > 2  # calibration learns that copied tokens are accepted


def test_adaptive_draft_model_is_lossless_and_drafts_less_on_a_steep_curve():
    model = tiny_model("llama", seed=4)
    draft_model = perturbed_copy(model, 0.5)
    results = {}
    for name, curve in (("flat", FLAT), ("steep", STEEP)):
        target = HFCausalLM(model, "target")
        drafter = make_drafter("draft-model", target=target, draft=HFCausalLM(draft_model, "draft"),
                               adaptive=True, num_draft_tokens=10)
        planner = HardwarePlanner(curve=curve)
        drafter.set_stop_rule(planner.chain_stop_rule("draft-model"))
        dec = SpeculativeDecoder(target, drafter, eos_token_ids=[], planner=planner)
        out = dec.generate([7, 8, 9, 10], SamplingParams(max_new_tokens=60, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, [7, 8, 9, 10], 60)
        results[name] = out.stats.drafted_tokens / out.stats.steps
    assert results["steep"] < results["flat"]


def test_sampled_sibling_trees_are_never_pruned():
    planner = HardwarePlanner(curve=STEEP)
    tree = TokenTree.build([5, 6, 7, 8], [-1, -1, 0, 0], scores=[0.5, 0.01, 0.2, 0.001], sources="draft-tree")
    q = torch.full((5, 16), 1 / 16)
    planned, expected = planner.plan(Proposal(tree, q, "without_replacement"), ctx(), 0.0)
    assert planned.tree == tree and expected > 1.0
    pruned, _ = planner.plan(Proposal(tree), ctx(), 0.0)  # deterministic candidates may be pruned
    assert len(pruned.tree) < len(tree)


def test_per_source_correction_learns_the_planner_optimism():
    """Nodes are accepted half as often as the per-source calibration says (e.g. the winner's
    curse of picking the best-looking nodes, or a text where this source copies badly): the
    source's factor converges to about 0.5, another source's stays at 1, and the predicted
    tokens per step follow the realized ones."""
    planner = HardwarePlanner(curve=FLAT)
    tree = TokenTree.chain([5, 6, 7, 8], [0.8, 0.64, 0.512, 0.4096], "prompt-lookup")
    planner.calibrator.update = lambda *a, **k: None  # freeze per-source calibration: 0.8 per edge
    rng = random.Random(0)
    predicted, realized = [], []
    for step in range(400):
        planned, expected = planner.plan(Proposal(tree), ctx(), 0.0)
        accepted = 0
        while accepted < len(planned.tree) and rng.random() < 0.4:  # each edge: 0.4, not 0.8
            accepted += 1
        planner.observe(StepResult(3, planned, tuple(range(accepted)), 9, torch.zeros(5, 16)), 0.0, 1.0)
        predicted.append(expected)
        realized.append(1 + accepted)
    assert planner.bias_of("prompt-lookup") == pytest.approx(0.5, abs=0.12)
    assert planner.bias_of("token-recycling") == 1.0
    late = slice(100, None)
    assert sum(predicted[late]) / sum(realized[late]) == pytest.approx(1.0, abs=0.08)


def test_a_pessimistic_correction_fades_while_the_source_is_not_drafted():
    planner = HardwarePlanner(curve=STEEP)
    tree = TokenTree.chain([5, 6], [0.9, 0.81], "prompt-lookup")
    for _ in range(10):  # confident nodes, never accepted
        planned, _ = planner.plan(Proposal(tree), ctx(), 0.0)
        planner.observe(StepResult(3, planned, (), 9, torch.zeros(len(planned.tree) + 1, 16)), 0.0, 1.0)
    low = planner.bias_of("prompt-lookup")
    assert low < 0.5
    for _ in range(100):  # plain steps: nothing drafted, nothing learned, but time passes
        planned, _ = planner.plan(Proposal.empty(), ctx(), 0.0)
        planner.observe(StepResult(3, planned, (), 9, torch.zeros(1, 16)), 0.0, 1.0)
    assert low < 0.9 < planner.bias_of("prompt-lookup") <= 1.0


def test_fusion_skips_the_draft_model_when_retrieval_already_beats_it():
    model = successor_model()
    target = HFCausalLM(model, "target")
    draft = HFCausalLM(perturbed_copy(model, 0.3), "draft")
    drafter = make_drafter("fusion", target=target, draft=draft)
    calls = []
    drafter.set_stop_rule(lambda edges, step_s, draft_s, baseline: calls.append((len(edges), baseline)) or True)
    drafter.set_rate_estimator(lambda proposal, seconds: 123.0)
    drafter.draft_model._token_seconds = 0.01  # a measured draft step: the rule is consulted first
    proposal = drafter.propose(ctx([3, 4, 5, 6, 3, 4, 5]))
    assert calls == [(0, 123.0)]  # asked once, before any draft pass, with fusion's baseline rate
    assert len(draft) == 0  # the draft model never ran
    assert "draft-model" not in proposal.tree.sources and len(proposal.tree) > 0  # prompt lookup still proposed


def test_draft_model_weighs_its_cache_catch_up_before_drafting():
    model = successor_model()
    drafter = make_drafter("draft-model", draft=HFCausalLM(perturbed_copy(model, 0.3), "draft"), adaptive=True)
    seen = []
    drafter.set_stop_rule(lambda edges, step_s, draft_s, baseline: seen.append((len(edges), step_s)) or not edges)
    drafter._token_seconds, drafter._catch_up_seconds = 0.01, 0.002
    long_prompt = ctx(list(range(2, 60)))
    assert len(drafter.propose(long_prompt).tree) == 0  # the rule said no before any draft pass
    assert seen == [(0, pytest.approx(0.01 + 57 * 0.002))]  # 58 tokens to catch up: 57 beyond the first pass
    assert len(drafter.draft) == 0


def test_pessimistic_planner_probes_at_growing_gaps_and_recovers():
    """A source whose estimate says 'never worth it' still gets its best node verified now and
    then (1, 2, 4, ... steps apart); when those probes succeed the planner drafts again."""
    planner = HardwarePlanner(curve=STEEP)
    tree = TokenTree.chain([5, 6], [0.05, 0.0025], "prompt-lookup")  # raw 0.05 per edge: looks useless
    probes = []
    for step in range(40):
        planned, _ = planner.plan(Proposal(tree), ctx(), 0.0)
        if len(planned.tree):
            probes.append(step)
        planner.observe(StepResult(3, planned, (), 9, torch.zeros(len(planned.tree) + 1, 16)), 0.0,
                         STEEP.latency(len(planned.tree) + 1))
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 4 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # probes thin out
    for _ in range(200):  # now the first token is always accepted (probes 64 steps apart by now)
        planned, _ = planner.plan(Proposal(tree), ctx(), 0.0)
        path = (0,) if len(planned.tree) else ()
        planner.observe(StepResult(3, planned, path, 9, torch.zeros(len(planned.tree) + 1, 16)), 0.0,
                         STEEP.latency(len(planned.tree) + 1))
    drafted = sum(len(planner.plan(Proposal(tree), ctx(), 0.0)[0].tree) > 0 for _ in range(10))
    assert drafted == 10


def test_projection_is_measured_on_the_curve_as_given():
    """Projected speedup = expected tokens per step when verifying costs one plain step (flat
    curve, free drafting), even after observed step times rescaled the online cost model."""
    planner = HardwarePlanner(curve=FLAT)
    tree = TokenTree.chain([5, 6], [0.9, 0.81], "prompt-lookup")
    planner.calibrator.update = lambda *a, **k: None
    expected = []
    for _ in range(20):
        planned, e = planner.plan(Proposal(tree), ctx(), 0.0)
        expected.append(e)
        planner.observe(StepResult(3, planned, (0,), 9, torch.zeros(len(planned.tree) + 1, 16)), 0.0, 3.0)
    assert planner.cost.scale > 2.0  # this "machine" is 3x slower than the curve
    assert planner.projection()["projected_speedup"] == pytest.approx(sum(expected) / len(expected), rel=1e-3)


def test_no_probes_where_a_one_node_tree_can_never_pay():
    jump = CostCurve((1, 2, 4, 8), (1.0, 2.3, 2.3, 2.2), 64)  # float32 CPU: 1 row GEMV, 2+ rows GEMM
    planner = HardwarePlanner(curve=jump)
    tree = TokenTree.chain([5, 6], [0.05, 0.0025], "prompt-lookup")
    drafted = 0
    for _ in range(40):
        planned, _ = planner.plan(Proposal(tree), ctx(), 0.0)
        drafted += len(planned.tree)
        planner.observe(StepResult(3, planned, (), 9, torch.zeros(len(planned.tree) + 1, 16)), 0.0, 1.0)
    assert drafted == 0


def test_backoff_follows_realised_rates_when_estimates_are_wrong():
    """The calibration keeps promising 0.9 per node (frozen here) but nothing is ever accepted:
    the plan always looks good, the realised tokens/s do not, and drafting pauses anyway."""
    planner = HardwarePlanner(curve=STEEP)
    planner.calibrator.update = lambda *a, **k: None
    tree = TokenTree.chain([5, 6, 7], [0.9, 0.81, 0.729], "prompt-lookup")
    verified = 0
    for _ in range(60):
        planner._recent.clear()  # keep the per-source factor at 1: only the back-off can act
        verified += len(engine_step(planner, tree, 1e-4)[1].tree) > 0
    assert planner.last_plan["chosen"] == 3  # every drafting step still plans the whole chain
    assert verified < 15  # but most steps are plain


def test_a_new_request_ends_the_back_off_pause():
    planner = HardwarePlanner(curve=STEEP)
    tree = TokenTree.chain([5], [0.01], "prompt-lookup")
    run = 0
    for _ in range(40):  # useless slow drafting: pauses of 1, 2, 4, ... plain steps
        run = 0 if engine_step(planner, tree, 0.5, lambda n: STEEP.latency(1))[0] else run + 1
        if run == 3:  # inside a pause of at least 4 steps: one more is still due
            break
    assert run == 3
    planner.reset()
    assert planner.should_draft(ctx())  # the next text is judged afresh
