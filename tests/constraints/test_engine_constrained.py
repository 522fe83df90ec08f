"""End to end: constrained greedy output equals constrained plain greedy decoding token for token
for every method, the sampled law under a mask is the masked target law (and a rule that ignores
the mask fails the check), forced tokens are drafted and accepted."""

from __future__ import annotations

import json

import pytest
import torch

from grammar_kit import VOCAB, constraint_kinds
from laws import tv, tv_bound
from tiny import perturbed_copy, tiny_model
from specula.api import build_decoder
from specula.constraints import Constraint, grammar_tokenizer
from specula.models.hf import HFCausalLM
from specula.planner import CostCurve, HardwarePlanner
from specula.sampling import SamplingParams

FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1e-3,) * 7, 64)  # verifying is free: the planner keeps what may pay
EOS = 1


@pytest.fixture(scope="module")
def models():
    model = tiny_model("llama", seed=3, vocab=VOCAB)
    return model, perturbed_copy(model, 0.3)


def reference(model, tokenizer, constraint: Constraint, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Constrained plain greedy decoding by full recomputation and a fresh llguidance matcher."""
    from llguidance import LLMatcher

    from specula.constraints.matcher import unpack_bitmask

    matcher = LLMatcher(grammar_tokenizer(tokenizer, VOCAB, [EOS]), constraint.grammar_text())
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            allowed = unpack_bitmask(matcher.compute_bitmask(), VOCAB)
            tok = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            out.append(tok)
            ids.append(tok)
            if tok == EOS:
                break
            assert matcher.consume_token(tok)
    return out


def decoder(models, tokenizer, method: str, planner="none"):
    model, draft = models
    uses_draft = method in ("draft-model", "draft-tree", "fusion")
    options = {"num_draft_tokens": 4} if method in ("draft-model", "fusion") else {}
    if method == "draft-model":
        options["greedy_proposals"] = False  # seeded trials still draw the chain from q
    return build_decoder(method, HFCausalLM(model, "target"), tokenizer,
                         HFCausalLM(draft, "draft") if uses_draft else None, planner=planner, **options)


PROMPTS = ('{"name": "abc", "age": 12, "tags": ["x"]} {"name": "ab', "list people:")
CONSTRAINTS = constraint_kinds()


@pytest.mark.parametrize("method", ["none", "prompt-lookup", "token-recycling", "draft-model", "draft-tree", "fusion"])
def test_constrained_greedy_equals_constrained_plain_greedy(models, json_tokenizer, method):
    for kind, constraint in CONSTRAINTS.items():
        for planner in ("none", HardwarePlanner(curve=FLAT)):
            dec = decoder(models, json_tokenizer, method, planner)
            for text in PROMPTS:
                prompt = json_tokenizer.encode(text, add_special_tokens=False)
                out = dec.generate(prompt, SamplingParams(max_new_tokens=40), constraint)
                assert out.token_ids == reference(models[0], json_tokenizer, constraint, prompt, 40), (method, kind)
                if kind == "schema" and out.stats.finish_reason == "stop":
                    value = json.loads(out.text)
                    assert set(value) == {"name", "age", "tags"} and value["name"] in ("ab", "cd", "abc")


@pytest.mark.parametrize("method", ["none", "prompt-lookup", "fusion"])
def test_constrained_greedy_through_the_output_screen(models, json_tokenizer, monkeypatch, method):
    """A native target whose greedy steps take each row's masked argmax through the output screen
    (`models.native.screen`; the tiny model's layer screened on purpose) outputs what constrained plain
    greedy decoding outputs, and its steps did go through the screen with masks (and only with them)."""
    from specula.models.native import NativeCausalLM, NativeDecoder, configure, kernels
    from specula.models.native import screen

    if not kernels.available():
        pytest.skip(f"specula's CPU kernels cannot run here: {kernels.unavailable_reason()}")
    monkeypatch.setattr(screen, "SCREEN_MIN_WEIGHTS", 0)
    masked, unmasked = [], []
    real, real_decide = screen.OutputScreen.masked_argmax, screen.OutputScreen.decide
    monkeypatch.setattr(screen.OutputScreen, "masked_argmax",
                        lambda self, *a: (masked.append(1), real(self, *a))[1])
    monkeypatch.setattr(screen.OutputScreen, "decide", lambda self, *a: (unmasked.append(1), real_decide(self, *a))[1])

    def native(model):
        return NativeCausalLM(configure(NativeDecoder.from_hf(model), "specula", "none", "sdpa"), "native",
                              eos_token_ids=[EOS])

    model, draft = models
    options = {"num_draft_tokens": 4} if method == "fusion" else {}
    dec = build_decoder(method, native(model), json_tokenizer, native(draft) if method == "fusion" else None,
                        planner=HardwarePlanner(curve=FLAT) if method != "none" else "none", **options)
    for kind, constraint in CONSTRAINTS.items():
        for text in PROMPTS:
            prompt = json_tokenizer.encode(text, add_special_tokens=False)
            out = dec.generate(prompt, SamplingParams(max_new_tokens=30), constraint)
            assert out.token_ids == reference(model, json_tokenizer, constraint, prompt, 30), (method, kind, text)
    assert masked  # rows were screened through the grammar's masks
    assert not unmasked  # and no pass took its rows' unmasked argmax for nothing


@pytest.mark.parametrize("method", ["none", "fusion"])
@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=30, repetition_penalty=1.5, logit_bias={EOS: -2.0}),
    SamplingParams(max_new_tokens=30, temperature=0.9, seed=4),  # the race in logit form: a change of every id
    SamplingParams(max_new_tokens=30, temperature=1.3, seed=5, repetition_penalty=1.5, logit_bias={EOS: -2.0}),
    SamplingParams(max_new_tokens=30, temperature=1.0, seed=6, top_k=8, top_p=0.9, min_p=0.05),  # the kept ids
    SamplingParams(max_new_tokens=30, temperature=1.1, seed=7, min_p=0.1, repetition_penalty=1.3),
    SamplingParams(max_new_tokens=30, temperature=0.7, seed=8, top_p=0.8, presence_penalty=0.5),  # bounds on the rest
])
def test_constrained_and_penalised_steps_through_the_output_screen(models, json_tokenizer, monkeypatch, method,
                                                                   params):
    """A grammar's masks and penalties on the same rows (`RowEdit`: the mask and the change together), greedy or
    sampled at a temperature, alone or truncated (top-k, top-p within it, min-p, top-p over every id: the kept ids
    through the screen, `OutputScreen.edited_top`), through the output screen output what they output without it."""
    from specula.models.native import NativeCausalLM, NativeDecoder, configure, kernels
    from specula.models.native import screen

    if not kernels.available():
        pytest.skip(f"specula's CPU kernels cannot run here: {kernels.unavailable_reason()}")
    edited = []
    real, real_top = screen.OutputScreen.edited_argmax, screen.OutputScreen.edited_top
    monkeypatch.setattr(screen.OutputScreen, "edited_argmax", lambda self, *a: (edited.append(1), real(self, *a))[1])
    monkeypatch.setattr(screen.OutputScreen, "edited_top", lambda self, *a: (edited.append(1), real_top(self, *a))[1])

    def native(model):
        return NativeCausalLM(configure(NativeDecoder.from_hf(model), "specula", "none", "sdpa"), "native",
                              eos_token_ids=[EOS])

    model, draft = models
    outs = []
    for floor in (0, 1 << 40):  # screened, not
        monkeypatch.setattr(screen, "SCREEN_MIN_WEIGHTS", floor)
        monkeypatch.setattr(screen, "TOP_SCREEN_MIN_WEIGHTS", floor)
        options = {"num_draft_tokens": 4} if method == "fusion" else {}
        dec = build_decoder(method, native(model), json_tokenizer, native(draft) if method == "fusion" else None,
                            planner=HardwarePlanner(curve=FLAT) if method != "none" else "none", **options)
        outs.append([dec.generate(json_tokenizer.encode(text, add_special_tokens=False), params, constraint).token_ids
                     for constraint in CONSTRAINTS.values() for text in PROMPTS])
    assert outs[0] == outs[1]
    assert edited  # rows went through the screen with both the masks and the penalties


def test_forced_tokens_are_drafted_accepted_and_priced_as_certain(models, json_tokenizer):
    prompt = json_tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    dec = decoder(models, json_tokenizer, "prompt-lookup", HardwarePlanner(curve=FLAT))
    out = dec.generate(prompt, SamplingParams(max_new_tokens=40), CONSTRAINTS["schema"])
    assert out.stats.source_accepted["grammar"] >= 6  # keys, quotes, separators
    assert out.stats.source_accepted["grammar"] == out.stats.source_drafted["grammar"]
    assert out.stats.steps < len(out.token_ids)
    plain = decoder(models, json_tokenizer, "none").generate(prompt, SamplingParams(max_new_tokens=40),
                                                              CONSTRAINTS["schema"])
    assert plain.stats.steps == len(plain.token_ids)  # plain decoding stays one token a step
    assert plain.token_ids == out.token_ids


# ---------------------------------------------------------------------------- the sampled law
LAW = Constraint.regex(r"(a|b|c|ab)(b|c|d)[a-d]*")
TEMP = 1.5
TRIALS = 1500


def exact_masked_first_two(model, tokenizer, prompt: list[int], law: Constraint = LAW) -> torch.Tensor:
    """P(first = a, second = b) of constrained plain sampling: [VOCAB * VOCAB]."""
    from llguidance import LLMatcher

    from specula.constraints.matcher import unpack_bitmask

    matcher = LLMatcher(grammar_tokenizer(tokenizer, VOCAB, [EOS]), law.grammar_text())

    def masked_p(ids):
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        allowed = unpack_bitmask(matcher.compute_bitmask(), VOCAB)
        return torch.softmax(logits.masked_fill(~allowed, float("-inf")) / TEMP, -1)

    p1 = masked_p(prompt)
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for a in p1.nonzero().flatten().tolist():
        assert matcher.consume_token(a)
        joint[a] = p1[a] * masked_p(prompt + [a])
        matcher.rollback(1)
    return joint.flatten()


def sample_codes(dec, prompt, trials=TRIALS, law: Constraint = LAW):
    codes = torch.empty(trials, dtype=torch.long)
    accepted = 0
    for s in range(trials):
        out = dec.generate(prompt, SamplingParams(temperature=TEMP, max_new_tokens=3, seed=s, ignore_eos=True), law)
        codes[s] = out.token_ids[0] * VOCAB + out.token_ids[1]
        accepted += out.stats.accepted_tokens
    return codes, accepted


@pytest.fixture(scope="module")
def law_prompt(json_tokenizer):
    return json_tokenizer.encode("abcdabcdab", add_special_tokens=False)  # prompt lookup proposes "cd"


@pytest.fixture(scope="module")
def exact(models, json_tokenizer, law_prompt):
    return exact_masked_first_two(models[0], json_tokenizer, law_prompt)


@pytest.mark.parametrize("method", ["fusion", "draft-model"])
def test_sampled_output_follows_the_masked_target_law(models, json_tokenizer, law_prompt, exact, method):
    codes, accepted = sample_codes(decoder(models, json_tokenizer, method, HardwarePlanner(curve=FLAT)), law_prompt)
    # the draft model samples from its unmasked q: few of its draws are allowed (verified as drawn)
    assert accepted > (TRIALS // 10 if method == "fusion" else 0), accepted
    assert tv(codes, exact) < tv_bound(exact, TRIALS, c=2.0), method
    assert exact[codes].min() > 0  # nothing the grammar forbids is ever emitted


@pytest.mark.parametrize("method, options", [("draft-model", {"greedy_proposals": False, "num_draft_tokens": 4}),
                                             ("draft-tree", {"tree_sampling": "iid"})])
def test_sampled_drafts_keep_the_masked_law_where_the_grammar_forces_tokens(models, json_tokenizer, law_prompt,
                                                                             method, options):
    """A forced first token, then free ones: the step that forces drops the sampled draft for the
    forced chain (they cannot share a tree), the next steps verify draws from q."""
    forcing = Constraint.regex(r"x(a|b|c|ab)(b|c|d)[a-d]*")
    exact = exact_masked_first_two(models[0], json_tokenizer, law_prompt, forcing)
    model, draft = models
    dec = build_decoder(method, HFCausalLM(model, "target"), json_tokenizer, HFCausalLM(draft, "draft"),
                        planner=HardwarePlanner(curve=FLAT), **options)
    codes, _ = sample_codes(dec, law_prompt, TRIALS, forcing)
    assert tv(codes, exact) < tv_bound(exact, TRIALS, c=2.0), method
    assert exact[codes].min() > 0
    schema = dec.generate(law_prompt, SamplingParams(temperature=1.0, max_new_tokens=60, seed=1), CONSTRAINTS["schema"])
    if schema.stats.finish_reason == "stop":
        assert set(json.loads(schema.text)) == {"name", "age", "tags"}


def test_planted_rule_that_ignores_the_mask_is_detected(models, json_tokenizer, law_prompt, monkeypatch):
    """A rule fed unmasked rows emits tokens the grammar forbids: the grammar state refuses the
    commit loudly (the step fails) instead of returning text outside the constraint."""
    import specula.constraints.matcher as matcher

    monkeypatch.setattr(matcher.MaskedLogits, "__getitem__", lambda self, row: self.logits[int(row)])
    with pytest.raises(RuntimeError, match="grammar refused"):
        sample_codes(decoder(models, json_tokenizer, "fusion", HardwarePlanner(curve=FLAT)), law_prompt, 200)


def test_a_minimum_length_with_a_constraint_is_refused(models, json_tokenizer):
    """A complete match allows EOS alone: under a minimum length every token would be masked."""
    from specula.errors import ConfigError

    dec = decoder(models, json_tokenizer, "prompt-lookup")
    prompt = json_tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    with pytest.raises(ConfigError, match="min_new_tokens cannot be combined with a constraint"):
        dec.generate(prompt, SamplingParams(max_new_tokens=8, min_new_tokens=2), CONSTRAINTS["regex"])


@pytest.mark.parametrize("constraint", [Constraint.grammar('start: a\na: a "x"'), Constraint.regex("[^\\x00-\\x{10FFFF}]")])
def test_a_constraint_with_no_text_in_it_is_refused_by_every_method(models, json_tokenizer, constraint):
    """It compiles, but llguidance stops at its first mask: plain decoding gave an empty output that
    matches nothing, and every drafter crashed on a roll-back (a 24-line RuntimeError, a 500)."""
    from specula.constraints import ConstraintError

    prompt = json_tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    for method in ("none", "prompt-lookup", "token-recycling"):
        with pytest.raises(ConstraintError, match="matches no text this tokenizer can write"):
            decoder(models, json_tokenizer, method).generate(prompt, SamplingParams(max_new_tokens=8), constraint)


@pytest.mark.parametrize("constraint", [Constraint.json_schema({"type": "string", "pattern": "^Q+$"}),
                                        Constraint.json_schema({"enum": ["QQ"]}), Constraint.regex("aQ")])
def test_a_constraint_needing_text_the_tokenizer_cannot_write_is_an_error_not_an_output(models, json_tokenizer,
                                                                                         constraint):
    """The tokenizer has no token for "Q": llguidance allows the text before it and finds the dead
    end only there. The regex's output was "a" then EOS, finish "stop" (a match it is not); the
    schemas failed with a 20-line RuntimeError (a 500 from the server)."""
    from specula.constraints import ConstraintError

    prompt = json_tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    for method in ("none", "prompt-lookup", "draft-model"):
        with pytest.raises(ConstraintError, match="cannot be completed after 1 tokens") as caught:
            decoder(models, json_tokenizer, method, HardwarePlanner(curve=FLAT)).generate(
                prompt, SamplingParams(max_new_tokens=8), constraint)
        assert "\n" not in str(caught.value)


def test_a_constraint_with_an_unwritable_branch_ends_alike_for_every_method(models, json_tokenizer):
    """`(bQ|a)` and `(aQ|b)` can each be written one way; llguidance's mask also allows the branch
    that cannot ("Q" has no token). Whichever branch the model takes, every method ends as plain
    decoding does: the same output, or the same error (never an output that does not match)."""
    from specula.constraints import ConstraintError

    for pattern in ("(bQ|a)", "(aQ|b)"):
        for text in PROMPTS:
            prompt = json_tokenizer.encode(text, add_special_tokens=False)
            ends = []
            for method in ("none", "prompt-lookup", "draft-model", "fusion"):
                dec = decoder(models, json_tokenizer, method, HardwarePlanner(curve=FLAT))
                try:
                    out = dec.generate(prompt, SamplingParams(max_new_tokens=8), Constraint.regex(pattern))
                    assert out.stats.finish_reason != "stop" or out.text in ("a", "b"), out.text
                    ends.append(out.token_ids)
                except ConstraintError as exc:
                    ends.append(str(exc))
            assert all(end == ends[0] for end in ends), (pattern, text, ends)


def test_a_target_without_eos_ids_ends_a_match_with_the_tokenizers_eos_once(models, json_tokenizer):
    """llguidance ends a match with the tokenizer's EOS when the decoder names none; the grammar state
    took it for an ordinary token and the output carried it twice."""
    model, _ = models
    prompt = json_tokenizer.encode("abc", add_special_tokens=False)
    constraint = Constraint.regex("[a-d]{1,4}")
    for method in ("none", "prompt-lookup"):
        dec = build_decoder(method, HFCausalLM(model, "target", eos_token_ids=[]), json_tokenizer, planner="none")
        out = dec.generate(prompt, SamplingParams(max_new_tokens=10), constraint)
        with_eos = build_decoder(method, HFCausalLM(model, "target", eos_token_ids=[EOS]), json_tokenizer,
                                 planner="none").generate(prompt, SamplingParams(max_new_tokens=10), constraint)
        assert out.token_ids == with_eos.token_ids and out.token_ids.count(EOS) == 1, method
        assert out.token_ids[-1] == EOS and out.stats.finish_reason == "stop"
