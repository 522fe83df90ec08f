"""Arguments shared by `generate`, `bench` and `serve`: models, method and sampling."""

from __future__ import annotations

import argparse
import contextlib
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from specula.errors import ConfigError, ModelNotFoundError, reworded
from specula.methods import (
    DEFAULT_METHOD, METHODS, NO_HEAD, PLAIN, default_head, flag_spellings, get_method, in_flags, is_given,
    methods_taking, spelled,
)

if TYPE_CHECKING:  # keep `specula --help` and `specula models` free of torch imports
    from specula.api import EngineConfig, LoadConfig
    from specula.sampling import SamplingParams


def add_model_args(parser: argparse.ArgumentParser, *, target_required: bool = True) -> None:
    g = parser.add_argument_group("models")
    g.add_argument("--target", required=target_required,
                   help="target model: embedded alias (see `specula models list`), local directory, .gguf file or cached hub id")
    g.add_argument("--draft", default="auto",
                   help="draft model (same tokenizer as the target); self = the target's own weights, int8 (no "
                        "second conversion); skip = the target itself with decoder sub-layers skipped (SWIFT, native "
                        "backend, no extra weights); none; auto = for "
                        f"{', '.join(spec.name for spec in METHODS.values() if spec.auto_draft)} on CPU, targets "
                        "of >= 1B parameters draft with their embedded companion (qwen2.5-coder-1.5b: "
                        "qwen2.5-coder-0.5b) when it is installed, in int4 where specula's CPU kernels run (else "
                        "int8), else self in int8; else none (default)")
    g.add_argument("--skip-layers", default=None, metavar="LAYERS",
                   help="with --draft skip: a fixed skip set instead of the on-the-fly search, as 0-based layers or "
                        "ranges, each optionally attn: or mlp: only, e.g. attn:14-26,mlp:5-12,3")
    g.add_argument("--draft-quantize", default=None, choices=("none", "int8", "int4"),
                   help="quantize the draft only (the target keeps its dtype and kernels): int8 = int8 weights and "
                        "activations (default for --draft self, and for a companion --draft auto picks where int4 "
                        "cannot run); int4 = 4-bit weights (a scale per 64 inputs) and int8 activations, specula's "
                        "CPU kernels only (native backend; default for a companion --draft auto picks); none "
                        "(default for a draft you name)")
    g.add_argument("--draft-vocab", default="auto", metavar="auto|full|N",
                   help="tokens the draft model scores (FR-Spec; outputs unchanged, the target verifies over its "
                        "whole vocabulary): auto = the 32768 most frequent where a token ranking ships for the "
                        "tokenizer (Qwen2.5) and the draft runs on the native backend (default); full = every "
                        "token; N = the N most frequent")
    add_load_args(g)
    add_prepared_cache_arg(g)


def add_load_args(parser) -> None:
    """How a model is loaded and run (what `load_config` reads besides the model names): device and
    dtype, attention, quantization, linear kernels, backend; and the CPU threads (`set_threads`)."""
    add_device_args(parser)
    add_attn_arg(parser)
    add_quantize_arg(parser)
    add_linear_kernel_arg(parser)
    add_backend_arg(parser)
    add_threads_arg(parser)


def add_threads_arg(parser) -> None:
    """`--threads N` (`set_threads`): every command that loads a model takes it through `add_load_args`."""
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="CPU threads of torch and specula's kernels for the whole run (default: torch's choice, "
                             "one a core); cost curves are cached per thread count, and the bench records it")


def set_threads(threads: int | None) -> None:
    """`--threads` (every command that loads a model; `cli.main` sets it before the command runs): torch's
    intra-op CPU threads, which specula's CPU kernels use too, for the whole run."""
    if threads is None:
        return
    if threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def add_prepared_cache_arg(parser) -> None:
    parser.add_argument("--prepared-cache", default="on", choices=("on", "off"),
                        help="on = a model prepared for specula's CPU kernels (fused, quantized, packed) is written "
                             "once under $SPECULA_CACHE/prepared and memory-mapped by later runs (docs/cache.md); "
                             "off = prepare it in memory on every run (default on)")


def add_device_args(parser) -> None:
    parser.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N",
                        help="where the models run: auto = the first CUDA device PyTorch sees, else the CPU (default)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="weights dtype: auto = float32 on CPU (the model unchanged), bfloat16 on CUDA (default)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="native backend on CUDA: run passes of up to 64 tokens as captured CUDA graphs (default on; "
                             "--no-cuda-graphs runs every pass eagerly)")


def add_backend_arg(parser) -> None:
    parser.add_argument("--backend", default="auto", choices=("auto", "native", "hf"),
                        help="native = specula's own Llama/Qwen2/Mistral decoder (static KV cache, low per-step "
                             "overhead); hf = any Hugging Face causal LM; auto = native where supported (default)")


def add_attn_arg(parser) -> None:
    from specula.models.attention_names import ATTN_IMPLEMENTATIONS

    parser.add_argument("--attn", default="auto", choices=ATTN_IMPLEMENTATIONS,
                        help="attention implementation: batch_invariant computes every query row alone (bitwise "
                             "equal to one-token steps); auto = batch_invariant with --quantize int8, else sdpa")


def add_quantize_arg(parser) -> None:
    parser.add_argument("--quantize", default="none", choices=("none", "int8", "int4"),
                        help="int8: int8 linear layers (per-channel weights, per-row activations) for target and draft "
                             "on CPU, ~4x faster decoding; speculative output stays identical to plain decoding of the "
                             "int8 model, which itself differs slightly from float32 (docs/cpu.md); int4: 4-bit weights "
                             "(a scale per 64 inputs), specula's CPU kernels only, further from float32 (default none)")


def add_linear_kernel_arg(parser) -> None:
    parser.add_argument("--linear-kernel", default="auto", choices=("auto", "specula", "onednn", "aten"),
                        help="linear layers: specula = specula's own C kernels (native backend on CPU: near memory "
                             "bandwidth for 1-16 rows, every row bitwise independent of the others), onednn = weights "
                             "prepacked for oneDNN, aten = F.linear; auto = specula on the native backend where it runs, "
                             "else onednn for float32 on CPU without --quantize, else aten (default auto)")


PROMPTS_SPELLING = {"source": "--prompts"}
"""`bench.datasets.load_prompts`' keyword as `specula bench` and `specula analyze` spell it (`flags_in_errors`' and
`in_command_flags`' `spellings`: its flag is not its name's)."""


def add_categories_arg(parser) -> None:
    """`--categories` (bench, analyze), read by `bench.datasets.parse_categories` once the prompts are known."""
    parser.add_argument("--categories", nargs="+", default=None, metavar="NAME",
                        help="only these prompt groups, comma- or space-separated (spec-bench: mt_bench, translation, "
                             "summarization, qa, math_reasoning, rag; a JSONL file: its categories; default all)")


def _taking(option: str) -> str:
    """"draft-tree, eagle, ..." : the methods a method flag applies to (from the method table)."""
    return ", ".join(methods_taking(option))


def add_method_args(parser: argparse.ArgumentParser) -> None:
    """The method's flags. A flag named like an option in a method's row (`MethodSpec.options`) is
    that option (`drafter_options`); each flag's help names the methods that take it."""
    g = parser.add_argument_group("method")
    g.add_argument("--num-draft-tokens", type=int, default=None,
                   help=f"{_taking('num_draft_tokens')}: tokens drafted per step (default 5; 12 with --adaptive, "
                        "in fusion, or with layers skipped)")
    g.add_argument("--draft-window", type=int, default=None, metavar="N",
                   help=f"{_taking('draft_window')} (and {DEFAULT_METHOD}'s draft model): most prompt tokens the draft "
                        "model reads; of a longer prompt, its first and last N/2 (default 512; 0: the whole prompt)")
    g.add_argument("--max-tree-nodes", type=int, default=None,  # None: not given (method none refuses it)
                   help="most tree nodes verified per step (default 64; every method but none, which drafts nothing)")
    g.add_argument("--cost-curve", metavar="JSON", default=None,
                   help="planner: use this cost curve (cost_curve.json from `specula profile`, e.g. measured on "
                        "another machine) instead of measuring the target here (every method but none, which drafts "
                        "nothing)")
    g.add_argument("--adaptive", action="store_true",
                   help=f"{_taking('adaptive')}: adaptive chain length (stop drafting by the planner's cost-derived rule)")
    g.add_argument("--tree-sampling", default=None, choices=("deterministic", "iid", "without_replacement", "beam"),
                   help=f"{_taking('tree_sampling')}: how siblings are drafted when sampling (default deterministic top-k)")
    g.add_argument("--tree-verifier", default=None, choices=("rrs", "kseq"),
                   help=f"{_taking('tree_verifier')}: rule for iid siblings, recursive rejection sampling or SpecTr "
                        "K-SEQ (default rrs)")
    g.add_argument("--tree-top-k", type=int, default=None,
                   help=f"{_taking('tree_top_k')}: children per node and frontier size (default 4)")
    g.add_argument("--tree-depth", type=int, default=None,
                   help=f"{_taking('tree_depth')}: levels drafted (default 5; eagle 6, medusa / hydra 4)")
    g.add_argument("--tree-nodes", type=int, default=None,
                   help=f"{_taking('tree_nodes')}: most nodes proposed (default 24; eagle 48, medusa / hydra 32)")
    g.add_argument("--datastore", metavar="FILE", default=None,
                   help=f"{_taking('datastore')}: datastore file built with `specula datastore build` (same tokenizer "
                        "as the target)")
    g.add_argument("--head", metavar="FILE", default=None,
                   help=f"{_taking('head')} (and {DEFAULT_METHOD}): a trained head file (`specula train`); default: "
                        f"the head installed for the target by `specula models install`, if any ({DEFAULT_METHOD}: "
                        f"its members' kinds, eagle3 first); `{NO_HEAD}`: no head")
    g.add_argument("--head-window", type=int, default=None, metavar="N",
                   help=f"{_taking('head_window')} (and {DEFAULT_METHOD}'s head): committed tokens the head attends "
                        "to while drafting (default: the context it was trained on, from its file; 0: all)")
    g.add_argument("--head-context-vocab", type=int, default=None, metavar="N",
                   help=f"{_taking('head_context_vocab')} (and {DEFAULT_METHOD}'s head): most tokens outside the head's "
                        "draft vocabulary that a request's prompt and output add to what the head can draft (names, "
                        "numbers, foreign words it would copy; default 0: none; e.g. 1024)")
    g.add_argument("--online-distill", action="store_true",
                   help=f"{_taking('online_distill')} (and {DEFAULT_METHOD}'s head): keep training the head on the "
                        "requests it serves (OSD: replay buffer, small learning rate); greedy output is unchanged and "
                        "sampled output keeps the target's law, acceptance adapts (a seeded request with a sampled "
                        "--tree-sampling mode may differ when asked again after the head has trained)")
    g.add_argument("--recycling-state", metavar="FILE", default=None,
                   help=f"{_taking('recycling_state')}: matrix file loaded at start if present and saved after each "
                        "request (hot start)")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--min-new-tokens", type=int, default=0,
                   help="tokens to generate at least: end-of-sequence, stop ids and stop strings end no shorter "
                        "output (default 0)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0 or -1 = every token, "
                   "as vLLM; default 0)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this fraction as likely as the most likely one (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible runs)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template to the prompt")


def explicit_draft(args: argparse.Namespace) -> bool:
    """A draft was named (`--draft MODEL` or `self`), not left to `auto` or turned off."""
    return getattr(args, "draft", None) not in (None, "none", "auto")


def check_model_name(spec: str, option: str) -> None:
    """Refuse, before any model loads, a model `option` names that nothing could load (`models.loading.resolve`:
    a missing path, a file that is not a .gguf, a folder without config.json, an alias not installed); `self`
    (the target's own weights) passes."""
    from specula.models.loading import SELF_DRAFT, resolve

    if spec == SELF_DRAFT:
        return
    try:
        resolve(spec)
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(f"{option}: {exc}") from None


def load_config(args: argparse.Namespace) -> "LoadConfig":
    from specula.api import LoadConfig
    from specula.models.device import cuda_graphs_asker
    from specula.models.loading import check_graphs_backend, check_graphs_device

    asker = cuda_graphs_asker(getattr(args, "cuda_graphs", None))  # --cuda-graphs, or SPECULA_CUDA_GRAPHS=1
    with flags_in_errors(args):  # the library names LoadConfig's fields (device="cuda")
        config = LoadConfig(dtype=args.dtype, attn_implementation=args.attn, quantize=args.quantize,
                            linear_kernel=args.linear_kernel, backend=getattr(args, "backend", "auto"),
                            device=getattr(args, "device", "auto"),
                            prepared_cache=getattr(args, "prepared_cache", "on"))
        device, _ = config.resolved()  # a bad --device / --dtype fails here, before any slow load
        if config.backend == "hf":  # auto's choice of hf is refused by the load, before the model's weights
            check_graphs_backend(config.backend, device, args.target, asker)
        check_graphs_device(device, config.device, asker)  # it was ignored without a word
    if getattr(args, "cuda_graphs", None) is not None:
        from specula.models.device import set_cuda_graphs

        set_cuda_graphs(args.cuda_graphs)  # read by the native backends built from here on
    return config


def drafter_options(args: argparse.Namespace, method: str) -> dict:
    """The options a method takes (its row's `MethodSpec.cli_options`) from the command line: the flags
    of the same name (`target_name` is `--target`; a switch left off is None: the method's default),
    `--head` checked before any model is loaded, else the head installed for the target
    (`methods.default_head`)."""
    spec = get_method(method)
    options: dict = {}
    for name in spec.cli_options():
        value = args.target if name == "target_name" else getattr(args, name)
        options[name] = None if value is False else value
    check_drafter_files(options.get("head"), options.get("datastore"))
    if "head" in options and not options["head"]:  # (NO_HEAD: no head, not even the installed one)
        found = default_head(spec, getattr(args, "target", None))
        options["head"] = None if found is None else str(found)
    return options


def check_drafter_files(head: str | None = None, datastore: str | None = None) -> None:
    """Read a head file (not `NO_HEAD`) and a datastore's header before any model is loaded: a missing
    or damaged one fails here, not after the target's load."""
    if head and str(head) != NO_HEAD:
        from specula.drafters.heads.file import read_head

        read_head(str(head))
    if datastore:
        from specula.datastore.format import load_datastore

        load_datastore(str(datastore), verify=False)  # exists, whole, of this format (checksums: when loaded)


def planner_from_args(args: argparse.Namespace):
    """The cost curve given with --cost-curve (a `PlannerChoice`: the hardware planner on the
    target, with this curve), or None (measure here)."""
    if not getattr(args, "cost_curve", None):
        return None
    from specula.planner import read_cost_curve

    return read_cost_curve(args.cost_curve)


def served_model_name(args: argparse.Namespace) -> str:
    """The model id requests name: --served-model-name, else the --target value. An empty or blank name is
    refused (it fell back to --target without a word, and clients sending "" got 404)."""
    name = args.served_model_name
    if name is None:
        return args.target
    if not name.strip():
        raise ConfigError(f"--served-model-name is empty ({name!r}); give a name, or leave the option out to "
                          "serve under the --target value")
    return name


def add_prefix_cache_arg(group) -> None:
    """`--prefix-cache-mib` of `serve` and `run-batch` (`EngineConfig.prefix_cache_mib`; its default,
    `engine.DEFAULT_PREFIX_CACHE_MIB`, written out: the engine imports torch, and --help must not)."""
    group.add_argument("--prefix-cache-mib", type=int, default=None, metavar="MIB",
                       help="memory for finished requests' caches, so that a request beginning with the same tokens (a "
                            "chat's next turn, a shared system prompt) prefills only the rest (default 1024 on "
                            "specula's CPU kernels, where outputs stay bit for bit the same; else off; 0: off)")


def add_tool_args(group) -> None:
    """vLLM's tool-calling options of `serve` and `run-batch`: tool_choice auto parses the output."""
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='parse tool calls out of the output of chat requests with tools and tool_choice "auto" '
                            "(the default when tools are given; without this option they are refused, as in vLLM)")
    group.add_argument("--tool-call-parser", default=None, metavar="PARSER",
                       help="the format of the model's tool calls, for --enable-auto-tool-choice: hermes "
                            "(<tool_call>{...}</tool_call>: Qwen2.5, Qwen3, Hermes), llama3_json ({\"name\": ..., "
                            "\"parameters\": {...}}: Llama 3.1-3.3), mistral ([TOOL_CALLS][{...}] or "
                            "[TOOL_CALLS]name[ARGS]{...}: Mistral), pythonic ([name(key=value, ...), ...]: "
                            "Llama 3.2 1B/3B, Llama 4) or llama4_pythonic (pythonic, Llama 4's "
                            "<|python_start|> and <|python_end|> around it dropped)")


def auto_tool_parser(args: argparse.Namespace) -> str | None:
    """The parser of tool_choice auto's output that --enable-auto-tool-choice and --tool-call-parser give
    (None: auto is off), checked: its errors name the flags (the library names `ServerConfig`'s fields)."""
    from specula.serve.tools import auto_tool_parser as checked

    with flags_in_errors(args, ["enable_auto_tool_choice", "tool_call_parser"]):
        return checked(args.enable_auto_tool_choice, args.tool_call_parser)


def add_penalty_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("penalties (the penalised distribution is decoded exactly; outputs then "
                                  "differ from unpenalised decoding)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already in the prompt or output (Hugging Face's rule; 1 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per occurrence in the output (OpenAI's, -2..2; 0 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted once from every token the output holds (OpenAI's, -2..2; 0 = off)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (-100..100) to token ID's logit (repeatable)")


def penalties_from_args(args: argparse.Namespace) -> dict:
    """The `SamplingParams` penalty fields of the command line (`add_penalty_args`; a bad --logit-bias:
    ConfigError)."""
    bias = {}
    for item in args.logit_bias:
        token, _, value = item.partition("=")  # no "=": an empty value, refused below
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ConfigError(f"--logit-bias takes ID=BIAS (a token id and a number), got {item!r}") from None
    return {"repetition_penalty": args.repetition_penalty, "frequency_penalty": args.frequency_penalty,
            "presence_penalty": args.presence_penalty, "logit_bias": bias}


def sampling_params(args: argparse.Namespace) -> "SamplingParams":
    """The `SamplingParams` of a command's `add_sampling_args` and `add_penalty_args` flags (a bad value: a
    ConfigError naming its flag)."""
    from specula.sampling import SamplingParams

    with flags_in_errors(args):
        return SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
            max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, stop=tuple(args.stop),
            ignore_eos=args.ignore_eos, **penalties_from_args(args),
        )


def command_flags(args: argparse.Namespace, options: Iterable[str] = (),
                  spellings: dict[str, str] | None = None) -> dict[str, str]:
    """{option: flag} (`methods.flag_spellings`) of the options this command's flags set: the methods' options,
    the engine's limits, sampling parameters, how models load (`LoadConfig`), `load`'s keywords (draft, method,
    draft_quantize, skip_layers, draft_vocab; `draft=MODEL` in a message: `--draft MODEL`) and `options` (another
    config's fields or a function's keywords, e.g. `specula train`'s), each only where the command has the flag (its
    `args` has the attribute), `make_drafters`' and `Specula`'s draft_skip=True as `--draft skip` where it has
    --draft, the native backend's cuda_graphs=False as `--no-cuda-graphs` and the ask `set_cuda_graphs(True)` as
    `--cuda-graphs` where it has --cuda-graphs, the planner's `planner=read_cost_curve(FILE)` as `--cost-curve FILE`
    where it has --cost-curve, and plain decoding's `method="none"` as `--methods none` where it has --methods (and
    no --method); and
    `spellings`, options whose flag is not their name's (`specula train`'s `cache_features=False`:
    `--no-feature-cache`)."""
    from dataclasses import fields

    from specula.engine import EngineConfig
    from specula.models.device import GRAPHS_ASKED
    from specula.models.loading import LoadConfig
    from specula.models.skipping import SKIP_DRAFT
    from specula.planner.cost import CURVE_GIVEN, PLAIN_METHOD
    from specula.sampling import SamplingParams

    names = [*(f.name for config in (EngineConfig, SamplingParams, LoadConfig) for f in fields(config)), "draft",
             "method", "draft_quantize", "skip_layers", "draft_vocab", *options]
    flags = {name: flag for name, flag in flag_spellings(names).items() if hasattr(args, flag[2:].replace("-", "_"))}
    if hasattr(args, "draft"):  # the drafters' keyword for load's draft="skip"
        flags["draft_skip=True"] = f"--draft {SKIP_DRAFT}"
    if hasattr(args, "cost_curve"):  # the planner's advice when the target's window is too short to time a curve
        flags[CURVE_GIVEN] = "--cost-curve FILE"
    if hasattr(args, "methods") and not hasattr(args, "method"):  # the same advice's plain decoding, in bench
        flags[PLAIN_METHOD] = f"--methods {PLAIN}"
    if hasattr(args, "cuda_graphs"):  # the native backend's advice when --cuda-graphs cannot run (GRAPHS_OFF)
        flags.update({"cuda_graphs=False": "--no-cuda-graphs", GRAPHS_ASKED: "--cuda-graphs"})
    return {**flags, **(spellings or {})}


def in_command_flags(args: argparse.Namespace, options: Iterable[str] = (),
                     spellings: dict[str, str] | None = None) -> Callable[[str], str]:
    """A library's message (naming options as Python does, `tree_depth`) -> the same naming this command's flags
    instead (`--tree-depth`; `command_flags(args, options, spellings)`, `methods.in_flags`): for its errors
    (`flags_in_errors`) and its notes (`specula train`'s)."""
    options = list(options)
    return lambda message: in_flags(message, command_flags(args, options, spellings))


@contextlib.contextmanager
def flags_in_errors(args: argparse.Namespace, options: Iterable[str] = (),
                    spellings: dict[str, str] | None = None) -> Iterator[None]:
    """Errors the library raises inside (`SpeculaError`: it names options as Python does, `tree_depth`) name the
    command line's flags instead (`in_command_flags`)."""
    with reworded(in_command_flags(args, options, spellings)):
        yield


def check_method_flags(args: argparse.Namespace, method: str) -> None:
    """Refuse a method flag that `method` does not take, and a draft model named for a method that
    drafts without one: either would be ignored without a word (ConfigError naming the fix)."""
    from specula.models.skipping import SKIP_DRAFT

    spec = get_method(method)
    check_flags_taken(args, [method], f"method {spec.name}", "pass --method with one of those")
    check_drafting_flags_used(args, [method], f"method {spec.name}", "pass --method with a method that drafts")
    if spec.draft_model == "no" and explicit_draft(args) and args.draft != SKIP_DRAFT:
        raise ConfigError(f"method {spec.name} drafts without a draft model; drop --draft {args.draft} or pass a "
                          "method that uses one (draft-model, draft-tree, fusion)")
    given = draft_model_flags(args) if spec.draft_model == "no" else []
    if given:  # nothing to quantize or cut: it was ignored without a word
        raise ConfigError(f"{given[0]} applies to a draft model, and method {spec.name} drafts without one; "
                          "drop it or pass a method that uses one (draft-model, draft-tree, fusion)")


def draft_model_flags(args: argparse.Namespace) -> list[str]:
    """The flags that shape a draft model given on the command line (--draft-quantize, --draft-vocab):
    a command running no method that drafts with one refuses them."""
    return [flag for flag, given in (("--draft-quantize", getattr(args, "draft_quantize", None) is not None),
                                     ("--draft-vocab", getattr(args, "draft_vocab", "auto") != "auto")) if given]


def check_drafting_flags_used(args: argparse.Namespace, methods, what: str, fix: str) -> None:
    """Refuse --cost-curve and the engine's drafting limits (`engine.DRAFTING_LIMITS`: --max-tree-nodes) given
    when every one of `methods` is plain decoding: method none drafts nothing and has no planner, so either was
    ignored without a word (`methods.check_drafting_used`, the check and wording `api.load` refuses them with). A
    limit given at its default's value is refused too: the command line tells it apart from one left out."""
    from specula.engine import DRAFTING_LIMITS
    from specula.methods import check_drafting_used

    given = [*(["--cost-curve"] if getattr(args, "cost_curve", None) else []),
             *(spelled(name) for name in DRAFTING_LIMITS if getattr(args, name, None) is not None)]
    check_drafting_used(methods, given, what, fix)


def engine_config(args: argparse.Namespace) -> "EngineConfig":
    """The decode loop's limits: each `EngineConfig` field from the flag of the same name when given (e.g.
    `--max-tree-nodes`), else its default (64). A command without `--prefix-cache-mib` runs with no prefix
    cache: `generate` decodes one request (its `--compare` warm-up would leave the method, not plain
    decoding, the prompt's cache), `bench` measures decoding with every prompt prefilled whole."""
    from dataclasses import fields

    from specula.api import EngineConfig

    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if getattr(args, f.name, None) is not None}
    if not hasattr(args, "prefix_cache_mib"):
        values["prefix_cache_mib"] = 0
    with flags_in_errors(args):
        return EngineConfig(**values)


def check_flags_taken(args: argparse.Namespace, methods, what: str, fix: str) -> None:
    """Refuse a method flag given on the command line that none of `methods` takes (it would be
    ignored without a word): a ConfigError naming `what` runs and the `fix`."""
    taken = {o for m in methods for o in get_method(m).cli_options()}
    for name in sorted({o for s in METHODS.values() for o in s.cli_options()} - taken):
        if is_given(getattr(args, name, None)):  # --draft-window 0 too
            raise ConfigError(f"{spelled(name)} does not apply to {what} (it applies to "
                              f"{_taking(name)}); drop it or {fix}")


def load_spec(args: argparse.Namespace):
    """The `Specula` a command decodes with (`--target`, `--draft`, `--method` and the drafter and
    planner options), and its method's name. A flag the method would ignore is refused first; an error the
    library raises about an option names its flag (`flags_in_errors`)."""
    from specula.api import load
    from specula.methods import DEFAULT_METHOD, get_method

    method = get_method(DEFAULT_METHOD if args.method is None else args.method).name
    check_method_flags(args, method)
    with flags_in_errors(args):  # an option's error from the library names its flag
        spec = load(args.target, draft=args.draft, method=method, config=load_config(args),
                    draft_quantize=args.draft_quantize, skip_layers=args.skip_layers, draft_vocab=args.draft_vocab,
                    engine=engine_config(args), planner=planner_from_args(args),
                    **drafter_options(args, method))
    return spec, method


def method_help(default: bool = False) -> str:
    """`--method`'s help: the names in the table (with `default`: and the default method)."""
    names = "decoding method: " + ", ".join(METHODS)
    if not default:
        return names
    return names + f" (default: {DEFAULT_METHOD} = {METHODS[DEFAULT_METHOD].summary})"
