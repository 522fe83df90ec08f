"""The Python API as users call it: `specula.api.load` on a local model directory."""

from __future__ import annotations

import re

import pytest

from tiny import reference_greedy, tiny_model, word_tokenizer
import specula.api as specula
from specula.engine import EngineConfig
from specula.errors import ConfigError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny random Qwen2 saved as a Hugging Face directory (weights, config, tokenizer)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_tokenizer.save_pretrained(path)
    tiny_model("qwen2").save_pretrained(path)  # the config decides the tokenizer class loading picks
    reloaded = AutoTokenizer.from_pretrained(path)  # as loading sees it (Qwen2's adds <|endoftext|>)
    model = tiny_model("qwen2", seed=3, vocab=max(reloaded.get_vocab().values()) + 1)  # every id has a logit
    model.save_pretrained(path)
    return path, model


def test_load_fusion_greedy_equals_plain_greedy(model_dir, tmp_path, monkeypatch):
    """The production wiring (`load` -> every available drafter + the planner on a measured cost
    curve) on a tiny model: output identical to plain greedy decoding."""
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    path, model = model_dir
    spec = specula.load(str(path), method="fusion")
    assert spec.decoder.planner is not None
    assert [d.name for d in spec.decoder.drafters] == ["prompt-lookup", "token-recycling"]
    for prompt in ([5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], [60, 61, 62, 63, 64, 60, 61]):
        out = spec.generate(prompt, max_new_tokens=40, ignore_eos=True)
        assert out.token_ids == reference_greedy(model, prompt, 40)
    text = spec.generate("w5 w17 w33 w5 w17", max_new_tokens=8, ignore_eos=True)
    assert text.text.split() and all(w.startswith("w") for w in text.text.split())


def test_load_with_the_model_as_its_own_draft_uses_every_drafter(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    path, model = model_dir
    spec = specula.load(str(path), draft=str(path), method="fusion")
    assert [d.name for d in spec.decoder.drafters] == ["prompt-lookup", "token-recycling", "draft-model"]
    out = spec.generate([9, 8, 7], max_new_tokens=30, ignore_eos=True)
    assert out.token_ids == reference_greedy(model, [9, 8, 7], 30)


def test_bad_method_and_empty_prompt_fail_clearly(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))  # prepared models and cost curves stay here
    path, _ = model_dir
    with pytest.raises(ConfigError, match="unknown method 'lookahead'"):
        specula.load(str(path), method="lookahead")
    with pytest.raises(ConfigError, match="medusa.*needs a trained head.*specula train"):
        specula.load(str(path), method="medusa")  # no head installed for a local model
    spec = specula.load(str(path), method="none")
    with pytest.raises(ConfigError, match="tokenized to no tokens"):  # a word-level tokenizer drops whitespace
        spec.generate("   ")
    with pytest.raises(ConfigError, match="empty"):
        spec.generate("")


def test_a_draft_that_cannot_load_is_refused_before_the_target_loads(model_dir, tmp_path, monkeypatch):
    """A missing draft path (or a draft alias not installed) was found only after the target had
    loaded, up to a minute for the 1.5B; a draft the method does not use is still ignored."""
    from specula.errors import ModelNotFoundError

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    path, _ = model_dir

    def no_target(*args, **kwargs):
        raise AssertionError("the target loaded before the draft was checked")

    monkeypatch.setattr(specula, "load_backend", no_target)
    for draft, match in ((str(tmp_path / "nowhere"), "no such file or directory"),
                         ("qwen2.5-coder-0.5b", "not installed.*specula models install")):
        with pytest.raises(ModelNotFoundError, match=match):
            specula.load(str(path), draft=draft, method="draft-model")
    with pytest.raises(AssertionError, match="the target loaded"):  # prompt-lookup loads no draft
        specula.load(str(path), draft=str(tmp_path / "nowhere"), method="prompt-lookup")


@pytest.mark.parametrize("keywords, python, argv, flags", [
    ({"draft": "skip", "method": "draft-tree"},
     'draft="skip" drafts chains: use method="draft-model", method="layer-skip" or method="fusion" with it '
     "(draft-tree needs a draft model)",
     ["--draft", "skip", "--method", "draft-tree"],
     "--draft skip drafts chains: use --method draft-model, --method layer-skip or --method fusion with it "
     "(draft-tree needs a draft model)"),
    ({"draft": "none", "method": "draft-tree"}, "needs a draft model: pass draft=MODEL (same tokenizer",
     ["--draft", "none", "--method", "draft-tree"], "needs a draft model: pass --draft MODEL (same tokenizer"),
    ({"draft": "none", "method": "draft-model"}, "needs a draft model: pass draft=MODEL (same tokenizer",
     ["--draft", "none", "--method", "draft-model"], "needs a draft model: pass --draft MODEL (same tokenizer"),
    ({"method": "rest"}, "method rest needs a datastore: pass datastore=FILE (build one with `specula datastore",
     ["--method", "rest"], "method rest needs a datastore: pass --datastore FILE (build one with `specula datastore"),
    ({"draft": "MODEL", "method": "draft-tree", "tree_verifier": "kseq"},
     'tree_verifier="kseq" needs i.i.d. siblings: use tree_sampling="iid" with tree_verifier="kseq"',
     ["--draft", "MODEL", "--method", "draft-tree", "--tree-verifier", "kseq"],
     "--tree-verifier kseq needs i.i.d. siblings: use --tree-sampling iid with --tree-verifier kseq"),
    ({"skip_layers": "1"},
     'skip_layers applies to draft="skip" only (the target drafting with layers skipped); add draft="skip" or drop '
     "skip_layers", ["--skip-layers", "1"],
     "--skip-layers applies to --draft skip only (the target drafting with layers skipped); add --draft skip or drop "
     "--skip-layers"),
    ({"method": "layer-skip", "config": specula.LoadConfig(backend="hf")},
     'needs a backend that can skip layers: use backend="native" (Llama',
     ["--method", "layer-skip", "--backend", "hf"],
     "needs a backend that can skip layers: use --backend native (Llama"),
    ({"draft": "self", "draft_quantize": "none", "method": "draft-model"},
     'draft="self" with draft_quantize="none" would draft with the target itself; use draft_quantize="int8"',
     ["--draft", "self", "--draft-quantize", "none", "--method", "draft-model"],
     "--draft self with --draft-quantize none would draft with the target itself; use --draft-quantize int8"),
    ({"config": specula.LoadConfig(dtype="float16", device="cpu")},
     'dtype="float16" runs on CUDA; on CPU use float32', ["--dtype", "float16", "--device", "cpu"],
     "--dtype float16 runs on CUDA; on CPU use float32"),
    ({"config": specula.LoadConfig(linear_kernel="specula", backend="hf")},
     'linear_kernel="specula" is specula\'s own kernels, which run on backend="native"; with backend="hf" use '
     "linear_kernel auto, onednn or aten", ["--linear-kernel", "specula", "--backend", "hf"],
     "--linear-kernel specula is specula's own kernels, which run on --backend native; with --backend hf use "
     "--linear-kernel auto, onednn or aten"),
    ({"config": specula.LoadConfig(linear_kernel="onednn", quantize="int8")},
     'linear_kernel="onednn" runs float32 models on CPU with quantize="none"; use linear_kernel="auto" or '
     'linear_kernel="aten"', ["--linear-kernel", "onednn", "--quantize", "int8"],
     "--linear-kernel onednn runs float32 models on CPU with --quantize none; use --linear-kernel auto or "
     "--linear-kernel aten"),
    ({"draft": "self", "method": "draft-model", "config": specula.LoadConfig(linear_kernel="onednn")},
     'runs float32 models on CPU with draft_quantize="none"; use',  # load_draft's quantize: the self-draft's int8
     ["--draft", "self", "--method", "draft-model", "--linear-kernel", "onednn"],
     "--linear-kernel onednn runs float32 models on CPU with --draft-quantize none; use --linear-kernel auto"),
    ({"config": specula.LoadConfig(quantize="int4", backend="hf")},
     'quantize="int4" runs on specula\'s CPU kernels only (backend="native" on CPU, a Llama / Qwen2 / Mistral model, '
     'float32), not on the transformers backend; use quantize="int8"', ["--quantize", "int4", "--backend", "hf"],
     "--quantize int4 runs on specula's CPU kernels only (--backend native on CPU, a Llama / Qwen2 / Mistral model, "
     "float32), not on the transformers backend; use --quantize int8"),
    ({"draft": "self", "draft_quantize": "int4", "method": "draft-model", "config": specula.LoadConfig(backend="hf")},
     'draft_quantize="int4" runs on specula\'s CPU kernels only (', ["--draft", "self", "--draft-quantize", "int4",
                                                                     "--method", "draft-model", "--backend", "hf"],
     "--draft-quantize int4 runs on specula's CPU kernels only (--backend native on CPU, a Llama / Qwen2 / Mistral "
     "model, float32), not on the transformers backend; use --draft-quantize int8"),
])
def test_a_drafting_error_names_loads_keywords_and_the_command_lines_flags(model_dir, tmp_path, monkeypatch,
                                                                           capsys, keywords, python, argv, flags):
    """A drafter's error (and `models.skipping`'s) named the command line's flags (--draft skip, --method, --draft
    MODEL, --skip-layers) to a `load` caller, who had written draft="skip"; it names load's keywords now, and
    `specula generate` shows the flags."""
    from specula.cli import main

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    path = str(model_dir[0])
    keywords = {k: path if v == "MODEL" else v for k, v in keywords.items()}
    with pytest.raises(ConfigError) as caught:
        specula.load(path, **keywords)
    assert python in str(caught.value) and "--" not in re.sub("`[^`]*`", "", str(caught.value))  # a command's: kept
    code = main(["generate", "--target", path, *(path if a == "MODEL" else a for a in argv), "--prompt", "w5 w6",
                 "--raw", "--max-new-tokens", "4"])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the load's progress lines
    assert code == 2 and last.startswith("error: ") and flags in last and "_" not in last, last


def test_a_draft_vocab_error_names_loads_keyword_and_the_commands_flag(model_dir, tmp_path, monkeypatch, capsys):
    """models.draft_vocab's errors named --draft-vocab to a `load` caller, who had written draft_vocab=40; they name
    load's keyword now, and `specula generate` and `specula analyze acceptance` (load_draft) show the flag."""
    from specula.cli import main

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    path = str(model_dir[0])  # a tiny tokenizer: no token ranking ships for it
    with pytest.raises(ConfigError, match=r'^draft_vocab=40: no token ranking ships .*; pass draft_vocab="full"$'):
        specula.load(path, draft=path, method="draft-model", draft_vocab=40)
    for argv in (["generate", "--target", path, "--method", "draft-model", "--prompt", "w5 w6", "--raw"],
                 ["analyze", "acceptance", "--target", path, "--out", str(tmp_path / "a")]):
        assert main([*argv, "--draft", path, "--draft-vocab", "40"]) == 2, argv
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("error: --draft-vocab 40: no token ranking ships ") \
            and last.endswith("; pass --draft-vocab full"), last


def test_a_draft_quantization_error_names_draft_quantize_and_the_commands_flag(model_dir, tmp_path, monkeypatch,
                                                                               capsys):
    """load_draft takes the draft's quantization as `quantize` and its errors named it so: a `load` caller, who had
    written draft_quantize, read quantize="none", and `specula analyze acceptance` and bench's assistant showed
    --quantize none (the target's flag). They name draft_quantize / --draft-quantize now; a draft sharing the
    target's quantization (LoadConfig's, no draft_quantize given) is still named quantize."""
    from specula.cli import build_parser, main
    from specula.commands.bench import load_assistant
    from specula.models.loading import draft_quantize_named

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    path = str(model_dir[0])
    assert main(["analyze", "acceptance", "--target", path, "--out", str(tmp_path / "a"), "--draft", "self",
                 "--linear-kernel", "onednn"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: --linear-kernel onednn runs float32 models on CPU with --draft-quantize none; ")
    args = build_parser().parse_args(["bench", "--target", path, "--prompts", "p.jsonl", "--compare", "hf",
                                      "--assistant", "self", "--linear-kernel", "onednn", "--out", "o"])
    with pytest.raises(ConfigError, match="^--linear-kernel onednn runs float32 models on CPU with --draft-quantize "):
        load_assistant(args, None, None)
    for spec, quantize, named in (("self", None, "draft_quantize"), ("m", "int8", "draft_quantize"),
                                  ("m", None, "quantize")):  # "m" without one: LoadConfig's quantize
        with pytest.raises(ConfigError, match=f'^{named}="none"; use fusion:quantize=x, quantize the draft$'):
            with draft_quantize_named(spec, quantize):
                raise ConfigError('quantize="none"; use fusion:quantize=x, quantize the draft')


def test_a_load_or_sampling_keyword_given_to_load_names_where_it_goes_before_the_target_loads(tmp_path, monkeypatch):
    """load("m", device="cpu") (vLLM's LLM(model, dtype=...) habit) or load("m", temperature=0.5) said
    'method fusion does not take device; its options are datastore, ...' once the target had loaded; it
    names LoadConfig or generate() now, before any load (other unknown keywords keep the method's error)."""
    monkeypatch.setattr(specula, "load_backend", lambda *a, **k: pytest.fail("the target loaded"))
    for kw, match in (({"device": "cpu"}, r"config=LoadConfig\(device=...\)"),
                      ({"quantize": "int8", "method": "prompt-lookup"}, r"LoadConfig\(quantize=...\)"),
                      ({"temperature": 0.5}, r"sampling parameters go to generate\(\)"),
                      ({"max_tokens": 5}, r"load\(\) does not take max_tokens")):
        with pytest.raises(ConfigError, match=match):
            specula.load(str(tmp_path / "nowhere"), **kw)


def test_a_planner_given_to_method_none_is_refused_before_the_target_loads(tmp_path, monkeypatch):
    """load(m, method="none", planner=CostCurve(...)) ignored the planner without a word (method none
    never gets one), where the command line refuses --cost-curve with --method none; now a planner
    object (or a curve) is refused before any load, and the default spellings still pass."""
    from specula.models.hf import HFCausalLM
    from specula.planner import CostCurve, PassThroughPlanner

    def no_target(*args, **kwargs):
        raise AssertionError("the target loaded")

    monkeypatch.setattr(specula, "load_backend", no_target)
    curve = CostCurve((1, 2, 4), (0.010, 0.011, 0.012), 64)
    for planner in (curve, PassThroughPlanner()):
        with pytest.raises(ConfigError, match=r"method none drafts nothing.*drop planner= or pass a method that "):
            specula.load(str(tmp_path / "nowhere"), method="none", planner=planner)
    with pytest.raises(ConfigError, match="planner 'fast'"):
        specula.load(str(tmp_path / "nowhere"), method="none", planner="fast")
    for planner in ("hardware", None, "none", False):  # the default, and what method none runs with
        with pytest.raises(AssertionError, match="the target loaded"):
            specula.load(str(tmp_path / "nowhere"), method="none", planner=planner)
    target = HFCausalLM(tiny_model("qwen2", seed=5))
    with pytest.raises(ConfigError, match="method none drafts nothing"):  # built directly: the same check
        specula.Specula(target, None, "none", planner=curve)
    assert specula.Specula(target, None, "prompt-lookup", planner=curve).planned  # a method that drafts takes it


def test_what_only_matters_when_drafting_is_refused_for_method_none_before_the_target_loads(tmp_path, monkeypatch):
    """load(m, method="none", engine=EngineConfig(max_tree_nodes=8)) ignored the limit without a word, and a
    drafter option (tree_depth=3) was refused only once the target had loaded, in other words; every drafting
    limit (`engine.DRAFTING_LIMITS`) set away from its default, a planner and a drafter option are refused now,
    before any load, in the command line's wording (`methods.check_drafting_used`)."""
    from specula.engine import DRAFTING_LIMITS
    from specula.models.hf import HFCausalLM

    def no_target(*args, **kwargs):
        raise AssertionError("the target loaded")

    monkeypatch.setattr(specula, "load_backend", no_target)
    nowhere = str(tmp_path / "nowhere")
    assert EngineConfig(max_tree_nodes=8).drafting_limits_set() == ["max_tree_nodes"] == list(DRAFTING_LIMITS)
    assert EngineConfig(max_tree_nodes=64).drafting_limits_set() == []  # the default's value: nothing set
    assert EngineConfig(max_tree_nodes=8).without_drafting_limits() == EngineConfig()
    wording = "only matters when drafting, and method none drafts nothing; drop {} or pass a method that drafts"
    for kw, name in (({"engine": EngineConfig(max_tree_nodes=8)}, "max_tree_nodes"), ({"tree_depth": 3}, "tree_depth"),
                     ({"num_draft_tokens": 4, "max_ngram": 2}, "max_ngram"), ({"adaptive": False}, "adaptive")):
        with pytest.raises(ConfigError, match=re.escape(name + " " + wording.format(name))):
            specula.load(nowhere, method="none", **kw)
    for kw in ({"engine": EngineConfig()}, {"engine": EngineConfig(max_tree_nodes=64)}, {"tree_depth": None}):
        with pytest.raises(AssertionError, match="the target loaded"):  # nothing set: it loads
            specula.load(nowhere, method="none", **kw)
    target = HFCausalLM(tiny_model("qwen2", seed=5))
    with pytest.raises(ConfigError, match=re.escape("max_tree_nodes " + wording.format("max_tree_nodes"))):
        specula.Specula(target, None, "none", engine=EngineConfig(max_tree_nodes=8))  # built directly: the same
    for kw, name in (({"tree_depth": 3}, "tree_depth"), ({"tree_nodes": 16, "adaptive": True}, "adaptive")):
        with pytest.raises(ConfigError, match=re.escape(name + " " + wording.format(name))):  # not "does not take"
            specula.Specula(target, None, "none", **kw)
    assert specula.Specula(target, None, "none", tree_depth=None).method == "none"  # not given: plain decoding
    assert specula.Specula(target, None, "none", draft_skip=True, skip_layers=[1])  # the draft's (--draft skip)
    spec = specula.Specula(target, None, "prompt-lookup", engine=EngineConfig(max_tree_nodes=8))
    assert spec.baseline().engine_config == EngineConfig()  # --compare's plain decoding keeps its own limits


def test_a_draft_model_option_fusion_would_not_read_is_refused_saying_why_there_is_no_draft(model_dir, tmp_path,
                                                                                           monkeypatch):
    """load(m, num_draft_tokens=3) with no draft model (draft=None / "none", or auto picking none for a small target)
    ignored it without a word, as draft_window=256 with draft="skip" (layer skipping reads num_draft_tokens only):
    refused before the target loads where the draft is known, after it with auto's reason, and when a draft model
    or layer skipping reads it, taken."""
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    path, _ = model_dir
    fix = "give it a draft model with draft=MODEL, or drop"
    hf = specula.LoadConfig(backend="hf")  # (the refusals do not depend on the backend; no kernels to build)
    real_backend = specula.load_backend
    monkeypatch.setattr(specula, "load_backend", lambda *a, **k: pytest.fail("the target loaded"))
    for draft in (None, "none"):
        with pytest.raises(ConfigError, match=re.escape("num_draft_tokens is for a draft model or layer skipping, and "
                                                        "fusion drafts with neither here (no draft model given); "
                                                        f"{fix} num_draft_tokens")):
            specula.load(str(path), draft=draft, num_draft_tokens=3)
    with pytest.raises(ConfigError, match=re.escape("draft_window is for a draft model, and fusion drafts with the "
                                                    "target's own layers skipped here")):
        specula.load(str(path), draft="skip", draft_window=256)
    monkeypatch.setattr(specula, "load_backend", real_backend)
    with pytest.raises(ConfigError, match=re.escape("draft_window is for a draft model, and fusion drafts without one "
                                                    "here (the default draft choice, auto, picks one for targets of "
                                                    ">= 1B parameters, and this one has 0.0")) as caught:
        specula.load(str(path), draft_window=256, config=hf)  # draft="auto": a tiny target gets none
    assert str(caught.value).endswith(f"M); {fix} draft_window")
    spec = specula.load(str(path), draft=str(path), draft_window=0, num_draft_tokens=3, config=hf)
    last = spec.decoder.drafters[-1]
    assert last.name == "draft-model" and (last.config.draft_window, last.config.num_draft_tokens) == (0, 3)
    with pytest.raises(ConfigError, match="num_draft_tokens is for a draft model"):  # built directly: the same check
        specula.Specula(spec.target, spec.tokenizer, "fusion", num_draft_tokens=3)


def test_self_draft_reuses_the_target_weights_quantized_and_stays_lossless(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    path, model = model_dir
    spec = specula.load(str(path), draft="self", method="draft-model", num_draft_tokens=4)
    assert spec.draft is not None and spec.draft.cost_key()["quantize"] == "int8"
    assert spec.draft.weight_bytes < spec.target.weight_bytes  # int8 linears: a smaller copy
    drafted = accepted = 0
    for prompt in ([5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], [9, 8, 7]):
        out = spec.generate(prompt, max_new_tokens=30, ignore_eos=True)
        assert out.token_ids == reference_greedy(model, prompt, 30)
        drafted, accepted = drafted + out.stats.drafted_tokens, accepted + out.stats.accepted_tokens
    assert accepted > drafted / 2  # the int8 copy agrees with its float32 self most of the time


def test_auto_draft_is_off_for_small_targets_and_self_is_refused_unquantized(model_dir, tmp_path, monkeypatch):
    from specula.draft_choice import SELF_DRAFT_MIN_PARAMETERS, auto_draft

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    path, _ = model_dir
    spec = specula.load(str(path), method="fusion")  # draft="auto": a tiny target gets none
    assert spec.draft is None and [d.name for d in spec.decoder.drafters] == ["prompt-lookup", "token-recycling"]
    big = type("Big", (), {"num_parameters": SELF_DRAFT_MIN_PARAMETERS, "device": spec.target.device})()
    assert auto_draft("fusion", big) == "self" and auto_draft("prompt-lookup", big) is None
    # an embedded target with its companion draft installed drafts with the companion, else with itself
    monkeypatch.setattr("specula.models.install.is_valid_conversion", lambda model, directory=None: True)
    assert auto_draft("fusion", big, "qwen2.5-coder-1.5b") == "qwen2.5-coder-0.5b"
    assert auto_draft("draft-model", big, str(path)) == "self"  # not embedded: no companion
    monkeypatch.setattr("specula.models.install.is_valid_conversion", lambda model, directory=None: False)
    assert auto_draft("fusion", big, "qwen2.5-coder-1.5b") == "self"
    with pytest.raises(ConfigError, match='use draft_quantize="int8"'):
        specula.load(str(path), draft="self", draft_quantize="none", method="draft-model")


def test_a_self_draft_on_cuda_names_what_drafts_there_not_draft_quantize_none(monkeypatch):
    """A self-draft on CUDA met quantize's own check, `use draft_quantize="none"`, which the self-draft refuses (it
    would draft with the target itself): the advice went in a circle. It names what drafts on CUDA now (draft="skip",
    another draft model), and `specula generate` shows the flags."""
    import torch

    from specula.cli import build_parser
    from specula.commands.common import in_command_flags
    from specula.models.loading import LoadConfig, load_draft

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for quantize in (None, "int8", "none"):
        with pytest.raises(ConfigError) as caught:
            load_draft("self", None, None, LoadConfig(device="cuda"), target_name="t", quantize=quantize)
        message = str(caught.value)
        assert message == ('draft="self" drafts with the target\'s weights quantized, which runs on CPU only, not on '
                           'cuda:0; there use draft="skip" (the target drafting with layers skipped) or another draft '
                           "model (draft=MODEL)"), message
    args = build_parser().parse_args(["generate", "--target", "t", "--draft", "self", "--prompt", "p"])
    assert in_command_flags(args)(message) == (
        "--draft self drafts with the target's weights quantized, which runs on CPU only, not on cuda:0; there use "
        "--draft skip (the target drafting with layers skipped) or another draft model (--draft MODEL)")


def test_auto_quantizes_a_companion_to_int4_where_specula_kernels_run_and_a_self_draft_to_int8():
    from specula.draft_choice import auto_draft_quantize
    from specula.models.loading import LoadConfig
    from specula.models.native import kernels

    companion = "int4" if kernels.available() else "int8"
    assert auto_draft_quantize("qwen2.5-coder-0.5b", LoadConfig(device="cpu")) == companion
    assert auto_draft_quantize("self", LoadConfig(device="cpu")) == "int8"
    for other in ({"backend": "hf"}, {"backend": "hf", "linear_kernel": "specula"}, {"linear_kernel": "aten"},
                  {"linear_kernel": "onednn"}):
        assert auto_draft_quantize("qwen2.5-coder-0.5b", LoadConfig(device="cpu", **other)) == "int8", other


# ---------------------------------------------------------------------------- the session calls
@pytest.fixture(scope="module")
def tiny_spec():
    from specula.models.hf import HFCausalLM

    model = tiny_model("qwen2", seed=5)
    return specula.Specula(HFCausalLM(model), None, "prompt-lookup", planner="none"), model


def test_encode_takes_the_chat_templates_options(tiny_spec):
    """vLLM's LLM.chat options, on `encode`: continue_final_message leaves the last message open for the model."""
    template = "{% for m in messages %}w2 {{ m.content }} w3 {% endfor %}{% if add_generation_prompt %}w4{% endif %}"
    tok = word_tokenizer(8, chat_template=template)
    spec = specula.Specula(tiny_spec[0].target, tok, "none")
    messages = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6 w7"}]
    assert spec.encode(messages) == tok.encode("w2 w5 w3 w2 w6 w7 w3 w4")
    assert spec.encode(messages, add_generation_prompt=False) == tok.encode("w2 w5 w3 w2 w6 w7 w3")
    assert spec.encode(messages, add_generation_prompt=False, continue_final_message=True) == tok.encode(
        "w2 w5 w3 w2 w6 w7")
    with pytest.raises(ConfigError, match="Cannot set both"):
        spec.encode(messages, continue_final_message=True)


def test_sessions_stepped_together_give_what_generate_gives_alone(tiny_spec):
    """`start` / `step` / `finish` on the facade: two requests stepped in one batch, each gets
    exactly its own `generate` output (greedy = plain greedy, sampled = the same seeded draw)."""
    spec, model = tiny_spec
    prompts = [[5, 17, 33, 2, 5, 17, 40, 5, 17], [9, 8, 7, 9, 8]]
    params = [specula.SamplingParams(max_new_tokens=12, ignore_eos=True),
              specula.SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, seed=3)]
    sessions = [spec.start(p, params=q) for p, q in zip(prompts, params)]
    assert all(isinstance(s, specula.Session) for s in sessions)
    got: list[list[int]] = [[], []]
    while not all(s.finished for s in sessions):
        for out, chunk in zip(got, spec.step(sessions)):
            assert isinstance(chunk, specula.StreamChunk) and chunk.error is None
            out.extend(chunk.token_ids)
    for s in sessions:
        spec.finish(s)
        spec.finish(s)  # idempotent
    assert got[0] == reference_greedy(model, prompts[0], 12)
    assert got[1] == spec.generate(prompts[1], params=params[1]).token_ids
    assert spec.generate(prompts[1], max_new_tokens=12, ignore_eos=True, temperature=0.8, seed=3).token_ids == got[1]


def test_a_batch_of_prompts_gives_each_its_own_output_in_order(tiny_spec):
    """`generate_batch`: 5 prompts, 2 decoded at a time, per-prompt params (greedy and seeded
    samples, with logprobs): each output equals `generate` on that prompt alone, in prompt order."""
    spec, model = tiny_spec
    prompts = [[5, 17, 33, 2, 5, 17], [9, 8, 7, 9, 8], [60, 61, 62, 60], [3], [40, 41, 42, 40, 41]]
    params = [specula.SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True, temperature=0.9 * (i % 2), seed=i,
                                     logprobs=1 if i == 2 else None) for i in range(len(prompts))]
    outs = spec.generate_batch(prompts, params=params, max_batch_size=2)
    alone = [spec.generate(p, params=q) for p, q in zip(prompts, params)]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert outs[0].token_ids == reference_greedy(model, prompts[0], 6)
    assert [len(o.token_ids) for o in outs] == [6 + 3 * i for i in range(5)]
    assert [(e.token_id, round(e.logprob, 4)) for e in outs[2].logprobs] == [
        (e.token_id, round(e.logprob, 4)) for e in alone[2].logprobs]
    same = spec.generate_batch(prompts[:2], max_new_tokens=5, ignore_eos=True)  # keywords: one params for all
    assert [o.token_ids for o in same] == [reference_greedy(model, p, 5) for p in prompts[:2]]
    with pytest.raises(ConfigError, match="2 entries for 5 prompts"):
        spec.generate_batch(prompts, params=params[:2])
    with pytest.raises(ConfigError, match="the prompt is empty") as err:
        spec.generate_batch([[5, 6], []], max_new_tokens=4)  # checked before anything runs
    assert "(prompts[1] of the batch)" in getattr(err.value, "__notes__", [])  # which one (not said before)
    lone = spec.generate_batch(prompts[0], max_new_tokens=5, ignore_eos=True)  # one prompt's ids: one prompt
    assert [o.token_ids for o in lone] == [reference_greedy(model, prompts[0], 5)]
    assert [o.token_ids for o in spec.generate_batch((5, 17, 33), max_new_tokens=2, ignore_eos=True)] == [
        reference_greedy(model, [5, 17, 33], 2)]


def test_an_abandoned_batch_frees_its_sessions(tiny_spec):
    spec, _ = tiny_spec
    released = []
    jobs = ((i, [5, 6, 7 + i], specula.SamplingParams(max_new_tokens=10 + 10 * i, ignore_eos=True)) for i in range(6))
    gen = spec.decoder.generate_many(jobs, max_batch_size=3)
    original = spec.decoder.finish

    def finish(session):
        released.append(session)
        original(session)

    spec.decoder.finish = finish
    try:
        key, out = next(gen)  # the batch holds three sessions; one finished
        gen.close()  # the caller stops early: the other two are freed
    finally:
        del spec.decoder.finish
    assert (key, len(out.token_ids)) == (0, 10)
    freed = {id(s): s for s in released}.values()  # finish is idempotent: the finished one may be freed twice
    assert sorted(s.finish_reason for s in freed) == ["cancelled", "cancelled", "length"]  # jobs 3-5 never started


def test_facade_facts_baseline_and_planner_spellings(tiny_spec):
    from specula.planner import HardwarePlanner, PassThroughPlanner

    spec, model = tiny_spec
    assert spec.eos_token_ids == spec.target.eos_token_ids and isinstance(spec.engine_config, specula.EngineConfig)
    assert spec.lossless and not spec.planned and spec.drafter_memory_bytes() is None
    spec.prepare_batch(2)  # the pass-through planner has nothing to time
    plain = spec.baseline()
    assert plain.method == "none" and plain.target is spec.target and plain.engine_config == spec.engine_config
    assert plain.generate([9, 8, 7], max_new_tokens=6, ignore_eos=True).token_ids == reference_greedy(model, [9, 8, 7], 6)
    with pytest.raises(ConfigError, match="either params= or sampling keywords"):
        spec.generate([9, 8, 7], params=specula.SamplingParams(), max_new_tokens=3)
    with pytest.raises(ConfigError, match="unknown sampling keyword 'max_tokens'.*max_new_tokens"):  # not a TypeError
        spec.generate([9, 8, 7], max_tokens=3)
    with pytest.raises(ConfigError, match="unknown sampling keyword 'min_tokens'.*min_new_tokens"):
        spec.generate_batch([[9, 8, 7]], min_tokens=3)
    with pytest.raises(ConfigError, match="unknown sampling keyword 'continue_final_message'.*spec.encode"):
        spec.generate([9, 8, 7], continue_final_message=True)
    for choice, kind in (("hardware", HardwarePlanner), (None, HardwarePlanner), ("none", PassThroughPlanner),
                         (False, PassThroughPlanner)):  # None / False: the old spellings
        assert type(specula.build_decoder("prompt-lookup", spec.target, planner=choice).planner) is kind
    shared = PassThroughPlanner()
    assert specula.build_decoder("prompt-lookup", spec.target, planner=shared).planner is shared
    assert type(specula.build_decoder("none", spec.target, planner="hardware").planner) is PassThroughPlanner
    with pytest.raises(ConfigError, match="planner 'fast'"):
        specula.build_decoder("prompt-lookup", spec.target, planner="fast")


def test_what_generate_batch_reads_as_one_prompt():
    from specula.api import _lone_prompt

    chat = [{"role": "user", "content": "hi"}]
    assert _lone_prompt("hello") and _lone_prompt([5, 6]) and _lone_prompt((5,)) and _lone_prompt(chat)
    assert not any(_lone_prompt(p) for p in (["a", "b"], [[5, 6]], [chat], [], [True, False]))


def test_bad_requests_are_refused_before_anything_runs(tiny_spec):
    """Token ids outside the vocabulary (a bare IndexError, which failed the whole batched step),
    a prompt past the window in a batch (refused after the others had run), a text prompt without
    a tokenizer, params of the wrong type, a non-integer budget: each a ConfigError naming it, from
    the call itself (a stream's too), before any prompt is prefilled."""
    import numpy as np
    import torch

    from specula.sampling import SamplingParams

    spec, model = tiny_spec
    prefills = []
    real = spec.decoder.target.new_sequence
    spec.decoder.target.new_sequence = lambda: prefills.append(1) or real()
    try:
        with pytest.raises(ConfigError, match="prompt token id 700 is outside the model's vocabulary of 96"):
            spec.generate([5, 6, 700], max_new_tokens=4)
        with pytest.raises(ConfigError, match="prompt token id -1"):
            spec.start([5, -1], max_new_tokens=4)
        with pytest.raises(ConfigError, match="stop_token_ids names token 96, outside the model's vocabulary of 96"):
            spec.generate([5, 6], max_new_tokens=4, stop_token_ids=[5, 96])  # never emitted: never a stop
        with pytest.raises(ConfigError, match="stop_token_ids names token 500"):
            spec.generate_batch([[5, 6], [7, 8]], params=[SamplingParams(stop_token_ids=(500,))] * 2)
        with pytest.raises(ConfigError, match="context window"):
            spec.generate_batch([[5, 6, 7], [5] * 300], max_new_tokens=4)
        with pytest.raises(ConfigError, match="context window"):
            spec.stream([5] * 300, max_new_tokens=4)  # at the call, not at the first next()
        with pytest.raises(ConfigError, match="need the target's tokenizer"):
            spec.generate("hello", max_new_tokens=4)
        with pytest.raises(ConfigError, match="params= takes a SamplingParams"):
            spec.generate([5, 6], params={"max_new_tokens": 4})
        with pytest.raises(ConfigError, match="params= takes a SamplingParams"):
            spec.generate_batch([[5, 6], [7, 8]], params=[{"max_new_tokens": 4}] * 2)
        for bad in (2.5, "5", True):
            with pytest.raises(ConfigError, match="max_new_tokens must be a positive integer"):
                SamplingParams(max_new_tokens=bad)
        with pytest.raises(ConfigError, match="a prompt is text, a list of token ids or a list of chat messages"):
            spec.generate(5, max_new_tokens=4)
        assert prefills == []
    finally:
        spec.decoder.target.new_sequence = real
    expected = spec.generate([5, 17, 33], max_new_tokens=6).token_ids
    assert spec.generate(np.array([5, 17, 33]), max_new_tokens=6).token_ids == expected  # as HF tokenizers give them
    assert spec.generate(torch.tensor([5, 17, 33]), max_new_tokens=6).token_ids == expected
    assert spec.generate([np.int64(5), 17, 33], max_new_tokens=6).token_ids == expected
    [batched] = spec.generate_batch(np.array([5, 17, 33]), max_new_tokens=6)
    assert batched.token_ids == expected


def test_stats_count_the_tokens_a_step_emitted_not_drafts_past_a_stop():
    """A step that accepts drafts past a stop token: its accepted length is what it emitted."""
    from specula.api import build_decoder
    from specula.models.hf import HFCausalLM
    from specula.sampling import SamplingParams
    from tiny import successor_model

    dec = build_decoder("prompt-lookup", HFCausalLM(successor_model(40), "target"), planner="none")
    prompt = list(range(2, 20)) + [2]  # lookup drafts 3 4 5 ..., all accepted by a successor model
    out = dec.generate(prompt, SamplingParams(max_new_tokens=20, stop_token_ids=(5,), ignore_eos=True))
    assert out.token_ids == [3, 4, 5] and out.stats.steps == 1
    assert out.stats.accepted_lengths == [3] and out.stats.mean_accepted_tokens == 3.0


def test_a_given_cost_curve_plans_on_the_target_so_batches_still_pack(tmp_path, monkeypatch):
    """`--cost-curve` / planner=CostCurve: the hardware planner sizes lone steps by the given curve
    and still knows its target, so a backend that packs sessions gets its packed-pass table (a
    planner built without the target sized every session as if verified alone)."""
    import argparse
    import json

    from specula.commands.common import planner_from_args
    from specula.models.native import NativeCausalLM, NativeDecoder, configure
    from specula.planner import CostCurve, HardwarePlanner

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    target = NativeCausalLM(configure(NativeDecoder.from_hf(tiny_model("llama", seed=4)), "onednn", "none", "sdpa"),
                            "native", eos_token_ids=[])
    given = CostCurve((1, 2, 4, 8, 16), (0.010, 0.011, 0.012, 0.015, 0.020), 64)
    (tmp_path / "cost_curve.json").write_text(json.dumps(given.to_dict()))
    choice = planner_from_args(argparse.Namespace(cost_curve=str(tmp_path / "cost_curve.json")))
    spec = specula.Specula(target, None, "prompt-lookup", planner=choice)
    planner = spec.decoder.planner
    assert isinstance(planner, HardwarePlanner) and planner.cost.estimate(8) == pytest.approx(0.015)
    spec.prepare_batch(2)
    assert planner.batch_curve is not None
