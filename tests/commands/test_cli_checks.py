"""What the command line refuses before any model loads (exit 2, one line naming the fix), and
how it ends when its reader goes away."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specula.cli import main


@pytest.fixture
def no_loading(monkeypatch, tmp_path):
    """Fail the test if a command gets as far as loading a model."""
    import specula.api as api
    import specula.models.loading as loading

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    for module in (api, loading):
        monkeypatch.setattr(module, "load_backend", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(api, "load", lambda *a, **k: pytest.fail("a model was loaded"))


def refused(capsys, argv: list[str], *words: str) -> None:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    last = err.splitlines()[-1]
    assert last.startswith("error:") and all(w in last for w in words), last


GENERATE = ["generate", "--target", "smollm2-135m", "--prompt", "hi", "--max-new-tokens", "4"]


@pytest.mark.parametrize("extra, words", [
    (["--max-tree-nodes", "0"], ("--max-tree-nodes", ">= 1")),
    (["--method", "prompt-lookup", "--tree-top-k", "3"], ("--tree-top-k does not apply to method prompt-lookup",
                                                          "draft-tree")),
    (["--tree-depth", "3"], ("--tree-depth does not apply to method fusion",)),  # the default method
    (["--method", "none", "--datastore", "x.specds"], ("--datastore does not apply to method none",)),
    (["--method", "prompt-lookup", "--draft-window", "0"], ("--draft-window does not apply to method prompt-lookup",)),
    (["--method", "prompt-lookup", "--head-window", "0"], ("--head-window does not apply to method prompt-lookup",)),
    (["--method", "none", "--cost-curve", "c.json"], ("--cost-curve", "method none drafts nothing",
                                                      "pass --method with a method that drafts")),  # was ignored
    (["--method", "none", "--max-tree-nodes", "64"], ("--max-tree-nodes", "method none drafts nothing",  # was ignored,
                                                          "pass --method with a method that drafts")),  # as 64
    (["--method", "prompt-lookup", "--draft", "smollm2-135m"], ("drafts without a draft model",)),
    (["--device", "cpu", "--cuda-graphs"], ("--cuda-graphs", "this run is on cpu", "drop --cuda-graphs")),  # ignored
    (["--method", "prompt-lookup", "--draft-quantize", "int8"], ("--draft-quantize applies to a draft model",
                                                                 "method prompt-lookup drafts without one")),
    (["--method", "eagle3", "--draft-vocab", "full"], ("--draft-vocab applies to a draft model",)),
    (["--linear-kernel", "specula", "--backend", "hf"], ("--linear-kernel specula", "--backend native")),
])
def test_generate_refuses_what_it_would_ignore_or_misread(no_loading, capsys, extra, words):
    refused(capsys, [*GENERATE, *extra], *words)


def test_max_tree_nodes_left_out_is_the_engines_default_and_given_reaches_it():
    """--max-tree-nodes defaults to None (so that method none can tell it was given); left out, the
    engine gets EngineConfig's default."""
    from specula.api import EngineConfig
    from specula.cli import build_parser
    from specula.commands.common import engine_config

    for command in (GENERATE, ["bench", "--target", "t", "--out", "o"]):
        args = build_parser().parse_args(command)
        assert args.max_tree_nodes is None and engine_config(args) == EngineConfig(prefix_cache_mib=0)
        assert EngineConfig().max_tree_nodes == 64  # as --help says
        assert engine_config(build_parser().parse_args([*command, "--max-tree-nodes", "8"])).max_tree_nodes == 8


def _help_of(command: str) -> str:
    """`specula COMMAND --help`, its whitespace folded."""
    import contextlib
    import io

    from specula.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return " ".join(out.getvalue().split())


def test_the_prefix_cache_is_serve_and_run_batchs_and_off_for_one_request_or_a_measurement():
    """serve and run-batch take --prefix-cache-mib (left out: the engine's default, on where outputs stay bit
    for bit); generate (one request: its --compare warm-up would leave the method alone the prompt's cache)
    and bench (every prompt prefilled whole, as hf:greedy) run without one."""
    from specula.api import EngineConfig
    from specula.cli import build_parser
    from specula.commands.common import engine_config
    from specula.errors import ConfigError

    from specula.engine import DEFAULT_PREFIX_CACHE_MIB

    for command in (["serve", "--target", "t"], ["run-batch", "--target", "t", "-i", "a", "-o", "b"]):
        assert engine_config(build_parser().parse_args(command)).prefix_cache_mib is None
        assert f"default {DEFAULT_PREFIX_CACHE_MIB} on" in _help_of(command[0])  # the help says the engine's
        assert engine_config(build_parser().parse_args([*command, "--prefix-cache-mib", "64"])).prefix_cache_mib == 64
        with pytest.raises(ConfigError, match="--prefix-cache-mib must be an integer >= 0"):
            engine_config(build_parser().parse_args([*command, "--prefix-cache-mib", "-1"]))
    for command in (GENERATE, ["bench", "--target", "t", "--out", "o"]):
        assert engine_config(build_parser().parse_args(command)) == EngineConfig(prefix_cache_mib=0)
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--prefix-cache-mib", "64"])


def test_a_missing_or_damaged_datastore_is_refused_before_loading(no_loading, capsys, tmp_path):
    """--datastore was first opened when the drafter was built, after the target (and draft) had loaded."""
    gone, damaged = tmp_path / "gone.specds", tmp_path / "damaged.specds"
    damaged.write_text("not a datastore")
    refused(capsys, [*GENERATE, "--method", "rest", "--datastore", str(gone)], "does not exist", str(gone))
    refused(capsys, [*GENERATE, "--method", "rest", "--datastore", str(damaged)], "not a specula datastore")
    batch = tmp_path / "in.jsonl"
    batch.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}\n')
    refused(capsys, ["run-batch", "--target", "smollm2-135m", "--method", "rest", "--datastore", str(gone), "-i",
                     str(batch), "-o", str(tmp_path / "out.jsonl")], "does not exist")


def test_an_empty_prompt_is_refused_before_loading(no_loading, capsys):
    refused(capsys, ["generate", "--target", "smollm2-135m", "--prompt", "", "--max-new-tokens", "4"],
            "--prompt is empty")


def test_a_prompt_of_bytes_that_are_not_utf8_is_refused_before_loading(no_loading, capsys, monkeypatch):
    """generate --prompt $'\\xff' (or such bytes on standard input): Python reads them as lone surrogates,
    which the tokenizer refused with a TypeError traceback after the model had loaded."""
    import io

    refused(capsys, [*GENERATE[:4], "hi \udcff", *GENERATE[5:]], "--prompt is not valid Unicode", "'\\udcff'")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"Say \xff hi"), errors="surrogateescape"))
    refused(capsys, [*GENERATE[:4], "-", *GENERATE[5:]], "--prompt is not valid Unicode", "at character 4")


def test_an_empty_method_name_is_refused_not_taken_for_the_default(no_loading, capsys):
    refused(capsys, ["generate", "--target", "smollm2-135m", "--prompt", "hi", "--method", ""],
            "unknown method ''")  # found by a review: it ran fusion


def test_outputs_that_cannot_be_written_are_refused_before_any_work(no_loading, capsys, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    refused(capsys, ["profile", "--target", "smollm2-135m", "--out", str(a_file), "--sizes", "1,2"],
            "--out", "is a file")
    refused(capsys, ["bench", "--target", "smollm2-135m", "--methods", "none", "--per-category", "1",
                     "--out", str(a_file / "sub")], "not a writable directory")
    refused(capsys, ["analyze", "acceptance", "--target", "smollm2-135m", "--draft", "self", "--out", str(a_file)],
            "is a file")
    batch = tmp_path / "in.jsonl"
    batch.write_text("")
    refused(capsys, ["run-batch", "--target", "smollm2-135m", "-i", str(batch), "-o", str(tmp_path)],
            "--output-file", "is a directory")
    refused(capsys, ["run-batch", "--target", "smollm2-135m", "-i", str(batch), "-o", str(tmp_path / "o.jsonl"),
                     "--chat-max-tokens", "0"], "--chat-max-tokens must be positive")
    batch.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n')
    refused(capsys, ["run-batch", "--target", "smollm2-135m", "-i", str(batch), "-o",
                     str(tmp_path / "." / "in.jsonl")], "would overwrite the batch file")  # found by a review: it was
    assert batch.read_text().startswith('{"custom_id": "a"')  # overwritten with the answers (exit 0)


@pytest.mark.parametrize("command", ["serve", "run-batch"])
@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_served_model_name_is_refused_before_loading(no_loading, capsys, tmp_path, command, name):
    """--served-model-name "" fell back to the --target value without a word."""
    batch = tmp_path / "in.jsonl"
    batch.write_text("")
    extra = ["-i", str(batch), "-o", str(tmp_path / "o.jsonl")] if command == "run-batch" else ["--port", "0"]
    refused(capsys, [command, "--target", "smollm2-135m", *extra, "--served-model-name", name],
            "--served-model-name is empty", "leave the option out")


@pytest.mark.parametrize("command", ["generate", "serve", "run-batch"])
@pytest.mark.parametrize("extra, words", [
    (["--draft", "none", "--num-draft-tokens", "3"],
     "--num-draft-tokens is for a draft model or layer skipping, and fusion drafts with neither here (no draft model "
     "given); give it a draft model with --draft MODEL, or drop --num-draft-tokens"),
    (["--draft", "none", "--draft-window", "0"], "--draft-window is for a draft model, and fusion drafts without one"),
    (["--draft", "skip", "--draft-window", "64"],
     "--draft-window is for a draft model, and fusion drafts with the target's own layers skipped here, not a draft "
     "model; drop --draft-window, or give a draft model with --draft MODEL instead"),
])
def test_a_draft_model_flag_fusion_would_not_read_is_refused_before_the_target_loads(monkeypatch, tmp_path, capsys,
                                                                                    command, extra, words):
    """fusion (the default) with no draft model read neither flag (layer skipping reads --num-draft-tokens only),
    without a word; `specula.api.load` refuses them before the target loads, named as the command line writes them."""
    import specula.api as api
    import specula.models.loading as loading

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    for module in (api, loading):
        monkeypatch.setattr(module, "load_backend", lambda *a, **k: pytest.fail("the target was loaded"))
    batch = tmp_path / "in.jsonl"
    batch.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n')
    argv = {"generate": GENERATE, "serve": ["serve", "--target", "smollm2-135m", "--port", "0"],
            "run-batch": ["run-batch", "--target", "smollm2-135m", "-i", str(batch), "-o", str(tmp_path / "o.jsonl")]}
    refused(capsys, [*argv[command], *extra], words)


def test_train_checks_its_held_out_files_answer_length_and_output_before_loading(no_loading, capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Write a haiku about rain on a tin roof."}\n')
    train = ["train", "--target", "smollm2-135m", "--data", str(prompts), "--out", str(tmp_path / "out")]
    refused(capsys, [*train, "--eval-data", str(tmp_path / "missing.jsonl")], "held-out data", "--eval-data")
    refused(capsys, [*train, "--max-new-tokens", "0"], "--max-new-tokens must be >= 1")
    (tmp_path / "file").write_text("x")
    refused(capsys, [*train[:-1], str(tmp_path / "file")], "--out", "is a file")


def test_a_list_of_sizes_starting_with_a_minus_gets_the_options_own_check(no_loading, capsys, tmp_path):
    profile = ["profile", "--target", "smollm2-135m", "--out", str(tmp_path / "p")]
    refused(capsys, [*profile, "--sizes", "-1,0"], "--sizes must be integers >= 1")  # was argparse's "expected
    refused(capsys, [*profile, "--batch-sizes", "-2,4"], "--batch-sizes must be integers >= 1")  # one argument"


@pytest.mark.parametrize("categories, words", [
    (["writing"], ("error: --categories names an unknown category 'writing'", "choose from: mt_bench, translation, summarization")),
    ([","], ("error: --categories names no category", "mt_bench, translation, summarization, qa, math_reasoning, rag")),
])
def test_analyze_reads_categories_as_bench_does(no_loading, capsys, tmp_path, categories, words):
    refused(capsys, ["analyze", "acceptance", "--target", "smollm2-135m", "--draft", "self", "--categories",
                     *categories, "--out", str(tmp_path / "out")], *words)


def test_analyze_names_the_per_category_flag(no_loading, capsys, tmp_path):
    """select_prompts names its keyword (per_category=0); analyze acceptance shows the flag, as bench does."""
    refused(capsys, ["analyze", "acceptance", "--target", "smollm2-135m", "--draft", "self", "--per-category", "0",
                     "--out", str(tmp_path / "out")], "error: --per-category must be >= 1, got 0")


@pytest.mark.parametrize("argv, words", [
    (["--temperature", "1", "1"], "error: --temperature lists a temperature twice ([1.0, 1.0]); give each once"),
    (["--temperature", "0"], "error: --temperature must be finite and > 0 (acceptance of sampling), got [0.0]"),
    (["--drafts", "0"], "error: --drafts must be between 1 and 16, got 0"),
    (["--positions", "0"], "error: --positions must be >= 1, got 0"),
    (["--lump-mass", "0.5"], "error: --lump-mass must be in [0, 0.01), got 0.5"),
    (["--trajectories", "1"], "error: --trajectories must be >= 2, got 1"),
])
def test_analyze_shows_its_flags_where_acceptance_config_names_its_fields(no_loading, capsys, tmp_path, argv, words):
    """AcceptanceConfig names its fields (max_drafts, temperatures=); analyze acceptance shows its flags."""
    refused(capsys, ["analyze", "acceptance", "--target", "smollm2-135m", "--draft", "self", *argv,
                     "--out", str(tmp_path / "out")], words)


def test_analyze_names_the_prompts_flag(no_loading, capsys, tmp_path):
    """load_prompts names its keyword (source=, was --prompts to a Python caller); analyze acceptance shows the
    flag, as bench does."""
    missing = str(tmp_path / "none.jsonl")
    refused(capsys, ["analyze", "acceptance", "--target", "smollm2-135m", "--draft", "self", "--prompts", missing,
                     "--out", str(tmp_path / "out")],
            f"error: prompts file '{missing}' not found; give --prompts one of spec-bench, everyday, structured or a "
            "JSONL file")


def test_outputs_that_would_overwrite_an_input_are_refused_before_any_work(no_loading, capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Write a haiku about rain on a tin roof."}\n')
    (out / "eagle.safetensors").write_text("a head")  # fine-tuned into its own folder: it was replaced (exit 0)
    refused(capsys, ["train", "--target", "smollm2-135m", "--data", str(prompts), "--out", str(out), "--init-head",
                     str(out / "eagle.safetensors")], "--out would overwrite the --init-head head")
    (out / "report.json").write_text(prompts.read_text())
    refused(capsys, ["train", "--target", "smollm2-135m", "--data", str(out / "report.json"), "--out", str(out)],
            "--out would overwrite a --data file")
    turns = '{"id": "a", "category": "chat", "turns": ["Write a haiku about rain."]}\n'
    (out / "report.md").write_text(turns)  # the bench cleared it, then wrote its report over it (exit 0)
    refused(capsys, ["bench", "--target", "smollm2-135m", "--methods", "none", "--prompts", str(out / "report.md"),
                     "--out", str(out)], "--out would overwrite the --prompts file")
    (out / "results.json").write_text(turns)
    refused(capsys, ["analyze", "acceptance", "--target", "smollm2-135m", "--draft", "self", "--prompts",
                     str(out / "results.json"), "--out", str(out)], "--out would overwrite the --prompts file")
    assert (out / "eagle.safetensors").read_text() == "a head" and (out / "report.md").read_text() == turns


@pytest.mark.parametrize("extra, words", [
    # were accepted: a head of NaN copy weights written (exit 0), a traceback or "training diverged" after the answers
    (["--copy-lr-scale", "inf", "--copy-ngram", "2"], ("--copy-lr-scale must be a finite number > 0",)),
    (["--epochs", "inf"], ("--epochs inf, --lr 0.001: epochs must be a finite number",)),
    (["--topk-loss", "inf"], ("--topk-loss must be a finite number",)),
    (["--max-minutes", "inf"], ("--max-minutes must be > 0 (a finite number)",)),
    (["--time-budget", "inf"], ("--time-budget must be > 0 minutes (a finite number)",)),
    # were refused after the answers and features were made, or (medusa) ignored without a word
    (["--copy-ngram", "9"], ("--copy-ngram must be at most 8",)),
    (["--kind", "medusa", "--num-kv-heads", "3"], ("--num-kv-heads shapes an eagle / eagle3 head", "drop it")),
    # were refused after the target had loaded
    (["--epochs", "0"], ("--epochs 0 writes out the --init-head head untrained",)),
    (["--answers", "nowhere"], ("--answers 'nowhere': no such file or folder",)),
    (["--vocab-from", "nowhere"], ("--vocab-from 'nowhere': no such file or folder",)),
    (["--stop-after", "features", "--no-feature-cache"], ("--no-feature-cache keeps them in memory only",)),
    (["--init-head", "nowhere.safetensors"], ("head file nowhere.safetensors does not exist",)),
    # were ignored without a word: options for a head kind other than the one trained, copy hints' rate without hints
    (["--kind", "medusa", "--ttt-steps", "3"], ("--ttt-steps is for eagle / eagle3 heads, not --kind medusa",)),
    (["--kind", "eagle3", "--num-offsets", "3"], ("--num-offsets is for medusa / hydra heads", "drop it")),
    (["--copy-lr-scale", "10"], ("--copy-lr-scale is the copy hints' learning rate", "add --copy-ngram N")),
])
def test_train_checks_its_settings_and_files_before_the_target_loads(no_loading, capsys, tmp_path, extra, words):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Write a haiku about rain on a tin roof."}\n')
    refused(capsys, ["train", "--target", "smollm2-135m", "--data", str(prompts), "--eval-data", "none", "--out",
                     str(tmp_path / "out"), *extra], *words)
    assert not (tmp_path / "out").exists()


def test_train_refuses_held_out_prompts_it_trains_on_before_the_target_loads(no_loading, capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Write a haiku about rain on a tin roof."}\n')
    refused(capsys, ["train", "--target", "smollm2-135m", "--data", str(prompts), "--eval-data", str(prompts),
                     "--out", str(tmp_path / "out")], "also training prompts", "pass other --eval-data")


def test_analyze_leaves_no_out_folder_when_its_models_cannot_load(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    refused(capsys, ["analyze", "acceptance", "--target", str(tmp_path / "nowhere"), "--draft", "self", "--prompts",
                     "everyday", "--out", str(tmp_path / "out")], "no such file or directory")
    assert not (tmp_path / "out").exists()  # was made (empty) before the models loaded


def test_analyze_and_bench_name_the_flags_of_what_the_library_refuses_as_loads_keywords(no_loading, capsys, tmp_path,
                                                                                         monkeypatch):
    """The library names load's skip_layers, draft="skip" and method= (`models.skipping`, `drafters`); analyze,
    which checks them itself before any load, and bench, which loads its models with `load`, show their flags."""
    refused(capsys, ["analyze", "acceptance", "--target", "smollm2-135m", "--draft", "self", "--skip-layers", "3",
                     "--prompts", "everyday", "--out", str(tmp_path / "out")],
            "error: --skip-layers applies to --draft skip only (the target drafting with layers skipped); add --draft "
            "skip or drop --skip-layers")
    import specula.api as api
    from specula.drafters import make_drafters

    def load(target, draft=None, method=None, **options):  # the drafters of `method`, as load builds them
        return make_drafters(method, draft_skip=draft == "skip")

    monkeypatch.setattr(api, "load", load)
    refused(capsys, ["bench", "--target", "smollm2-135m", "--methods", "draft-tree", "--draft", "skip", "--prompts",
                     "everyday", "--out", str(tmp_path / "bench")],
            "error: --draft skip drafts chains: use --methods draft-model, --methods layer-skip or --methods fusion "
            "with it (draft-tree needs a draft model)")


def test_analyze_refuses_a_draft_that_cannot_load_before_the_target_loads(no_loading, capsys, tmp_path):
    refused(capsys, ["analyze", "acceptance", "--target", "smollm2-135m", "--draft", str(tmp_path / "nowhere"),
                     "--prompts", "everyday", "--out", str(tmp_path / "out")], "--draft", "no such file or directory")


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`specula ... | head`: the pipe closes; exit 141 as a shell reports SIGPIPE, no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "specula", "models", "list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err


def test_a_cost_curve_without_its_sizes_names_the_missing_key(no_loading, capsys, tmp_path):
    curve = tmp_path / "curve.json"
    curve.write_text('{"seconds": [0.01]}')
    refused(capsys, [*GENERATE, "--cost-curve", str(curve)], "cannot read cost curve", "missing key 'sizes'")


@pytest.fixture
def on_cuda(monkeypatch):
    """A machine that reads as having one GPU (nothing here runs on it: refusals come before any load)."""
    import torch

    from specula.models import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(device, "_CUDA_GRAPHS", None)
    monkeypatch.delenv("SPECULA_CUDA_GRAPHS", raising=False)


def test_cuda_graphs_with_the_hugging_face_backend_is_refused(no_loading, on_cuda, capsys, monkeypatch):
    """--cuda-graphs --backend hf ran every pass eagerly without a word: that backend has no CUDA-graph path."""
    refused(capsys, [*GENERATE, "--backend", "hf", "--cuda-graphs"],
            "--cuda-graphs asks for CUDA graphs, which only the native backend has", "--backend hf",
            "drop --cuda-graphs", "--backend native")
    monkeypatch.setenv("SPECULA_CUDA_GRAPHS", "1")  # an explicit ask too
    refused(capsys, [*GENERATE, "--backend", "hf"], "SPECULA_CUDA_GRAPHS=1 asks for CUDA graphs",
            "unset SPECULA_CUDA_GRAPHS")


def test_cuda_graphs_asked_for_by_the_environment_on_the_cpu_is_refused_as_the_flag_is(no_loading, capsys,
                                                                                       monkeypatch):
    """SPECULA_CUDA_GRAPHS=1 on a CPU run was read as the default (nothing to capture, without a word) where
    --cuda-graphs is refused; 0 and leaving it out still run."""
    from specula.models import device

    monkeypatch.setattr(device, "_CUDA_GRAPHS", None)
    monkeypatch.setenv("SPECULA_CUDA_GRAPHS", "1")
    refused(capsys, [*GENERATE, "--device", "cpu"], "SPECULA_CUDA_GRAPHS=1", "this run is on cpu",
            "unset SPECULA_CUDA_GRAPHS")
