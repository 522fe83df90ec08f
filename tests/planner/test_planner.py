import random
from dataclasses import replace

import pytest
import torch

from specula.drafters import make_drafter, make_drafters
from specula.engine import SpeculativeDecoder
from specula.models.hf import HFCausalLM
from specula.planner import (CostCurve, HardwarePlanner, PassThroughPlanner, Plan, PlanRequest, PlannerConfig,
                             StepTiming)
from specula.planner.batch_cost import BatchCostCurve
from specula.planner.merge import merge_proposals
from specula.sampling import SamplingParams, make_generator
from specula.step import DraftBudget, DraftContext, Proposal, StepResult
from specula.tree import TokenTree
from tiny import perturbed_copy, reference_greedy, successor_model, tiny_model

FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64, 128), (1.0,) * 8, 64)  # GPU-like
STEEP = CostCurve((1, 2, 4, 8, 16, 32, 64, 128), (1.0, 1.17, 1.4, 2.0, 2.6, 4.0, 7.0, 13.0), 64)  # 2-core CPU


BUDGET = DraftBudget(64, 32)


def ctx(tokens=(1, 2, 3), cost=None) -> DraftContext:
    return DraftContext(list(tokens), 2, SamplingParams(), BUDGET, make_generator(0), cost)


class Driver:
    """One request's planning, driven as the engine drives the planner (one shared planner,
    one per-request state)."""

    def __init__(self, planner: HardwarePlanner) -> None:
        self.planner = planner
        self.state = planner.new_state()
        self.last: Plan | None = None

    def plan(self, proposal: Proposal, draft_seconds: float = 0.0, drafted: bool = True) -> tuple[Proposal, float]:
        [self.last] = self.planner.plan([PlanRequest([proposal] if drafted else [], BUDGET, self.state,
                                                     draft_seconds, drafted)])
        return self.last.proposal, self.last.predicted

    def observe(self, planned: Proposal, path=(), draft_seconds: float = 0.0, verify_seconds: float = 1.0) -> None:
        """Observe the step that verified `planned` (the last plan's tree, or another one to force it)."""
        plan = replace(self.last, proposal=planned,
                       contexts=self.last.contexts if planned is self.last.proposal else None)
        step = StepResult(3, planned, tuple(path), 9, torch.zeros(len(planned.tree) + 1, 16))
        self.planner.observe_pass([plan], verify_seconds)
        self.planner.observe(plan, step, self.state, StepTiming(draft_seconds, verify_seconds))

    def engine_step(self, tree, draft_seconds, verify_seconds=STEEP.latency):
        """should_draft, plan, observe, with nothing accepted. A step the back-off skips proposes
        nothing. Returns (drafting, planned)."""
        drafting = self.planner.should_draft(self.state)
        seconds = draft_seconds if drafting else 1e-5
        planned, _ = self.plan(Proposal(tree) if drafting else Proposal.empty(), seconds, drafting)
        self.observe(planned, (), seconds, verify_seconds(len(planned.tree) + 1))
        return drafting, planned


def chain(tokens, edge, source="prompt-lookup") -> TokenTree:
    """A chain whose every edge score is `edge`."""
    return TokenTree.chain(tokens, [edge] * len(tokens), source)


def wide_tree() -> TokenTree:
    # 4 chains of 8 tokens with decreasing confidence.
    paths = [[10 * b + i for i in range(8)] for b in range(4)]
    edges = [[0.9 - 0.2 * b] * 8 for b in range(4)]
    return TokenTree.from_paths(paths, edges, source="draft-model")


def test_flat_cost_curve_plans_bigger_trees_than_a_steep_one():
    flat, steep = Driver(HardwarePlanner(curve=FLAT)), Driver(HardwarePlanner(curve=STEEP))
    proposal = Proposal(wide_tree())
    p_flat, e_flat = flat.plan(proposal)
    p_steep, e_steep = steep.plan(proposal)
    assert len(p_flat.tree) > len(p_steep.tree) > 0
    assert e_flat > e_steep > 1.0
    assert flat.last.rate > steep.last.rate
    # The kept nodes are the best ones by estimated path probability, ancestor-closed.
    probs = flat.planner.estimate(proposal)
    for planned in (p_flat.tree, p_steep.tree):
        kept = {tuple(planned.tokens_of(planned.path_to(i))) for i in range(len(planned))}
        paths = [tuple(proposal.tree.tokens_of(proposal.tree.path_to(i))) for i in range(len(proposal.tree))]
        worst_kept = min(probs[i] for i, path in enumerate(paths) if path in kept)
        best_dropped = max((probs[i] for i, path in enumerate(paths) if path not in kept), default=0.0)
        assert worst_kept >= best_dropped
        assert all(path[:-1] in kept for path in kept if len(path) > 1)


def test_observe_calibrates_and_corrects_the_cost_scale():
    planner = HardwarePlanner(curve=STEEP)
    driver = Driver(planner)
    tree = chain([5, 6, 7], 0.9)
    before = planner.calibrator.estimate("prompt-lookup", 0.9)
    for _ in range(50):  # the target never accepts the first node
        driver.plan(Proposal(tree))
        driver.observe(Proposal(tree), (), 0.0, 2.0 * STEEP.latency(4))
    assert planner.calibrator.estimate("prompt-lookup", 0.9) < 0.2 < before
    assert planner.cost.scale == pytest.approx(2.0, rel=0.05)
    # Such a source is no longer worth verifying: the planner takes plain steps.
    planned, expected = driver.plan(Proposal(tree))
    assert driver.last.explore or (len(planned.tree) == 0 and expected == 1.0)  # at most a probe
    planned = [driver.plan(Proposal(tree))[0] for _ in range(8)]
    assert sum(len(p.tree) > 0 for p in planned) <= 1


def test_cost_model_learns_a_bump_the_start_up_curve_missed():
    """On CPU a 3-token pass can cost more than a 4-token one; the start-up curve (sizes 1, 2, 4,
    ...) interpolates it. Observed step times correct each size on its own."""
    from specula.planner.cost import CostModel

    cost = CostModel(STEEP)
    true = {1: 1.0, 2: 1.17, 3: 1.9, 4: 1.4}  # 3 tokens: a slow kernel the curve cannot see
    for _ in range(30):
        for n, seconds in true.items():
            cost.observe(n, seconds)
    for n, seconds in true.items():
        assert cost.estimate(n) == pytest.approx(seconds, rel=0.02)
        assert cost.verify_seconds(n) == pytest.approx(seconds, rel=0.03)  # what optimism is left: 0.4 / (1 + 16)
    assert cost.estimate(8) == pytest.approx(cost.ratio(4) * STEEP.latency(8))  # unseen size: the nearest seen


def test_backoff_skips_drafting_when_it_does_not_pay_and_probes_again():
    driver = Driver(HardwarePlanner(curve=STEEP))
    tree = chain([5], 0.01)
    skipped = 0
    for _ in range(40):  # drafting costs 5% of a step, the tree is useless
        skipped += not driver.engine_step(tree, 0.05, lambda n: STEEP.latency(1))[0]
    # Back-off pauses of 1, 2, 4, 8, 16 plain steps between probes: the plain steps themselves must
    # not count as drafting that paid (they once halved the pause again at every probe).
    assert 30 < skipped < 40


@pytest.mark.parametrize("curve", [FLAT, STEEP], ids=["flat", "steep"])
def test_fusion_with_planner_is_lossless(curve):
    model = tiny_model("qwen2", seed=3)
    draft = HFCausalLM(perturbed_copy(model, 0.3), "draft")
    target = HFCausalLM(model, "target")
    drafters = make_drafters("fusion", target=target, draft=draft)
    dec = SpeculativeDecoder(target, drafters, eos_token_ids=[], planner=HardwarePlanner(curve=curve))
    for prompt in ([5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], [60, 61, 62]):
        out = dec.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 40)
        assert out.stats.predicted_accepted > 0


def test_fusion_on_a_copying_target_accepts_long_runs_and_predicts_them():
    model = successor_model()
    target = HFCausalLM(model, "target")
    planner = HardwarePlanner(curve=FLAT)
    dec = SpeculativeDecoder(target, make_drafters("fusion", target=target), eos_token_ids=[], planner=planner)
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
        dec = SpeculativeDecoder(target, drafter, eos_token_ids=[], planner=HardwarePlanner(curve=curve))
        out = dec.generate([7, 8, 9, 10], SamplingParams(max_new_tokens=60, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, [7, 8, 9, 10], 60)
        results[name] = out.stats.drafted_tokens / out.stats.steps
    assert results["steep"] < results["flat"]


def test_sampled_sibling_trees_are_never_pruned():
    from specula.planner import PlannerConfig

    driver = Driver(HardwarePlanner(curve=STEEP, config=PlannerConfig(cost_explore=0.0)))
    tree = TokenTree.build([5, 6, 7, 8], [-1, -1, 0, 0], edge_scores=[0.5, 0.01, 0.4, 0.002], sources="draft-tree")
    q = torch.full((5, 16), 1 / 16)
    planned, expected = driver.plan(Proposal(tree, q, "without_replacement"))
    assert planned.tree == tree and expected > 1.0
    pruned, _ = driver.plan(Proposal(tree))  # deterministic candidates may be pruned
    assert len(pruned.tree) < len(tree)


def test_a_sampled_chain_is_verified_whole_whatever_its_draws_are_worth():
    # A cut chosen from the estimates reads each node's own q: it would keep a drawn token or not
    # by its value, and the kept draws would no longer follow q.
    from specula.planner import PlannerConfig

    driver = Driver(HardwarePlanner(curve=STEEP, config=PlannerConfig(cost_explore=0.0)))
    tree = TokenTree.chain([5, 6, 7, 8], [0.9, 0.001, 0.001, 0.001], "draft-model")
    planned, _ = driver.plan(Proposal(tree, torch.full((5, 16), 1 / 16), "iid"))
    assert planned.tree == tree
    cut, _ = driver.plan(Proposal(tree))  # deterministic candidates are sized
    assert len(cut.tree) < len(tree)


def test_a_sampled_proposal_over_budget_keeps_its_first_draws_not_its_best():
    tree = TokenTree.build([5, 6, 7, 8], [-1, -1, 0, 1], edge_scores=[0.1, 0.9, 0.5, 0.9], sources="draft-tree")
    q = torch.full((5, 16), 1 / 16)
    assert Proposal(tree, q, "iid").limit(DraftBudget(2, 8)).tree.tokens == (5, 6)
    assert Proposal(tree).limit(DraftBudget(2, 8)).tree.tokens == (6, 8)  # deterministic: by path score


def test_the_planner_keeps_the_law_of_sampled_draft_chains():
    # A perfect draft (q = p) of one token a step through the planner and the rule, as the engine
    # runs them: the first token's law must be p (the planner once cut unlikely draws: 0.43 for p 0.3).
    from specula.sampling import sample_iid
    from specula.verify import verify_step

    p = torch.tensor([0.3] + [0.07] * 10, dtype=torch.float64)
    curve = CostCurve((1, 2, 4, 8), (1e-3, 1.1e-3, 1.3e-3, 1.6e-3), 64)
    planner = HardwarePlanner(curve=curve)
    state, gen, params = planner.new_state(), make_generator(0), SamplingParams(temperature=1.0)
    logits = p.log().float()[None].repeat(2, 1)  # [2, 11]: root and one node
    trials, counts = 3000, torch.zeros(len(p))
    for _ in range(trials):
        x = int(sample_iid(p, 1, gen))
        proposal = Proposal(TokenTree.chain([x], [float(p[x])], "draft-model"),
                            torch.stack([p.float(), torch.zeros(len(p))]), "iid")
        [plan] = planner.plan([PlanRequest([proposal], DraftBudget(8, 8), state, 1e-4)])
        n = len(plan.proposal.tree)
        result = verify_step(plan.proposal.tree, logits[: n + 1], params, q=plan.proposal.q,
                             mode=plan.proposal.sibling_mode, generator=gen)
        counts[result.tokens(plan.proposal.tree)[0]] += 1
    se = (p * (1 - p) / trials).sqrt()
    assert float(((counts / trials - p).abs() / se).max()) < 4.5


def test_per_source_correction_learns_the_planner_optimism():
    """Nodes are accepted half as often as the per-source calibration says (e.g. the winner's
    curse of picking the best-looking nodes, or a text where this source copies badly): the
    source's factor converges to about 0.5, another source's stays at 1, and the predicted
    tokens per step follow the realized ones."""
    planner = HardwarePlanner(curve=FLAT)
    driver = Driver(planner)
    tree = chain([5, 6, 7, 8], 0.8)
    planner.calibrator.update = lambda *a, **k: None  # freeze per-source calibration: 0.8 per edge
    rng = random.Random(0)
    predicted, realized = [], []
    for step in range(400):
        planned, expected = driver.plan(Proposal(tree))
        accepted = 0
        while accepted < len(planned.tree) and rng.random() < 0.4:  # each edge: 0.4, not 0.8
            accepted += 1
        driver.observe(planned, tuple(range(accepted)))
        predicted.append(expected)
        realized.append(1 + accepted)
    assert planner.bias_of("prompt-lookup") == pytest.approx(0.5, abs=0.12)
    assert planner.bias_of("token-recycling") == 1.0
    late = slice(100, None)
    assert sum(predicted[late]) / sum(realized[late]) == pytest.approx(1.0, abs=0.08)


def test_a_pessimistic_correction_fades_while_the_source_is_not_drafted():
    """Plain steps fade a source's correction back towards 1 (time passes: it is tried again). A
    batch step on which a session drafted nothing because drafts do not pay at the load leaves it
    as it was (the batch back-off decides when to try again); faded there, a probe after a long
    pause trusted the prior again and verified a tree that lost."""
    planner = HardwarePlanner(curve=STEEP)
    driver = Driver(planner)
    tree = chain([5, 6], 0.9)
    for _ in range(10):  # confident nodes, never accepted
        planned, _ = driver.plan(Proposal(tree))
        driver.observe(planned)
    low = planner.bias_of("prompt-lookup")
    assert low < 0.5
    idle = StepResult(3, Proposal.empty(), (), 9, torch.zeros(1, 16), idle=True)
    plan = Plan(Proposal.empty(), batch=8, drafted=False)
    assert plan.idle_by_load
    for _ in range(500):
        planner.observe(plan, idle, driver.state, StepTiming(0.0, 1.0))
    assert planner.bias_of("prompt-lookup") == pytest.approx(low)
    for _ in range(100):  # plain steps: nothing drafted, nothing learned, but time passes
        planned, _ = driver.plan(Proposal.empty())
        driver.observe(planned)
    assert low < 0.9 < planner.bias_of("prompt-lookup") <= 1.0


class RecordingView:
    """A `CostView` that allows `more` chain tokens and records what the drafter asked."""

    def __init__(self, more: int, baseline: float = 123.0) -> None:
        self.more, self.baseline_rate, self.calls = more, baseline, []

    def verify_seconds(self, n_tokens: int) -> float:
        return 1.0

    def plan_chain(self, source, edge_scores, seconds_per_token, spent_seconds, max_more, one_time_seconds=0.0,
                   remaining_tokens=1) -> int:
        self.calls.append((source, len(edge_scores), seconds_per_token, one_time_seconds))
        return min(self.more, max_more)


def test_fusion_skips_the_draft_model_when_retrieval_already_beats_it():
    """In fusion the engine builds the draft model's cost view after the model-free drafters
    proposed; the draft model asks it once, before any draft pass, and does not run."""
    model = successor_model()
    target = HFCausalLM(model, "target")
    draft = HFCausalLM(perturbed_copy(model, 0.3), "draft")
    drafters = make_drafters("fusion", target=target, draft=draft)
    assert [d.name for d in drafters] == ["prompt-lookup", "token-recycling", "draft-model"]
    draft_model = drafters[-1]
    draft_model._token_seconds.update(0.01)  # a measured draft step: the view is consulted first
    state = draft_model.start()
    view = RecordingView(more=0)
    proposal = draft_model.propose(ctx([3, 4, 5, 6, 3, 4, 5], cost=view), state)
    assert [call[:3] for call in view.calls] == [("draft-model", 0, 0.01)]  # once, before any draft pass
    assert len(proposal.tree) == 0 and len(state.tokens) == 0  # the draft model never ran
    # Through the engine: the view the draft model reads covers prompt lookup's tree.
    planner = HardwarePlanner(curve=STEEP)
    views = []
    real_view = planner.view
    planner.view = lambda proposals, seconds, batch_size=1, state=None: (
        views.append([len(p.tree) for p in proposals]) or real_view(proposals, seconds, batch_size, state))
    dec = SpeculativeDecoder(target, drafters, eos_token_ids=[], planner=planner)
    dec.generate([3, 4, 5, 6, 3, 4, 5], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert views[0] == [] and views[2][0] > 0  # prompt lookup proposed before the draft model's view


def test_a_chain_is_valued_beside_the_tree_proposed_before_it():
    """The cost view values a chain by what it adds to the tree the drafters before it proposed:
    a cheap chain accepted half the time, which alone rates below a head's tree, is drafted beside
    it (judged against that tree, as before, it was not, and the two together beat either)."""
    from specula.planner import PlannerConfig
    from specula.planner.select import chain_lookahead

    curve = CostCurve((1, 2, 4, 8, 16), (1.0, 1.08, 1.19, 1.45, 1.58), 64)
    planner = HardwarePlanner(curve=curve, config=PlannerConfig(cost_explore=0.0, explore_prior=0.5))
    head = Proposal(TokenTree.chain([5, 6, 7, 8], [0.5, 0.8, 0.75, 2 / 3], "eagle3"))
    view = planner.view([head], 0.0)
    alpha = planner.expected_acceptance("draft-model")
    assert alpha == pytest.approx(0.5)
    alone = chain_lookahead([], alpha, 8, 0.02, 0.0, view.verify_seconds)[1]
    assert alone < view.baseline_rate  # alone, the chain rates below the head's tree
    more = view.plan_chain("draft-model", [], 0.02, 0.0, 8)
    assert more >= 1
    # Once drafted, the chain goes on while more tokens beat stopping (its own first token counted).
    assert view.plan_chain("draft-model", [0.9], 0.02, 0.02, 7) >= 1
    # With nothing proposed before it, the same chain is judged against a plain step, as always.
    assert planner.view([], 0.0).plan_chain("draft-model", [], 0.02, 0.0, 8) >= 1
    assert planner.view([], 0.0).plan_chain("draft-model", [], 0.9, 0.0, 8) == 0  # a token costs a step


def test_draft_model_weighs_its_cache_catch_up_before_drafting():
    model = successor_model()
    drafter = make_drafter("draft-model", draft=HFCausalLM(perturbed_copy(model, 0.3), "draft"), adaptive=True)
    drafter._token_seconds.update(0.01)
    drafter._catch_up_seconds.update(0.002)
    state = drafter.start()
    view = RecordingView(more=0)
    assert len(drafter.propose(ctx(list(range(2, 60)), cost=view), state).tree) == 0  # no before any draft pass
    assert view.calls == [("draft-model", 0, 0.01, pytest.approx(57 * 0.002))]  # 58 to catch up: 57 beyond the first pass
    assert len(state.tokens) == 0
    # Allowed three tokens, the chain stops at three (the view is asked again after each).
    view = RecordingView(more=3)
    assert len(drafter.propose(ctx(list(range(2, 60)), cost=view), state).tree) == 3


def test_pessimistic_planner_probes_at_growing_gaps_and_recovers():
    """A source whose estimate says 'never worth it' still gets its best node verified now and
    then (1, 2, 4, ... steps apart); when those probes succeed the planner drafts again."""
    driver = Driver(HardwarePlanner(curve=STEEP))
    tree = chain([5, 6], 0.05)  # raw 0.05 per edge: looks useless
    probes = []
    for step in range(40):
        planned, _ = driver.plan(Proposal(tree))
        if len(planned.tree):
            probes.append(step)
        driver.observe(planned, (), 0.0, STEEP.latency(len(planned.tree) + 1))
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 4 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # probes thin out
    for _ in range(200):  # now the first token is always accepted (probes 64 steps apart by now)
        planned, _ = driver.plan(Proposal(tree))
        path = (0,) if len(planned.tree) else ()
        driver.observe(planned, path, 0.0, STEEP.latency(len(planned.tree) + 1))
    drafted = sum(len(driver.plan(Proposal(tree))[0].tree) > 0 for _ in range(10))
    assert drafted == 10


def _chain_step(planner, state, accepted, tokens=(5, 6, 7, 8, 9, 10), edge=0.9, seconds_per_token=0.02, beside=()):
    """One engine step of a lone adaptive chain drafter ("draft-model") whose tokens the target
    accepts up to `accepted` (a number, or a function of the verified tree giving the path), after
    the proposals `beside`: the view sizes the chain, the plan verifies it, the planner observes.
    Returns (chain tokens drafted, nodes verified, the plan)."""
    assert planner.should_draft(state)
    k = planner.view(list(beside), 0.0, 1, state).plan_chain("draft-model", [], seconds_per_token, 0.0, len(tokens))
    drafted = 0
    while 0 < k and drafted < len(tokens):  # the drafter asks again after each token, as `draft_chain` does
        drafted += 1
        k = planner.view(list(beside), 0.0, 1, state).plan_chain("draft-model", [edge] * drafted, seconds_per_token,
                                                                 seconds_per_token * drafted, len(tokens) - drafted)
    tree = TokenTree.chain(list(tokens[:drafted]), [edge] * drafted, "draft-model") if drafted else TokenTree.empty()
    [plan] = planner.plan([PlanRequest([*beside, Proposal(tree)], BUDGET, state, seconds_per_token * drafted)])
    planned = plan.proposal
    path = accepted(planned.tree) if callable(accepted) else tuple(range(min(accepted, len(planned.tree))))
    seconds = STEEP.latency(len(planned.tree) + 1)
    planner.observe_pass([plan], seconds)
    planner.observe(plan, StepResult(3, planned, path, 9, torch.zeros(len(planned.tree) + 1, 16)), state,
                    StepTiming(seconds_per_token * drafted, seconds))
    return drafted, len(planned.tree), plan


def test_a_refused_chain_drafter_is_probed_and_recovers_on_text_it_drafts_well():
    """Estimates learned on text where a draft model is always wrong say its chains never pay; with
    nothing verified its calibration could never learn otherwise (before: never asked to draft
    again in that process). Refused, it is still probed 1, 2, 4, ... steps apart (whole chains,
    verified whatever their estimates, not judged by the back-off), and on text it drafts well one
    accepted probe is enough to resume drafting."""
    planner = HardwarePlanner(curve=STEEP, config=PlannerConfig(cost_explore=0.0))
    state = planner.new_state()
    for _ in range(80):  # text A: nothing it drafts is accepted
        _chain_step(planner, state, accepted=0)
    assert planner.expected_acceptance("draft-model") < 0.3
    assert planner.view([], 0.0).plan_chain("draft-model", [], 0.02, 0.0, 6) == 0  # refused (no probes without a state)
    drafted, probes = [], []
    for _ in range(60):  # still text A: refused, probed at doubling gaps
        n, verified, plan = _chain_step(planner, state, accepted=0)
        drafted.append(n)
        if n:
            assert verified == n and plan.probes == ("draft-model",) and plan.explore and plan.rate is None
            probes.append(len(drafted))
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert 1 <= len(probes) <= 4 and gaps == sorted(gaps), probes
    state = planner.new_state()  # text B: every token it drafts is accepted
    drafted = [_chain_step(planner, state, accepted=6)[0] for _ in range(80)]
    first = next(i for i, n in enumerate(drafted) if n)
    assert first <= 64 and all(drafted[first + 1:]) and drafted[-10:] == [6] * 10, drafted  # after one probe


def _frozen_node_estimates(planner) -> None:
    """Keep every node's estimate at its raw score: only the tree kind's factor can learn."""
    planner.calibrator.update = lambda *a, **k: None
    planner._recent.clear()
    planner._context.clear()


COPY = chain([5, 6, 7, 8], 0.8)  # prompt lookup's chain
RECYCLED = chain([9], 0.15, "token-recycling")  # a sibling of its first token
MIXED = frozenset({"prompt-lookup", "token-recycling"})


def _mixed_step(driver, rng, edge, sibling=0.0):
    """Plan prompt lookup's chain beside token recycling's sibling, accept each chain token with
    probability `edge`, else the sibling with probability `sibling` (siblings exclude each other);
    returns (predicted, realised) tokens."""
    _frozen_node_estimates(driver.planner)
    planned, expected = driver.plan(merge_proposals([Proposal(COPY), Proposal(RECYCLED)]))
    tokens = planned.tree.tokens_of(range(len(planned.tree)))
    accepted, u = [], rng.random()
    if u >= edge and 9 in tokens and u < edge + sibling:
        accepted.append(tokens.index(9))
    elif u < edge:
        for want in (5, 6, 7, 8):
            if want not in tokens or (want != 5 and rng.random() >= edge):
                break
            accepted.append(tokens.index(want))
    driver.observe(planned, tuple(accepted))
    return expected, 1 + len(accepted)


def test_a_tree_kind_that_realises_less_than_its_nodes_predict_is_scaled_and_others_are_not():
    """Prompt lookup's chain (0.8 per edge by its nodes' estimates) beside token recycling's sibling is
    accepted at 0.4 per edge: that kind's factor learns accepted / predicted drafted tokens (the
    prediction before the factor), and the plan's prediction then follows what is realised. Each kind
    learns on its own (prompt lookup's chain alone is not scaled by what the mixed trees realised); a
    kind that realises more than predicted is scaled up, never past a probability of 1."""
    planner = HardwarePlanner(curve=FLAT)
    driver = Driver(planner)
    rng = random.Random(0)
    steps, factors = [], []
    for _ in range(300):
        steps.append(_mixed_step(driver, rng, 0.4))
        factors.append(planner.tree_factor(MIXED))
    raw = 0.8 + 0.8 ** 2 + 0.8 ** 3 + 0.8 ** 4 + 0.15  # drafted tokens the nodes' own estimates predict
    real = 0.4 + 0.4 ** 2 + 0.4 ** 3 + 0.4 ** 4
    assert sum(factors[100:]) / 200 == pytest.approx(real / raw, rel=0.15)
    assert driver.last.kind == MIXED and driver.last.tree_factor < 0.5  # the plan's tree was scaled
    late = steps[100:]
    assert sum(p for p, _ in late) / sum(r for _, r in late) == pytest.approx(1.0, abs=0.08)
    assert list(planner.tree_factors) == ["prompt-lookup+token-recycling"]
    assert planner.summary(driver.state)["tree_factors"] == planner.tree_factors
    _frozen_node_estimates(planner)
    _, alone = driver.plan(Proposal(COPY))  # another kind, never verified: its estimates as they are
    assert driver.last.tree_factor == 1.0 and alone == pytest.approx(1 + raw - 0.15)
    for _ in range(100):  # every chain token accepted: the factor rises past 1
        _mixed_step(driver, rng, 1.0)
    assert planner.tree_factor(MIXED) > 1.1
    top = driver.last.tree_factor * 0.8
    assert driver.last.tree_factor < planner.tree_factor(MIXED) and top == pytest.approx(1.0)  # scaled to 1 at most


def test_a_tree_kind_whose_estimates_are_right_keeps_a_factor_of_one_on_average():
    """Where the nodes' estimates are exactly right the factor's noise averages out around 1 (capped
    at 1, as first written, it averaged 0.94 here and every plan read low)."""
    planner = HardwarePlanner(curve=FLAT)
    driver = Driver(planner)
    rng = random.Random(1)
    factors = []
    for _ in range(1500):
        _mixed_step(driver, rng, 0.8, 0.15)
        factors.append(planner.tree_factor(MIXED))
    mean = sum(factors[100:]) / len(factors[100:])
    assert 0.97 < mean < 1.06, mean


def test_a_chain_refused_beside_trees_that_realise_less_than_predicted_is_drafted_once_they_are_scaled():
    """The draft model's chain is refused while prompt lookup's and token recycling's tree looks best
    (their nodes' estimates frozen here); on the steps it is refused that tree realises nothing
    (measured on the 1.5B with fusion: 4.06 tokens predicted, 2.49 realised, where the estimates were
    right on average over those sources' nodes). The tree kind's factor learns that, so the chain is
    drafted beside it on later steps; before, it was refused, and the steps that verified the others'
    tree alone lost until the back-off paused drafting altogether."""
    planner = HardwarePlanner(curve=STEEP, config=PlannerConfig(cost_explore=0.0))
    state = planner.new_state()
    others = merge_proposals([Proposal(chain([50, 51, 52, 53, 54, 55], 0.9)), Proposal(RECYCLED)])

    def accept_the_chain(tree):  # the draft model's tokens are right, the others' are not
        return tuple(i for i in range(len(tree)) if any(src == "draft-model" for src, _ in tree.proposers(i)))

    drafted = []
    for _ in range(60):
        _frozen_node_estimates(planner)
        drafted.append(_chain_step(planner, state, accept_the_chain, edge=0.9, beside=[others])[0])
    assert drafted[0] == 0  # refused at first: the others' tree looks better
    assert planner.tree_factor(MIXED) < 0.5
    assert sum(n > 0 for n in drafted[-20:]) >= 18, drafted


def test_no_chain_probe_where_the_chain_would_not_pay_even_untried():
    """A probe asks whether the text changed, not whether the drafter got cheaper: a chain whose
    tokens cost a plain step each would not pay at an untried drafter's acceptance, and is not probed."""
    planner = HardwarePlanner(curve=STEEP, config=PlannerConfig(cost_explore=0.0))
    state = planner.new_state()
    for _ in range(30):
        assert _chain_step(planner, state, accepted=0, seconds_per_token=0.9)[0] == 0


def test_a_probe_beside_another_drafters_tree_keeps_each_verified_nodes_sibling_context():
    """The probe's chain is forced in below nodes chosen by estimate: each verified node keeps the
    sibling context it has in the merged tree (they were read off the best nodes in order, so the
    probe's contested first token was learned as uncontested, its child as contested)."""
    from specula.planner.select import sibling_contexts

    planner = HardwarePlanner(curve=STEEP, config=PlannerConfig(cost_explore=0.0))
    state = planner.new_state()
    for _ in range(80):
        _chain_step(planner, state, accepted=0)
    lookup = Proposal(TokenTree.chain([20, 21, 22], [0.95] * 3, "prompt-lookup"))
    for _ in range(80):  # a request a step (no back-off pause)
        drafted, _, plan = _chain_step(planner, planner.new_state(), accepted=0, tokens=(5, 6, 7), beside=[lookup])
        if plan.probes:
            break
    assert plan.probes == ("draft-model",) and drafted > 0
    merged = merge_proposals([lookup, Proposal(TokenTree.chain([5, 6, 7][:drafted], [0.9] * drafted,
                                                                "draft-model"))]).tree
    where = {tuple(merged.tokens_of(merged.path_to(i))): i for i in range(len(merged))}
    verified = plan.proposal.tree
    expected = tuple(sibling_contexts(merged)[where[tuple(verified.tokens_of(verified.path_to(i)))]]
                     for i in range(len(verified)))
    assert plan.contexts == expected and "contested" in expected and None in expected


def test_a_drafter_that_does_not_pay_on_this_text_is_probed_seldom():
    """A calibrated drafter refused because its chains do not pay (each token accepted half the time
    at a quarter of a plain step): its probes, judged by their average gain over a plain step, thin
    out (judged one by one, a third of them won by luck and it probed every few steps), and cost
    about nothing."""
    rng = random.Random(0)
    planner = HardwarePlanner(curve=STEEP, config=PlannerConfig(cost_explore=0.0))
    state = planner.new_state()

    def half(tree):
        path = []
        while len(path) < len(tree) and rng.random() < 0.5:
            path.append(len(path))
        return tuple(path)

    probes = 0
    for step in range(400):
        if not planner.should_draft(state):  # a back-off pause: a plain step
            [plan] = planner.plan([PlanRequest([], BUDGET, state, 0.0, False)])
            planner.observe(plan, StepResult(3, plan.proposal, (), 9, torch.zeros(1, 16)), state, StepTiming(0.0, 1.0))
            continue
        _, _, plan = _chain_step(planner, state, accepted=half, edge=0.6, seconds_per_token=0.25)
        probes += step >= 100 and bool(plan.probes)
    assert probes <= 15, probes  # in the last 300 steps; probes at most every 64 steps once failing: ~5


def test_a_probe_is_judged_by_what_its_chain_adds_not_by_what_the_step_realised():
    """A chain never accepted, probed beside prompt lookup whose copy the target takes: the step
    pays for itself, not the chain. Judged by the whole step against a plain one, every probe won
    and it probed on every step (179 probes in 300 steps, 716 nodes verified, none accepted, the
    decoding 21% slower); judged by what the step would have realised without its chain, its probes
    thin out."""
    planner = HardwarePlanner(curve=STEEP, config=PlannerConfig(cost_explore=0.0))
    state = planner.new_state()
    for _ in range(80):  # learned: nothing it drafts is accepted
        _chain_step(planner, state, accepted=0, seconds_per_token=0.003)
    lookup = Proposal(TokenTree.chain([20, 21, 22], [0.5] * 3, "prompt-lookup"))

    def copy(tree):  # the target takes prompt lookup's first two tokens, never the chain's
        path, parent = [], -1
        for token in (20, 21):
            child = next((i for i in range(len(tree)) if tree.parents[i] == parent and tree.tokens[i] == token), None)
            if child is None:
                break
            path.append(child)
            parent = child
        return tuple(path)

    state = planner.new_state()
    probes = 0
    for step in range(300):
        _, _, plan = _chain_step(planner, state, accepted=copy, seconds_per_token=0.003, beside=[lookup])
        probes += step >= 100 and bool(plan.probes)
    assert probes <= 8, probes  # in the last 200 steps: at most every 64 steps once failing


def test_sessions_planned_in_one_step_take_one_probe_between_them():
    """The schedule is taken when a probe is drafted: sessions planned one by one in the same engine
    step (a backend that does not pack) do not each probe."""
    planner = HardwarePlanner(curve=STEEP, config=PlannerConfig(cost_explore=0.0))
    teach = planner.new_state()
    for _ in range(80):
        _chain_step(planner, teach, accepted=0)
    for _ in range(64):  # whatever the schedule's wait, it runs out
        planner.chain_probe("draft-model").waiting()
    states = [planner.new_state() for _ in range(4)]
    asked = []
    for state in states:
        assert planner.should_draft(state)
        asked.append(planner.view([], 0.0, 1, state).plan_chain("draft-model", [], 0.02, 0.0, 6))
    assert sum(k > 0 for k in asked) == 1 and asked[0] > 0


def test_the_engine_probes_an_adaptive_draft_model_its_planner_refuses():
    """End to end (session 105's review script): after requests where a draft model is always
    wrong, requests where it is always right are drafted again, output equal to plain greedy."""
    import copy
    import time

    from specula.models.sequence import TreeSequence
    from tiny import VOCAB

    target_model = successor_model()
    draft_model = copy.deepcopy(target_model)
    emb = draft_model.model.embed_tokens.weight.detach().clone()
    with torch.no_grad():  # after a token >= 48 the draft says last + 2 (wrong), before it last + 1 (right)
        weights = torch.roll(emb, 1, dims=0).clone()
        weights[49:] = emb[47:VOCAB - 2]
        draft_model.lm_head.weight.copy_(weights)
    target, draft = HFCausalLM(target_model, "target"), HFCausalLM(draft_model, "draft")
    slow_pass = target.new_sequence

    def new_sequence(*args, **kwargs):  # the target's passes cost 6 ms more: a draft token is ~0.1 of a step
        seq = slow_pass(*args, **kwargs)
        forward = seq.forward_tree
        seq.forward_tree = lambda *a, **k: (time.sleep(0.006), forward(*a, **k))[1]
        return seq

    target.new_sequence = new_sequence
    curve = CostCurve((1, 2, 4, 8, 16), (0.0066, 0.0068, 0.0070, 0.0072, 0.0075), 64)
    drafter = make_drafter("draft-model", target=target, draft=draft, adaptive=True, num_draft_tokens=6)
    dec = SpeculativeDecoder(target, [drafter], eos_token_ids=[], planner=HardwarePlanner(curve=curve))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for _ in range(8):
        dec.generate([60, 61, 62, 63], params)
    assert dec.planner.expected_acceptance("draft-model") < 0.3
    outs = [dec.generate([2, 3, 4], params) for _ in range(4)]  # a probe within 64 steps (of any request)
    for out in outs:
        assert out.token_ids == [(5 + j) % VOCAB for j in range(30)]
    assert outs[-1].stats.mean_accepted_tokens >= 4


def test_projection_is_measured_on_the_curve_as_given():
    """Projected speedup = expected tokens per step when verifying costs one plain step (flat
    curve, free drafting), even after observed step times rescaled the online cost model."""
    planner = HardwarePlanner(curve=FLAT)
    driver = Driver(planner)
    tree = chain([5, 6], 0.9)
    planner.calibrator.update = lambda *a, **k: None
    expected = []
    for _ in range(20):
        planned, e = driver.plan(Proposal(tree))
        expected.append(e)
        driver.observe(planned, (0,), 0.0, 3.0)
    assert planner.cost.scale > 2.0  # this "machine" is 3x slower than the curve
    assert planner.summary(driver.state)["projected_speedup"] == pytest.approx(sum(expected) / len(expected), rel=1e-3)


def test_no_probes_where_a_one_node_tree_can_never_pay():
    """Where a 2-token pass costs 2.3 plain steps, a one-node tree can never pay: once the run has
    timed such passes (the prior alone is not trusted: a few are tried) probing stops for good."""
    jump = CostCurve((1, 2, 4, 8), (1.0, 2.3, 2.3, 2.2), 64)  # float32 CPU: 1 row GEMV, 2+ rows GEMM
    driver = Driver(HardwarePlanner(curve=jump))
    tree = chain([5, 6], 0.05)
    drafted = []
    for _ in range(60):
        planned, _ = driver.plan(Proposal(tree))
        drafted.append(len(planned.tree))
        driver.observe(planned, (), 0.0, jump.latency(len(planned.tree) + 1))
    assert sum(drafted) <= 4 and sum(drafted[20:]) == 0


def test_backoff_follows_realised_rates_when_estimates_are_wrong():
    """The calibration keeps promising 0.9 per node (frozen here) but nothing is ever accepted:
    the plan always looks good, the realised tokens/s do not, and drafting pauses anyway."""
    planner = HardwarePlanner(curve=STEEP)
    driver = Driver(planner)
    planner.calibrator.update = lambda *a, **k: None
    tree = chain([5, 6, 7], 0.9)
    verified, planned = 0, []
    for _ in range(60):
        planner._recent.clear()  # keep the per-source and tree factors at 1: only the back-off can act
        planner._trees.clear()
        drafting, plan = driver.engine_step(tree, 1e-4)
        verified += len(plan.tree) > 0
        if drafting:
            planned.append(len(plan.tree))
    assert set(planned) == {3}  # every drafting step still plans the whole chain
    assert verified < 15  # but most steps are plain


def test_sampled_drafts_that_lose_are_paused_by_the_back_off_too():
    """A sampled tree is verified as drawn (never sized), so its steps were never judged: drafting
    that realised fewer tokens/s than plain steps was never paused at temperature > 0."""
    planner = HardwarePlanner(curve=STEEP)
    driver = Driver(planner)
    planner.calibrator.update = lambda *a, **k: None  # estimates stay optimistic: only the back-off can act
    tree = chain([5, 6, 7], 0.9, "draft-model")
    drafted = 0
    for _ in range(60):
        planner._recent.clear()
        planner._trees.clear()
        drafting = planner.should_draft(driver.state)
        proposal = Proposal(tree, torch.zeros(4, 16), "iid") if drafting else Proposal.empty()
        planned, _ = driver.plan(proposal, 0.3 if drafting else 1e-5, drafting)
        assert len(planned.tree) in (0, 3)  # as drawn, never cut
        drafted += len(planned.tree) > 0
        driver.observe(planned, (), 0.3 if drafting else 1e-5, STEEP.latency(len(planned.tree) + 1))
    assert drafted < 15


def test_a_probe_after_a_pause_is_judged_afresh_so_drafting_resumes_once_it_pays():
    """Nothing is accepted on a request's first drafting steps, so drafting pauses; then the first
    node of every chain is (2 tokens in 1.45 plain steps: drafting pays 1.38x). Judged through the
    average of the losses before the pause, each winning probe read below plain and doubled the
    pause (an MT-bench prompt on SmolLM2 drafted 8 of 63 steps); judged afresh, the first probe
    after the text turned resumes drafting on every step."""
    planner = HardwarePlanner(curve=STEEP)
    driver = Driver(planner)
    planner.calibrator.update = lambda *a, **k: None  # estimates frozen: only the back-off acts
    tree = chain([5, 6, 7], 0.9)

    def step(path):
        planner._recent.clear()
        planner._trees.clear()
        drafting = planner.should_draft(driver.state)
        seconds = 0.05 if drafting else 1e-5
        planned, _ = driver.plan(Proposal(tree) if drafting else Proposal.empty(), seconds, drafting)
        driver.observe(planned, path if planned.tree else (), seconds, STEEP.latency(len(planned.tree) + 1))
        return drafting

    losing = [step(()) for _ in range(12)]
    assert not all(losing[4:])  # the misses paused drafting
    paying = [step((0,)) for _ in range(60)]
    first = paying.index(True)
    assert first <= 16  # the pause in progress ends, then the probe
    assert all(paying[first:])  # the winning probe resumed drafting for good


def test_a_probe_the_back_off_cannot_judge_leaves_the_next_one_judged_afresh():
    """After a pause the first drafting step is an explore step (a one-node tree nothing else paid
    for: no plan rate, not judged); the next, winning step must still be judged afresh. Once the
    explore step used up the fresh start, the win was averaged with the losses that paused drafting
    and doubled the pause."""
    planner = HardwarePlanner(curve=STEEP)
    driver = Driver(planner)
    planner.calibrator.update = lambda *a, **k: None  # estimates frozen: only the back-off acts
    strong, weak = chain([5, 6, 7], 0.9), chain([5], 0.001, "b")

    def step(tree, path, explore=False):
        planner._recent.clear()
        planner._trees.clear()
        drafting = planner.should_draft(driver.state)
        if drafting and explore:
            driver.state.explore_wait = 0  # its countdown ran out on this step
        seconds = 0.05 if drafting else 1e-5
        planned, _ = driver.plan(Proposal(tree) if drafting else Proposal.empty(), seconds, drafting)
        driver.observe(planned, path if planned.tree else (), seconds, STEEP.latency(len(planned.tree) + 1))
        return drafting

    while driver.state.backoff.left == 0:  # misses until drafting pauses
        step(strong, ())
    while driver.state.backoff.left:
        step(strong, ())
    assert step(strong, ()) and driver.state.backoff.left  # a probe that misses: a loss, a longer pause
    while driver.state.backoff.left:
        step(strong, ())
    assert step(weak, (), explore=True) and driver.last.rate is None  # the probe: explored, not judged
    assert step(strong, (0,))  # the text turned: 2 tokens in 1.45 plain steps
    assert driver.state.backoff.left == 0 and planner.should_draft(driver.state)


def test_the_request_summary_counts_the_steps_sat_out_in_back_off_pauses():
    planner = HardwarePlanner(curve=STEEP)
    driver = Driver(planner)
    tree = chain([5], 0.01)
    skipped = sum(not driver.engine_step(tree, 0.05, lambda n: STEEP.latency(1))[0] for _ in range(40))
    assert skipped > 20  # useless slow drafting: most steps paused
    assert planner.summary(driver.state)["paused_steps"] == skipped
    assert planner.new_state().paused_steps == 0


def test_a_new_request_ends_the_back_off_pause():
    planner = HardwarePlanner(curve=STEEP)
    driver = Driver(planner)
    tree = chain([5], 0.01)
    run = 0
    for _ in range(40):  # useless slow drafting: pauses of 1, 2, 4, ... plain steps
        run = 0 if driver.engine_step(tree, 0.5, lambda n: STEEP.latency(1))[0] else run + 1
        if run == 3:  # inside a pause of at least 4 steps: one more is still due
            break
    assert run == 3
    assert not planner.should_draft(driver.state)  # still paused for this request ...
    assert planner.should_draft(planner.new_state())  # ... a new one is judged afresh


def test_an_untried_drafter_with_high_acceptance_and_moderate_cost_is_used_within_a_few_steps():
    """Issue 17's failure: a draft model whose tokens cost 40% of a target step and are accepted
    90% of the time was never judged worth a first token (one token alone does not pay, and a
    drafter with no data had a 50% prior). With lookahead and an optimistic prior it is tried at
    once, its acceptance is learned, and it keeps drafting long chains."""
    curve = CostCurve((1, 2, 4, 8, 16), (1.0, 1.08, 1.16, 1.3, 1.6), 64)
    planner = HardwarePlanner(curve=curve)
    state = planner.new_state()
    rng = random.Random(1)
    drafted_steps, lengths = 0, []
    for step in range(30):
        view = planner.view([], 0.0)
        more = view.plan_chain("draft-model", [], 0.4, 0.0, 12, 0.0, 200)
        if more:
            drafted_steps += 1
            lengths.append(more)
            tree = TokenTree.chain(list(range(10, 10 + more)), [0.95] * more, "draft-model")
            accepted = 0
            while accepted < more and rng.random() < 0.9:
                accepted += 1
            [plan] = planner.plan([PlanRequest([Proposal(tree)], BUDGET, state, 0.4 * more)])
            planned = plan.proposal
            seconds = curve.latency(len(planned.tree) + 1)
            planner.observe_pass([plan], seconds)
            planner.observe(plan, StepResult(3, planned, tuple(range(min(accepted, len(planned.tree)))), 9,
                                             torch.zeros(len(planned.tree) + 1, 16)), state,
                            StepTiming(0.4 * more, seconds))
    assert drafted_steps >= 25, drafted_steps  # used from the first steps on, and kept
    assert sum(lengths[-10:]) / 10 >= 4  # once its acceptance is learned: chains, not single tokens


def batch_table(per_token: float) -> BatchCostCurve:
    """A packed pass costs 1 + per_token * (total tokens - batch size) at every batch size."""
    sizes = (1, 2, 4, 8)
    totals = tuple(tuple(b * n for n in (1, 2, 4, 8)) for b in sizes)
    return BatchCostCurve(sizes, totals, tuple(tuple(1.0 + per_token * (t - b) for t in row)
                                               for b, row in zip(sizes, totals)), 64)


def test_batch_plan_of_one_request_is_the_lone_plan():
    lone, batched = Driver(HardwarePlanner(curve=STEEP)), Driver(HardwarePlanner(curve=STEEP, batch_curve=batch_table(0.5)))
    proposal = Proposal(wide_tree())
    planned, expected = lone.plan(proposal)
    [plan_b] = batched.planner.plan([PlanRequest([proposal], BUDGET, batched.state, 0.0)])
    planned_b, expected_b = plan_b.proposal, plan_b.predicted
    assert planned_b.tree.tokens == planned.tree.tokens and planned_b.tree.parents == planned.tree.parents
    assert expected_b == pytest.approx(expected)


def test_batch_plan_switches_speculation_off_when_the_load_makes_it_lose():
    """Four requests with the same wide tree: on a pass whose tokens are nearly free every request
    drafts; on a compute-bound one (each token 0.3 of a full step) none does, although each would
    alone on the steep single-sequence curve, and each such step is counted as switched off by load."""
    proposal = Proposal(wide_tree())
    for per_token, drafts in ((0.001, True), (0.3, False)):
        planner = HardwarePlanner(curve=STEEP, batch_curve=batch_table(per_token))
        states = [planner.new_state() for _ in range(4)]
        plans = planner.plan([PlanRequest([proposal], BUDGET, s, 0.0) for s in states])
        assert all((p.nodes > 0) == drafts for p in plans)
        assert all(p.off_by_load == (not drafts) for p in plans)
        if not drafts:
            assert all(p.predicted == 1.0 for p in plans)
            assert plans[0].alone > 0


def test_between_timed_batch_sizes_the_plan_prices_nodes_as_the_rows_do():
    """The table times batches of 1, 2, 4 and 8; a batch of 3, 5, 6 or 7 is read between two rows.
    Where every row charges 0.3 of a step a node, so does every batch between (the same total read
    on the larger row priced the first nodes lower), each pass costs more with more nodes and more
    sequences, and from 4 sequences on (as at 4 and 8) the plan refuses every draft."""
    proposal = Proposal(wide_tree())
    for per_token, drafts in ((0.001, True), (0.3, False)):
        planner = HardwarePlanner(curve=STEEP, batch_curve=batch_table(per_token))
        for batch in range(2, 9):
            prices = [planner.batch_seconds(batch, batch + nodes) for nodes in range(17)]
            assert prices == pytest.approx([1.0 + per_token * nodes for nodes in range(17)])
            assert planner.batch_seconds(batch, batch) <= planner.batch_seconds(batch + 1, batch + 1)
            if batch >= 4:
                states = [planner.new_state() for _ in range(batch)]
                plans = planner.plan([PlanRequest([proposal], BUDGET, s, 0.0) for s in states])
                assert all((p.nodes > 0) == drafts for p in plans), (per_token, batch)


def test_the_cost_view_prices_a_batched_session_by_the_packed_pass():
    """A drafter deciding whether to draft reads the pass its tree joins: in a batch of 8, each of
    its tokens must beat the batch's own rate (8 roots a pass), not a lone plain step's. At 0.1 of
    a pass a token, a chain that pays alone on the steep lone curve does not pay beside seven other
    roots; at 0.01 it does. Without a batch table the view is the lone one."""
    from specula.planner import PlannerConfig

    for per_token, pays in ((0.1, False), (0.01, True)):
        planner = HardwarePlanner(curve=STEEP, batch_curve=batch_table(per_token),
                                  config=PlannerConfig(cost_explore=0.0))
        lone, batched = planner.view([], 0.0), planner.view([], 0.0, batch_size=8)
        assert lone.plan_chain("draft-model", [], 0.02, 0.0, 8) >= 1
        assert (batched.plan_chain("draft-model", [], 0.02, 0.0, 8) >= 1) == pays
        assert [batched.verify_seconds(n) for n in (1, 3)] == [pytest.approx(planner.batch_seconds(8, 8)),
                                                              pytest.approx(planner.batch_seconds(8, 10))]
        assert batched.baseline_rate == pytest.approx(8 / planner.batch_seconds(8, 8))
    no_table = HardwarePlanner(curve=STEEP)
    assert no_table.view([], 0.0, batch_size=8).verify_seconds(4) == no_table.view([], 0.0).verify_seconds(4)


def test_the_engine_gives_each_drafter_the_size_of_the_batch_it_drafts_for():
    model = successor_model()
    target = HFCausalLM(model)
    planner = HardwarePlanner(curve=STEEP, batch_curve=batch_table(0.001))
    sizes = []
    real_view = planner.view
    planner.view = lambda proposals, seconds, batch_size=1, state=None: (sizes.append(batch_size)
                                                                         or real_view(proposals, seconds, batch_size, state))
    dec = SpeculativeDecoder(target, [make_drafter("prompt-lookup")], eos_token_ids=[], planner=planner)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    list(dec.generate_many([(i, [3, 4, 5, 3, 4], params) for i in range(3)], max_batch_size=3))
    assert sizes and set(sizes) == {3}


def test_under_a_load_where_drafts_lose_drafting_pauses_and_probes():
    """A request whose drafts the batch plan keeps refusing stops drafting after two such steps and
    probes every 8th step; a request in the same batch whose drafts pay keeps drafting."""
    planner = HardwarePlanner(curve=STEEP, batch_curve=batch_table(0.3))
    poor, good = planner.new_state(), planner.new_state()
    drafted = []
    for _ in range(20):
        drafting = [planner.should_draft(s, batch_size=2) for s in (poor, good)]
        drafted.append(drafting)
        proposals = [[Proposal(chain([5, 6], 0.02, "prompt-lookup"))] if drafting[0] else [],
                     [Proposal(chain([7, 8, 9], 0.99, "draft-model"))] if drafting[1] else []]
        plans = planner.plan([PlanRequest(p, BUDGET, s, 0.0, d) for p, s, d in zip(proposals, (poor, good), drafting)])
        assert plans[0].nodes == 0
    poor_drafted = [d[0] for d in drafted]
    assert poor_drafted[:2] == [True, True] and poor_drafted.count(True) == 4 and poor_drafted[8] and poor_drafted[16]
    assert all(d[1] for d in drafted)  # the confident one drafts every step
    assert planner.should_draft(poor, batch_size=1)  # alone again, drafting resumes at once


def test_a_request_idle_at_one_load_drafts_again_when_the_load_falls():
    """Refused at 4 a pass, a request stops drafting at 4 (and at more); once others finish and the
    batch is 2, it drafts on the next step, not at the next probe."""
    planner = HardwarePlanner(curve=STEEP, batch_curve=batch_table(0.3))
    states = [planner.new_state() for _ in range(4)]
    for _ in range(3):
        drafting = [planner.should_draft(s, batch_size=4) for s in states]
        planner.plan([PlanRequest([Proposal(chain([5, 6], 0.02, "prompt-lookup"))] if d else [], BUDGET, s, 0.0, d)
                      for s, d in zip(states, drafting)])
    poor = states[0]
    assert not planner.should_draft(poor, batch_size=4)
    assert not planner.should_draft(poor, batch_size=8)
    paused = [planner.new_state() for _ in range(2)]  # the batch of 2's own back-off still rules it
    planner.observe_pass(planner.plan([PlanRequest([Proposal(chain([5, 6], 0.99, "draft-model"))], BUDGET, s, 0.0)
                                       for s in paused]), 10.0, [1, 1], 0.0)
    assert planner._batch_backoff[2].pause.left > 0
    assert not planner.should_draft(poor, batch_size=2)
    fresh = replace(planner.new_state(), resumed=False)  # sitting the pause out: its next drafting step
    assert not planner.should_draft(fresh, batch_size=2) and fresh.resumed  # may carry a catch-up
    planner._batch_backoff[2].pause.left = 0
    assert planner.should_draft(poor, batch_size=2)


def _batch_chain_step(planner, states, accepted, tokens=(5, 6, 7, 8, 9, 10), edge=0.9, seconds_per_token=0.02):
    """`_chain_step` for sessions packed into one pass: each session's adaptive chain drafter
    ("draft-model") asks the batch's cost view, the planner plans the batch, the pass is timed on the
    batch table and every session observes. Returns (chain tokens drafted, plans), per session."""
    batch, requests, drafted = len(states), [], []
    for state in states:
        drafting, n = planner.should_draft(state, batch), 0
        k = planner.view([], 0.0, batch, state).plan_chain("draft-model", [], seconds_per_token, 0.0,
                                                           len(tokens)) if drafting else 0
        while 0 < k and n < len(tokens):
            n += 1
            k = planner.view([], 0.0, batch, state).plan_chain("draft-model", [edge] * n, seconds_per_token,
                                                               seconds_per_token * n, len(tokens) - n)
        tree = TokenTree.chain(list(tokens[:n]), [edge] * n, "draft-model") if n else TokenTree.empty()
        requests.append(PlanRequest([Proposal(tree)] if drafting else [], BUDGET, state, seconds_per_token * n,
                                    drafting, (("draft-model", seconds_per_token * n),) if n else ()))
        drafted.append(n)
    plans = planner.plan(requests)
    seconds = planner.batch_seconds(batch, sum(plan.nodes + 1 for plan in plans))
    paths = [tuple(range(min(accepted, plan.nodes))) for plan in plans]
    planner.observe_pass(plans, seconds, [1 + len(path) for path in paths], sum(r.draft_seconds for r in requests))
    for plan, state, path, r in zip(plans, states, paths, requests):
        planner.observe(plan, StepResult(3, plan.proposal, path, 9, torch.zeros(plan.nodes + 1, 16)), state,
                        StepTiming(r.draft_seconds, seconds))
    return drafted, plans


def _taught_to_refuse(batch_curve) -> HardwarePlanner:
    """A planner whose draft model missed every token on 80 lone steps: its chain is refused."""
    planner = HardwarePlanner(curve=STEEP, batch_curve=batch_curve, config=PlannerConfig(cost_explore=0.0))
    state = planner.new_state()
    for _ in range(80):
        _chain_step(planner, state, accepted=0)
    assert planner.view([], 0.0, 4).plan_chain("draft-model", [], 0.02, 0.0, 6) == 0
    return planner


def test_a_chain_refused_in_a_packed_batch_is_probed_and_recovers():
    """Four sessions in packed passes whose extra tokens cost 1% of a pass, on text where the draft
    model's every token is accepted: an untried draft model would draft its whole chain, but one
    refused on other text was never probed in a batch (no chain in 300 batch steps: the refusal
    stood while the load lasted). Probed, one accepted chain is enough."""
    planner = _taught_to_refuse(batch_table(0.01))
    states = [planner.new_state() for _ in range(4)]
    drafted, probes = [], []
    for step in range(150):
        counts, plans = _batch_chain_step(planner, states, accepted=6)
        drafted.append(counts)
        for n, plan in zip(counts, plans):
            if plan.probes:
                assert plan.probes == ("draft-model",) and plan.nodes == n > 0  # verified whatever its estimates
                probes.append(step)
    assert probes and probes[0] <= 64, probes
    assert all(counts == [6] * 4 for counts in drafted[-10:]), drafted[-10:]


def test_a_failing_probe_in_a_packed_batch_waits_as_many_batch_steps_as_one_alone():
    """A probe in a batch costs every session in it, and each session's step counts the schedule
    down: the wait after a probe that did not pay is counted in batch steps (up to 64 of them, as
    alone), not in the sessions' steps (64 of those pass in 8 batch steps of 8)."""
    planner = _taught_to_refuse(batch_table(0.01))
    states = [planner.new_state() for _ in range(8)]
    probes = [step for step in range(300)
              if any(plan.probes for plan in _batch_chain_step(planner, states, accepted=0)[1])]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 3 and min(gaps) >= planner.config.max_explore_gap, probes


def test_the_batch_back_off_does_not_judge_a_step_holding_a_probe():
    """A probe's chain is verified whatever its estimates: alone the back-off does not judge its
    step, nor does the batch's (a probe that missed would pause drafting for the whole batch)."""
    planner = HardwarePlanner(curve=STEEP, batch_curve=batch_table(0.01))
    probe = Plan(Proposal(TokenTree.chain([5, 6], [0.9, 0.9], "draft-model")), 1.0, batch=4, probes=("draft-model",))
    plain = Plan(Proposal.empty(), 1.0, batch=4)
    planner.observe_pass([probe, plain, plain, plain], 5.0, [1, 1, 1, 1], 0.0)
    assert planner._batch_backoff[4].pause.left == 0
    planner.observe_pass([replace(probe, probes=()), plain, plain, plain], 5.0, [1, 1, 1, 1], 0.0)
    assert planner._batch_backoff[4].pause.left > 0  # the same step, not a probe: a loss


def test_a_batch_probe_after_a_pause_is_judged_afresh():
    """After drafting lost at a batch size (paused 1, 2, 4, ... steps), the text changes and
    drafting realises twice the plain rate: the first probe after the pause wins and no new pause
    starts; through the average of the earlier losses it read as a loss and doubled the pause."""
    planner = HardwarePlanner(curve=STEEP, batch_curve=batch_table(0.001))
    drafted = [Plan(Proposal(TokenTree.chain([5], [0.9], "x")), 1.5, batch=4)] + [Plan(Proposal.empty(), 1.0,
                                                                                        batch=4)] * 3
    plain = [Plan(Proposal.empty(), 1.0, batch=4, drafted=False)] * 4
    probes, judged = 0, []
    for _ in range(200):
        backoff = planner._batch_backoff.get(4)
        if backoff is not None and backoff.pause.left > 0:  # nobody drafts (should_draft)
            planner.observe_pass(plain, 1.0, [1, 1, 1, 1], 0.0)  # 4 tokens/s
            continue
        probes += 1
        good = probes > 6
        planner.observe_pass(drafted, 1.0, [2, 2, 2, 2] if good else [1, 0, 0, 0], 0.0)
        if good:
            judged.append(planner._batch_backoff[4].pause.left)
            break
        assert planner._batch_backoff[4].pause.left > 0  # each losing step pauses
    assert judged == [0]


@pytest.mark.parametrize("per_token", [0.001, 3.0])
def test_batched_planning_is_lossless_per_session(per_token):
    """Sessions advanced together with a goodput plan get exactly their plain greedy output."""
    model = tiny_model("qwen2", seed=3)
    target = HFCausalLM(model, "target")
    draft = HFCausalLM(perturbed_copy(model, 0.3), "draft")
    dec = SpeculativeDecoder(target, make_drafters("fusion", target=target, draft=draft), eos_token_ids=[],
                             planner=HardwarePlanner(curve=STEEP, batch_curve=batch_table(per_token)))
    prompts = [[5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], [60, 61, 62], [9, 8, 7, 9, 8]]
    sessions = [dec.start(p, SamplingParams(max_new_tokens=24, ignore_eos=True)) for p in prompts]
    while not all(s.finished for s in sessions):
        dec.step(sessions)
    for prompt, session in zip(prompts, sessions):
        assert session.generated == reference_greedy(model, prompt, 24)
    drafted = sum(s.stats.drafted_tokens for s in sessions)
    assert (drafted > 0) == (per_token < 0.01)


def test_a_request_idle_by_load_does_no_drafter_work():
    """Under a load where drafts never pay, a request idle in the batch neither proposes (but on
    probe steps) nor updates token recycling's matrix (its steps come with `idle`)."""
    import specula.drafters.token_recycling as recycling

    model = tiny_model("qwen2", seed=3)
    target = HFCausalLM(model, "target")
    drafters = make_drafters("token-recycling", target=target)
    proposes, writes = [], []
    real_propose, real_rows, real_one = drafters[0].propose, recycling.rows_to_write, recycling.draft_top_k_into
    drafters[0].propose = lambda ctx, state: proposes.append(1) or real_propose(ctx, state)
    planner = HardwarePlanner(curve=STEEP, batch_curve=batch_table(0.3))
    dec = SpeculativeDecoder(target, drafters, eos_token_ids=[], planner=planner)
    prompts = [[5, 17, 33, 2, 5, 17], [60, 61, 62]]
    sessions = [dec.start(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in prompts]
    try:
        recycling.rows_to_write = lambda step: writes.append(step.idle) or real_rows(step)
        # a step that verified no draft writes its root's row alone, past the same check of `idle`
        recycling.draft_top_k_into = lambda logits, row, out: writes.append(False) or real_one(logits, row, out)
        steps = 0
        while not all(s.finished for s in sessions):
            dec.step(sessions)
            steps += 1
    finally:
        recycling.rows_to_write, recycling.draft_top_k_into = real_rows, real_one
    assert steps == 40
    # two drafting steps each before the plan idles them, then a probe every 8th step
    assert len(proposes) <= 2 * (2 + 40 // 8 + 1)
    assert len(writes) == len(proposes) and not any(writes)  # bookkeeping only on drafting steps
    for prompt, session in zip(prompts, sessions):
        assert session.generated == reference_greedy(model, prompt, 40)


def test_under_load_the_batch_stops_drafting_when_its_drafting_steps_realise_less():
    """The packed-pass table says extra tokens are nearly free, but the passes this run times say
    each costs 0.3 of a pass and nothing is accepted: the batch's drafting steps realise fewer
    tokens per second than its plain ones, so the whole batch pauses drafting (1, 2, 4, ... steps)."""
    planner = HardwarePlanner(curve=STEEP, batch_curve=batch_table(0.001))
    states = [planner.new_state() for _ in range(4)]
    drafted_steps = 0
    for _ in range(60):
        drafting = [planner.should_draft(s, batch_size=4) for s in states]
        drafted_steps += any(drafting)
        proposals = [[Proposal(chain([5, 6, 7], 0.9, "draft-model"))] if d else [] for d in drafting]
        plans = planner.plan([PlanRequest(p, BUDGET, s, 0.01 if d else 0.0, d)
                              for p, s, d in zip(proposals, states, drafting)])
        total = sum(plan.nodes + 1 for plan in plans)
        seconds = 1.0 + 0.3 * (total - 4)  # what the passes really cost
        planner.observe_pass(plans, seconds, [1] * 4, 0.01 * sum(drafting))  # nothing accepted
    assert drafted_steps < 20


def test_best_children_are_each_parents_top_scored_child_per_source():
    from specula.planner.select import best_children

    # root -> a (0.6, head), b (0.3, head), c (0.9, prompt-lookup); a -> d (0.2), e (0.7)
    tree = TokenTree.build([1, 2, 3, 4, 5], [-1, -1, -1, 0, 0], [0.6, 0.3, 0.9, 0.2, 0.7],
                           ["head", "head", "prompt-lookup", "head", "head"])
    assert best_children(tree) == {(0, "head"), (2, "prompt-lookup"), (4, "head")}
    # a node two sources propose is judged among each source's children on that source's own score
    shared = tree.merge(TokenTree.build([2], [-1], [0.95], "prompt-lookup"))  # b, now also prompt lookup's top
    assert shared.proposers(1) == (("head", 0.3), ("prompt-lookup", 0.95))
    assert best_children(shared) == {(0, "head"), (1, "prompt-lookup"), (4, "head")}


def test_a_wide_tree_whose_best_children_are_accepted_keeps_chains_worth_drafting():
    """The chain lookahead prices a level more by the source's best children: seven rejected
    siblings per level must not make a source whose top child is always accepted look worthless."""
    planner = HardwarePlanner(curve=STEEP)
    driver = Driver(planner)
    tokens, parents, edges = [], [], []
    for level in range(3):  # top child of each level on the path, 7 siblings beside it
        par = -1 if level == 0 else 8 * (level - 1)
        for k in range(8):
            tokens.append(100 * level + k)
            parents.append(par)
            edges.append(0.6 if k == 0 else 0.05)
    tree = TokenTree.build(tokens, parents, edges, "eagle3")
    for _ in range(30):
        driver.plan(Proposal(tree))
        driver.observe(Proposal(tree), (0, 8, 16))
    assert planner.calibrator.mean("eagle3") < 0.25
    assert planner.expected_acceptance("eagle3") > 0.8


def test_a_node_two_sources_propose_is_estimated_by_the_better_and_credited_to_both():
    """Fusion's merged tree keeps one source label per node; the planner still estimates a shared
    node by its better proposer and credits every proposer with the outcome on its own score, so a
    head whose accepted tokens prompt lookup also found is not judged on its rejected nodes alone."""
    planner = HardwarePlanner(curve=STEEP)
    driver = Driver(planner)
    lookup = TokenTree.chain([5, 6, 7], [0.2] * 3, "prompt-lookup")
    head = TokenTree.build([5, 6, 7, 9, 8], [-1, 0, 1, -1, 0], [0.6, 0.6, 0.6, 0.3, 0.3], "eagle3")
    merged = lookup.merge(head)  # 5, 6, 7 keep prompt lookup's label; 9 and 8 are the head's alone
    assert merged.sources == ("prompt-lookup",) * 3 + ("eagle3",) * 2
    assert merged.proposers(0) == (("prompt-lookup", 0.2), ("eagle3", 0.6))
    est = planner._edge_acceptance(merged)
    assert est[0] == pytest.approx(planner.source_acceptance("eagle3", 0.6))
    assert est[0] > planner.source_acceptance("prompt-lookup", 0.2)
    for _ in range(40):  # the shared chain is always accepted, the head's own siblings never
        driver.plan(Proposal(merged))
        driver.observe(Proposal(merged), (0, 1, 2))
    # both sources learned from the shared chain: the head's best children (the chain) were accepted
    assert planner.calibrator.mean("prompt-lookup", best=True) > 0.9
    assert planner.calibrator.mean("eagle3", best=True) > 0.9
    assert planner.calibrator.mean("eagle3") < 0.7  # its rejected siblings count in the all-node mean
    assert planner.expected_acceptance("eagle3") > 0.9


def test_disagreeing_sources_are_estimated_by_their_context_not_their_average():
    """Source "a" is right 80% of the time alone, 40% when "b" proposes another next token (that
    "b" is never right). Calibration per source learns a's average (60%); the estimates the planner
    sizes trees by must be 80% alone and 40% contested (once, siblings from two sources summed to
    0.86-1.07 where 0.60-0.72 was realised, and fusion's trees were predicted 14-18% too high)."""
    from specula.planner.merge import merge_proposals

    planner = HardwarePlanner(curve=FLAT)
    driver = Driver(planner)
    alone = Proposal(chain([5], 0.6, "a"))
    contested = merge_proposals([alone, Proposal(chain([7], 0.6, "b"))])
    five = contested.tree.tokens.index(5)
    for i in range(200):
        proposal, right = (alone, i % 10 < 8) if i % 2 else (contested, i % 10 < 4)
        driver.plan(proposal)
        path = ((0 if proposal is alone else five),) if right else ()
        driver.observe(proposal, path)
    assert planner.calibrator.estimate("a", 0.6) == pytest.approx(0.6, abs=0.1)  # the average
    estimate = planner._edge_acceptance
    assert estimate(alone.tree)[0] == pytest.approx(0.8, abs=0.1)
    assert estimate(contested.tree)[five] == pytest.approx(0.4, abs=0.1)
    assert estimate(contested.tree)[1 - five] < 0.15


def test_a_node_whose_contesting_sibling_was_cut_is_learned_as_contested():
    """"b" proposes another next token than "a"; the plan verifies only a's node (b's is not worth
    a place). a's node was estimated as contested, and its outcome teaches the contested factor,
    not a's own: another drafter disagreed with it whether or not that sibling was verified."""
    from specula.planner import PlannerConfig
    from specula.planner.merge import merge_proposals
    from specula.planner.select import CONTESTED

    planner = HardwarePlanner(curve=STEEP, config=PlannerConfig(cost_explore=0.0))
    driver = Driver(planner)
    merged = merge_proposals([Proposal(chain([5], 0.9, "a")), Proposal(chain([7], 0.02, "b"))])
    for _ in range(5):
        planned, _ = driver.plan(merged)
        assert list(planned.tree.tokens) == [5] and driver.last.contexts == (CONTESTED,)
        driver.observe(planned, ())  # rejected
    assert planner._context[("a", CONTESTED)][1] > 0  # what it learned from: predicted nodes
    assert planner._recent.get("a", [0.0, 0.0])[1] == 0.0  # a's own factor: nothing
    assert planner.context_factor("a", CONTESTED) < 1.0 and planner.bias_of("a") == 1.0


def test_a_new_requests_unlucky_first_step_is_judged_without_its_catch_up():
    """A drafter whose nodes are accepted drafts for 0.1 of a step, after a catch-up of 3 steps on a
    request's first step (a draft model's prefill over the prompt). A second request's first step
    accepts nothing: had its plan's rate paid the catch-up, it would read below plain, and judged
    against that the one unlucky step paused drafting (seen on the 1.5B with its 0.5B draft). The
    plan is made, and the step judged, at the steady drafting time, so the request drafts on."""
    planner = HardwarePlanner(curve=STEEP)
    tree = chain([5, 6, 7], 0.9)
    first, resumed = Driver(planner), True
    for _ in range(10):  # the first request teaches the steady drafting time
        drafting = planner.should_draft(first.state)
        seconds = (3.0 if resumed else 0.1) if drafting else 1e-5
        resumed = not drafting
        planned, _ = first.plan(Proposal(tree) if drafting else Proposal.empty(), seconds, drafting)
        first.observe(planned, tuple(range(len(planned.tree))), seconds, STEEP.latency(len(planned.tree) + 1))
    second = Driver(planner)
    assert planner.should_draft(second.state)
    planned, _ = second.plan(Proposal(tree), 3.0)
    assert len(planned.tree) > 0 and second.last.rate > 1.0 / STEEP.latency(1)  # planned without the catch-up
    second.observe(planned, (), 3.0, STEEP.latency(len(planned.tree) + 1))  # nothing accepted
    assert planner.should_draft(second.state)


def test_a_step_after_the_prefill_or_a_pause_is_sized_without_its_catch_up():
    """A drafter of 32-token chains drafting for 0.1 of a step, after a catch-up of 3 steps on a request's
    first step: that step is sized as a steady step is, not by the tree whose rate best carries the
    catch-up (sized so, a step after a 700-token summary's prefill verified 16-64 nodes of 3-8 predicted
    tokens at 4-14 plain steps, and in one trace the back-off paused over half the answer). Until a
    steady step was seen there is nothing to size it at but what it spent."""
    tree = chain(list(range(5, 37)), 0.95)

    def sized(seconds: float, taught: bool) -> int:
        planner = HardwarePlanner(curve=STEEP)
        if taught:  # one request's steps after a drafting step teach the steady drafting time
            first = Driver(planner)
            for spent in (3.0, 0.1, 0.1, 0.1):
                planned, _ = first.plan(Proposal(tree), spent)
                first.observe(planned, tuple(range(len(planned.tree))), spent, STEEP.latency(len(planned.tree) + 1))
        driver = Driver(planner)
        assert driver.state.resumed and planner.should_draft(driver.state)
        planned, _ = driver.plan(Proposal(tree), seconds)
        return len(planned.tree)

    assert sized(3.0, taught=True) == sized(0.1, taught=True) > 0
    assert sized(3.0, taught=False) > sized(0.1, taught=False) > 0


def test_a_catch_up_after_the_prefill_or_a_pause_is_not_judged_as_drafting_cost():
    """A drafter whose every node is accepted, drafting for 0.1 of a step, except right after the
    prefill or a pause, when it first catches up over the tokens committed meanwhile (3 steps, a
    head's cache over a prompt). Judged at that cost, the first step paused drafting and every
    probe after a pause paused it again for twice as long; now it drafts all along."""
    planner = HardwarePlanner(curve=STEEP)
    driver = Driver(planner)
    tree = chain([5, 6, 7], 0.9)
    drafted, resumed = 0, True
    for _ in range(60):
        drafting = planner.should_draft(driver.state)
        seconds = (3.0 if resumed else 0.1) if drafting else 1e-5
        resumed = not drafting
        planned, _ = driver.plan(Proposal(tree) if drafting else Proposal.empty(), seconds, drafting)
        driver.observe(planned, tuple(range(len(planned.tree))), seconds, STEEP.latency(len(planned.tree) + 1))
        drafted += drafting
    assert drafted == 60


def test_a_paused_lone_request_gets_the_plan_the_sizing_path_gives_it():
    """A lone request that drafts nothing this step is planned without sizing (`_undrafted`): the same plan as
    `_plan_pass` makes for it and the same projection recorded, with a probe pending or not."""
    planner = HardwarePlanner(curve=STEEP)
    for probes in ((), ("prompt-lookup",)):
        fast, full = planner.new_state(), planner.new_state()
        for state in (fast, full):
            state.chain_probes.update(probes)
        request = PlanRequest([], BUDGET, fast, 2e-5, False, (("prompt-lookup", 1e-5),))
        [got] = planner.plan([request])
        [want] = planner._plan_pass([replace(request, state=full)])
        assert got == want and not got.drafted and got.predicted == 1.0 and len(got.proposal.tree) == 0
        assert got.drafter_seconds == (("prompt-lookup", 1e-5),)
        assert vars(fast.projected) == vars(full.projected) and fast.projected.steps == 1
