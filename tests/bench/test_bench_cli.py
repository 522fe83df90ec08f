"""`specula bench` end to end on tiny models (loading monkeypatched): exit codes and messages."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest

import specula.commands.bench as bench_cmd
from specula.bench.datasets import load_prompts, select_prompts
from specula.cli import main
from specula.drafters.base import Proposal
from specula.errors import ConfigError
from specula.methods import METHODS, MethodSpec
from specula.planner.cost import DEFAULT_SIZES
from tiny import VOCAB


@pytest.fixture
def tiny_models(monkeypatch, tiny_pair, chat_tokenizer):
    """`specula bench` loads the tiny pair instead of real models."""
    target, draft = tiny_pair
    loaded = []

    def load_models(args):
        from specula.commands.common import explicit_draft

        loaded.append(args.target)  # `--draft auto` on a tiny target: no draft
        return target, chat_tokenizer, (draft if explicit_draft(args) else None)

    monkeypatch.setattr(bench_cmd, "load_models", load_models)
    return loaded


class CorruptingDrafter:
    """A buggy drafter: proposes nothing, but after its 3rd step overwrites the request's cached
    last token with another one (as a drafter that got hold of the target's cache could). It
    grabs the sequence the engine opened for the request just before calling `start()`."""

    name = "corrupt"

    def __init__(self, target):
        self.opened = []
        original = target.new_sequence

        def new_sequence():
            seq = original()
            self.opened.append(seq)
            return seq

        target.new_sequence = new_sequence  # the test's tiny backend (a fixture of its own)

    def start(self):
        return {"seq": self.opened[-1], "steps": 0}

    def propose(self, ctx, state):
        return Proposal.empty()

    def observe(self, step, state):
        state["steps"] += 1
        if state["steps"] == 3:
            seq = state["seq"]
            last = seq.tokens[-1]
            seq.crop(len(seq.tokens) - 1)
            seq.prefill([(last + 7) % VOCAB], logits="none")

    def finish(self, state):
        return None


@pytest.fixture
def corrupt_method(monkeypatch):
    module = types.ModuleType("specula_test_corrupt_drafter")
    module.create = lambda *, target=None, draft=None, **options: CorruptingDrafter(target)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(METHODS, "corrupt", MethodSpec("corrupt", "a drafter that corrupts the cache", module.__name__))


def test_bench_cli_end_to_end(tmp_path, prompts_file, tiny_models, capsys):
    out = tmp_path / "run"
    code = main(["bench", "--target", "tiny", "--draft", "tiny-draft", "--methods", "prompt-lookup,draft-model",
                 "--prompts", str(prompts_file), "--per-category", "1", "--max-new-tokens", "8", "--compare", "hf",
                 "--num-draft-tokens", "3", "--profile-repeats", "1", "--warmup-tokens", "2", "--no-progress",
                 "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert tiny_models == ["tiny"]  # models loaded once
    doc = json.loads((out / "results.json").read_text())
    assert [m["name"] for m in doc["methods"]] == [
        "none", "prompt-lookup", "draft-model", "hf:greedy", "hf:assisted", "hf:assisted-heuristic", "hf:prompt-lookup"]
    assert doc["status"] == "complete" and doc["prompts_done"] == 2
    # a loader without a load report: the draft as --draft names it, its quantization not known
    assert [m["name"] for m in doc["methods"] if m["draft"] == {"model": "tiny-draft", "quantize": None}] == [
        "draft-model", "hf:assisted", "hf:assisted-heuristic"]
    assert doc["config"]["max_new_tokens"] == 8 and doc["config"]["seed"] == 0
    assert doc["config"]["drafter_options"]["draft-model"] == {"num_draft_tokens": 3}
    expected = select_prompts(load_prompts(str(prompts_file)), per_category=1, seed=0)
    assert doc["config"]["prompt_ids"] == [p.id for p in expected]
    assert doc["cost_curve"]["context"] == 192  # clamped to the tiny model's 256 positions - 64
    sizes = doc["cost_curve"]["sizes"]  # the timing cuts sizes past paying (a pass slowed twice by a busy machine)
    assert len(sizes) >= 2 and sizes == list(DEFAULT_SIZES[:len(sizes)])
    assert max(len(d) for d in (r["depth_drafted"] for r in doc["runs"] if r["method"] == "draft-model")) <= 3
    for name in ("prompt-lookup", "draft-model"):
        assert doc["summary"][name]["identical_fraction"] == 1.0
    assert "prompt-lookup: " in captured.out and "x vs none" in captured.out
    for name in ("report.md", "speedup_by_category.png", "accepted_lengths.png", "cost_curve.png"):
        assert (out / name).stat().st_size > 0
    # load time and peak memory: the loader here gives no report, so as measured around it
    load = doc["load"]
    assert load["total_s"] >= 0 and load["peak_rss_bytes"] > 10 * 2**20 and load["cost_curve_s"] > 0
    assert doc["peak_rss_bytes"] >= load["peak_rss_bytes"]
    report = (out / "report.md").read_text()
    assert "- load: " in report and "cost curve" in report and "peak RSS" in report and "for the whole run" in report


def test_repeats_run_rounds_on_methods_built_afresh(tmp_path, prompts_file, tiny_models, monkeypatch, capsys):
    import specula.bench.methods as bench_methods

    built = []
    real = bench_methods.build_specula_methods

    def counting(*args, **kwargs):
        methods = real(*args, **kwargs)
        built.append(methods)
        return methods

    monkeypatch.setattr(bench_methods, "build_specula_methods", counting)
    out = tmp_path / "rounds"
    code = main(["bench", "--target", "tiny", "--methods", "prompt-lookup", "--prompts", str(prompts_file),
                 "--per-category", "1", "--max-new-tokens", "6", "--profile-repeats", "0", "--warmup-tokens", "2",
                 "--repeats", "3", "--no-progress", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert tiny_models == ["tiny"]  # the models are loaded once; the methods are built once a round
    assert len(built) == 3 and len({id(m.spec) for methods in built for m in methods}) == 6
    doc = json.loads((out / "results.json").read_text())
    assert doc["repeats"] == 3 and doc["prompts_done"] == doc["prompts_total"] == 6
    assert sorted({r["round"] for r in doc["runs"]}) == [1, 2, 3]
    rounds = doc["summary"]["prompt-lookup"]["rounds"]
    assert rounds["count"] == 3 and len(rounds["speedup"]["values"]) == 3
    assert rounds["speedup"]["min"] <= rounds["speedup"]["median"] <= rounds["speedup"]["max"]
    assert doc["summary"]["none"]["rounds"]["speedup"]["values"] == [1.0, 1.0, 1.0]
    assert "min / median / max over 3 rounds" in captured.out
    assert "## Across 3 rounds" in (out / "report.md").read_text()


def test_bench_records_the_load_report(tmp_path, prompts_file, tiny_pair, chat_tokenizer, monkeypatch, capsys):
    from specula.models.loading import LoadReport

    report = LoadReport(target_seconds=1.5, draft_seconds=0.25, other_seconds=0.5, total_seconds=2.25,
                        peak_rss_bytes=3 * 2**30, target_prepared="hit", draft_prepared="built", process_seconds=4.0)
    monkeypatch.setattr(bench_cmd, "load_models", lambda args: (tiny_pair[0], chat_tokenizer, tiny_pair[1], report))
    out = tmp_path / "run"
    code = main(["bench", "--target", "tiny", "--draft", "tiny-draft", "--methods", "draft-model", "--prompts",
                 str(prompts_file), "--per-category", "1", "--max-new-tokens", "4", "--profile-repeats", "0",
                 "--warmup-tokens", "0", "--no-progress", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    doc = json.loads((out / "results.json").read_text())
    assert doc["load"] == report.to_dict()
    assert doc["load"]["target_prepared"] == "hit" and doc["load"]["draft_s"] == 0.25
    assert "loaded in 2.2 s (target 1.5 s [prepared: hit], draft 0.2 s [prepared: built]" in captured.err
    line = next(l for l in (out / "report.md").read_text().splitlines() if l.startswith("- load: "))
    assert line.startswith("- load: 2.2 s (target 1.5 s [prepared: hit], draft 0.2 s [prepared: built], other 0.5 s)")
    assert "peak RSS 3.0 GiB after loading" in line


@pytest.mark.parametrize("categories", [["beta,alpha"], ["beta", "alpha"], ["beta,", "alpha,beta"]])
def test_categories_take_commas_or_spaces_and_are_recorded_as_a_list(tmp_path, prompts_file, tiny_models, capsys,
                                                                      categories):
    """`--categories beta alpha` was refused as unrecognized arguments (analyze took only that form)."""
    out = tmp_path / "run"
    code = main(["bench", "--target", "tiny", "--methods", "none", "--prompts", str(prompts_file), "--categories",
                 *categories, "--per-category", "1", "--max-new-tokens", "2", "--profile-repeats", "0",
                 "--warmup-tokens", "0", "--no-progress", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["categories"] == ["beta", "alpha"] and doc["config"]["prompt_ids"] == ["b1", "a2"]


def test_budgets_are_capped_at_the_context_window_for_methods_and_peers_alike(tmp_path, tiny_models, capsys):
    """A prompt near the tiny model's 256 positions: specula stopped at the window while Hugging Face's generate
    ran its whole budget past it (compared on unequal budgets); a prompt that fills it is refused by name."""
    path = tmp_path / "long.jsonl"
    words = " ".join(f"w{5 + k % 40}" for k in range(300))
    rows = [{"id": "near", "category": "long", "turns": [" ".join(words.split()[:190])]},
            {"id": "full", "category": "full", "turns": [words]}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["bench", "--target", "tiny", "--methods", "prompt-lookup", "--compare", "hf:greedy", "--prompts", str(path),
            "--max-new-tokens", "32", "--ignore-eos", "--profile-repeats", "0", "--warmup-tokens", "2",
            "--no-progress"]
    assert main([*argv, "--categories", "long", "--out", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    assert doc["run"]["context_window"] == 256 and doc["run"]["max_new_tokens"] == 32
    room = 256 - doc["runs"][0]["prompt_tokens"]
    assert 0 < room < 32
    assert {(r["method"], r["new_tokens"], r["finish_reason"]) for r in doc["runs"]} == {
        ("none", room, "length"), ("prompt-lookup", room, "length"), ("hf:greedy", room, "length")}
    assert main([*argv, "--categories", "full", "--out", str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: prompt full (full) turn 1 takes ") and "fills the context window of 256" in err


def _two_turn_rows(first: int, second: int) -> list[dict]:
    """A one-turn prompt, then a two-turn one (id 81, as MT-bench's) of `first` and `second` words."""
    words = [f"w{5 + k % 40}" for k in range(first + second)]
    return [{"id": "one", "category": "single", "turns": [" ".join(words[:20])]},
            {"id": 81, "category": "mt", "turns": [" ".join(words[:first]), " ".join(words[first:])]}]


def test_a_later_turn_gets_room_in_the_window_the_first_one_shares(tmp_path, tiny_models, chat_tokenizer, capsys):
    """A two-turn prompt whose first answer, at its whole --max-new-tokens, left its second turn no room in the
    tiny model's 256 positions: the run failed at that turn, after the prompts before it. Each turn now gets at
    most an equal share of the room its turns have left (a note says so before the runs), the same for every
    method, so the second turn runs."""
    from specula.bench.runner import conversation_ids

    rows = _two_turn_rows(60, 20)
    path = tmp_path / "mt.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    assert main(["bench", "--target", "tiny", "--methods", "prompt-lookup", "--compare", "hf:greedy", "--prompts",
                 str(path), "--max-new-tokens", "200", "--ignore-eos", "--profile-repeats", "0", "--warmup-tokens",
                 "2", "--no-progress", "--out", str(out)]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    frame = len(conversation_ids(chat_tokenizer, rows[1]["turns"], [""]))  # both turns, the answer left empty
    share = (256 - frame) // 2
    assert "note: 1 multi-turn prompt(s) share the context window of 256 between their turns" in err
    assert f"(prompt: turn 1's budget; 81: {share})" in err
    doc = json.loads((out / "results.json").read_text())
    assert doc["status"] == "complete" and doc["prompts_done"] == 2
    runs = {(r["id"], r["turn"], r["method"]): r for r in doc["runs"]}
    for method in ("none", "prompt-lookup", "hf:greedy"):
        assert runs["one", 1, method]["new_tokens"] == 200  # a prompt of one turn keeps its whole budget
        first, second = runs[81, 1, method], runs[81, 2, method]
        assert (first["new_tokens"], first["finish_reason"]) == (share, "length")
        assert second["new_tokens"] == 256 - second["prompt_tokens"] > 0 and second["finish_reason"] == "length"


def test_the_prompts_fit_is_checked_once_a_run(tmp_path, tiny_models, monkeypatch, capsys):
    """The command checked the prompts' fit in the window before its cost curve, and run_bench checked it
    again (1.8 s for Spec-Bench's 480 prompts): once now, before the cost curve."""
    import specula.bench.runner as runner

    calls = []
    real = runner.check_prompts_fit
    monkeypatch.setattr(runner, "check_prompts_fit", lambda *args: calls.append(args[0]) or real(*args))
    path = tmp_path / "mt.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _two_turn_rows(10, 5)))
    assert main(["bench", "--target", "tiny", "--methods", "prompt-lookup", "--prompts", str(path),
                 "--max-new-tokens", "4", "--profile-repeats", "0", "--warmup-tokens", "2", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    assert len(calls) == 1 and [p.id for p in calls[0]] == ["one", 81]


def test_a_turn_that_cannot_fit_is_refused_before_anything_is_timed(tmp_path, tiny_models, monkeypatch, capsys):
    """A two-turn prompt whose second user turn alone leaves no room in the window: refused by prompt id, turn,
    length and window before the cost curve and the first timed prompt (it had failed after them)."""
    timed = []
    monkeypatch.setattr(bench_cmd, "_cost_curve", lambda args, target: timed.append("cost curve"))
    path = tmp_path / "mt.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _two_turn_rows(20, 240)))
    out = tmp_path / "run"
    assert main(["bench", "--target", "tiny", "--methods", "prompt-lookup", "--prompts", str(path),
                 "--max-new-tokens", "8", "--profile-repeats", "1", "--warmup-tokens", "2", "--no-progress",
                 "--out", str(out)]) == 2
    assert timed == [] and not (out / "results.json").exists()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"error: prompt 81 \(mt\) turn 2 takes \d+ tokens and with the earlier answers left empty "
                        r"leaves no room for its own and the earlier answers in the context window of 256 \(the "
                        r"smallest of the methods' and peers'\); leave it out \(--categories, --prompts\) or "
                        r"compare a longer-context peer", err), err


def test_a_target_window_too_short_for_the_cost_curve_names_what_bench_takes(tmp_path, prompts_file, tiny_pair,
                                                                             chat_tokenizer, monkeypatch, capsys):
    """A target whose window (<= 64 tokens) cannot hold the cost curve's passes: the advice names bench's own flags,
    --cost-curve and --methods none (it said `method="none"`, as a Python caller writes it: bench has no --method)."""
    target = tiny_pair[0]
    monkeypatch.setattr(target, "max_context", 64)
    monkeypatch.setattr(bench_cmd, "load_models", lambda args: (target, chat_tokenizer, None))
    assert main(["bench", "--target", "tiny", "--methods", "prompt-lookup", "--prompts", str(prompts_file),
                 "--per-category", "1", "--max-new-tokens", "4", "--no-progress", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: method 'prompt-lookup': the target's context window of 64 tokens is too short to time the planner's "
        "cost curve (passes of up to 64 tokens after a prefix); give a curve of passes that fit, --cost-curve FILE "
        "with the cost_curve.json of `specula profile --target MODEL --sizes 1,2,4,8,16,32 --context 32`, or decode "
        "plainly (--methods none)")


def test_bench_records_the_draft_model_each_method_drafts_with(tmp_path, prompts_file, tiny_pair, chat_tokenizer,
                                                                monkeypatch, capsys):
    """results.json `methods[].draft` and report.md's drafts line: the draft model as the load report names it
    (with its quantization) for the methods and assisted peers drafting with it, none for the others."""
    from specula.models.loading import DraftInfo, LoadReport

    report = LoadReport(target_seconds=1.0, draft_seconds=0.5, other_seconds=0.0, total_seconds=1.5,
                        peak_rss_bytes=2**30, draft=DraftInfo("tiny-draft", "int8"))
    monkeypatch.setattr(bench_cmd, "load_models", lambda args: (tiny_pair[0], chat_tokenizer, tiny_pair[1], report))
    out = tmp_path / "run"
    code = main(["bench", "--target", "tiny", "--draft", "tiny", "--methods",
                 "prompt-lookup,draft-model,fusion:draft=none", "--num-draft-tokens", "2",
                 "--compare", "hf:greedy,hf:assisted", "--prompts", str(prompts_file), "--per-category", "1",
                 "--max-new-tokens", "4", "--profile-repeats", "0", "--warmup-tokens", "0", "--no-progress",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    drafted, nothing = {"model": "tiny-draft", "quantize": "int8"}, {"model": None, "quantize": None}
    assert doc["load"]["draft"] == drafted
    assert {m["name"]: m["draft"] for m in doc["methods"]} == {
        "none": nothing, "prompt-lookup": nothing, "draft-model": drafted, "fusion:draft=none": nothing,
        "hf:greedy": nothing, "hf:assisted": drafted}
    assert ("- drafts: none for none, prompt-lookup, fusion:draft=none, hf:greedy; tiny-draft (int8) for draft-model, "
            "hf:assisted") in (out / "report.md").read_text().splitlines()
    # each entry's options as it ran: fusion:draft=none without the draft model's --num-draft-tokens
    options = doc["config"]["drafter_options"]
    assert options["draft-model"] == {"num_draft_tokens": 2} and options["fusion:draft=none"] == {"target_name": "tiny"}


def test_penalties_run_every_method_on_the_penalised_distribution(tmp_path, prompts_file, tiny_models, capsys):
    """--repetition-penalty and the others reach every method: the lossless ones output penalised plain
    decoding's tokens (the bench's identity check), which differ from unpenalised decoding's, and the run
    records them."""
    outs = {}
    for name, penalty in (("plain", []), ("penalised", ["--repetition-penalty", "1.5", "--logit-bias", "3=2"])):
        code = main(["bench", "--target", "tiny", "--methods", "none,prompt-lookup", "--prompts", str(prompts_file),
                     "--per-category", "1", "--max-new-tokens", "12", "--profile-repeats", "0", "--warmup-tokens",
                     "0", "--no-progress", "--out", str(tmp_path / name), *penalty])
        assert code == 0, capsys.readouterr().err
        outs[name] = json.loads((tmp_path / name / "results.json").read_text())
    doc = outs["penalised"]
    assert doc["summary"]["prompt-lookup"]["identical_fraction"] == 1.0
    assert doc["run"]["repetition_penalty"] == 1.5 and doc["run"]["logit_bias"] == {"3": 2.0}
    tokens = {name: [r["token_ids"] for r in d["runs"] if r["method"] == "none"] for name, d in outs.items()}
    assert tokens["penalised"] != tokens["plain"]
    assert "repetition penalty 1.5" in (tmp_path / "penalised" / "report.md").read_text()


def test_lossless_mismatch_exits_1_naming_prompt_and_method(tmp_path, prompts_file, tiny_models, corrupt_method,
                                                           capsys):
    out = tmp_path / "bad"
    code = main(["bench", "--target", "tiny", "--methods", "none,corrupt", "--prompts", str(prompts_file),
                 "--categories", "beta", "--per-category", "1", "--max-new-tokens", "12", "--profile-repeats", "0",
                 "--warmup-tokens", "0", "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    assert "corrupt output differs from plain decoding on prompt b1 (beta, turn 1" in lines[0]
    doc = json.loads((out / "results.json").read_text())  # results written before exiting
    assert doc["status"] == "complete"
    assert [(m["method"], m["id"]) for m in doc["mismatches"]] == [("corrupt", "b1")]
    assert doc["mismatches"][0]["first_difference"] >= 3  # the corruption happens after step 3
    assert doc["mismatches"][0]["logit_gap"] > 0  # the plain forward prefers the reference token
    assert doc["summary"]["corrupt"]["identical_fraction"] == 0.0
    assert (out / "report.md").exists()


@pytest.mark.parametrize("argv, message", [
    (["--methods", "none,warp-drive"], "unknown method 'warp-drive'"),
    (["--stop", "x"], "bench does not take --stop"),
    # the peers would decode the unpenalised distribution beside penalised methods
    (["--compare", "hf:greedy", "--repetition-penalty", "1.2"],
     "the peers of --compare decode without specula's penalties"),
    (["--frequency-penalty", "3"], "--frequency-penalty must be between -2 and 2"),
    (["--logit-bias", "5"], "--logit-bias takes ID=BIAS"),
    (["--compare", "hf:assisted"], "needs a draft model: pass --draft MODEL"),
    (["--categories", "zeta"], "error: --categories names an unknown category 'zeta'; choose from: alpha, beta"),
    (["--categories", "alpha", "zeta,"], "--categories names an unknown category 'zeta'; choose from: alpha, beta"),
    # load_prompts names its keyword, source=: the command shows its flag
    (["--prompts", "/nonexistent/p.jsonl"], "error: prompts file '/nonexistent/p.jsonl' not found; give --prompts "
     "one of spec-bench, everyday, structured or a JSONL file\n"),
    # was every category, silently
    (["--categories", ","], "error: --categories names no category; pass one or more of: alpha, beta"),
    (["--per-category", "0"], "--per-category must be >= 1, got 0\n"),
    (["--methods", "draft-model"], "needs a draft model"),
    (["--repeats", "0"], "repeats must be >= 1, got 0; pass e.g. --repeats 3\n"),
    # the note blamed the target's context window, and the cost curve was skipped
    (["--profile-context", "0"], "--profile-context must be >= 1, got 0"),
    # a variant's value of the wrong kind: a TypeError traceback after loading the models
    (["--methods", "none,prompt-lookup:max_ngram=abc"], "method variant 'prompt-lookup:max_ngram=abc'"),
    (["--methods", "none,prompt-lookup:max_ngram=-1"], "need 1 <= min_ngram <= max_ngram"),
    (["--methods", "none,prompt-lookup:warp=1"], "prompt-lookup does not take warp"),
    # a switch given another value ran as on
    (["--methods", "draft-model:adaptive=maybe"],
     "method variant 'draft-model:adaptive=maybe': adaptive is a switch: it takes true or false, got 'maybe'"),
    # a method flag no benched method takes was dropped without a word (and recorded in results.json)
    (["--methods", "none,prompt-lookup", "--num-draft-tokens", "3"],
     "--num-draft-tokens does not apply to the methods benched (none, prompt-lookup)"),
    (["--methods", "none,prompt-lookup", "--max-tree-nodes", "0"],  # was found once the models had loaded
     "--max-tree-nodes must be an integer >= 1, got 0"),
    (["--methods", "none", "--cost-curve", "c.json"],  # plain decoding has no planner: the curve was ignored
     "--cost-curve only matters when drafting, and method none (the only one benched) drafts nothing"),
    (["--methods", "none", "--max-tree-nodes", "64"],  # the default's value, told apart from it: it was ignored
     "--max-tree-nodes only matters when drafting, and method none (the only one benched) drafts nothing; drop "
     "--max-tree-nodes or add a method that drafts to --methods"),
])
def test_bad_arguments_one_line_exit_2(tmp_path, prompts_file, tiny_models, argv, message, capsys):
    code = main(["bench", "--target", "tiny", "--prompts", str(prompts_file), "--no-progress",
                 "--profile-repeats", "0", "--out", str(tmp_path / "x"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert tiny_models == [] or "draft model" in message  # before any model loads (--draft auto: after the target's)


@pytest.mark.parametrize("argv, message, before_loading", [
    (["--draft", "none", "--methods", "fusion", "--num-draft-tokens", "3"],
     "method 'fusion': --num-draft-tokens is for a draft model or layer skipping, and fusion drafts with neither here "
     "(no draft model given); give it a draft model with --draft MODEL, or drop --num-draft-tokens", True),
    (["--draft", "skip", "--methods", "fusion", "--draft-window", "64"],
     "method 'fusion': --draft-window is for a draft model, and fusion drafts with the target's own layers skipped "
     "here, not a draft model; drop --draft-window, or give a draft model with --draft MODEL instead", True),
    (["--draft", "tiny", "--methods", "draft-model,fusion:draft=none:draft_window=64"],
     "method variant 'fusion:draft=none:draft_window=64': draft_window is for the draft model, which draft=none takes "
     "away; drop one of them", True),
    # --draft auto picks none for the tiny target: refused once it has loaded, saying so
    (["--methods", "fusion", "--num-draft-tokens", "3"],
     "method 'fusion': --num-draft-tokens is for a draft model or layer skipping, and fusion drafts with neither here "
     "(the default draft choice, auto, picks one for targets of >= 1B parameters, and this one has ", False),
    (["--methods", "fusion:draft_window=0"],
     "method variant 'fusion:draft_window=0': draft_window is for a draft model, and fusion drafts without one here "
     "(the default draft choice, auto, picks one", False),
    (["--draft", "none", "--methods", "fusion:skip_layers=1"],  # the drafters' draft_skip=True: --draft skip
     "method variant 'fusion:skip_layers=1': skip_layers is for layer skipping, and fusion drafts without it here (no "
     "--draft skip); add --draft skip (the target drafting with layers skipped) or drop skip_layers\n", False),
])
def test_a_draft_model_flag_fusion_would_not_read_is_refused(tmp_path, prompts_file, tiny_models, capsys, argv,
                                                             message, before_loading):
    """fusion with no draft model (--draft none, or auto picking none) read neither --num-draft-tokens nor
    --draft-window, nor --draft-window with --draft skip; each was ignored without a word. Refused before the models
    load where the draft is known, a variant's own option named as it writes it."""
    code = main(["bench", "--target", "tiny", "--prompts", str(prompts_file), "--no-progress", "--profile-repeats", "0",
                 "--out", str(tmp_path / "x"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert (tiny_models == []) == before_loading


@pytest.mark.parametrize("argv, message", [
    (["--methods", "fusion:head=none", "--head-window", "3"],
     "--head-window applies to no method benched as written (fusion:head=none runs without a trained head); drop "
     "--head-window or add a method it applies to, to --methods"),
    (["--methods", "prompt-lookup,fusion:head=none", "--online-distill"],
     "--online-distill applies to no method benched as written (fusion:head=none runs without a trained head)"),
    (["--draft", "tiny", "--methods", "draft-tree,fusion:draft=none", "--num-draft-tokens", "3"],
     "--num-draft-tokens applies to no method benched as written (fusion:draft=none runs without a draft model)"),
    (["--draft", "tiny", "--methods", "draft-tree:tree_depth=3,eagle:tree_depth=2", "--tree-depth", "5"],
     "--tree-depth applies to no method benched as written (draft-tree:tree_depth=3 sets its own; eagle:tree_depth=2 "
     "sets its own)"),
])
def test_a_flag_every_entry_taking_it_drops_or_sets_is_refused_before_loading(tmp_path, prompts_file, tiny_models,
                                                                               capsys, argv, message):
    """fusion:head=none runs without the command line's head options, fusion:draft=none without its draft model's,
    and a variant's own option wins over the flag: with no other entry taking the flag, it was ignored without a
    word."""
    code = main(["bench", "--target", "tiny", "--prompts", str(prompts_file), "--no-progress", "--out",
                 str(tmp_path / "x"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert tiny_models == []


@pytest.mark.parametrize("argv", [["--methods", "fusion:head=none,fusion", "--head-window", "3"],
                                  ["--methods", "fusion,fusion:draft=none", "--num-draft-tokens", "3"],
                                  ["--methods", "draft-tree:tree_depth=3,draft-tree", "--tree-depth", "5"]])
def test_a_flag_one_entry_runs_with_is_taken(tmp_path, prompts_file, argv):
    from specula.cli import build_parser

    args = build_parser().parse_args(["bench", "--target", "tiny", "--draft", "tiny-draft", "--prompts",
                                      str(prompts_file), "--out", str(tmp_path / "x"), *argv])
    assert bench_cmd.plan(args).methods[1:] == argv[1].split(",")


@pytest.mark.parametrize("argv, message, before_loading", [
    (["--methods", "draft-tree:tree_verifier=kseq"],  # named --tree-sampling iid with --tree-verifier kseq
     "method variant 'draft-tree:tree_verifier=kseq': tree_verifier=kseq needs i.i.d. siblings: use tree_sampling=iid "
     "with tree_verifier=kseq", True),
    (["--methods", "draft-tree:tree_sampling=beam", "--tree-verifier", "kseq"],  # --tree-sampling iid: the variant's
     "method variant 'draft-tree:tree_sampling=beam': --tree-verifier kseq needs i.i.d. siblings: use "  # wins
     "tree_sampling=iid with --tree-verifier kseq", False),
    (["--methods", "draft-tree", "--tree-verifier", "kseq"],
     "method 'draft-tree': --tree-verifier kseq needs i.i.d. siblings: use --tree-sampling iid with --tree-verifier "
     "kseq", False),
])
def test_an_error_names_options_as_the_user_wrote_them(tmp_path, prompts_file, tiny_models, capsys, argv, message,
                                                       before_loading):
    """A variant's own options as Python names them (as it writes them), the command line's as flags: the library
    named some options by their flags in its messages, which a variant did not write (tree_verifier=kseq)."""
    code = main(["bench", "--target", "tiny", "--draft", "tiny", "--prompts", str(prompts_file), "--no-progress",
                 "--profile-repeats", "0", "--out", str(tmp_path / "x"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert (tiny_models == []) == before_loading


def test_bad_prompt_file_names_the_line(tmp_path, tiny_models, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": 1, "turns": ["w5"]}\n{"id": 2, "turns": ["w6"}\n')
    code = main(["bench", "--target", "tiny", "--prompts", str(path), "--out", str(tmp_path / "x")])
    assert code == 2
    assert "line 2: not valid JSON" in capsys.readouterr().err
    assert tiny_models == []  # rejected before loading any model


@pytest.mark.parametrize("assistant, message", [("nowhere", "no such file or directory"),
                                                ("p.jsonl", "is a file but not a .gguf")])
def test_a_bad_assistant_path_is_refused_before_the_target_loads(tmp_path, prompts_file, tiny_models, capsys,
                                                                 assistant, message):
    (tmp_path / "p.jsonl").write_text("{}\n")
    code = main(["bench", "--target", "tiny", "--prompts", str(prompts_file), "--compare", "hf", "--assistant",
                 str(tmp_path / assistant), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --assistant: ") and message in err and err.count("\n") == 1
    assert tiny_models == []  # found missing only after the target had loaded


@pytest.mark.parametrize("compare", [[], ["--compare", "hf:greedy,hf:prompt-lookup"]])
def test_an_assistant_no_assisted_peer_uses_is_refused(tmp_path, prompts_file, tiny_models, capsys, compare):
    """--assistant without an assisted peer to draft for was ignored without a word."""
    code = main(["bench", "--target", "tiny", "--prompts", str(prompts_file), *compare, "--assistant", "self",
                 "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and "no assisted peer is compared" in err and err.count("\n") == 1, err
    assert tiny_models == []


@pytest.mark.parametrize("methods, flag", [("none,eagle", "--head"), ("none,eagle:head={}", None),
                                           ("none,rest", "--datastore"), ("none,rest:datastore={}", None)])
def test_missing_head_and_datastore_files_are_refused_before_the_target_loads(tmp_path, prompts_file, tiny_models,
                                                                              capsys, methods, flag):
    missing = tmp_path / ("gone.safetensors" if "eagle" in methods else "gone.specds")
    argv = ["--methods", methods.format(missing), *([flag, str(missing)] if flag else [])]
    code = main(["bench", "--target", "tiny", "--prompts", str(prompts_file), "--no-progress", "--out",
                 str(tmp_path / "x"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "does not exist" in err and str(missing) in err, err
    assert tiny_models == []  # found missing only after the target had loaded


@pytest.mark.parametrize("argv, message", [
    (["--draft", "tiny-draft", "--methods", "none,prompt-lookup"],
     "no method benched (none, prompt-lookup) drafts with a draft model, so --draft tiny-draft would not be used"),
    (["--draft", "self", "--methods", "none,fusion:draft=none"], "so --draft self would not be used"),
    (["--draft", "tiny-draft", "--methods", "none", "--compare", "hf", "--assistant", "self"],
     "so --draft tiny-draft would not be used"),  # the assisted peers draft with --assistant
    (["--draft-quantize", "int8", "--methods", "none,prompt-lookup"], "--draft-quantize applies to a draft model"),
    (["--draft-vocab", "full", "--methods", "none,prompt-lookup"], "--draft-vocab applies to a draft model"),
])
def test_a_draft_no_benched_method_uses_is_refused(tmp_path, prompts_file, tiny_models, capsys, argv, message):
    """A draft no method (nor assisted peer) drafts with was never loaded, without a word, and report.md named
    it as the run's draft."""
    code = main(["bench", "--target", "tiny", "--prompts", str(prompts_file), "--no-progress", "--out",
                 str(tmp_path / "x"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert "draft-model, draft-tree, fusion" in err and tiny_models == []


@pytest.mark.parametrize("argv", [["--methods", "none", "--compare", "hf:assisted"],
                                  ["--methods", "none,fusion:draft=none,draft-model"]])
def test_a_draft_an_assisted_peer_or_one_method_uses_is_taken(tmp_path, prompts_file, argv):
    from specula.cli import build_parser

    args = build_parser().parse_args(["bench", "--target", "tiny", "--draft", "tiny-draft", "--prompts",
                                      str(prompts_file), "--out", str(tmp_path / "x"), *argv])
    assert bench_cmd.plan(args).prompts


def test_sigterm_ends_the_bench_like_ctrl_c():
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with bench_cmd._sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode
            for _ in range(1000):
                pass
    assert signal.getsignal(signal.SIGTERM) is before


def test_reduced_precision_mismatches_are_reported_not_failed(tmp_path, prompts_file, tiny_models, corrupt_method,
                                                              tiny_pair, capsys):
    """A target whose guarantee is 'near-ties' (bfloat16 verification) may flip near-tied tokens:
    the bench reports the outputs that differ and exits 0, naming the float32 fix."""
    target, _ = tiny_pair
    target.greedy_guarantee = "near-ties"
    out = tmp_path / "bf16"
    code = main(["bench", "--target", "tiny", "--methods", "none,corrupt", "--prompts", str(prompts_file),
                 "--categories", "beta", "--per-category", "1", "--max-new-tokens", "12", "--profile-repeats", "0",
                 "--warmup-tokens", "0", "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0
    assert "note: corrupt output differs" in err and "--dtype float32" in err
    doc = json.loads((out / "results.json").read_text())
    assert doc["greedy_guarantee"] == "near-ties" and len(doc["mismatches"]) == 1
    assert "expected here" in (out / "report.md").read_text()


def test_a_second_bench_into_the_same_out_leaves_nothing_of_the_first(tmp_path, prompts_file, tiny_models,
                                                                      monkeypatch, capsys):
    """Interrupted before its first prompt, the second bench leaves no results.json of the first
    (exit 130 says the prompts done are there); complete without a cost curve, no cost_curve.png of
    the first stands beside its results."""
    out = tmp_path / "run"
    common = ["bench", "--target", "tiny", "--methods", "prompt-lookup", "--prompts", str(prompts_file),
              "--per-category", "1", "--max-new-tokens", "4", "--warmup-tokens", "1", "--no-progress",
              "--out", str(out)]
    assert main([*common, "--profile-repeats", "1"]) == 0
    assert (out / "cost_curve.png").exists() and (out / "results.json").exists()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    real = bench_cmd._cost_curve
    monkeypatch.setattr(bench_cmd, "_cost_curve", interrupted)
    assert main([*common, "--profile-repeats", "1"]) == 130
    assert not (out / "results.json").exists() and not (out / "cost_curve.png").exists()
    monkeypatch.setattr(bench_cmd, "_cost_curve", real)
    assert main([*common, "--profile-repeats", "1"]) == 0
    assert main([*common, "--profile-repeats", "0"]) == 0  # no cost curve this time
    assert json.loads((out / "results.json").read_text())["cost_curve"] is None
    assert not (out / "cost_curve.png").exists()
    capsys.readouterr()


def test_an_hf_peers_errors_name_what_a_python_caller_gives(tiny_pair):
    """HFPeer (bench's Python API) told a caller missing the assisted peers' model to "pass --draft MODEL" and one
    with stop strings to "drop --stop"; the command line never reaches either (--compare and --stop are checked
    first)."""
    from specula.bench.peers import HFPeer
    from specula.sampling import SamplingParams

    model = tiny_pair[0].reference_model()
    with pytest.raises(ConfigError, match=r"^peer hf:assisted needs a draft model: pass assistant= \(the draft's model "
                                          r"object\)$"):
        HFPeer("hf:assisted", model, [1])
    with pytest.raises(ConfigError, match="^Hugging Face peers do not take stop strings in the bench; drop stop= from "
                                          "the SamplingParams$"):
        HFPeer("hf:greedy", model, [1]).generate([5, 17], SamplingParams(max_new_tokens=2, stop=("x",)))


def test_hf_peers_ignore_processors_a_checkpoints_generation_config_sets(tiny_pair):
    from specula.bench.peers import HFPeer
    from specula.sampling import SamplingParams

    target, _ = tiny_pair
    model = target.reference_model()
    peer = HFPeer("hf:greedy", model, [1])
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    clean = peer.generate([5, 17, 33, 2], params).token_ids
    saved = model.generation_config
    try:
        model.generation_config.suppress_tokens = [clean[0]]  # a checkpoint that suppresses a token
        model.generation_config.bad_words_ids = [[clean[1]]]
        assert peer.generate([5, 17, 33, 2], params).token_ids == clean
        assert model.generation_config is saved  # given back after the call
    finally:
        model.generation_config.suppress_tokens = None
        model.generation_config.bad_words_ids = None


def test_an_assistant_self_on_cuda_names_benchs_own_flag_before_the_target_loads(tmp_path, prompts_file, tiny_models,
                                                                                   capsys, monkeypatch):
    """--assistant self on a GPU was refused by the self-draft's check, after the target had loaded, with its advice
    for --draft (--draft self, use --draft skip), which is not the flag given and cannot draft for Hugging Face's
    assisted peers."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code = main(["bench", "--target", "tiny", "--prompts", str(prompts_file), "--methods", "none", "--compare", "hf",
                 "--assistant", "self", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and err == (
        "error: --assistant self drafts with the target's weights quantized, which runs on CPU only, not on cuda:0; "
        "there use another model (--assistant MODEL, same tokenizer as the target)\n"), err
    assert tiny_models == []
