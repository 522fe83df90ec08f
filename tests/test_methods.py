"""The method table (`specula.methods`): every row is consistent with its drafter module, every
reader takes what it needs from it, and method names are written nowhere else."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

import specula
from specula.drafters.heads.config import HeadKind
from specula.errors import ConfigError
from specula.methods import (
    DEFAULT_METHOD, METHODS, NO_HEAD, PLAIN, bench_defaults, get_method, layer_skipper, methods_taking,
)

PACKAGE = Path(specula.__file__).parent


def test_every_row_names_a_module_whose_create_takes_its_options():
    for spec in METHODS.values():
        assert (spec.module is None) == bool(spec.members), spec.name
        if spec.members:
            continue
        module = spec.drafter_module()
        assert callable(module.create), spec.name
        assert set(spec.options) <= set(spec.accepted_options()), spec.name


def test_fusion_members_are_rows_and_get_only_options_they_take():
    fusion = get_method(DEFAULT_METHOD)
    assert fusion.members
    for member in fusion.members:
        spec = get_method(member.method)
        assert not spec.members
        assert set(member.forwards) | {k for k, _ in member.fixed} <= set(spec.accepted_options()), member
    # the command line gives fusion what it forwards and the members expose (not --skip-layers: load takes it)
    assert set(fusion.cli_options()) == {"datastore", "recycling_state", "head", "target_name", "online_distill", "head_window",
                                         "head_context_vocab",
                                         "num_draft_tokens", "draft_window"}
    assert "skip_layers" in fusion.accepted_options()


def test_unknown_names_are_refused_with_the_list():
    with pytest.raises(ConfigError, match="unknown method 'lookahead'; choose one of: none, draft-model"):
        get_method("lookahead")
    assert get_method(METHODS[PLAIN]) is METHODS[PLAIN]


def test_facts_the_readers_take_from_the_table():
    assert {spec.head for spec in METHODS.values() if spec.head} == set(get_args(HeadKind))
    assert all(spec.features for spec in METHODS.values() if spec.head)
    assert layer_skipper().name == "layer-skip"
    assert [s.name for s in METHODS.values() if s.draft_model != "no"] == ["draft-model", "draft-tree", "fusion"]
    assert [s.name for s in METHODS.values() if s.auto_draft] == ["draft-model", "draft-tree", "fusion"]
    assert bench_defaults(False) == ["none", "prompt-lookup"]
    assert bench_defaults(True) == ["none", "prompt-lookup", "draft-model"]
    assert methods_taking("tree_top_k") == ["draft-tree", "eagle", "eagle3", "medusa", "hydra"]


def test_every_command_line_option_is_a_flag_of_the_same_name():
    from specula.cli import build_parser
    from specula.commands.common import drafter_options

    args = build_parser().parse_args(["generate", "--target", "x", "--prompt", "hi"])
    for spec in METHODS.values():
        for name in spec.cli_options():
            assert name == "target_name" or hasattr(args, name), (spec.name, name)
        options = drafter_options(args, spec.name)
        assert set(options) == set(spec.cli_options())
        assert all(v is None for k, v in options.items() if k != "target_name"), spec.name  # nothing given
    train = build_parser().parse_args(["train", "--target", "x", "--out", "o"])
    assert train.kind == "eagle"


def test_errors_name_options_as_flags_on_the_command_line():
    """`in_flags` rewrites the library's option names (tree_depth) as the command line's flags (--tree-depth):
    whole words with an underscore only, a one-word option (head: also an English word) and `keep` left alone."""
    from specula.methods import flag_spellings, in_flags, spelled

    assert spelled("tree_depth") == "--tree-depth" and spelled("target_name") == "--target"
    flags = flag_spellings(["max_tree_nodes", "top_p"])
    assert {"tree_depth", "head_window", "num_draft_tokens", "max_tree_nodes", "top_p", "head"} <= set(flags)
    assert all(flags[name] == spelled(name) for name in flags)
    message = "tree_depth must be >= 1 (subtree_depth, tree_depth_x, --tree-depth); max_tree_nodes; the head"
    assert in_flags(message, flags) == ("--tree-depth must be >= 1 (subtree_depth, tree_depth_x, --tree-depth); "
                                        "--max-tree-nodes; the head")
    variant = "method variant 'draft-tree:tree_depth=0': tree_depth must be >= 1; top_p"
    assert in_flags(variant, flags, keep=["tree_depth"]) == variant.replace("top_p", "--top-p")
    assert in_flags("use head=FILE or head=none, tree_nodes=N", flags) == ("use --head FILE or --head none, "
                                                                         "--tree-nodes N")
    # a value that is a word, as a flag takes it; a bench variant's own (keep) or after a colon (a variant) stays
    kseq = "tree_verifier=kseq needs i.i.d. siblings: use tree_sampling=iid with tree_verifier=kseq"
    assert in_flags(kseq, flags) == ("--tree-verifier kseq needs i.i.d. siblings: use --tree-sampling iid with "
                                     "--tree-verifier kseq")
    assert in_flags(kseq, flags, keep=["tree_sampling"]) == ("--tree-verifier kseq needs i.i.d. siblings: use "
                                                             "tree_sampling=iid with --tree-verifier kseq")
    assert in_flags("e.g. draft-tree:tree_sampling=iid, fusion:head=none", flags) == (
        "e.g. draft-tree:tree_sampling=iid, fusion:head=none")


def test_a_keyword_with_a_value_or_alone_names_the_flag_on_the_command_line():
    """A one-word option (draft, epochs, answers) reads as an English word, so the library names it as a keyword
    where the command line must show its flag: with a string in double quotes or a number, the flag and the value
    (`draft="skip"`: `--draft skip`); alone (`answers=`), the flag; `keep`'s and a variant's (after a colon) stay,
    and a lowercase bare value is a word, as a flag takes it (`head=none`: `--head none`)."""
    from specula.methods import in_flags, spelled

    flags = {name: spelled(name) for name in ("draft", "method", "epochs", "answers", "lr", "tree_depth", "head")}
    message = ('draft="skip" drafts chains: use method="layer-skip"; epochs=0 or epochs=1.5. with answers= (or '
               'answers=[x]), drop answers=; lr=-0.1, lr=1e-05, lr=nan, epochs=-inf, lr=nano, lr=1e5x; head=none, '
               'epochsx=0, the answers, tree_depth=0')
    assert in_flags(message, flags) == (
        "--draft skip drafts chains: use --method layer-skip; --epochs 0 or --epochs 1.5. with --answers (or "
        "answers=[x]), drop --answers; --lr -0.1, --lr 1e-05, --lr nan, --epochs -inf, --lr nano, lr=1e5x; "
        "--head none, epochsx=0, the answers, --tree-depth 0")  # nano, none: a word, as a flag takes it
    assert in_flags('tree_depth=0, draft="skip", answers=', flags, keep=["tree_depth", "draft", "answers"]) == (
        'tree_depth=0, draft="skip", answers=')
    variants = 'fusion:draft="skip", draft-tree:tree_depth=3, fusion:epochs=0, x:answers=, fusion:head=none'
    assert in_flags(variants, flags) == variants  # a variant written out: its options as the library spells them
    assert in_flags("cache_features=False keeps them", {"cache_features=False": "--no-feature-cache"}) == (
        "--no-feature-cache keeps them")  # a spelling of a keyword's value: a switch the command line turns off
    spellings = {"padded=None": "--padded-rows 0", "eval_data=[]": "--eval-data none", "eval_data": "--eval-data",
                 "padded": "--padded"}
    assert in_flags("give padded=None (padded=Nones), eval_data=[] or eval_data; padded", spellings) == (
        "give --padded-rows 0 (padded=Nones), --eval-data none or --eval-data; padded")  # a one-word name stays


def test_a_keyword_with_a_paths_repr_names_the_flag_and_keeps_the_quotes():
    """A path is written as Python shows it (`out='/data/my corpus'`, its repr); on the command line, the flag and
    the path as quoted (`--out '/data/my corpus'`), as the command line's own messages show a path."""
    from specula.methods import in_flags, spelled

    flags = {"out": spelled("out"), "eval_data": spelled("eval_data")}
    assert in_flags("out='/data/my corpus' is a directory; out='' and eval_data='x.jsonl', the out='", flags) == (
        "--out '/data/my corpus' is a directory; --out '' and --eval-data 'x.jsonl', the out='")


@pytest.mark.parametrize("option, value", [("head_window", -1), ("head_window", 8), ("head_context_vocab", 64),
                                           ("online_distill", True), ("head_window", 0)])  # 0: all (was ignored)
def test_a_head_option_given_to_fusion_without_a_head_is_refused(option, value):
    """fusion forwards these to its trained head; with none (none given, none installed) head_window=-1 was
    ignored without a word. head=none (no head, not even the installed one) likewise, and the message says so: it
    read "none given, none installed for the target" there too."""
    from tiny import tiny_model

    from specula.drafters import make_drafters
    from specula.models.hf import HFCausalLM

    target = HFCausalLM(tiny_model("qwen2", seed=5))
    for head, why, fix in ((None, "none given, none installed for the target", "head=FILE (`specula train`"),
                           (NO_HEAD, "the head given is none", "head=FILE instead of none, or drop")):
        with pytest.raises(ConfigError, match=re.escape(f"{option} is for a trained head, and fusion drafts without "
                                                        f"one here ({why}); give it one with {fix}")) as caught:
            make_drafters(DEFAULT_METHOD, target=target, head=head, **{option: value})
        assert ("installed" in str(caught.value)) == (head is None), caught.value
    assert make_drafters(DEFAULT_METHOD, target=target, **{option: None if value is not True else False})


@pytest.mark.parametrize("option, value", [("num_draft_tokens", 3), ("draft_window", 128), ("draft_window", 0)])
def test_a_draft_model_option_given_to_fusion_without_a_draft_model_is_refused(option, value):
    """fusion forwards num_draft_tokens to its draft model (and layer skipping), draft_window to its draft model; with
    neither joining, num_draft_tokens=3 or draft_window=0 (the whole prompt) was ignored without a word."""
    from tiny import tiny_model

    from specula.drafters import make_drafters
    from specula.methods import draft_options_unread
    from specula.models.hf import HFCausalLM

    target, draft = HFCausalLM(tiny_model("qwen2", seed=5)), HFCausalLM(tiny_model("qwen2", seed=6), "draft")
    readers, drafts = (("a draft model or layer skipping", "with neither") if option == "num_draft_tokens" else
                       ("a draft model", "without one"))
    with pytest.raises(ConfigError, match=re.escape(f"{option} is for {readers}, and fusion drafts {drafts} here (no "
                                                    f"draft model given); give it a draft model with draft=MODEL, or "
                                                    f"drop {option}")):
        make_drafters(DEFAULT_METHOD, target=target, **{option: value})
    drafters = make_drafters(DEFAULT_METHOD, target=target, draft=draft, **{option: value})
    assert getattr(drafters[-1].config, option) == value  # the draft model's drafter reads it
    # layer skipping (--draft skip) reads num_draft_tokens, not draft_window (tests/drafters/test_layer_skip.py)
    assert draft_options_unread(DEFAULT_METHOD, {option: value}, False, draft_skip=True) == (
        [] if option == "num_draft_tokens" else [option])
    assert draft_options_unread(DEFAULT_METHOD, {option: None, "adaptive": False}, False) == []  # nothing given
    assert draft_options_unread("draft-model", {option: value}, False) == []  # it needs a draft model: its own error


def test_every_switch_of_a_method_takes_true_or_false_only():
    """The options typed bool (CONFIG fields, `create` keywords) are the switches `check_switches` guards; make_drafter
    refuses another value for them (adaptive="maybe" drafted adaptively)."""
    from specula.drafters import make_drafter
    from specula.methods import check_switches

    assert {name: spec.switches() for name, spec in METHODS.items() if spec.switches()} == {
        "draft-model": ("adaptive", "greedy_proposals"), "draft-tree": ("adaptive",), "rest": ("verify",),
        **{kind: ("adaptive", "online_distill") for kind in ("eagle", "eagle3", "medusa", "hydra")},
        "fusion": ("online_distill",)}
    for value in ("maybe", 1, "true", 0.0):
        message = f"adaptive is a switch: it takes true or false, got {value!r}"
        with pytest.raises(ConfigError, match=re.escape(message)):
            make_drafter("draft-model", adaptive=value)
    check_switches("draft-model", {"adaptive": True, "greedy_proposals": None, "num_draft_tokens": 3})


def test_the_table_imports_no_drafter_and_no_torch():
    code = ("import sys, specula.methods; "
            "assert not {'torch', 'specula.drafters'} & set(sys.modules), 'torch or a drafter imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_moved_names_fail_naming_their_new_home():
    import specula.datastore
    import specula.drafters

    with pytest.raises(AttributeError, match="use specula.methods"):
        specula.drafters.MODULES  # noqa: B018
    with pytest.raises(AttributeError, match="use specula.models.loading.load_tokenizer"):
        specula.datastore.load_tokenizer  # noqa: B018
    import specula.models.loading
    import specula.models.skipping

    with pytest.raises(AttributeError, match="use specula.draft_choice.auto_draft"):
        specula.models.loading.auto_draft  # noqa: B018
    with pytest.raises(AttributeError, match="use draft_skip=True"):
        specula.models.skipping.LayerSkipDraft  # noqa: B018


def test_method_names_are_written_only_in_the_table_and_the_drafters():
    """Outside `methods.py` and the drafter packages (and training, which names head kinds), a method
    name is read from the table. "none" is left out: it also means no quantization, no draft, ..."""
    allowed = (PACKAGE / "methods.py", PACKAGE / "drafters", PACKAGE / "training")
    names = set(METHODS) - {PLAIN}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(path == a or a in path.parents for a in allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}")
    assert not found, found


def test_default_head_is_the_installed_one_of_the_methods_kind(tmp_path, monkeypatch):
    from specula.drafters.heads.shipped import installed_path
    from specula.methods import default_head

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    assert default_head("eagle", "smollm2-135m") is None and default_head("eagle3", "smollm2-135m") is None
    for kind in ("eagle", "eagle3"):
        path = installed_path("smollm2-135m", kind)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        assert default_head(kind, "smollm2-135m") == path
    assert default_head("fusion", "smollm2-135m") == installed_path("smollm2-135m", "eagle3")  # eagle3 first
    installed_path("smollm2-135m", "eagle3").unlink()
    assert default_head("fusion", "smollm2-135m") == installed_path("smollm2-135m", "eagle")
    assert default_head("prompt-lookup", "smollm2-135m") is None and default_head("eagle", "not-embedded") is None
    # every shipped head joins fusion, beside a draft model too (the planner values its chains)
    for alias in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        path = installed_path(alias, "eagle3")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        assert default_head("fusion", alias) == default_head("eagle3", alias) == path


def test_head_none_means_no_head():
    from tiny import tiny_model
    from specula.drafters import make_drafters
    from specula.models.hf import HFCausalLM

    target = HFCausalLM(tiny_model("llama", seed=1), "t")
    names = [d.name for d in make_drafters("fusion", target=target, head="none")]
    assert names and not {"eagle", "eagle3", "medusa", "hydra"} & set(names)
    with pytest.raises(ConfigError, match="needs a trained head"):
        make_drafters("eagle", target=target, head="none")


def test_fusion_leaves_token_recycling_out_when_a_head_joins():
    """With a trained head, token recycling's candidates are the head's done worse, at a cost
    (measured: docs/training.md); without one it stays."""
    import torch
    from tiny import tiny_model
    from specula.drafters import make_drafters
    from specula.drafters.heads.runtime import new_head
    from specula.models.hf import HFCausalLM

    target = HFCausalLM(tiny_model("llama", seed=1), "t")
    alone = [d.name for d in make_drafters("fusion", target=target, head="none")]
    head = new_head("eagle3", target, torch.arange(target.vocab_size))
    with_head = [d.name for d in make_drafters("fusion", target=target, head=head)]
    assert alone == ["prompt-lookup", "token-recycling"]
    assert with_head == ["prompt-lookup", "eagle3"]


def test_fusion_drafts_with_the_draft_model_before_a_head():
    """Each drafter's chain is valued beside the trees of the drafters before it: the draft model
    (costly, strong) first, so a cheap head adds nodes beside its chain instead of keeping it from
    drafting (the README main job with Qwen2.5-Coder-1.5B's head: 14.5 tok/s head first, 20.6 draft
    model first)."""
    import torch
    from tiny import perturbed_copy, tiny_model
    from specula.drafters import make_drafters
    from specula.drafters.heads.runtime import new_head
    from specula.models.hf import HFCausalLM

    model = tiny_model("llama", seed=1)
    target = HFCausalLM(model, "t")
    draft = HFCausalLM(perturbed_copy(model, 0.3), "d")
    head = new_head("eagle3", target, torch.arange(target.vocab_size))
    assert [d.name for d in make_drafters("fusion", target=target, draft=draft, head=head)] == [
        "prompt-lookup", "draft-model", "eagle3"]
