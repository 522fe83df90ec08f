"""The planner's hold-back: a costly drafter measured to add less than it costs beside the others
sits out steps of a request, probing again at growing gaps (`HardwarePlanner.adds_beside`)."""

import time

import pytest
import torch

from specula.drafters import make_drafter
from specula.engine import SpeculativeDecoder
from specula.models.hf import HFCausalLM
from specula.planner import CostCurve, HardwarePlanner, PlanRequest, StepTiming
from specula.sampling import SamplingParams
from specula.step import DraftBudget, Proposal, StepResult
from specula.tree import TokenTree
from tiny import reference_greedy, successor_model

STEEP = CostCurve((1, 2, 4, 8, 16, 32, 64, 128), (1.0, 1.17, 1.4, 2.0, 2.6, 4.0, 7.0, 13.0), 64)
BUDGET = DraftBudget(64, 32)


def run_step(planner: HardwarePlanner, state, drafts, accepted) -> frozenset[str]:
    """One engine step: the drafters the planner holds back sit out, the others propose (`drafts`:
    (name, tree, seconds) in drafting order), the planner sizes the merged tree and the target
    accepts the longest prefix of `accepted` the verified tree holds. Returns the held drafters."""
    assert planner.should_draft(state)
    held = planner.held(state)
    ran = [(name, tree, seconds) for name, tree, seconds in drafts if name not in held]
    spent = tuple((name, seconds) for name, _, seconds in ran)
    draft_seconds = sum(seconds for *_, seconds in ran)
    [plan] = planner.plan([PlanRequest([Proposal(tree) for _, tree, _ in ran], BUDGET, state, draft_seconds,
                                       True, spent)])
    tree = plan.proposal.tree
    path, parent = [], -1
    for token in accepted:
        child = next((i for i in range(len(tree)) if tree.parents[i] == parent and tree.tokens[i] == token), None)
        if child is None:
            break
        path.append(child)
        parent = child
    verify = STEEP.latency(len(tree) + 1)
    planner.observe_pass([plan], verify)
    planner.observe(plan, StepResult(3, plan.proposal, tuple(path), 9, torch.zeros(len(tree) + 1, 16)), state,
                    StepTiming(draft_seconds, verify))
    return held


def chain(tokens, source, edge=0.8) -> TokenTree:
    return TokenTree.chain(tokens, [edge] * len(tokens), source)


PROSE = [5, 6, 7]
"""What the target accepts on prose: the head's chain; the draft model's fourth token is rejected."""
CODE = [5, 6, 7, 8, 9, 10, 11, 12]
"""On code: the draft model's whole chain."""


def drafts(draft_seconds=0.15):
    return [("draft-model", chain(CODE, "draft-model", 0.9), draft_seconds), ("eagle3", chain(PROSE, "eagle3"), 0.05)]


def test_a_costly_drafter_that_adds_nothing_beside_a_head_sits_out_and_probes_at_growing_gaps():
    planner = HardwarePlanner(curve=STEEP)
    state = planner.new_state()
    drafted = [step for step in range(60) if "draft-model" not in run_step(planner, state, drafts(), PROSE)]
    gaps = [b - a for a, b in zip(drafted, drafted[1:])]
    assert drafted[:3] == [0, 1, 3]  # two steps measure it (the first one's time is not steady yet), then it sits out
    assert gaps == sorted(gaps) and max(gaps) == planner.config.max_hold + 1  # pauses of 1, 1, 2, 4, ..., 16
    assert len(drafted) <= 9
    assert planner.summary(state)["held_steps"] == {"draft-model": 60 - len(drafted)}
    assert not planner.adds_beside("draft-model", state) and "eagle3" not in state.holds  # the head drafts every step


def test_a_costly_drafter_whose_chain_runs_past_the_head_keeps_drafting():
    planner = HardwarePlanner(curve=STEEP)
    state = planner.new_state()
    assert not any(run_step(planner, state, drafts(), CODE) for _ in range(40))
    assert planner.adds_beside("draft-model", state)


def test_a_held_drafter_drafts_again_once_a_probe_finds_it_pays():
    """Prose, then code: after the first probe on code the draft model drafts every step again."""
    planner = HardwarePlanner(curve=STEEP)
    state = planner.new_state()
    for _ in range(40):
        run_step(planner, state, drafts(), PROSE)
    held = [("draft-model" in run_step(planner, state, drafts(), CODE)) for _ in range(40)]
    first = held.index(False)  # the probe
    assert first <= planner.config.max_hold and not any(held[first:])


def test_a_cheap_drafter_is_never_held_back_even_when_it_adds_nothing():
    planner = HardwarePlanner(curve=STEEP)
    state = planner.new_state()
    cheap = [("prompt-lookup", chain(PROSE, "prompt-lookup", 0.5), 0.001), ("eagle3", chain(PROSE, "eagle3"), 0.05)]
    held = [run_step(planner, state, cheap, PROSE) for _ in range(30)]
    assert not any("prompt-lookup" in h for h in held) and planner.adds_beside("prompt-lookup", state)
    assert sum("eagle3" in h for h in held) > 15  # the head, dearer and as redundant, sits out


def test_a_held_head_probed_beside_a_costlier_drafter_is_not_judged_by_older_evidence():
    """The head is held where prompt lookup already proposes its chain; then the draft model drafts
    on every step (code, its chain pays). Beside it the head's probes cannot be judged (two that
    propose alike would each look idle), so they do not lengthen its pause: it drafts again."""
    planner = HardwarePlanner(curve=STEEP)
    state = planner.new_state()
    lookup = ("prompt-lookup", chain(PROSE, "prompt-lookup", 0.5), 0.001)
    held = [run_step(planner, state, [lookup, ("eagle3", chain(PROSE, "eagle3"), 0.05)], PROSE) for _ in range(30)]
    assert sum("eagle3" in h for h in held) > 15 and not planner.adds_beside("eagle3", state)
    beside = [lookup, *drafts()]
    held = [run_step(planner, state, beside, CODE) for _ in range(40)]
    assert not any("draft-model" in h for h in held)
    first = next(k for k, h in enumerate(held) if "eagle3" not in h)  # its pause from before runs out
    assert first <= planner.config.max_hold and not any("eagle3" in h for h in held[first:])
    assert not planner.adds_beside("eagle3", state)  # no step judged it: the old evidence stands, unused


def test_a_catch_up_is_not_counted_as_the_drafters_cost():
    """The draft model's first step carries its prefill of the prompt (20 plain steps here), and the
    step after each pause a catch-up: neither is its cost; on code it drafts all along."""
    planner = HardwarePlanner(curve=STEEP)
    state = planner.new_state()
    assert not run_step(planner, state, drafts(draft_seconds=20.0), CODE)
    assert not any(run_step(planner, state, drafts(), CODE) for _ in range(20))


def test_a_new_request_probes_a_held_drafter_at_once():
    planner = HardwarePlanner(curve=STEEP)
    state = planner.new_state()
    for _ in range(30):
        run_step(planner, state, drafts(), PROSE)
    assert not run_step(planner, planner.new_state(), drafts(), CODE)  # another request: drafts on its first step


def test_requests_stepped_in_turn_are_each_held_back_on_their_own_text():
    """Two lone requests stepped in turn (a backend that does not pack, or sessions stepped by hand):
    on code the draft model pays, on prose it adds nothing beside the head. Evidence shared by the
    process held it on code and drafted it on prose (4 of 60 steps held on each); each request's
    own evidence decides for it, as for a request alone."""
    planner = HardwarePlanner(curve=STEEP)
    code, prose = planner.new_state(), planner.new_state()
    held_code, held_prose = [], []
    for _ in range(60):
        held_code.append("draft-model" in run_step(planner, code, drafts(), CODE))
        held_prose.append("draft-model" in run_step(planner, prose, drafts(), PROSE))
    assert not any(held_code)
    assert sum(held_prose) >= 50, sum(held_prose)  # as alone (test above: drafted on at most 9 of 60)


def test_a_new_request_starts_from_the_evidence_the_last_one_left():
    """Sequential requests weigh the draft model as one process did before requests had their own
    evidence (started empty, each request's first steps alone decided: the 1.5B's everyday bench
    held the draft model on 9-27% of fusion's steps, 0-4% before); requests stepped in turn still
    keep their own (test above)."""
    planner = HardwarePlanner(curve=STEEP)
    state = planner.new_state()
    for _ in range(20):
        run_step(planner, state, drafts(), CODE)
    last = list(state.evidence["draft-model"])
    state = planner.new_state()
    run_step(planner, state, drafts(), CODE)
    d = planner.config.hold_decay
    assert state.evidence["draft-model"][0] == pytest.approx(d * last[0] + 9)  # carried on, not 9 alone


class SlowTwin:
    """A drafter proposing exactly what prompt lookup does, after sleeping: it adds nothing beside
    prompt lookup and costs more than prompt lookup."""

    name = "slow-twin"

    def __init__(self, seconds: float) -> None:
        self.inner, self.seconds, self.calls = make_drafter("prompt-lookup"), seconds, 0

    def start(self):
        return self.inner.start()

    def propose(self, ctx, state):
        self.calls += 1
        time.sleep(self.seconds)
        tree = self.inner.propose(ctx, state).tree
        return Proposal(TokenTree.build(tree.tokens, tree.parents, tree.edge_scores, self.name))

    def observe(self, step, state):
        self.inner.observe(step, state)

    def finish(self, state):
        self.inner.finish(state)


def test_through_the_engine_a_slow_redundant_drafter_is_held_back_and_the_output_is_unchanged():
    model = successor_model()
    target = HFCausalLM(model, "target")
    curve = CostCurve(STEEP.sizes, tuple(0.001 * s for s in STEEP.seconds), 64)  # a 1 ms plain step
    planner = HardwarePlanner(curve=curve)
    twin = SlowTwin(0.0005)  # less than a pass (drafting still pays: no back-off), 2% of one or more
    dec = SpeculativeDecoder(target, [make_drafter("prompt-lookup"), twin], eos_token_ids=[], planner=planner)
    prompt = list(range(2, 90))  # the target counts on: 90 .. 95, 0, 1, then the prompt again, copied
    out = dec.generate(prompt, SamplingParams(max_new_tokens=200, ignore_eos=True))
    assert out.token_ids == reference_greedy(model, prompt, 200)
    held = out.stats.planner["held_steps"]["slow-twin"]
    assert held >= 5 and twin.calls + held <= out.stats.steps


def step_or_pause(planner: HardwarePlanner, state, drafts, accepted) -> bool:
    """`run_step`, or a plain step where the back-off pauses drafting. Returns whether a drafter ran."""
    if planner.should_draft(state):
        return len(run_step(planner, state, drafts, accepted)) < len(drafts)
    [plan] = planner.plan([PlanRequest([], BUDGET, state, 0.0, False)])
    planner.observe_pass([plan], STEEP.latency(1))
    planner.observe(plan, StepResult(3, plan.proposal, (), 9, torch.zeros(1, 16)), state,
                    StepTiming(0.0, STEEP.latency(1)))
    return False


def test_steps_on_which_every_drafter_is_held_are_not_judged_as_drafting_steps():
    """A lone draft model that never pays: the back-off and the hold-back both pause it. A step on
    which it is held drafts nothing and costs a plain step; judged as a drafting step it read as a
    win, halving the back-off's pause and resetting its average, so the draft model drafted every
    9-10 steps for as long as the request ran (25 of 200 steps; now 10, the back-off's 1, 2, 4, ... 64)."""
    planner = HardwarePlanner(curve=STEEP)
    state = planner.new_state()
    lone = [("draft-model", chain([5, 6, 7, 8], "draft-model", 0.9), 0.3)]
    ran = [step for step in range(200) if step_or_pause(planner, state, lone, [99])]
    gaps = [b - a for a, b in zip(ran, ran[1:])]
    assert len(ran) <= 10, ran
    assert max(gaps) > planner.config.max_hold + 1 and state.backoff.next == planner.config.max_backoff


def test_a_head_that_pays_drafts_on_while_the_draft_model_is_held():
    """Steps on which the draft model is held and the head's chain is verified are drafting steps of
    the head, judged by what they realise: the back-off never pauses it."""
    planner = HardwarePlanner(curve=STEEP)
    state = planner.new_state()
    assert all(step_or_pause(planner, state, drafts(), PROSE) for _ in range(60))
    assert state.paused_steps == 0 and state.held_steps["draft-model"] >= 50
