"""`specula generate` end to end on a tiny model (loading monkeypatched): output, --compare, --json."""

from __future__ import annotations

import json

import pytest

from tiny import tiny_model
import specula.api
from specula.cli import main
from specula.models.hf import HFCausalLM


@pytest.fixture
def tiny_load(monkeypatch, tiny_tokenizer):
    model = tiny_model("qwen2", seed=3)

    def load(target, draft=None, method=None, config=None, draft_quantize=None, skip_layers=None, draft_vocab=None, **options):
        return specula.api.Specula(HFCausalLM(model, "target"), tiny_tokenizer, method or "fusion", **options)

    monkeypatch.setattr(specula.api, "load", load)


def run(capsys, *extra: str) -> tuple[int, str, str]:
    code = main(["generate", "--target", "tiny", "--prompt", "w5 w17 w33 w5 w17 w40", "--raw", "--max-new-tokens", "16",
                 "--ignore-eos", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_greedy_compare_says_identical(tiny_load, capsys):
    code, out, err = run(capsys, "--compare")
    assert code == 0 and out.strip()
    assert "output identical to plain decoding" in err and "speedup vs plain decoding" in err


def test_compare_warms_up_both_before_timing_either(tiny_load, capsys, monkeypatch):
    """The process's first request pays one-time costs: `--compare` runs the method and plain
    decoding each once, untimed, for 2 tokens before the two timed runs (charged to the method
    alone, plain decoding read 0.63-1.16x against itself)."""
    calls = []
    real_generate, real_stream = specula.api.Specula.generate, specula.api.Specula.stream
    monkeypatch.setattr(specula.api.Specula, "generate", lambda self, prompt, **kw: (
        calls.append((self.method, kw["params"].max_new_tokens)), real_generate(self, prompt, **kw))[1])
    monkeypatch.setattr(specula.api.Specula, "stream", lambda self, prompt, **kw: (
        calls.append((self.method, "stream")), real_stream(self, prompt, **kw))[1])
    code, _, err = run(capsys, "--compare")
    assert code == 0
    assert calls == [("fusion", 2), ("none", 2), ("fusion", "stream"), ("none", 16)]
    calls.clear()
    assert run(capsys)[0] == 0 and calls == [("fusion", "stream")]  # no --compare: no warm-up


def test_sampled_compare_does_not_call_another_draw_a_bug(tiny_load, capsys):
    code, _, err = run(capsys, "--compare", "--temperature", "1.0", "--seed", "4", "--method", "prompt-lookup")
    assert code == 0
    assert "DIFFERENT" not in err and "sampled run: a draw from the same distribution as plain decoding" in err
    code, out, _ = run(capsys, "--compare", "--temperature", "1.0", "--seed", "4", "--json")
    payload = json.loads(out)
    assert payload["identical_to_plain"] is None and payload["speedup"] > 0
    code, out, _ = run(capsys, "--compare", "--json")
    assert json.loads(out)["identical_to_plain"] is True


@pytest.fixture(scope="module")
def skip_model_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny random 4-layer Qwen2 saved as a model directory (the native backend loads it)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-qwen2-4")
    tiny_tokenizer.save_pretrained(path)
    tiny_model("qwen2", layers=4).save_pretrained(path)  # the config decides the tokenizer class loading picks
    vocab = max(AutoTokenizer.from_pretrained(path).get_vocab().values()) + 1  # (without it: 96 logits, 97 ids)
    tiny_model("qwen2", seed=3, vocab=vocab, layers=4).save_pretrained(path)
    return str(path)


def run_skip(capsys, path: str, *extra: str) -> tuple[int, str]:
    code = main(["generate", "--target", path, "--prompt", "w5 w17 w33 w5 w17 w40", "--raw", "--max-new-tokens", "16",
                 "--ignore-eos", "--draft", "skip", *extra])
    return code, capsys.readouterr().err


def test_draft_skip_runs_lossless_and_bad_skip_sets_exit_2_naming_the_fix(skip_model_dir, capsys, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    code, err = run_skip(capsys, skip_model_dir, "--skip-layers", "attn:1-2", "--compare", "--method", "draft-model")
    assert code == 0 and "output identical to plain decoding" in err
    assert "loaded in " in err and "[prepared: built]" in err and "first token " in err and "peak RSS" in err
    code = main(["generate", "--target", skip_model_dir, "--prompt", "w5 w17", "--raw", "--max-new-tokens", "4",
                 "--draft", "none", "--json"])
    load = json.loads(capsys.readouterr().out)["load"]
    assert code == 0 and load["target_prepared"] == "hit"  # prepared by the first run, memory-mapped now
    assert load["total_s"] > 0 and load["peak_rss_bytes"] > 0 and load["first_token_process_s"] > 0
    code, err = run_skip(capsys, skip_model_dir, "--skip-layers", "9")  # the library names skip_layers: the flag
    assert code == 2 and "error: --skip-layers names layer 9, but the model has 4 layers" in err
    code, err = run_skip(capsys, skip_model_dir, "--draft-quantize", "int8")
    assert code == 2 and "drop --draft-quantize, or use --draft self with --draft-quantize int8\n" in err
    code, err = run_skip(capsys, skip_model_dir, "--backend", "hf")
    assert code == 2 and ("error: --draft skip needs the native backend (Llama, Qwen2, Mistral models): use --backend "
                          "native, or another draft (--draft MODEL)\n") in err


def test_a_draft_model_flag_is_refused_where_draft_auto_picks_none_saying_so(skip_model_dir, capsys, tmp_path,
                                                                            monkeypatch):
    """--draft auto (the default) picks no draft model for a small target: fusion's --num-draft-tokens was then
    ignored without a word; the refusal says why there is none, in flags. With a draft model it is read."""
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    base = ["generate", "--target", skip_model_dir, "--prompt", "w5 w17", "--raw", "--max-new-tokens", "2",
            "--backend", "hf", "--num-draft-tokens", "3"]
    code = main(base)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("error: --num-draft-tokens is for a draft model or layer skipping, and fusion "
                                        "drafts with neither here (the default draft choice, auto, picks one for "
                                        "targets of >= 1B parameters, and this one has "), err
    assert err.endswith("M); give it a draft model with --draft MODEL, or drop --num-draft-tokens"), err
    assert main([*base, "--draft", skip_model_dir]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("flags, expected", [
    (["--draft", "{dir}", "--method", "draft-model"], {"model": "{dir}", "quantize": "none"}),
    (["--draft", "{dir}", "--draft-quantize", "int8", "--method", "draft-model"],
     {"model": "{dir}", "quantize": "int8"}),
    (["--draft", "self", "--method", "draft-model"], {"model": "self", "quantize": "int8"}),  # self's default
    (["--draft", "{dir}", "--method", "prompt-lookup"], {"model": None, "quantize": None}),  # drafts without one
])
def test_json_load_report_names_the_draft_model_and_its_quantization(skip_model_dir, capsys, tmp_path, monkeypatch,
                                                                     flags, expected):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    if "prompt-lookup" in flags:  # a draft a method cannot use is refused: load one through the Python API instead
        spec = specula.api.load(skip_model_dir, draft=skip_model_dir, method="prompt-lookup",
                                config=specula.api.LoadConfig(backend="hf"))
        assert spec.load_report.to_dict()["draft"] == expected
        return
    code = main(["generate", "--target", skip_model_dir, "--prompt", "w5 w17", "--raw", "--max-new-tokens", "2",
                 "--backend", "hf", "--json", *(f.format(dir=skip_model_dir) for f in flags)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert json.loads(out.out)["load"]["draft"] == {k: v and v.format(dir=skip_model_dir) for k, v in expected.items()}


def test_backend_native_on_an_unsupported_architecture_exits_2_naming_backend_hf(tmp_path, tiny_tokenizer, capsys,
                                                                               monkeypatch):
    """A GPT-2 directory with --backend native: one-line error naming --backend hf, exit 2; auto falls back to hf."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-gpt2"
    tiny_tokenizer.save_pretrained(path)
    vocab = max(AutoTokenizer.from_pretrained(path).get_vocab().values()) + 1
    tiny_model("gpt2", seed=3, vocab=vocab).save_pretrained(path)
    args = ["generate", "--target", str(path), "--prompt", "w5 w17", "--raw", "--max-new-tokens", "4", "--draft", "none"]
    code = main([*args, "--backend", "native"])
    err = capsys.readouterr().err
    assert code == 2 and "--backend hf" in err and 'backend="' not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [err.strip().splitlines()[-1]]
    assert main([*args, "--backend", "auto"]) == 0
    capsys.readouterr()
    for argv in (["profile", "--target", str(path), "--out", str(tmp_path / "profile")],  # their loads show flags too
                 ["analyze", "acceptance", "--target", str(path), "--draft", str(path), "--out", str(tmp_path / "a")]):
        assert main([*argv, "--backend", "native"]) == 2, argv
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("error: --backend native runs ") and last.endswith(": use --backend hf"), last
    from specula.errors import ConfigError

    with pytest.raises(ConfigError, match=r'^backend="native" runs .*: use backend="hf"$'):  # load's caller: Python
        specula.api.load(str(path), method="none", config=specula.api.LoadConfig(backend="native"))


@pytest.fixture
def json_load(monkeypatch):
    from grammar_kit import JSON_CHARS, JSON_MERGES, VOCAB, byte_level_tokenizer

    model = tiny_model("llama", seed=3, vocab=VOCAB)
    tokenizer = byte_level_tokenizer(JSON_CHARS, JSON_MERGES)

    def load(target, draft=None, method=None, config=None, draft_quantize=None, skip_layers=None, draft_vocab=None, **options):
        return specula.api.Specula(HFCausalLM(model, "target"), tokenizer, method or "fusion", **options)

    monkeypatch.setattr(specula.api, "load", load)


@pytest.mark.parametrize("inline", [False, True])
def test_json_schema_output_is_valid_and_identical_to_constrained_plain(json_load, capsys, tmp_path, inline):
    """The schema from a file, or given inline: valid output, identical to constrained plain decoding."""
    schema = {"type": "object", "properties": {"name": {"enum": ["ab", "cd"]}, "n": {"type": "integer", "maximum": 99,
                                                                                    "minimum": 0}},
              "required": ["name", "n"], "additionalProperties": False}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schema))
    code = main(["generate", "--target", "tiny", "--prompt", '{"name": "ab', "--raw", "--max-new-tokens", "40",
                 "--json-schema", json.dumps(schema, indent=1) if inline else str(path), "--compare", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["identical_to_plain"] is True
    value = json.loads(payload["text"])
    assert set(value) == {"name", "n"} and value["name"] in ("ab", "cd")


@pytest.mark.parametrize("flags, words", [
    (["--regex", "a(b"], "cannot compile the regex"),
    (["--grammar", "/nonexistent.lark"], "cannot read the grammar file"),
    (["--json-schema", "/nonexistent.json"], "cannot read the JSON schema file"),
    (["--json-schema", '{"type": "object", '], "JSON schema"),  # inline, cut short
])
def test_bad_constraints_exit_2_with_one_line(json_load, capsys, flags, words):
    code = main(["generate", "--target", "tiny", "--prompt", "x", "--raw", *flags])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag, what", [("--grammar", "grammar"), ("--json-schema", "JSON schema")])
def test_a_constraint_file_that_is_not_utf8_exits_2_with_one_line(json_load, capsys, tmp_path, flag, what):
    """A binary file (or one in another encoding) given as the grammar or schema: a one-line error naming
    the file, exit 2 (UnicodeDecodeError's traceback before)."""
    path = tmp_path / "g.bin"
    path.write_bytes(b"start: \"a\"\n\xa9\xff\x00")
    code = main(["generate", "--target", "tiny", "--prompt", "x", "--raw", flag, str(path)])
    err = capsys.readouterr().err
    assert code == 2 and f"the {what} file {path} is not UTF-8 text" in err and len(err.strip().splitlines()) == 1


def test_a_bad_draft_vocab_exits_2_naming_the_choices_before_loading(tmp_path, capsys, monkeypatch):
    """`--draft-vocab lots`: one-line error naming auto, full or a number, exit 2; no model is loaded."""
    import specula.api as api

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(api, "load_backend", lambda *a, **k: pytest.fail("a model was loaded"))
    code = main(["generate", "--target", str(tmp_path / "nowhere"), "--prompt", "w5", "--raw", "--max-new-tokens", "2",
                 "--draft-vocab", "lots"])
    err = capsys.readouterr().err
    assert code == 2 and "auto, full, or a number of tokens" in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [err.strip().splitlines()[-1]]


def test_prompt_dash_reads_standard_input(json_load, capsys, monkeypatch):
    """`--prompt -` decodes what standard input holds, as if it were given as the argument; an empty
    standard input is a one-line error, exit 2."""
    import io

    args = ["generate", "--target", "tiny", "--raw", "--max-new-tokens", "6", "--json"]
    assert main([*args, "--prompt", '{"name": "ab']) == 0
    given = json.loads(capsys.readouterr().out)
    monkeypatch.setattr("sys.stdin", io.StringIO('{"name": "ab'))
    assert main([*args, "--prompt", "-"]) == 0
    piped = json.loads(capsys.readouterr().out)
    assert piped["token_ids"] == given["token_ids"] and piped["text"] == given["text"]
    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    code = main([*args, "--prompt", "-"])
    err = capsys.readouterr().err
    assert code == 2 and "standard input" in err and len(err.strip().splitlines()) == 1


def test_logprobs_come_in_the_json_and_as_a_table_and_change_nothing(tiny_load, tiny_tokenizer, capsys):
    import torch

    code, out, _ = run(capsys, "--json", "--logprobs", "2")
    payload = json.loads(out)
    assert code == 0 and json.loads(run(capsys, "--json")[1])["token_ids"] == payload["token_ids"]
    entries = payload["logprobs"]
    assert [e["token_id"] for e in entries] == payload["token_ids"]
    model = tiny_model("qwen2", seed=3)
    prompt = tiny_tokenizer.encode("w5 w17 w33 w5 w17 w40")
    with torch.inference_mode():
        rows = torch.log_softmax(model(torch.tensor([prompt + payload["token_ids"]])).logits[0, len(prompt) - 1:-1], -1)
    for e, row in zip(entries, rows):
        assert e["logprob"] == pytest.approx(float(row[e["token_id"]]), abs=1e-4)
        assert [a["token_id"] for a in e["top"]] == row.topk(2).indices.tolist()
        assert e["token"] == f"w{e['token_id']}"
    code, out, err = run(capsys, "--logprobs", "0")
    table = err[err.index("logprobs (the target's"):].splitlines()[1: 1 + len(entries)]
    assert code == 0 and [line.split()[1] for line in table] == [repr(e["token"]) for e in entries]
    code, _, err = run(capsys, "--logprobs", "21")
    assert code == 2 and "logprobs must be an integer from 0 to 20" in err and len(err.strip().splitlines()) == 1


def test_penalties_decode_the_penalised_law_exactly_and_bad_biases_exit_2(tiny_load, capsys):
    plain = json.loads(run(capsys, "--json")[1])
    code, out, _ = run(capsys, "--json", "--compare", "--repetition-penalty", "1.5", "--presence-penalty", "0.5",
                       "--logit-bias", f"{plain['token_ids'][0]}=-100")
    penalised = json.loads(out)
    assert code == 0 and penalised["identical_to_plain"] is True  # plain decoding with the same penalties
    assert penalised["token_ids"][0] != plain["token_ids"][0]  # the bias removed the first token
    for bad in ("5", "x=1", "5=lots"):
        code, _, err = run(capsys, "--logit-bias", bad)
        assert code == 2 and "--logit-bias takes ID=BIAS" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "--repetition-penalty", "0")
    assert code == 2 and "--repetition-penalty must be > 0" in err


@pytest.mark.parametrize("extra, words", [
    (["--method", "draft-tree", "--tree-depth", "0"], "--tree-depth must be >= 1, got 0"),
    (["--method", "draft-tree", "--tree-sampling", "iid", "--tree-verifier", "kseq", "--tree-top-k", "0"],
     "--tree-top-k must be >= 1, got 0"),
    (["--method", "draft-model", "--num-draft-tokens", "0"], "--num-draft-tokens must be >= 1, got 0"),
    (["--method", "draft-tree", "--tree-verifier", "kseq"],  # tree_verifier=kseq: a value rewritten with its flag
     "--tree-verifier kseq needs i.i.d. siblings: use --tree-sampling iid with --tree-verifier kseq"),
    (["--method", "draft-model", "--draft-window", "3"], "--draft-window must be at least"),
    (["--max-tree-nodes", "0"], "--max-tree-nodes must be an integer >= 1, got 0"),
    (["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
    (["--min-p", "-1"], "--min-p must be in [0, 1]"),
    # fusion (the default) without a head: the head's options were ignored without a word
    (["--head-window", "-1"], "--head-window is for a trained head, and fusion drafts without one here (none given, "
                              "none installed for the target); give it one with --head FILE (`specula train`, or the "
                              "shipped one: `specula models install`), or drop --head-window"),
    (["--head", "none", "--head-context-vocab", "64"], "--head-context-vocab is for a trained head, and fusion drafts "
                                                       "without one here (the head given is none); give it one with "
                                                       "--head FILE instead of none, or drop --head-context-vocab"),
    (["--online-distill"], "--online-distill is for a trained head"),
    (["--head-window", "0"], "--head-window is for a trained head"),  # 0 (all) read as not given: ignored
])
def test_an_options_error_from_the_library_names_the_flag(monkeypatch, tiny_tokenizer, capsys, extra, words):
    """The library names options as Python does (tree_depth must be >= 1); the command line said so too, where
    the user had written --tree-depth."""
    model = tiny_model("qwen2", seed=3)

    def load(target, draft=None, method=None, config=None, draft_quantize=None, skip_layers=None, draft_vocab=None,
             **options):
        drafting = None if draft in (None, "none", "auto") else HFCausalLM(model, "draft")
        return specula.api.Specula(HFCausalLM(model, "target"), tiny_tokenizer, method, drafting, **options)

    monkeypatch.setattr(specula.api, "load", load)
    code, _, err = run(capsys, "--draft", "tiny", *extra)
    assert code == 2 and err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1, err
    python_name = words.split()[0][2:].replace("-", "_")
    assert python_name not in err


def test_compare_with_plain_decoding_says_there_is_nothing_to_compare(tiny_load, capsys):
    code, out, err = run(capsys, "--method", "none", "--compare")
    assert code == 0 and out.strip() and "note: --compare has nothing to compare with" in err


def test_a_minimum_length_runs_through_compare_and_a_bad_one_exits_2(tiny_load, capsys):
    """--min-new-tokens reaches the request and --compare's 2-token warm-ups (a minimum above 2 there
    was a ConfigError); one above --max-new-tokens is one line, exit 2."""
    code, out, _ = run(capsys, "--json", "--compare", "--min-new-tokens", "8")
    result = json.loads(out)
    assert code == 0 and result["identical_to_plain"] is True and len(result["token_ids"]) == 16
    code, _, err = run(capsys, "--min-new-tokens", "17")
    assert code == 2 and "--min-new-tokens must be an integer from 0 to --max-new-tokens (16)" in err
    assert len(err.strip().splitlines()) == 1


def test_compare_says_an_unseeded_sampled_run_drew_its_own_seed():
    """generate --temperature 0.8 --compare without --seed said 'with the same seed the texts differ',
    though each run had drawn its own seed."""
    from specula.commands.generate import compare_verdict
    from specula.sampling import SamplingParams

    unseeded = compare_verdict(False, SamplingParams(temperature=0.8))
    assert "same seed" not in unseeded and "no --seed: each run drew its own" in unseeded
    assert "with the same seed the texts differ" in compare_verdict(False, SamplingParams(temperature=0.8, seed=1))
    assert compare_verdict(True, SamplingParams()) == "output identical to plain decoding"


def test_top_k_minus_one_is_every_token_as_on_the_server(tiny_load, capsys):
    """--top-k -1 (vLLM's "every token", which the server takes) samples as --top-k 0; -2 exits 2 in one line."""
    sampled = [run(capsys, "--temperature", "1.0", "--seed", "4", "--top-k", k) for k in ("-1", "0")]
    assert sampled[0][0] == 0 and sampled[0][1] == sampled[1][1]
    code, _, err = run(capsys, "--top-k", "-2")
    assert code == 2 and "--top-k must be an integer >= 1, or 0 or -1" in err and len(err.strip().splitlines()) == 1


def test_a_target_window_too_short_for_the_cost_curve_names_what_generate_takes(monkeypatch, tiny_tokenizer, capsys):
    """A target with a context window of <= 64 tokens could not have its cost curve timed (passes of up to 64
    tokens after a prefix), and generate said to lower context= or sizes=, which it does not take: it names the
    cost curve generate takes (--cost-curve, from `specula profile` with passes that fit) or plain decoding."""
    backend = HFCausalLM(tiny_model("qwen2", seed=3), "target")
    backend.max_context = 64
    monkeypatch.setattr(specula.api, "load", lambda target, method=None, **options: specula.api.Specula(
        backend, tiny_tokenizer, method or "fusion"))
    code, _, err = run(capsys, "--method", "prompt-lookup")
    assert code == 2, err
    assert err.strip().splitlines()[-1] == (
        "error: the target's context window of 64 tokens is too short to time the planner's cost curve (passes of "
        "up to 64 tokens after a prefix); give a curve of passes that fit, --cost-curve FILE with the "
        "cost_curve.json of `specula profile --target MODEL --sizes 1,2,4,8,16,32 --context 32`, or decode plainly "
        "(--method none)")
