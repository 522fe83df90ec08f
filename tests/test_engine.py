import pytest
import torch

from tiny import output_text, perturbed_copy, reference_greedy, successor_model, tiny_model
from specula.drafters import make_drafter
from specula.drafters.draft_model import DraftModelConfig, DraftModelDrafter
from specula.engine import SpeculativeDecoder
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.sampling import SamplingParams

PROMPTS = [
    [5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17],
    [60, 61, 62, 63, 64, 60, 61],
    [9],
]

COPIED = list(range(10, 40)) + [20]
"""A prompt whose continuation under `successor_model` (21, 22, ...) prompt lookup copies: steps
accept several tokens, where a random model's output is never copied (one token a step)."""


def decoder(model, method: str, draft_model=None, k: int = 5) -> SpeculativeDecoder:
    draft = HFCausalLM(draft_model, "draft") if draft_model is not None else None
    options = {"num_draft_tokens": k, "greedy_proposals": False} if method == "draft-model" else {}  # draws from q
    drafter = make_drafter(method, draft=draft, **options)
    return SpeculativeDecoder(HFCausalLM(model, "target"), drafter, eos_token_ids=[])


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("method", ["none", "prompt-lookup", "draft-model"])
def test_greedy_output_equals_plain_greedy(arch, method):
    model = tiny_model(arch, seed=3)
    draft = perturbed_copy(model, 0.3) if method == "draft-model" else None
    dec = decoder(model, method, draft)
    accepted = 0
    for prompt in PROMPTS:
        out = dec.generate(prompt, greedy(40))
        assert out.token_ids == reference_greedy(model, prompt, 40), (arch, method, prompt)
        assert out.stats.new_tokens == 40
        accepted += out.stats.accepted_tokens
    if method != "none":  # drafts were verified and accepted: a drafter proposing nothing passed the above
        assert accepted > 0, (arch, method)


def test_unrelated_draft_model_is_still_lossless():
    model = tiny_model("qwen2", seed=3)
    other = tiny_model("qwen2", seed=11)  # random draft: almost everything rejected
    dec = decoder(model, "draft-model", other, k=4)
    out = dec.generate(PROMPTS[0], greedy(30))
    assert out.token_ids == reference_greedy(model, PROMPTS[0], 30)
    assert out.stats.acceptance_rate < 0.5


def test_draft_equal_to_target_accepts_every_draft_token():
    model = tiny_model("llama", seed=4)
    dec = decoder(model, "draft-model", model, k=4)
    out = dec.generate(PROMPTS[1], greedy(41))
    assert out.token_ids == reference_greedy(model, PROMPTS[1], 41)
    assert out.stats.drafted_tokens > 0
    assert out.stats.accepted_tokens == out.stats.drafted_tokens
    # 41 tokens at 5 per step (4 drafts + bonus): 8 full steps and one of 1.
    assert out.stats.steps == 9
    assert out.stats.mean_accepted_tokens == pytest.approx(41 / 9 + (5 * 8 + 1 - 41) / 9)


@pytest.mark.parametrize("max_new", [1, 2, 3, 6, 7, 11])
def test_max_new_tokens_is_never_overshot_mid_draft(max_new):
    model = tiny_model("qwen2", seed=5)
    dec = decoder(model, "draft-model", model, k=5)
    out = dec.generate(PROMPTS[0], greedy(max_new))
    assert out.token_ids == reference_greedy(model, PROMPTS[0], max_new)
    assert out.stats.finish_reason == "length"


def copying(method: str) -> tuple[list[int], SpeculativeDecoder]:
    """Plain greedy's 30 tokens after COPIED (21, 22, ...: each once) and a decoder of `method` whose
    first step on COPIED accepts several of them: prompt lookup copies 10, a draft equal to the target 5."""
    model = successor_model()
    return reference_greedy(model, COPIED, 30), decoder(model, method, model if method == "draft-model" else None)


def first_step(dec: SpeculativeDecoder) -> list[int]:
    """The tokens the first step on COPIED emits when nothing stops it."""
    return list(dec.stream(COPIED, greedy(30)))[0].token_ids


@pytest.mark.parametrize("method", ["prompt-lookup", "draft-model"])
def test_eos_inside_a_draft_stops_exactly_where_plain_greedy_stops(method):
    plain, dec = copying(method)
    eos = plain[3]
    step = first_step(dec)
    assert step[:4] == plain[:4] and len(step) >= 6  # EOS lies inside a step that accepts tokens after it
    dec.eos_token_ids = frozenset([eos])
    out = dec.generate(COPIED, SamplingParams(max_new_tokens=30))
    assert out.token_ids == plain[:4]  # cut right after EOS, not at the step's end
    assert out.stats.finish_reason == "stop"
    assert out.stats.steps == 1 and out.stats.accepted_tokens == 3  # the stats count what was emitted


@pytest.mark.parametrize("method", ["prompt-lookup", "draft-model"])
def test_a_requests_stop_token_ids_end_it_there_even_past_eos(method):
    """vLLM's `stop_token_ids`: the first one emitted ends the output (kept in it), mid-draft too,
    and it stops a request that ignores EOS."""
    plain, dec = copying(method)
    stop = plain[3]
    step = first_step(dec)
    assert step[:4] == plain[:4] and len(step) >= 6  # the stop id lies inside a step that accepts tokens after it
    dec.eos_token_ids = frozenset([plain[1]])  # ignored, as the request asks
    out = dec.generate(COPIED, SamplingParams(max_new_tokens=30, ignore_eos=True, stop_token_ids=(stop,)))
    assert out.token_ids == plain[:4]
    assert out.stats.finish_reason == "stop"
    assert out.stats.steps == 1 and out.stats.accepted_tokens == 3
    with pytest.raises(ConfigError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(-1,))


def test_plain_decoding_has_mean_accepted_one():
    model = tiny_model("llama", seed=2)
    out = decoder(model, "none").generate(PROMPTS[1], greedy(12))
    assert out.stats.steps == 12
    assert out.stats.mean_accepted_tokens == 1.0
    assert out.stats.drafted_tokens == 0


def test_prompt_lookup_accepts_copied_text():
    model = successor_model()
    prompt = list(range(10, 40)) + [20]  # the successor's output 21, 22, ... is in the prompt
    out = decoder(model, "prompt-lookup").generate(prompt, greedy(19))
    assert out.token_ids == list(range(21, 40))
    assert out.token_ids == reference_greedy(model, prompt, 19)
    # 10 copied tokens + bonus per step: two steps.
    assert out.stats.steps == 2 and out.stats.mean_accepted_tokens > 9
    assert out.stats.proposed_tokens >= out.stats.drafted_tokens > 0


def test_draft_cost_is_reported_as_a_fraction_of_a_plain_step():
    from specula.stats import GenerationStats

    stats = GenerationStats(steps=10, proposed_tokens=40, draft_seconds=0.02,
                            planner={"plain_step_seconds": 0.01})
    assert stats.draft_cost() == {"per_step": 0.2, "per_token": 0.05}
    assert stats.draft_cost(0.02) == {"per_step": 0.1, "per_token": 0.025}
    assert GenerationStats(steps=3).draft_cost() == {"per_step": None, "per_token": None}  # no planner, no step
    assert stats.to_dict()["draft_cost_of_plain_step"]["per_token"] == 0.05


def test_tokens_per_drafting_step_leave_out_plain_steps():
    from specula.stats import GenerationStats

    stats = GenerationStats()
    for depths, path in (((), ()), ((1, 2), (0, 1)), ((), ()), ((1,), ())):  # plain, 3 tokens, plain, 1 token
        stats.record_step(depths, [("x",)] * len(depths), path)
    assert stats.steps == 4 and stats.drafting_steps == 2 and stats.mean_accepted_tokens == 1.5
    assert stats.mean_accepted_per_drafting_step == 2.0  # (6 tokens - 2 plain) over 2 drafting steps
    assert "(2.00 per drafting step)" in stats.summary()
    assert stats.to_dict()["mean_accepted_per_drafting_step"] == 2.0
    assert GenerationStats().mean_accepted_per_drafting_step is None


def test_sampling_is_reproducible_with_a_seed_and_varies_without():
    model = tiny_model("qwen2", seed=7)
    draft = perturbed_copy(model, 0.3)
    dec = decoder(model, "draft-model", draft)
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=123, ignore_eos=True)
    a = dec.generate(PROMPTS[0], params).token_ids
    b = dec.generate(PROMPTS[0], params).token_ids
    assert a == b
    others = {tuple(dec.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=20, seed=s,
                                                            ignore_eos=True)).token_ids) for s in range(5)}
    assert len(others) > 1


def test_sampled_first_token_follows_the_target_distribution():
    """End to end through the loop: the law of the first two emitted tokens equals the
    target's (temperature 1.5 on a 8-token vocabulary), for a sampled draft-model chain."""
    torch.manual_seed(0)
    model = tiny_model("llama", seed=8, vocab=8)
    draft = tiny_model("llama", seed=9, vocab=8)
    dec = decoder(model, "draft-model", draft, k=2)
    prompt = [3, 5, 1]
    temp = 1.5
    with torch.inference_mode():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temp, -1)
        joint = torch.stack([
            p1[a] * torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1] / temp, -1) for a in range(8)
        ]).flatten()  # [64]
    trials = 3000
    counts = torch.zeros(64)
    for s in range(trials):
        ids = dec.generate(prompt, SamplingParams(temperature=temp, max_new_tokens=2, seed=s,
                                                  ignore_eos=True)).token_ids
        counts[ids[0] * 8 + ids[1]] += 1
    tv = 0.5 * (counts / trials - joint).abs().sum().item()
    wrong = torch.roll(joint, 1)
    tv_wrong = 0.5 * (counts / trials - wrong).abs().sum().item()
    # E[TV] for 64 cells at 3000 trials is ~ 0.06; the shifted reference is far off.
    assert tv < 0.09, tv
    assert tv_wrong > 3 * tv


def test_stop_strings_cut_the_output(tiny_tokenizer):
    model = successor_model()
    plain = reference_greedy(model, COPIED, 30)
    stop_text = tiny_tokenizer.decode([plain[5]])  # inside the first step's accepted copy
    first = next(i for i, t in enumerate(plain) if stop_text in tiny_tokenizer.decode([t]))
    dec = SpeculativeDecoder(HFCausalLM(model), make_drafter("prompt-lookup"), tiny_tokenizer, eos_token_ids=[])
    out = dec.generate(COPIED, SamplingParams(max_new_tokens=30, stop=(stop_text,)))
    assert out.token_ids == plain[: first + 1]
    assert out.stats.finish_reason == "stop"
    assert out.stats.accepted_tokens > 0  # the stop string ended a step that accepted several tokens
    # OpenAI's rule: the stop string and what follows it are not returned.
    full = output_text(tiny_tokenizer, COPIED, plain[: first + 1])  # the text after the prompt's
    assert out.text == full[: full.index(stop_text)]
    streamed = "".join(c.text for c in dec.stream(COPIED, SamplingParams(max_new_tokens=30, stop=(stop_text,))))
    assert streamed == out.text


def test_stream_yields_the_same_tokens_and_text_as_generate(tiny_tokenizer):
    model = successor_model()
    dec = SpeculativeDecoder(HFCausalLM(model), make_drafter("prompt-lookup"), tiny_tokenizer, eos_token_ids=[])
    params = greedy(25)
    whole = dec.generate(COPIED, params)
    chunks = list(dec.stream(COPIED, params))
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text
    assert chunks[-1].finished and chunks[-1].stats.new_tokens == 25
    assert chunks[-1].stats.accepted_tokens > 0  # chunks of several tokens, not only one a step


def test_bad_input_gives_clear_errors():
    model = tiny_model("llama")
    dec = decoder(model, "none")
    with pytest.raises(ConfigError, match="empty"):
        dec.generate([], greedy(5))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ConfigError, match="context window"):
        dec.generate(list(range(50)) * 6, greedy(5))
    with pytest.raises(ConfigError, match="unknown method"):
        make_drafter("lookahead")
    with pytest.raises(ConfigError, match="needs a draft model: pass draft=MODEL"):
        make_drafter("draft-model")


def test_generation_stops_at_the_context_window():
    model = tiny_model("llama")
    dec = decoder(model, "draft-model", model)
    out = dec.generate(list(range(1, 90)) * 2 + [5] * 60, greedy(100))  # 238 prompt tokens, window 256
    assert out.stats.finish_reason == "length"
    assert len(out.token_ids) <= 256 - 238
    assert out.token_ids == reference_greedy(model, list(range(1, 90)) * 2 + [5] * 60, len(out.token_ids))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_two_sessions_interleaved_step_by_step_give_what_each_gives_alone(temperature):
    """Per-request state lives in the session: stepping A, then B, then A ... on one target (and
    one draft model, one recycling matrix) gives each exactly its output alone."""
    from specula.api import build_decoder

    model = tiny_model("qwen2", seed=3)
    target, draft = HFCausalLM(model, "target"), HFCausalLM(perturbed_copy(model, 0.3), "draft")
    params = [SamplingParams(temperature=temperature, seed=s, max_new_tokens=30, ignore_eos=True) for s in (1, 2)]
    prompts = PROMPTS[:2]
    for method in ("draft-model", "draft-tree", "fusion", "token-recycling"):
        options = {"greedy_proposals": False} if method == "draft-model" else {}  # seeded, still drawn from q
        dec = build_decoder(method, target, None, draft, planner=False, **options)  # the same trees whatever the timing
        alone = [dec.generate(p, sp).token_ids for p, sp in zip(prompts, params)]
        sessions = [dec.start(p, sp) for p, sp in zip(prompts, params)]
        while not all(s.finished for s in sessions):
            for s in sessions:
                dec.step([s])
        assert [s.generated for s in sessions] == alone, method
        assert sum(s.stats.drafted_tokens for s in sessions) > 0, method
        for s in sessions:
            dec.finish(s)
            assert s.seq.tokens == [] and s.drafter_states == []
        if temperature == 0.0:
            assert alone == [reference_greedy(model, p, 30) for p in prompts]


def test_stopping_a_stream_early_frees_the_session():
    model = tiny_model("llama", seed=2)
    dec = decoder(model, "draft-model", model)
    opened = []
    real = dec.target.new_sequence
    dec.target.new_sequence = lambda: opened.append(real()) or opened[-1]
    stream = dec.stream(PROMPTS[0], greedy(40))
    next(stream)
    assert len(opened[0].tokens) > 0
    stream.close()
    assert opened[0].tokens == []


class FailingDrafter:
    """A drafter that raises when it proposes for the request whose prompt starts with `poison`."""

    name = "failing"

    def __init__(self, poison: int) -> None:
        self.poison = poison

    def start(self):
        return {}

    def propose(self, ctx, state):
        if ctx.tokens[0] == self.poison and len(ctx.tokens) > ctx.prompt_len + 2:
            raise RuntimeError("drafter broke")
        from specula.step import Proposal

        return Proposal.empty()

    def observe(self, step, state):
        return None

    def finish(self, state):
        return None


def step_pair(dec):
    """Steps PROMPTS[0] (a) and PROMPTS[1] (b) together until b ends: a, b, and every error a chunk
    carried as (from a?, message)."""
    a, b = dec.start(PROMPTS[0], greedy(20)), dec.start(PROMPTS[1], greedy(20))
    errors = []
    while not b.finished:
        for session, chunk in zip((a, b), dec.step([a, b])):
            if chunk.error is not None:
                errors.append((session is a, str(chunk.error)))
    return a, b, errors


def test_one_sessions_drafter_raising_fails_that_session_only():
    """Inside step([a, b]) a's drafter raises: a ends with finish_reason "error" and the exception,
    b goes on and still gets exactly its solo output."""
    from specula.drafters import make_drafters

    model = tiny_model("qwen2", seed=3)
    target = HFCausalLM(model, "target")
    drafters = [*make_drafters("prompt-lookup", target=target), FailingDrafter(poison=PROMPTS[0][0])]
    dec = SpeculativeDecoder(target, drafters, eos_token_ids=[])
    solo = dec.generate(PROMPTS[1], greedy(20)).token_ids
    a, b, errors = step_pair(dec)
    assert errors == [(True, "drafter broke")]
    assert a.finish_reason == "error" and b.finish_reason == "length"
    assert b.generated == solo == reference_greedy(model, PROMPTS[1], 20)


class SharedPass:
    """A lockstep pass (`drafters.lockstep.Pass`) that every session's expansion shares; `calls` counts
    the sessions of each call."""

    key = "shared"

    def __init__(self, calls: list[int]) -> None:
        self.calls = calls

    def run(self):
        return self.run_many([self])[0]

    def run_many(self, passes):
        self.calls.append(len(passes))
        return [None] * len(passes)


class FailingInLockstep(FailingDrafter):
    """`FailingDrafter` drafting in lockstep: each session's expansion yields a shared pass, and the
    poisoned request's raises once it has its result."""

    def __init__(self, poison: int) -> None:
        super().__init__(poison)
        self.calls: list[int] = []

    def propose_steps(self, ctx, state, clock):
        yield SharedPass(self.calls)
        return self.propose(ctx, state)


def test_one_sessions_drafter_raising_in_lockstep_fails_that_session_only():
    """As above with a drafter that drafts the batch in lockstep (`drafters.lockstep`): a's expansion
    raises after the pass it shared with b's; a ends in error, b gets exactly its solo output."""
    from specula.drafters import make_drafters

    model = tiny_model("qwen2", seed=3)
    target = HFCausalLM(model, "target")
    failing = FailingInLockstep(poison=PROMPTS[0][0])
    dec = SpeculativeDecoder(target, [*make_drafters("prompt-lookup", target=target), failing], eos_token_ids=[])
    solo = dec.generate(PROMPTS[1], greedy(20)).token_ids
    a, b, errors = step_pair(dec)
    assert errors == [(True, "drafter broke")]
    assert 2 in failing.calls  # the two sessions' passes ran as one call before a's broke
    assert a.finish_reason == "error" and b.finish_reason == "length"
    assert b.generated == solo == reference_greedy(model, PROMPTS[1], 20)


class PoisonChain(FailingDrafter):
    """Proposes a one-token chain under the name "poison" for the request whose prompt starts with
    `poison`, nothing for the others (it raises nothing itself)."""

    name = "poison"

    def propose(self, ctx, state):
        from specula.step import Proposal
        from specula.tree import TokenTree

        if ctx.tokens[0] != self.poison or ctx.budget.max_nodes < 1 or ctx.budget.max_depth < 1:
            return Proposal.empty()
        return Proposal(TokenTree.build([1], [-1], sources=self.name))


def fragile_planner(alone: bool, hardware: bool = False):
    """A planner that raises on any batch holding a "poison" node (`alone`), or only on a batch of
    several requests that holds one (a failure of the combination: each request plans alone); the
    hardware planner (per-request state the trial plans must not touch) or the pass-through one."""
    from specula.planner import CostCurve, HardwarePlanner, PassThroughPlanner

    base = HardwarePlanner if hardware else PassThroughPlanner

    class FragilePlanner(base):
        def plan(self, requests):
            poisoned = any("poison" in p.tree.sources for r in requests for p in r.proposals)
            if poisoned and (alone or len(requests) > 1):
                raise RuntimeError("planner broke")
            return super().plan(requests)

    if not hardware:
        return FragilePlanner()
    return FragilePlanner(curve=CostCurve((1, 2, 4, 8, 16), (1.0, 1.1, 1.3, 1.8, 2.6), 16))


@pytest.mark.parametrize("hardware", [False, True])
def test_a_batch_whose_plan_fails_on_one_request_fails_that_session_only(hardware):
    """The batch's plan raises, and a's request raises alone too: a ends in "error" with the
    planner's exception, b goes on and gets exactly its solo output (before: every session of the
    step failed, e.g. each request of the server's batch answered 500)."""
    model = tiny_model("qwen2", seed=3)
    target = HFCausalLM(model, "target")
    dec = SpeculativeDecoder(target, [PoisonChain(PROMPTS[0][0])], eos_token_ids=[],
                             planner=fragile_planner(True, hardware))
    a, b, errors = step_pair(dec)
    assert errors == [(True, "planner broke")]
    assert a.finish_reason == "error" and b.finish_reason == "length"
    assert b.generated == reference_greedy(model, PROMPTS[1], 20)
    alone = dec.start(PROMPTS[0], greedy(5))
    with pytest.raises(RuntimeError, match="planner broke"):  # one request: the step raises, as before
        dec.step([alone])
    assert alone.finish_reason == "error"


def test_a_batch_whose_plan_fails_only_together_fails_every_session():
    """Each request plans alone, the batch does not: no request is to blame, the step raises and
    every session ends in "error" (none is stepped on a plan that was never made)."""
    model = tiny_model("qwen2", seed=3)
    dec = SpeculativeDecoder(HFCausalLM(model, "target"), [PoisonChain(PROMPTS[0][0])], eos_token_ids=[],
                             planner=fragile_planner(False))
    a, b = dec.start(PROMPTS[0], greedy(20)), dec.start(PROMPTS[1], greedy(20))
    with pytest.raises(RuntimeError, match="planner broke"):
        dec.step([a, b])
    assert a.finish_reason == b.finish_reason == "error"


def test_pass_through_planner_gives_the_output_of_the_full_planner():
    """Greedy: the pass-through planner (merge + budget) and the hardware planner verify different
    trees, and both give exactly plain greedy decoding."""
    from specula.api import build_decoder
    from specula.planner import CostCurve, HardwarePlanner, PassThroughPlanner

    model = tiny_model("qwen2", seed=3)
    target, draft = HFCausalLM(model, "target"), HFCausalLM(perturbed_copy(model, 0.3), "draft")
    curve = CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.17, 1.4, 2.0, 2.6, 4.0, 7.0), 64)
    passthrough = build_decoder("fusion", target, None, draft, planner=False)
    planned = build_decoder("fusion", target, None, draft, planner=HardwarePlanner(curve=curve))
    assert isinstance(passthrough.planner, PassThroughPlanner)
    for prompt in PROMPTS:
        outs = [dec.generate(prompt, greedy(30)) for dec in (passthrough, planned)]
        assert outs[0].token_ids == outs[1].token_ids == reference_greedy(model, prompt, 30)
        assert outs[0].stats.planner is None and outs[1].stats.planner["steps"] > 0


def test_stop_strings_without_a_tokenizer_are_refused_not_ignored():
    dec = decoder(tiny_model("llama", seed=2), "none")  # built without a tokenizer
    with pytest.raises(ConfigError, match="stop strings need the target's tokenizer"):
        dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=4, stop=("w1",)))
    assert len(dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=4, stop_token_ids=(3,))).token_ids) <= 4


class OracleDrafter:
    """Proposes the target's own greedy next 3 tokens as a chain (always accepted), under `name`."""

    def __init__(self, model, name: str) -> None:
        self.model, self.name = model, name

    def start(self):
        return {}

    def propose(self, ctx, state):
        from specula.step import Proposal
        from specula.tree import TokenTree

        k = min(3, ctx.budget.max_depth, ctx.budget.max_nodes)
        if k <= 0:
            return Proposal.empty()
        chain = reference_greedy(self.model, list(ctx.tokens), k)
        return Proposal(TokenTree.build(chain, list(range(-1, k - 1)), sources=self.name))

    def observe(self, step, state):
        return None

    def finish(self, state):
        return None


def test_a_node_two_drafters_proposed_counts_for_both_in_the_stats():
    """Two drafters propose the same chain: each is credited with every node, whichever is listed
    first (the merged tree keeps both in `proposers`), so the per-drafter figures do not depend on
    the members' order."""
    model = tiny_model("qwen2", seed=3)
    target = HFCausalLM(model, "target")
    by_order = []
    for names in (("A", "B"), ("B", "A")):
        dec = SpeculativeDecoder(target, [OracleDrafter(model, n) for n in names], eos_token_ids=[])
        stats = dec.generate(PROMPTS[0], greedy(20)).stats
        by_order.append(stats.to_dict()["acceptance_by_source"])
        assert stats.source_drafted["A"] == stats.source_drafted["B"] == stats.drafted_tokens > 0
        assert stats.source_accepted["A"] == stats.source_accepted["B"] == stats.accepted_tokens > 0
    assert by_order[0] == by_order[1]


class InterruptingDrafter(OracleDrafter):
    """An oracle drafter whose `observe` raises KeyboardInterrupt once, on its `at`-th call (after the
    step's cache commit, before the session's tokens are recorded: a Ctrl-C mid-step)."""

    def __init__(self, model, at: int) -> None:
        super().__init__(model, "oracle")
        self.calls, self.at = 0, at

    def observe(self, step, state):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt


def test_an_interrupted_step_ends_its_sessions_instead_of_leaving_them_half_stepped():
    """A KeyboardInterrupt inside step(): its sessions were left with the cache committed and the
    tokens not (or a tree pending), and stepping on gave output other than plain greedy's (or failed
    on every later step). Each running session now ends in "error", freed; later steps give empty
    finished chunks."""
    model = tiny_model("qwen2", seed=3)
    dec = SpeculativeDecoder(HFCausalLM(model, "target"), [InterruptingDrafter(model, at=3)], eos_token_ids=[])
    a, b = dec.start(PROMPTS[0], greedy(20)), dec.start(PROMPTS[1], greedy(20))
    with pytest.raises(KeyboardInterrupt):
        for _ in range(5):
            dec.step([a, b])
    assert a.finish_reason == b.finish_reason == a.stats.finish_reason == "error"
    assert all(chunk.finished and not chunk.token_ids for chunk in dec.step([a, b]))
    assert dec.generate(PROMPTS[0], greedy(20)).token_ids == reference_greedy(model, PROMPTS[0], 20)  # the decoder goes on


def test_a_session_listed_twice_or_of_another_decoder_is_refused_before_anything_runs():
    model = tiny_model("qwen2", seed=3)
    target = HFCausalLM(model, "target")
    dec, other = (SpeculativeDecoder(target, [OracleDrafter(model, "o")], eos_token_ids=[]) for _ in range(2))
    a, b = dec.start(PROMPTS[0], greedy(12)), dec.start(PROMPTS[1], greedy(12))
    with pytest.raises(ConfigError, match="passed twice to one step"):
        dec.step([a, b, a])
    with pytest.raises(ConfigError, match="started by another decoder"):
        other.step([a])
    while not b.finished:  # nothing ran: both still step to their solo output
        dec.step([a, b])
    assert b.generated == reference_greedy(model, PROMPTS[1], 12) and a.generated == reference_greedy(model, PROMPTS[0], 12)
    c = dec.start(PROMPTS[0], greedy(12))
    dec.finish(c)
    assert c.finish_reason == c.stats.finish_reason == "cancelled"


def test_a_failing_job_of_a_batch_is_named_and_a_bad_batch_size_refused():
    model = tiny_model("qwen2", seed=3)
    target = HFCausalLM(model, "target")
    dec = SpeculativeDecoder(target, [FailingDrafter(poison=PROMPTS[1][0])], eos_token_ids=[])
    jobs = [(i, p, greedy(8)) for i, p in enumerate(PROMPTS[:2])]
    with pytest.raises(RuntimeError, match="drafter broke") as err:
        list(dec.generate_many(jobs, 2))
    assert "(while generating job 1)" in getattr(err.value, "__notes__", [])
    for bad in ("4", 2.5, True, 0):
        with pytest.raises(ConfigError, match="max_batch_size must be an integer >= 1"):
            list(dec.generate_many(jobs, bad))


def test_a_drafter_whose_clean_up_raises_leaves_the_others_and_the_cache_freed():
    """finish() stopped at the first drafter that raised: the later drafters' clean-up and the
    target's KV cache release were skipped (the cache held the session's tokens)."""
    model = tiny_model("llama", seed=2)
    target = HFCausalLM(model, "target")

    class CleanUp:
        def __init__(self, inner, fails):
            self.inner, self.fails, self.name, self.finished = inner, fails, inner.name, 0

        def start(self):
            return self.inner.start()

        def propose(self, ctx, state=None):
            return self.inner.propose(ctx, state)

        def observe(self, step, state=None):
            self.inner.observe(step, state)

        def finish(self, state=None):
            self.finished += 1
            if self.fails:
                raise RuntimeError("could not save the state")
            self.inner.finish(state)

    first = CleanUp(make_drafter("prompt-lookup", target=target), fails=True)
    second = CleanUp(make_drafter("token-recycling", target=target), fails=False)
    dec = SpeculativeDecoder(target, [first, second], eos_token_ids=[])
    session = dec.start([5, 6, 7, 5, 6], SamplingParams(max_new_tokens=4))
    dec.step([session])
    with pytest.raises(RuntimeError, match="could not save"):
        dec.finish(session)
    assert second.finished == 1 and session.seq.tokens == [] and session.finish_reason == "cancelled"
