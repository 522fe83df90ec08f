"""The bench loop on tiny models: conversations, records, identity, incremental writes."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace

import pytest

from specula.bench.datasets import BenchPrompt, load_prompts, select_prompts
from specula.bench.methods import MethodOutput, build_specula_methods
from specula.bench.peers import build_peers, parse_compare
from specula.bench.runner import BenchSettings, conversation_ids, run_bench, run_conversation
from specula.bench.summary import aggregate, first_difference, summarize
from specula.errors import ConfigError
from specula.models.loading import apply_chat_template
from specula.sampling import SamplingParams
from tiny import reference_greedy, tiny_model

SUMMARY_KEYS = {"tokens_per_s", "speedup", "speedup_vs_hf", "mean_accepted_tokens", "identical_fraction",
                "by_category", "acceptance_by_depth", "time_split", "draft_ms_per_step", "memory_bytes",
                "paused_step_fraction"}
RUN_KEYS = {"id", "category", "turn", "method", "new_tokens", "seconds", "tokens_per_s", "mean_accepted_tokens",
            "identical", "token_ids", "token_sha1", "accepted_lengths", "time", "finish_reason", "paused_steps"}


@dataclass
class ScriptedMethod:
    """A fake method: answers turn k with `answers[k]` and records the prompt ids it was given."""

    name: str
    answers: list[list[int]]
    kind: str = "specula"
    lossless: bool = True
    seen: list[list[int]] = field(default_factory=list)
    interrupt_on_call: int | None = None
    seconds: float = 0.01

    def generate(self, prompt_ids, params, constraint=None):
        self.seen.append(list(prompt_ids))
        if self.interrupt_on_call is not None and len(self.seen) == self.interrupt_on_call:
            raise KeyboardInterrupt
        turn = sum(1 for _ in self.seen) - 1
        return MethodOutput(self.answers[turn % len(self.answers)], self.seconds, None)

    def memory_bytes(self):
        return None


def test_conversation_ids(chat_tokenizer):
    turns = ["w5 w6", "w7"]
    first = conversation_ids(chat_tokenizer, turns[:1], [])
    assert first == apply_chat_template(chat_tokenizer, "w5 w6") == chat_tokenizer.encode("w2 w5 w6 w4")
    second = conversation_ids(chat_tokenizer, turns, ["w9 w10"])
    assert second == chat_tokenizer.encode("w2 w5 w6 w3 w9 w10 w2 w7 w4")
    assert conversation_ids(chat_tokenizer, turns, ["w9"], raw=True) == chat_tokenizer.encode("w5 w6 w9 w7")
    with pytest.raises(ValueError):
        conversation_ids(chat_tokenizer, turns, [])


def test_second_turn_follows_each_methods_own_first_answer(chat_tokenizer):
    prompt = BenchPrompt("q", "mt_bench", ("w5 w6", "w7 w8"), "writing")
    settings = BenchSettings(SamplingParams(max_new_tokens=4), warmup_tokens=0, progress=False)
    a = ScriptedMethod("a", [[11, 12], [13]])
    b = ScriptedMethod("b", [[40, 41, 42], [43]])
    for method in (a, b):
        outputs = run_conversation(method, prompt, chat_tokenizer, settings)
        assert len(outputs) == 2
    assert a.seen[0] == b.seen[0]
    assert a.seen[1] == chat_tokenizer.encode("w2 w5 w6 w3 w11 w12 w2 w7 w8 w4")
    assert b.seen[1] == chat_tokenizer.encode("w2 w5 w6 w3 w40 w41 w42 w2 w7 w8 w4")


def test_run_bench_refuses_a_turn_that_cannot_fit_before_generating_anything(chat_tokenizer, tmp_path):
    """run_bench called from Python: a prompt whose second turn (its first answer left empty, one token for each
    answer) does not fit the window is refused before the warm-up and the first prompt, naming it; a turn of
    another prompt that needs all but a token per answer runs."""
    fits = BenchPrompt("fits", "mt_bench", ("w5 w6", "w7"), "writing")  # 7 tokens; 9 with an answer each
    too_long = BenchPrompt(82, "mt_bench", ("w5 w6", "w7 w8"), "writing")  # 8 tokens; 10 with an answer each
    a = ScriptedMethod("none", [[9], [8]])  # "w9", "w8": one token each when encoded again
    settings = BenchSettings(SamplingParams(max_new_tokens=4), warmup_tokens=2, progress=False, context_window=9)
    with pytest.raises(ConfigError, match=r"^prompt 82 \(mt_bench\) turn 2 takes 8 tokens and with the earlier "
                                          r"answers left empty leaves no room .* context window of 9 "):
        run_bench([a], chat_tokenizer, [fits, too_long], settings, tmp_path / "out")
    assert a.seen == [] and not (tmp_path / "out").exists()
    run_bench([a], chat_tokenizer, [fits], replace(settings, warmup_tokens=0), tmp_path / "out")
    assert a.seen == [chat_tokenizer.encode("w2 w5 w6 w4"), chat_tokenizer.encode("w2 w5 w6 w3 w9 w2 w7 w4")]


def test_a_template_that_refuses_an_empty_assistant_message_still_measures_a_turns_room(chat_tokenizer, tmp_path):
    """The room of the turns to come was measured with their answers as empty assistant messages, which a
    template may refuse (its raise_exception): the check and the budget then failed. They measure with a
    one-token placeholder answer instead (a token more per answer: less room, never more); a template that
    refuses for another reason is still refused."""
    import copy

    from specula.bench.runner import check_prompts_fit, turn_budget
    from specula.prompts import TemplateRefused, encode_prompt

    refusing = "{% for m in messages %}{% if m['role'] == 'assistant' and not m['content'] %}{{ raise_exception(" \
               "'an assistant message needs content') }}{% endif %}{% endfor %}"
    tok = copy.deepcopy(chat_tokenizer)
    tok.chat_template = refusing + chat_tokenizer.chat_template
    prompt = BenchPrompt("q", "mt_bench", ("w5 w6", "w7 w8"), "writing")
    settings = BenchSettings(SamplingParams(max_new_tokens=50), warmup_tokens=0, progress=False, context_window=30)
    with pytest.raises(TemplateRefused, match="an assistant message needs content"):
        encode_prompt(tok, [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": ""},
                            {"role": "user", "content": "w7 w8"}])
    assert turn_budget(chat_tokenizer, prompt, [], settings)[1] == (30 - 8) // 2  # "w2 w5 w6 w3 w2 w7 w8 w4"
    assert turn_budget(tok, prompt, [], settings) == (tok.encode("w2 w5 w6 w4"), (30 - 9) // 2)  # "w3 OK": 2 tokens
    (note,) = check_prompts_fit([prompt], tok, settings)
    assert note.endswith("(prompt: turn 1's budget; q: 10)")
    a = ScriptedMethod("none", [[9], [8]])
    run_bench([a], tok, [prompt], settings, tmp_path / "out")
    assert a.seen == [tok.encode("w2 w5 w6 w4"), tok.encode("w2 w5 w6 w3 w9 w2 w7 w8 w4")]
    tok.chat_template = "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ raise_exception(" \
                        "'no assistant messages') }}{% endif %}{% endfor %}" + chat_tokenizer.chat_template
    with pytest.raises(TemplateRefused, match="no assistant messages"):
        check_prompts_fit([prompt], tok, settings)


def test_an_empty_answer_a_template_refuses_goes_on_as_the_placeholder(chat_tokenizer, tmp_path):
    """A model that stops at once answers turn 1 with nothing; a chat template that refuses an empty assistant
    message then failed turn 2, mid-run, after the first turn was timed. The conversation goes on with
    PLACEHOLDER_ANSWER as that answer (what the room of later turns is measured with); a template that accepts
    an empty answer gets it as it is."""
    import copy

    tok = copy.deepcopy(chat_tokenizer)
    tok.chat_template = "{% for m in messages %}{% if m['role'] == 'assistant' and not m['content'] %}{{ " \
                        "raise_exception('an assistant message needs content') }}{% endif %}{% endfor %}" + \
                        chat_tokenizer.chat_template
    prompt = BenchPrompt("q", "mt_bench", ("w5 w6", "w7 w8"), "writing")
    settings = BenchSettings(SamplingParams(max_new_tokens=4), warmup_tokens=0, progress=False)
    assert conversation_ids(tok, prompt.turns, [""]) == tok.encode("w2 w5 w6 w3 OK w2 w7 w8 w4")
    silent = ScriptedMethod("none", [[], [8]])
    run_bench([silent], tok, [prompt], settings, tmp_path / "refusing")
    assert silent.seen == [tok.encode("w2 w5 w6 w4"), tok.encode("w2 w5 w6 w3 OK w2 w7 w8 w4")]
    accepting = ScriptedMethod("none", [[], [8]])
    run_bench([accepting], chat_tokenizer, [prompt], settings, tmp_path / "accepting")
    assert accepting.seen[1] == chat_tokenizer.encode("w2 w5 w6 w3 w2 w7 w8 w4")


def test_a_turn_measured_with_placeholder_answers_says_so_in_its_refusal(chat_tokenizer):
    """Where the chat template refuses an empty assistant message, a turn's room is measured with PLACEHOLDER_ANSWER
    as each earlier answer: the refusal said its token count was "with the earlier answers left empty", while it
    counted the placeholders too."""
    import copy

    from specula.bench.runner import check_prompts_fit

    tok = copy.deepcopy(chat_tokenizer)
    tok.chat_template = "{% for m in messages %}{% if m['role'] == 'assistant' and not m['content'] %}{{ " \
                        "raise_exception('an assistant message needs content') }}{% endif %}{% endfor %}" + \
                        chat_tokenizer.chat_template
    prompt = BenchPrompt("q", "mt_bench", ("w5 w6", "w7 w8"), "writing")
    settings = BenchSettings(SamplingParams(max_new_tokens=4), warmup_tokens=0, progress=False, context_window=10)
    with pytest.raises(ConfigError) as caught:  # "w2 w5 w6 w3 OK w2 w7 w8 w4": 9 tokens, "OK" among them
        check_prompts_fit([prompt], tok, settings)
    assert str(caught.value).startswith(
        "prompt q (mt_bench) turn 2 takes 9 tokens and with 'OK' as each earlier answer (the chat template refuses "
        "an empty one) leaves no room for its own and the earlier answers in the context window of 10 "), caught.value
    with pytest.raises(ConfigError, match="turn 2 takes 8 tokens and with the earlier answers left empty leaves"):
        check_prompts_fit([prompt], chat_tokenizer, replace(settings, context_window=9))  # no placeholder


def _bench_methods(tiny_pair, tokenizer, peers=("hf:greedy", "hf:assisted", "hf:prompt-lookup")):
    target, draft = tiny_pair
    methods = build_specula_methods(["prompt-lookup", "draft-model"], target, tokenizer, draft)
    eos = sorted(methods[0].spec.eos_token_ids)
    return methods + build_peers(list(peers), target.model, eos, draft.model)


def test_run_bench_writes_results_report_and_plots(tmp_path, tiny_pair, chat_tokenizer, prompts_file):
    prompts = select_prompts(load_prompts(str(prompts_file)), per_category=2, seed=0)
    methods = _bench_methods(tiny_pair, chat_tokenizer)
    settings = BenchSettings(SamplingParams(max_new_tokens=10), warmup_tokens=4, progress=False)
    cost = {"sizes": [1, 2], "seconds": [0.01, 0.012], "ratio": [1.0, 1.2], "context": 8, "repeats": 1}
    result = run_bench(methods, chat_tokenizer, prompts, settings, tmp_path,
                       {"config": {"target": "tiny"}, "cost_curve": cost}, reference_model=tiny_pair[0].model)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["status"] == "complete" and doc["prompts_done"] == doc["prompts_total"] == 4
    assert {"summary", "runs", "machine", "config", "cost_curve", "methods", "categories", "mismatches"} <= set(doc)
    names = ["none", "prompt-lookup", "draft-model", "hf:greedy", "hf:assisted", "hf:prompt-lookup"]
    assert [m["name"] for m in doc["methods"]] == names and set(doc["summary"]) == set(names)
    assert doc["categories"] == ["alpha", "beta"]
    for name, entry in doc["summary"].items():
        assert SUMMARY_KEYS <= set(entry), name
        assert set(entry["by_category"]) == {"alpha", "beta"}
        assert SUMMARY_KEYS - {"by_category"} <= set(entry["by_category"]["alpha"])
        assert entry["tokens_per_s"] > 0
    assert doc["summary"]["none"]["speedup"] == 1.0
    assert doc["summary"]["hf:greedy"]["speedup_vs_hf"] == 1.0
    assert doc["summary"]["none"]["mean_accepted_tokens"] == 1.0
    # Lossless methods and HF greedy reproduce plain decoding exactly on these prompts.
    for name in ("none", "prompt-lookup", "draft-model", "hf:greedy", "hf:assisted", "hf:prompt-lookup"):
        assert doc["summary"][name]["identical_fraction"] == 1.0, name
    assert doc["mismatches"] == [] and result.mismatches == []
    assert doc["summary"]["draft-model"]["mean_accepted_tokens"] > 1.5  # the draft is a close copy
    assert doc["summary"]["hf:assisted"]["mean_accepted_tokens"] is None
    # One record per prompt, method and turn (a1 has two turns).
    assert len(doc["runs"]) == len(names) * 5
    for run in doc["runs"]:
        assert RUN_KEYS <= set(run)
        # the planner's back-off counts the steps it paused; peers and plain decoding have none
        planned = run["method"] in ("prompt-lookup", "draft-model")
        assert (isinstance(run["paused_steps"], int) and 0 <= run["paused_steps"] < run["steps"]) if planned \
            else run["paused_steps"] is None
        assert isinstance(run["held_steps"], dict) if planned else run["held_steps"] is None
    # Plain decoding equals an independent greedy reference (full recomputation, EOS id 1).
    target = tiny_pair[0]
    first = next(r for r in doc["runs"] if r["id"] == "b1" and r["method"] == "none")
    ids = conversation_ids(chat_tokenizer, ["w20 w21 w22 w20 w21 w22 w20"], [])
    assert first["token_ids"] == reference_greedy(target.model, ids, 10, eos=1)
    report = (tmp_path / "report.md").read_text()
    assert "## Overall" in report and "| prompt-lookup |" in report and "## Speedup vs `none` by category" in report
    assert "| alpha" in report.replace("| method | overall | alpha", "| alpha")
    for png in ("speedup_by_category.png", "accepted_lengths.png", "cost_curve.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in result.files) == sorted(
        ["results.json", "report.md", "speedup_by_category.png", "accepted_lengths.png", "cost_curve.png"])


def test_interrupt_keeps_the_prompts_done(tmp_path, chat_tokenizer):
    prompts = [BenchPrompt(i, "c", (f"w{5 + i} w6",), "c") for i in range(4)]
    none = ScriptedMethod("none", [[7, 8]])
    # Calls: 1 warm-up, then one per prompt: the 4th call is prompt 3 -> interrupted after 2 prompts.
    other = ScriptedMethod("other", [[7, 8]], interrupt_on_call=4)
    settings = BenchSettings(SamplingParams(max_new_tokens=4), warmup_tokens=2, progress=False)
    result = run_bench([none, other], chat_tokenizer, prompts, settings, tmp_path)
    assert result.interrupted
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["status"] == "interrupted" and doc["prompts_done"] == 2 and doc["prompts_total"] == 4
    assert sorted({r["id"] for r in doc["runs"]}) == [0, 1]
    assert len(doc["runs"]) == 4  # 2 prompts x 2 methods: the interrupted prompt is dropped
    assert "INTERRUPTED" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "speedup_by_category.png").exists()


def test_results_are_written_after_each_prompt(tmp_path, chat_tokenizer, monkeypatch):
    import specula.bench.runner as runner

    seen: list[int] = []
    real = runner.write_results

    def spy(out_dir, document):
        seen.append(document["prompts_done"])
        return real(out_dir, document)

    monkeypatch.setattr(runner, "write_results", spy)
    prompts = [BenchPrompt(i, "c", ("w5 w6",), "c") for i in range(3)]
    methods = [ScriptedMethod("none", [[7]]), ScriptedMethod("x", [[7]])]
    run_bench(methods, chat_tokenizer, prompts, BenchSettings(SamplingParams(max_new_tokens=2), progress=False),
              tmp_path)
    assert seen == [0, 1, 2, 3, 3]  # start, after each prompt, final


def test_mismatch_recorded_for_lossless_not_for_peers(tmp_path, chat_tokenizer):
    prompts = [BenchPrompt("p", "c", ("w5 w6",), "c")]
    methods = [ScriptedMethod("none", [[7, 8, 9]]), ScriptedMethod("bad", [[7, 9, 9]]),
               ScriptedMethod("hf:greedy", [[7, 8, 10]], kind="hf", lossless=False)]
    settings = BenchSettings(SamplingParams(max_new_tokens=3), warmup_tokens=0, progress=False)
    result = run_bench(methods, chat_tokenizer, prompts, settings, tmp_path)
    assert result.mismatches == [{"id": "p", "round": 1, "category": "c", "turn": 1, "method": "bad",
                                  "first_difference": 1, "same_prompt": True, "logit_gap": None}]
    summary = result.document["summary"]
    assert summary["bad"]["identical_fraction"] == 0.0 and summary["hf:greedy"]["identical_fraction"] == 0.0
    assert "Outputs that differ from plain decoding" in (tmp_path / "report.md").read_text()


def test_sampled_runs_report_no_identity(tmp_path, tiny_pair, chat_tokenizer, prompts_file):
    prompts = select_prompts(load_prompts(str(prompts_file)), per_category=1, seed=0)
    target, _ = tiny_pair
    methods = build_specula_methods(["prompt-lookup"], target, chat_tokenizer)
    settings = BenchSettings(SamplingParams(temperature=0.8, max_new_tokens=6, seed=3), warmup_tokens=0,
                             progress=False)
    doc = run_bench(methods, chat_tokenizer, prompts, settings, tmp_path).document
    assert doc["greedy"] is False
    assert all(e["identical_fraction"] is None for e in doc["summary"].values())
    assert all(r["identical"] is None for r in doc["runs"])
    again = run_bench(methods, chat_tokenizer, prompts, settings, tmp_path / "again").document
    assert [r["token_ids"] for r in again["runs"]] == [r["token_ids"] for r in doc["runs"]]  # seeded


def test_repeats_run_every_round_on_fresh_methods_and_give_the_spread(tmp_path, chat_tokenizer):
    prompts = [BenchPrompt(i, "c", (f"w{5 + i} w6",), "c") for i in range(2)]
    # "fast" takes 0.01 s an output in round 1, then 0.02 s and 0.005 s on the methods built afresh
    rounds = iter([0.02, 0.005])
    built = []

    def fresh():
        seconds = next(rounds)
        methods = [ScriptedMethod("none", [[7, 8]], seconds=0.01), ScriptedMethod("fast", [[7, 8]], seconds=seconds)]
        built.append(methods)
        return methods

    first = [ScriptedMethod("none", [[7, 8]]), ScriptedMethod("fast", [[7, 8]])]
    settings = BenchSettings(SamplingParams(max_new_tokens=2), warmup_tokens=2, progress=False, repeats=3)
    result = run_bench(first, chat_tokenizer, prompts, settings, tmp_path, fresh_methods=fresh)
    doc = json.loads((tmp_path / "results.json").read_text())
    assert len(built) == 2  # rounds 2 and 3
    for methods in (first, *built):  # each round's own objects: a warm-up, then every prompt once
        assert all(len(m.seen) == 1 + len(prompts) for m in methods)
    assert doc["repeats"] == 3 and doc["prompts_done"] == doc["prompts_total"] == 6
    assert sorted((r["round"], r["id"], r["method"]) for r in doc["runs"]) == sorted(
        (k, i, name) for k in (1, 2, 3) for i in range(2) for name in ("none", "fast"))
    spread = result.document["summary"]["fast"]["rounds"]
    assert spread["count"] == 3
    assert spread["speedup"] == {"min": 0.5, "median": 1.0, "max": 2.0, "values": [1.0, 0.5, 2.0]}
    assert spread["tokens_per_s"]["values"] == [200.0, 100.0, 400.0]
    assert result.document["summary"]["fast"]["speedup"] == round(0.06 / 0.07, 4)  # all rounds: a ratio of totals
    report = (tmp_path / "report.md").read_text()
    assert "## Across 3 rounds" in report and "| fast | 0.50x / 1.00x / 2.00x |" in report
    assert "6 of 6 done (complete) in 3 rounds" in report


def test_a_mismatch_in_a_later_round_names_its_round(tmp_path, chat_tokenizer):
    prompts = [BenchPrompt("p", "c", ("w5 w6",), "c")]
    fresh = iter([[ScriptedMethod("none", [[7, 8]]), ScriptedMethod("x", [[7, 9]])]])
    settings = BenchSettings(SamplingParams(max_new_tokens=2), warmup_tokens=0, progress=False, repeats=2)
    result = run_bench([ScriptedMethod("none", [[7, 8]]), ScriptedMethod("x", [[7, 8]])], chat_tokenizer, prompts,
                       settings, tmp_path, fresh_methods=lambda: next(fresh))
    assert [(m["round"], m["method"], m["first_difference"]) for m in result.mismatches] == [(2, "x", 1)]
    assert result.document["summary"]["x"]["identical_fraction"] == 0.5


def test_one_round_gives_no_spread_and_repeats_below_one_are_refused(tmp_path, chat_tokenizer):
    prompts = [BenchPrompt(1, "c", ("w5",), "c")]
    doc = run_bench([ScriptedMethod("none", [[5]])], chat_tokenizer, prompts,
                    BenchSettings(SamplingParams(max_new_tokens=1), warmup_tokens=0, progress=False), tmp_path).document
    assert doc["summary"]["none"]["rounds"] is None and doc["runs"][0]["round"] == 1
    assert "Across" not in (tmp_path / "report.md").read_text()
    with pytest.raises(ConfigError, match="^repeats must be >= 1, got 0; pass e.g. repeats=3$"):  # not --repeats
        BenchSettings(SamplingParams(), repeats=0)


def test_run_bench_needs_the_baseline(tmp_path, chat_tokenizer):
    prompts = [BenchPrompt(1, "c", ("w5",), "c")]
    with pytest.raises(ConfigError, match="baseline method 'none'"):
        run_bench([ScriptedMethod("x", [[5]])], chat_tokenizer, prompts,
                  BenchSettings(SamplingParams(), progress=False), tmp_path)
    with pytest.raises(ConfigError, match=r"^no prompts to run: give run_bench one or more \(load_prompts, "
                                          r"select_prompts\)$"):  # it named --prompts, --categories, --per-category
        run_bench([ScriptedMethod("none", [[5]])], chat_tokenizer, [],
                  BenchSettings(SamplingParams(), progress=False), tmp_path)


def _record(method, category, new_tokens, seconds, lengths=None, identical=True, drafted=(), accepted=(),
            predicted=None):
    return {
        "predicted_accepted": predicted,
        "id": f"{category}{len(lengths or [])}", "category": category, "method": method, "new_tokens": new_tokens,
        "seconds": seconds, "identical": identical, "memory_bytes": None,
        "steps": len(lengths) if lengths is not None else None, "accepted_lengths": lengths,
        "drafted_tokens": sum(drafted) if lengths is not None else None,
        "proposed_tokens": 2 * sum(drafted) if lengths is not None else None,
        "accepted_tokens": sum(accepted) if lengths is not None else None,
        "depth_drafted": list(drafted) if lengths is not None else None,
        "depth_accepted": list(accepted) if lengths is not None else None,
        "time": {"draft": 0.1 * seconds, "verify": 0.6 * seconds, "other": 0.3 * seconds} if lengths else None,
    }


def test_summary_math_is_ratios_of_totals():
    runs = [
        _record("none", "a", 10, 1.0, [1] * 10), _record("none", "b", 30, 1.0, [1] * 30),
        _record("fast", "a", 10, 0.5, [2, 3, 2, 3], drafted=[4, 3], accepted=[4, 2], predicted=9.0),
        _record("fast", "b", 30, 0.5, [1, 4, 5], drafted=[3, 2], accepted=[2, 1], identical=False, predicted=12.0),
        _record("hf:greedy", "a", 8, 1.0), _record("hf:greedy", "b", 32, 1.0),
    ]
    methods = [{"name": n, "kind": "hf" if n.startswith("hf") else "specula", "lossless": True}
               for n in ("none", "fast", "hf:greedy")]
    summary = summarize(runs, methods, ["a", "b"])
    fast = summary["fast"]
    assert fast["tokens_per_s"] == 40.0 and summary["none"]["tokens_per_s"] == 20.0
    assert fast["speedup"] == 2.0 and fast["speedup_vs_hf"] == 2.0
    assert fast["by_category"]["a"]["speedup"] == 2.0 and fast["by_category"]["b"]["speedup"] == 2.0
    assert fast["by_category"]["a"]["speedup_vs_hf"] == pytest.approx(20 / 8, abs=1e-4)
    assert fast["mean_accepted_tokens"] == pytest.approx(20 / 7, abs=1e-4)  # 20 tokens over 7 steps
    assert fast["acceptance_by_depth"] == [pytest.approx(6 / 7, abs=1e-4), pytest.approx(3 / 5)]
    assert fast["identical_fraction"] == 0.5
    assert fast["predicted_mean_accepted_tokens"] == pytest.approx(21 / 7, abs=1e-4)  # planner: 21 over 7 steps
    assert fast["by_category"]["a"]["predicted_mean_accepted_tokens"] == 9 / 4
    assert summary["none"]["predicted_mean_accepted_tokens"] is None
    assert fast["time_split"] == {"draft": 0.1, "verify": 0.6, "other": 0.3}
    assert fast["draft_ms_per_step"] == pytest.approx(1000 * 0.1 / 7, abs=1e-3)
    # drafting against one plain step (the baseline's verify time per step: 0.6 * 2 s over 40 steps)
    plain_ms = 1000 * 0.6 * 2.0 / 40
    assert summary["none"]["verify_ms_per_step"] == pytest.approx(plain_ms)
    assert fast["draft_fraction_of_plain_step"] == pytest.approx(1000 * 0.1 / 7 / plain_ms, abs=1e-3)
    assert fast["draft_fraction_of_plain_step_per_token"] == pytest.approx(1000 * 0.1 / 24 / plain_ms, abs=1e-3)
    assert summary["hf:greedy"]["draft_fraction_of_plain_step"] is None
    assert summary["hf:greedy"]["mean_accepted_tokens"] is None and summary["hf:greedy"]["time_split"] is None
    assert aggregate([])["tokens_per_s"] is None
    slow = summarize([_record("none", "a", 1, 3.0, [1]), _record("fast", "a", 3, 4.0, [3])], methods[:2], ["a"])
    assert slow["fast"]["speedup"] == 2.25  # from the totals (0.75 over 1/3), not rounded rates (0.75 / 0.333)


def test_decode_speedup_is_the_ratio_over_the_time_after_each_prefill():
    """Both methods spend 3 s in prefill: 1.5x over the whole time, 3x over what follows it; a method whose records
    lack the prefill (older results) or were not timed gets no decode figures."""
    def timed(method, tokens, seconds, prefill):
        record = _record(method, "a", tokens, seconds, [1] * tokens)
        record["time"]["prefill"] = prefill
        return record

    runs = [timed("none", 30, 4.0, 2.0), timed("none", 30, 2.0, 1.0), timed("fast", 30, 3.0, 2.0),
            timed("fast", 30, 1.0, 1.0), _record("old", "a", 60, 2.0, [1] * 60), _record("hf:greedy", "a", 60, 4.0)]
    methods = [{"name": n, "kind": "hf" if n.startswith("hf") else "specula", "lossless": True}
               for n in ("none", "fast", "old", "hf:greedy")]
    summary = summarize(runs, methods, ["a"])
    none, fast = summary["none"], summary["fast"]
    assert none["prefill_fraction"] == 0.5 and none["decode_seconds"] == 3.0 and none["decode_speedup"] == 1.0
    assert fast["speedup"] == 1.5 and fast["decode_speedup"] == pytest.approx(3.0, abs=1e-3)
    assert fast["prefill_fraction"] == pytest.approx(0.75) and fast["by_category"]["a"]["decode_speedup"] == \
        fast["decode_speedup"]
    for name in ("old", "hf:greedy"):
        assert summary[name]["speedup"] is not None
        assert summary[name]["decode_speedup"] is None and summary[name]["prefill_fraction"] is None


def test_tokens_per_drafting_step_leave_out_the_plain_steps():
    """A step with no verified node emits one token; tau per drafting step counts the others only."""
    runs = [_record("paused", "a", 9, 1.0, [1, 3, 1, 4], drafted=[2, 2, 1], accepted=[2, 2, 1])]
    entry = aggregate(runs)
    assert entry["mean_accepted_tokens"] == 9 / 4
    assert entry["mean_accepted_per_drafting_step"] == 3.5  # (9 - 2 plain tokens) over 2 drafting steps
    assert entry["drafting_step_fraction"] == 0.5
    every = aggregate([_record("fast", "a", 10, 0.5, [2, 3, 2, 3], drafted=[4, 3], accepted=[4, 2])])
    assert every["mean_accepted_per_drafting_step"] == every["mean_accepted_tokens"] == 2.5
    assert aggregate([_record("none", "a", 10, 1.0, [1] * 10)])["mean_accepted_per_drafting_step"] is None


def test_paused_steps_add_up_over_the_requests_a_back_off_judged():
    """The share of steps sat out in a back-off pause: paused over steps of the requests whose planner
    counted them (peers and unplanned methods count none, and are left out, not read as zero)."""
    runs = [dict(_record("eagle3", "a", 9, 1.0, [1, 3, 1, 4], drafted=[2, 2, 1], accepted=[2, 2, 1]), paused_steps=1),
            dict(_record("eagle3", "b", 8, 1.0, [1] * 6 + [2], drafted=[1], accepted=[1]), paused_steps=5)]
    entry = aggregate(runs)
    assert entry["paused_step_fraction"] == pytest.approx(6 / 11, abs=1e-4)
    assert aggregate(runs[:1])["paused_step_fraction"] == 0.25
    assert aggregate([_record("none", "a", 10, 1.0, [1] * 10)])["paused_step_fraction"] is None
    summary = summarize(runs, [{"name": "eagle3", "kind": "specula", "lossless": True}], ["a", "b"])
    assert summary["eagle3"]["by_category"]["b"]["paused_step_fraction"] == pytest.approx(5 / 7, abs=1e-4)


def test_held_steps_add_up_per_drafter_over_the_requests_a_planner_judged():
    """The share of steps each costly drafter sat out in the hold-back, over the requests whose
    planner counted them; a drafter never held is left out, and methods without a planner give None."""
    runs = [dict(_record("fusion", "a", 9, 1.0, [1, 3, 1, 4], drafted=[2, 2, 1], accepted=[2, 2, 1]),
                 paused_steps=0, held_steps={"eagle3": 2, "draft-model": 0}),
            dict(_record("fusion", "b", 8, 1.0, [1] * 6 + [2], drafted=[1], accepted=[1]), paused_steps=0,
                 held_steps={})]
    assert aggregate(runs)["held_step_fraction"] == {"eagle3": pytest.approx(2 / 11, abs=1e-4)}
    assert aggregate(runs[1:])["held_step_fraction"] == {}
    assert aggregate([_record("none", "a", 10, 1.0, [1] * 10)])["held_step_fraction"] is None


def test_the_report_shows_the_paused_share_by_category_when_a_back_off_paused():
    from specula.bench.report import build_document, render_markdown

    methods = [{"name": n, "kind": "specula", "lossless": True} for n in ("none", "eagle3")]
    runs = [_record("none", "a", 9, 1.0, [1] * 9),
            dict(_record("eagle3", "a", 9, 0.5, [1, 3, 1, 4], drafted=[2, 2, 1], accepted=[2, 2, 1]), paused_steps=1)]
    head = {"methods": methods, "categories": ["a"], "greedy": True, "machine": {}, "config": {}, "cost_curve": None}
    report = render_markdown(build_document(head, runs, [], prompts_done=1, prompts_total=1, status="complete"))
    assert "## Steps paused by the back-off by category" in report and "| eagle3 | 25% | 25% |" in report
    runs[1]["paused_steps"] = 0
    report = render_markdown(build_document(head, runs, [], prompts_done=1, prompts_total=1, status="complete"))
    assert "paused by the back-off" not in report


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_parse_compare():
    assert parse_compare("hf", has_draft=False) == ["hf:greedy", "hf:prompt-lookup"]
    assert parse_compare("hf", has_draft=True) == ["hf:greedy", "hf:assisted", "hf:assisted-heuristic",
                                                   "hf:prompt-lookup"]
    assert parse_compare(None, has_draft=True) == []
    with pytest.raises(ConfigError, match="needs a draft model"):
        parse_compare("hf:assisted", has_draft=False)
    with pytest.raises(ConfigError, match="unknown peer 'vllm'"):
        parse_compare("vllm", has_draft=False)


def test_method_variants_parse_and_reach_the_drafter(tiny_pair, chat_tokenizer):
    from specula.bench.methods import build_specula_methods, parse_method_list, split_method

    assert split_method("draft-tree:tree_sampling=iid:tree_top_k=3") == ("draft-tree", {"tree_sampling": "iid",
                                                                                          "tree_top_k": 3})
    assert split_method("draft-model:adaptive=true") == ("draft-model", {"adaptive": True})
    names = parse_method_list("draft-tree:tree_sampling=iid,draft-tree:tree_sampling=without_replacement", True)
    assert names == ["none", "draft-tree:tree_sampling=iid", "draft-tree:tree_sampling=without_replacement"]
    with pytest.raises(ConfigError, match="option=value"):
        parse_method_list("draft-tree:iid", True)
    with pytest.raises(ConfigError, match="unknown method 'nope'"):
        parse_method_list("nope:x=1", True)
    target, draft = tiny_pair
    methods = build_specula_methods(names, target, chat_tokenizer, draft)
    assert [m.name for m in methods] == names
    assert [m.spec.decoder.drafters[0].config.tree_sampling for m in methods[1:]] == ["iid", "without_replacement"]
    with pytest.raises(ConfigError, match="does not take tree_colour"):
        build_specula_methods(["draft-tree:tree_colour=red"], target, chat_tokenizer, draft)
    with pytest.raises(ConfigError, match="method 'prompt-lookup' does not take colour"):
        build_specula_methods(["prompt-lookup:colour=red"], target, chat_tokenizer, draft)


def test_the_baseline_runs_without_the_drafting_limits_the_others_get(tiny_pair, chat_tokenizer):
    """--max-tree-nodes 8 beside a method that drafts: method none refuses drafting limits, so the baseline is
    built with the engine's limits bar those (`EngineConfig.without_drafting_limits`)."""
    from specula.engine import EngineConfig

    target, _ = tiny_pair
    methods = build_specula_methods(["prompt-lookup"], target, chat_tokenizer, engine=EngineConfig(max_tree_nodes=8))
    assert [m.spec.engine_config for m in methods] == [EngineConfig(), EngineConfig(max_tree_nodes=8)]


def test_an_entry_that_cannot_be_built_is_named_as_given_with_its_options_as_the_command_line_wrote_them(
        tiny_pair, chat_tokenizer):
    """A plain entry was labelled "method variant 'draft-tree'", and an option of the command line's was named as
    Python does (tree_depth, not --tree-depth); a variant's own options stay as it writes them."""
    from specula.methods import flag_spellings

    target, draft = tiny_pair
    given = lambda name: {"tree_depth": 0} if name == "draft-tree" else {}  # noqa: E731 (--tree-depth 0)
    for names, message in ((["draft-tree"], "method 'draft-tree': --tree-depth must be >= 1, got 0"),
                           (["draft-tree:tree_top_k=2"], "method variant 'draft-tree:tree_top_k=2': --tree-depth must"),
                           (["draft-tree:draft=none"], "method variant 'draft-tree:draft=none': method 'draft-tree' ")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            build_specula_methods(names, target, chat_tokenizer, draft, given, flags=flag_spellings())
    with pytest.raises(ConfigError, match=re.escape("method variant 'draft-tree:tree_depth=0': tree_depth must")):
        build_specula_methods(["draft-tree:tree_depth=0"], target, chat_tokenizer, draft, flags=flag_spellings())
    with pytest.raises(ConfigError, match=re.escape("method 'draft-tree': tree_depth must be >= 1")):  # no flags
        build_specula_methods(["draft-tree"], target, chat_tokenizer, draft, given)


@pytest.mark.parametrize("variant, value", [("draft-model:adaptive=maybe", "'maybe'"), ("draft-tree:adaptive=1", "1"),
                                            ("draft-model:greedy_proposals=0", "0"), ("rest:verify=yes", "'yes'"),
                                            ("eagle3:adaptive=on", "'on'"), ("fusion:online_distill=2.5", "2.5")])
def test_a_switch_given_anything_but_true_or_false_is_refused_before_loading(variant, value):
    """draft-model:adaptive=maybe ran as adaptive (a non-empty string is true); every switch a variant can set
    (`MethodSpec.switches`) takes true or false only."""
    from specula.bench.methods import parse_method_list

    name = variant.split(":")[1].split("=")[0]
    with pytest.raises(ConfigError, match=re.escape(f"method variant {variant!r}: {name} is a switch: it takes true "
                                                    f"or false, got {value}")):
        parse_method_list(variant, True)
    assert parse_method_list(variant.split("=")[0] + "=False", True)[1] == variant.split("=")[0] + "=False"


def test_a_head_none_variant_runs_without_the_head_options_of_the_command_line(tiny_pair, chat_tokenizer):
    """fusion:head=none beside fusion with --head-window 8: the flag is for the entry with a head (fusion refuses
    head options without a head); a variant's own head option with head=none is refused."""
    from specula.methods import flag_spellings

    target, draft = tiny_pair
    given = lambda name: {"head_window": 8} if name == "fusion" else {}  # noqa: E731 (--head-window 8)
    methods = build_specula_methods(["fusion:head=none"], target, chat_tokenizer, draft, given)
    assert methods[1].spec.decoder.drafters
    with pytest.raises(ConfigError, match=re.escape("method 'fusion': --head-window is for a trained head")):
        build_specula_methods(["fusion"], target, chat_tokenizer, draft, given, flags=flag_spellings())
    with pytest.raises(ConfigError, match=re.escape("method variant 'fusion:head=none:head_window=3': head_window is")):
        build_specula_methods(["fusion:head=none:head_window=3"], target, chat_tokenizer, draft, flags=flag_spellings())


def test_a_draft_none_variant_runs_without_the_draft_model(tiny_pair, chat_tokenizer):
    from specula.bench.methods import build_specula_methods, parse_method_list
    from specula.drafters.draft_model import DraftModelDrafter

    target, draft = tiny_pair
    names = parse_method_list("fusion,fusion:draft=none", True)
    methods = build_specula_methods(names, target, chat_tokenizer, draft)
    kinds = {m.name: [type(d) for d in m.spec.decoder.drafters] for m in methods}
    assert DraftModelDrafter in kinds["fusion"]
    assert DraftModelDrafter not in kinds["fusion:draft=none"] and kinds["fusion:draft=none"]
    assert methods[2].spec.draft is None and methods[1].spec.draft is draft
    with pytest.raises(ConfigError, match="takes only none"):
        parse_method_list("fusion:draft=qwen2.5-coder-0.5b", True)


def test_a_draft_none_variant_runs_without_the_draft_model_options_of_the_command_line(tiny_pair, chat_tokenizer):
    """fusion:draft=none beside fusion with --num-draft-tokens 3 --draft-window 0: the flags are for the entry with a
    draft model (fusion refuses them without one, and the variant was refused); an entry without a draft model is
    refused naming why there is none (`no_draft`)."""
    from specula.drafters.draft_model import DraftModelDrafter
    from specula.methods import flag_spellings

    target, draft = tiny_pair
    given = lambda name: {"num_draft_tokens": 3, "draft_window": 0} if name == "fusion" else {}  # noqa: E731
    methods = build_specula_methods(["fusion", "fusion:draft=none"], target, chat_tokenizer, draft, given)
    drafted = [d for d in methods[1].spec.decoder.drafters if isinstance(d, DraftModelDrafter)]
    assert [(d.config.num_draft_tokens, d.config.draft_window) for d in drafted] == [(3, 0)]
    assert methods[2].spec.decoder.drafters and not any(isinstance(d, DraftModelDrafter)
                                                        for d in methods[2].spec.decoder.drafters)
    with pytest.raises(ConfigError, match=re.escape("method 'fusion': --num-draft-tokens is for a draft model or layer "
                                                    "skipping, and fusion drafts with neither here (no draft, for a "
                                                    "test); give it a draft model with --draft MODEL, or drop")):
        build_specula_methods(["fusion"], target, chat_tokenizer, None, given, flags=flag_spellings(["draft"]),
                              no_draft="no draft, for a test")


def test_a_variants_own_option_is_named_as_it_writes_it_and_the_command_lines_as_a_flag(tiny_pair, chat_tokenizer,
                                                                                       tmp_path):
    """fusion leaves token recycling out beside a head (here --head's): the refusal of fusion:recycling_state=FILE
    named --recycling-state, which the variant did not write; the head to drop is the command line's, --head."""
    import torch

    from specula.drafters.heads.runtime import new_head
    from specula.methods import flag_spellings

    target, draft = tiny_pair
    head = new_head("eagle", target, torch.arange(target.vocab_size))
    given = lambda name: {"head": head} if name == "fusion" else {}  # noqa: E731 (--head FILE)
    state = tmp_path / "s.npz"
    message = (f"method variant 'fusion:recycling_state={state}': recycling_state is for token-recycling, which "
               "fusion leaves out when a trained head drafts; pass --head none to keep token-recycling (or drop "
               "recycling_state)")
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_specula_methods([f"fusion:recycling_state={state}"], target, chat_tokenizer, draft, given,
                              flags=flag_spellings())
    from specula.cli import build_parser
    from specula.commands.common import command_flags

    bench_args = build_parser().parse_args(["bench", "--target", "t", "--out", "o"])
    skip = lambda name: {"draft_skip": True, "skip_layers": None}  # noqa: E731 (--draft skip, as `execute` gives it)
    with pytest.raises(ConfigError, match=re.escape("method 'draft-tree': --draft skip drafts chains: use "
                                                    'method="draft-model", method="layer-skip" or method="fusion" '
                                                    "with it")):  # load's keyword: named --method, not taken
        build_specula_methods(["draft-tree"], target, chat_tokenizer, None, skip,  # the bench's flags (command_flags):
                              flags=command_flags(bench_args))  # its draft_skip=True is --draft skip


def test_schema_valid_checks_each_output_against_its_prompts_schema():
    from specula.bench.datasets import BenchPrompt
    from specula.bench.methods import MethodOutput
    from specula.bench.runner import schema_valid

    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    prompt = BenchPrompt("p", "c", ("x",), "c", schema)
    out = lambda text: MethodOutput([ord(c) for c in text], 1.0, None)
    assert schema_valid(prompt, out('{"a": 3}'), Chars()) is True
    assert schema_valid(prompt, out('{"a": "3"}'), Chars()) is False  # valid JSON, wrong type
    assert schema_valid(prompt, out('{"a": 3'), Chars()) is False  # cut short
    assert schema_valid(BenchPrompt("p", "c", ("x",), "c"), out("free text"), Chars()) is None


def test_the_report_says_whether_methods_were_warmed_up():
    """report.md read "after one warm-up each" with --warmup-tokens 0 too."""
    from specula.bench.report import build_document, render_markdown

    methods = [{"name": "none", "kind": "specula", "lossless": True}]
    runs = [_record("none", "a", 9, 1.0, [1] * 9)]
    for warmup, says in ((32, "after one warm-up each"), (0, "without warm-up (`--warmup-tokens 0`)")):
        head = {"methods": methods, "categories": ["a"], "greedy": True, "machine": {},
                "config": {"warmup_tokens": warmup}, "cost_curve": None}
        report = render_markdown(build_document(head, runs, [], prompts_done=1, prompts_total=1, status="complete"))
        assert says in report


def test_an_assisted_peer_starts_each_round_afresh():
    """A bench round's methods are built afresh; the peers were reused, so the heuristic schedule an
    assisted peer learned in round one carried into round two."""
    from specula.bench.peers import HFPeer

    model, draft = tiny_model("qwen2", seed=3), tiny_model("qwen2", seed=4)
    peer = HFPeer("hf:assisted-heuristic", model, [1], draft)
    peer._assistant_config.num_assistant_tokens = 59  # what round one's calls left
    again = peer.fresh()
    assert again is not peer and again.name == peer.name and again.model is model and again.assistant is draft
    assert again._assistant_config.num_assistant_tokens != 59


def test_the_warm_up_decodes_a_prompt_of_its_own_not_a_timed_one(tmp_path, chat_tokenizer):
    """A drafter that learns across requests (token recycling) had seen the first timed prompt's
    answer in the warm-up: that prompt's mean accepted read 1.78 against 1.00."""
    from specula.bench.runner import WARMUP_PROMPT, conversation_ids

    prompts = [BenchPrompt(i, "c", (f"w{5 + i} w6",), "c") for i in range(2)]
    methods = [ScriptedMethod("none", [[7, 8]]), ScriptedMethod("x", [[7, 8]])]
    run_bench(methods, chat_tokenizer, prompts, BenchSettings(SamplingParams(max_new_tokens=2), warmup_tokens=2,
                                                              progress=False), tmp_path)
    timed = [conversation_ids(chat_tokenizer, p.turns[:1], [], False) for p in prompts]
    for method in methods:
        assert method.seen[0] == conversation_ids(chat_tokenizer, [WARMUP_PROMPT], [], False)
        assert method.seen[0] not in timed and sorted(method.seen[1:]) == sorted(timed)


def test_an_interrupted_round_is_left_out_of_the_spread(tmp_path, chat_tokenizer):
    """Round 3 stopped after one of its two prompts: its one prompt read as a round (a max of 2.00x
    where every whole round ran 1.00x)."""
    prompts = [BenchPrompt(i, "c", (f"w{5 + i} w6",), "c") for i in range(2)]
    later = iter([[ScriptedMethod("none", [[7, 8]]), ScriptedMethod("x", [[7, 8]])],
                  [ScriptedMethod("none", [[7, 8]]), ScriptedMethod("x", [[7, 8]], seconds=0.005,
                                                                         interrupt_on_call=3)]])
    settings = BenchSettings(SamplingParams(max_new_tokens=2), warmup_tokens=2, progress=False, repeats=3)
    result = run_bench([ScriptedMethod("none", [[7, 8]]), ScriptedMethod("x", [[7, 8]])], chat_tokenizer, prompts,
                       settings, tmp_path, fresh_methods=lambda: next(later))
    assert result.interrupted and result.document["prompts_done"] == 5
    spread = result.document["summary"]["x"]["rounds"]
    assert spread["count"] == 2 and spread["partial"] == [3] and spread["speedup"]["values"] == [1.0, 1.0]
    report = (tmp_path / "report.md").read_text()
    assert "## Across 2 rounds" in report and "Round 3 did not run every prompt" in report


def test_the_report_states_the_settings_the_run_used_from_python_too(tmp_path, chat_tokenizer):
    """report.md took sampling, budget, EOS rule, seed and warm-up from the command line's config
    alone: called from Python it read "temperature None ... stop at EOS ... after one warm-up", and
    rounds on the same method objects were said to be built afresh."""
    prompts = [BenchPrompt(1, "c", ("w5 w6",), "c")]
    params = SamplingParams(temperature=0.7, max_new_tokens=6, ignore_eos=True, seed=3)
    run_bench([ScriptedMethod("none", [[7, 8]]), ScriptedMethod("x", [[7, 8]])], chat_tokenizer, prompts,
              BenchSettings(params, warmup_tokens=0, progress=False, repeats=2), tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "sampling (temperature 0.7, top-k 0, top-p 1.0), max 6 new tokens, EOS ignored (fixed budget), seed 3" \
        in report
    assert "without warm-up" in report and "on the same methods (what their drafters learned" in report
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["run"]["fresh_rounds"] is False and doc["run"]["warmup_tokens"] == 0


def test_a_peer_that_ends_on_eos_at_the_budget_says_stop():
    from specula.bench.runner import _peer_finish

    class Peer:
        eos = [0]

    assert _peer_finish([5, 0], Peer(), 2, ignore_eos=False) == "stop"  # EOS on the budget's last token
    assert _peer_finish([5, 0], Peer(), 2, ignore_eos=True) == "length"
    assert _peer_finish([5, 6], Peer(), 2, ignore_eos=False) == "length"
    assert _peer_finish([5], Peer(), 2, ignore_eos=False) == "stop"
