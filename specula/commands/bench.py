"""`specula bench`: methods (and Hugging Face `generate` peers) side by side on Spec-Bench or a
JSONL file; writes DIR/results.json, DIR/report.md and PNG plots. Exit 1 when a lossless
method's greedy output differs from plain decoding (after writing the results), 130 on Ctrl-C
(partial results kept)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from specula.commands.common import (
    PROMPTS_SPELLING, add_categories_arg, add_method_args, add_model_args, add_penalty_args, add_sampling_args,
    check_drafter_files, check_flags_taken,
    check_model_name, check_drafting_flags_used, command_flags, draft_model_flags, drafter_options, engine_config,
    explicit_draft, flags_in_errors,
    load_config, method_help, planner_from_args, sampling_params,
)
from specula.errors import ConfigError
from specula.paths import check_not_input, check_output
from specula.methods import PLAIN, spelled


def default_methods_help() -> str:
    """The bench's default method list, as help text (`methods.bench_defaults`)."""
    from specula.methods import bench_defaults

    plain, with_draft = bench_defaults(False), bench_defaults(True)
    extra = [name for name in with_draft if name not in plain]
    return ",".join(plain) + (f" (+ {', '.join(extra)} with --draft)" if extra else "")


def register(sub) -> None:
    p = sub.add_parser(
        "bench", help="benchmark methods against plain decoding and Hugging Face generate",
        description="Run every method (and Hugging Face generate peers) on the same prompts in one process, "
                    "interleaved per prompt; write DIR/results.json, DIR/report.md and plots. A greedy bench "
                    "exits 1 if a lossless method's output differs from plain decoding.")
    add_model_args(p)
    g = p.add_argument_group("benchmark")
    g.add_argument("--methods", default=None,
                   help=method_help() + f"; comma-separated ({PLAIN} always runs: it is the baseline). "
                   f"Default: {default_methods_help()}")
    g.add_argument("--prompts", default="spec-bench",
                   help="spec-bench (shipped, 480 prompts), everyday (shipped, 24 prompts: chat, instructions, "
                        "code, math), structured (shipped, 24 prompts each with a JSON schema every method decodes "
                        "under: docs/structured.md) or a JSONL file of {id, category, turns} (default spec-bench)")
    g.add_argument("--per-category", type=int, default=None, help="prompts per category (seeded order; default all)")
    add_categories_arg(g)
    g.add_argument("--compare", default=None,
                   help="hf: also time Hugging Face generate (hf:greedy, hf:prompt-lookup, and with --draft "
                   "hf:assisted, hf:assisted-heuristic); llamacpp, llamacpp:prompt-lookup: llama.cpp on the target's "
                   "GGUF (needs pip install 'specula[llamacpp]'); or a comma list of those names")
    g.add_argument("--assistant", default=None, metavar="MODEL",
                   help="the model Hugging Face's assisted peers draft with (same tokenizer as the target; "
                        "default: the --draft model), so specula's self-draft can be compared with HF assisted "
                        "generation using a separate small model in one run")
    g.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="rounds over the whole prompt set, each on methods built afresh (nothing a drafter learned "
                        "carries over: what a new process gets); the report adds each method's speedup min / median "
                        "/ max over the rounds (default 1)")
    g.add_argument("--out", required=True, help="output directory (results.json, report.md, *.png)")
    g.add_argument("--profile-context", type=int, default=256,
                   help="context length of the cost-curve measurement at the start (default 256)")
    g.add_argument("--profile-repeats", type=int, default=3, help="cost-curve repeats per size; 0 skips it (default 3)")
    g.add_argument("--warmup-tokens", type=int, default=32, help="tokens of each method's untimed warm-up (default 32)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_method_args(p)
    add_sampling_args(p)
    add_penalty_args(p)
    p.set_defaults(handler=run, seed=0)


@dataclass(frozen=True)
class BenchPlan:
    """Everything validated before any model is loaded."""

    methods: list[str]
    peers: list[str]
    prompts: list  # [BenchPrompt]
    settings: object  # BenchSettings
    categories: list[str] | None = None
    """`--categories` as read (`parse_categories`), None when not given (every group)."""


def plan(args: argparse.Namespace) -> BenchPlan:
    """Validate the command line (fast, before loading models)."""
    from specula.bench.datasets import categories_of, load_prompts, parse_categories, select_prompts
    from specula.bench.methods import parse_method_list, split_method
    from specula.bench.peers import NEEDS_DRAFT, parse_compare
    from specula.bench.runner import BenchSettings
    from specula.models.skipping import SKIP_DRAFT

    if args.stop:
        raise ConfigError("bench does not take --stop (every method must get the same budget); drop it")
    if args.profile_repeats < 0 or args.warmup_tokens < 0:
        raise ConfigError("--profile-repeats and --warmup-tokens must be >= 0")
    if args.profile_context < 1:  # was measured as "the target's context window is too short", and skipped
        raise ConfigError(f"--profile-context must be >= 1, got {args.profile_context}; pass e.g. 256, or "
                          "--profile-repeats 0 to skip the cost curve")
    check_output(args.out, "--out", "dir")
    check_bench_inputs_kept(args)
    if args.assistant:
        check_model_name(args.assistant, "--assistant")  # else found missing only after the target loaded
    params = sampling_params(args)
    engine_config(args)  # --max-tree-nodes 0: refused before the models load, not after
    methods = parse_method_list(args.methods, explicit_draft(args))
    bases = list(dict.fromkeys(split_method(m)[0] for m in methods))
    check_flags_taken(args, bases, f"the methods benched ({', '.join(bases)})", "add one of those to --methods")
    check_drafting_flags_used(args, bases, "method none (the only one benched)",
                              "add a method that drafts to --methods")
    # skip: no model to assist; --assistant: a model for the HF assisted peers only
    peers = parse_compare(args.compare, bool(args.assistant) or (explicit_draft(args) and args.draft != SKIP_DRAFT))
    if peers and params.penalized:  # they would decode the unpenalised distribution, and read as slower or faster
        raise ConfigError("the peers of --compare decode without specula's penalties (--repetition-penalty, "
                          "--frequency-penalty, --presence-penalty, --logit-bias): drop --compare or the penalties")
    if args.assistant and not NEEDS_DRAFT & set(peers):  # it would be loaded for nothing, silently
        raise ConfigError("--assistant is the model Hugging Face's assisted peers draft with, and no assisted peer "
                          "is compared: add --compare hf (or hf:assisted), or drop --assistant")
    check_assistant_device(args)
    check_draft_used(args, methods, peers)
    check_entry_flags(args, methods)
    check_method_files(args, methods)
    # the library names its keywords (repeats=3, categories=, source= for --prompts)
    with flags_in_errors(args, ["per_category", "repeats", "categories"], PROMPTS_SPELLING):
        available = load_prompts(args.prompts)
        categories = None if args.categories is None else parse_categories(args.categories,
                                                                            categories_of(available))
        prompts = select_prompts(available, args.per_category, categories, args.seed)
        settings = BenchSettings(params, raw=args.raw, warmup_tokens=args.warmup_tokens,
                                 progress=not args.no_progress, repeats=args.repeats)
    return BenchPlan(methods, peers, prompts, settings, categories)


def check_method_files(args: argparse.Namespace, methods: list[str]) -> None:
    """Read the head and datastore files the benched methods take (`--head`, `--datastore`, a variant's
    `head=` / `datastore=`) before any model loads: a missing or damaged one failed only after the target's
    load (as `specula generate` checks `--head`)."""
    from specula.bench.methods import split_method

    heads = [args.head, *(split_method(m)[1].get("head") for m in methods)]
    stores = [args.datastore, *(split_method(m)[1].get("datastore") for m in methods)]
    for head in dict.fromkeys(str(h) for h in heads if h is not None):
        check_drafter_files(head=head)
    for store in dict.fromkeys(str(d) for d in stores if d is not None):
        check_drafter_files(datastore=store)


def check_draft_used(args: argparse.Namespace, methods: list[str], peers: list[str]) -> None:
    """Refuse a draft model (`--draft MODEL` or `self`, `--draft-quantize`, `--draft-vocab`) that no benched
    method drafts with and no assisted peer runs (`load_models` would not load it): it was ignored without a
    word, and report.md named it as the run's draft. `--draft skip` loads no model (each method takes it or
    not, as in `specula generate`)."""
    from specula.bench.methods import DRAFT_OPTION, split_method
    from specula.bench.peers import NEEDS_DRAFT
    from specula.methods import METHODS, get_method
    from specula.models.skipping import SKIP_DRAFT

    if args.draft == SKIP_DRAFT:
        return
    entries = [split_method(m) for m in methods]
    if any(get_method(m).draft_model != "no" and overrides.get(DRAFT_OPTION) is None for m, overrides in entries):
        return
    if NEEDS_DRAFT & set(peers) and not args.assistant:
        return  # the assisted peers draft with it
    bases = ", ".join(dict.fromkeys(m for m, _ in entries))
    users = ", ".join(spec.name for spec in METHODS.values() if spec.draft_model != "no")
    fix = f"drop it or add a method that drafts with one ({users}) to --methods"
    if explicit_draft(args):
        raise ConfigError(f"no method benched ({bases}) drafts with a draft model, so --draft {args.draft} would "
                          f"not be used; {fix}")
    # --draft-quantize with --assistant self quantizes the assisted peers' draft
    given = [f for f in draft_model_flags(args) if not (f == "--draft-quantize" and args.assistant == "self")]
    if given:
        raise ConfigError(f"{given[0]} applies to a draft model, and no method benched ({bases}) drafts with one; "
                          f"{fix}")


def check_entry_flags(args: argparse.Namespace, methods: list[str]) -> None:
    """Before any model loads, what each benched entry would do with the method flags (`bench.methods.entry_options`):
    a draft model's flag a fusion entry would get and not read (--num-draft-tokens, --draft-window with --draft none;
    --draft-window with --draft skip; a variant's own with draft=none) is refused, as it is once the models have
    loaded (with --draft auto's reason when it picked none); and a flag no entry runs with, every one taking it
    dropping it (--head-window with fusion:head=none alone, --num-draft-tokens with fusion:draft=none beside
    draft-tree) or setting its own (--tree-depth 5 with draft-tree:tree_depth=3), was ignored without a word:
    refused too."""
    from specula.bench.methods import entry_options, split_method
    from specula.methods import HEAD_ONLY, get_method, is_given
    from specula.models.skipping import SKIP_DRAFT

    skip = {"draft_skip": True} if args.draft == SKIP_DRAFT else {}
    has_draft = args.draft not in ("none", SKIP_DRAFT)  # --draft auto: as if it picks one (refused after, if not)
    unused: dict[str, list[str]] = {}  # option: why each entry taking it runs without the command line's value
    used: set[str] = set()
    for name in methods:
        base, overrides = split_method(name)
        options = [o for o in get_method(base).cli_options() if o != "target_name" and is_given(getattr(args, o))]
        given = {o: getattr(args, o) for o in options}
        runs = entry_options(name, {**given, **skip}, has_draft, flags=command_flags(args))
        for option in options:
            if option in overrides:
                unused.setdefault(option, []).append(f"{name} sets its own")
            elif option not in runs:
                unused.setdefault(option, []).append(
                    f"{name} runs without {'a trained head' if option in HEAD_ONLY else 'a draft model'}")
            else:
                used.add(option)
    for option, why in unused.items():
        if option not in used:
            flag = spelled(option)
            raise ConfigError(f"{flag} applies to no method benched as written ({'; '.join(why)}); drop {flag} or "
                              "add a method it applies to, to --methods")


def check_bench_inputs_kept(args: argparse.Namespace) -> None:
    """Refuse an --out whose results, report or plots (cleared first, then written) would overwrite a
    file the bench reads."""
    from specula.bench.plots import PLOTS
    from specula.bench.report import REPORT_FILE, RESULTS_FILE

    given = [("the --prompts file", args.prompts), ("the --cost-curve file", args.cost_curve),
             ("the --head file", args.head), ("the --datastore file", args.datastore)]
    for name in (RESULTS_FILE, REPORT_FILE, *PLOTS):
        check_not_input(Path(args.out) / name, "--out", given)


def load_models(args: argparse.Namespace):
    """(target backend, tokenizer, draft backend or None, `LoadReport`), loaded once for every method."""
    from specula.api import load

    from specula.bench.methods import DRAFT_OPTION, parse_method_list, split_method
    from specula.bench.peers import NEEDS_DRAFT, parse_compare
    from specula.methods import first_drafting_with_model, get_method
    from specula.models.skipping import SKIP_DRAFT

    # `--draft auto` resolves as for the first method that drafts with a model (none: no draft).
    entries = [split_method(n) for n in parse_method_list(args.methods, explicit_draft(args))]
    method = next((m for m, overrides in entries
                   if get_method(m).draft_model != "no" and overrides.get(DRAFT_OPTION) is None), PLAIN)
    if method == PLAIN and explicit_draft(args) and not args.assistant and args.draft != SKIP_DRAFT \
            and NEEDS_DRAFT & set(parse_compare(args.compare, True)):
        # no method drafts with the model, but Hugging Face's assisted peers do: load it as a draft method would
        method = first_drafting_with_model().name
    with flags_in_errors(args, spellings={"method": "--methods"}):  # the library names load's keywords
        spec = load(args.target, draft=args.draft, method=method, config=load_config(args),
                    draft_quantize=args.draft_quantize, skip_layers=args.skip_layers,
                    draft_vocab=args.draft_vocab)
    return spec.target, spec.tokenizer, spec.draft, spec.load_report


def check_assistant_device(args: argparse.Namespace) -> None:
    """Refuse `--assistant self` where a self-draft cannot run (off the CPU), naming this flag and what drafts for the
    assisted peers there: load_draft's own check names --draft and its --draft skip, after the target's load."""
    from specula.models.device import resolve_device
    from specula.models.loading import SELF_DRAFT, check_self_draft_device

    if args.assistant != SELF_DRAFT:
        return
    with flags_in_errors(args):  # a bad --device names the flag
        device = resolve_device(args.device)
    check_self_draft_device(device, f"--assistant {SELF_DRAFT}",
                            "another model (--assistant MODEL, same tokenizer as the target)")


def load_assistant(args: argparse.Namespace, target, tokenizer):
    """`--assistant MODEL`: the HF assisted peers' model (checked against the target like a draft), and
    its `DraftInfo` (name, quantization)."""
    from specula.models.loading import DraftInfo, draft_quantize_named, load_draft

    report: dict = {}
    quantize = args.draft_quantize if args.assistant == "self" else None
    with flags_in_errors(args), draft_quantize_named(args.assistant, quantize):  # LoadConfig's fields, draft_quantize
        assistant = load_draft(args.assistant, tokenizer, target, load_config(args), target_name=args.target,
                               quantize=quantize, report=report)
    return assistant, DraftInfo(args.assistant, report.get("quantize"))


def _config_record(args: argparse.Namespace, bench: BenchPlan, eos: list[int]) -> dict:
    record = {k: v for k, v in vars(args).items() if k != "handler" and isinstance(v, (str, int, float, bool, list, type(None)))}
    record.update({
        "methods": bench.methods,
        "peers": bench.peers,
        "categories": bench.categories,
        "drafter_options": {m: _method_options(args, m) for m in bench.methods},
        "prompt_ids": [p.id for p in bench.prompts],
        "eos_token_ids": eos,
        "argv": list(sys.argv),
    })
    return record


def _method_options(args: argparse.Namespace, spec: str) -> dict:
    """The options a method entry runs with (`bench.methods.entry_options`): the command line's for its method, less
    those its variant takes away (the head's for head=none, the draft model's for draft=none), then the variant's
    own."""
    from specula.bench.methods import entry_options, split_method
    from specula.models.skipping import SKIP_DRAFT

    base, _ = split_method(spec)
    given = {k: v for k, v in drafter_options(args, base).items() if v is not None}
    skip = {"draft_skip": True} if args.draft == SKIP_DRAFT else {}  # what layer skipping reads stays
    # the entries were built: what they would refuse was refused then (a draft model's option without one)
    runs = entry_options(spec, {**given, **skip}, True)
    return {k: v for k, v in runs.items() if k not in skip}


def _cost_curve(args: argparse.Namespace, target) -> dict | None:
    from specula.planner.cost import DEFAULT_SIZES, measure_cost_curve

    if args.profile_repeats == 0:
        return None
    context = min(args.profile_context, target.max_context - max(DEFAULT_SIZES))
    if context < 1:
        print(f"note: the target's context window ({target.max_context}) is too short for the cost curve; skipped",
              file=sys.stderr)
        return None
    if context < args.profile_context:
        print(f"note: cost curve measured at context {context} (the target's window is {target.max_context})",
              file=sys.stderr)
    print(f"measuring the target's cost curve (context {context}, sizes {list(DEFAULT_SIZES)})...", file=sys.stderr)
    return measure_cost_curve(target, DEFAULT_SIZES, context, args.profile_repeats).to_dict()


def execute(args: argparse.Namespace, bench: BenchPlan, target, tokenizer, draft, load: dict | None = None,
            load_line: str | None = None, draft_info=None) -> int:
    """Run a validated bench on loaded models; returns the exit code. `load`: how long loading took
    and the peak memory after it (`LoadReport.to_dict()`), recorded in results.json; `load_line`,
    its summary, printed before the runs start; `draft_info`: `draft` as loaded (`LoadReport.draft`;
    None: as `--draft` names it), the `draft` results.json records for the methods drafting with it."""
    import time

    from specula.bench.machine import machine_info
    from specula.bench.methods import build_specula_methods
    from specula.bench.peers import build_peers
    from specula.bench.plots import PLOTS
    from specula.bench.report import REPORT_FILE, RESULTS_FILE, ordered
    from specula.bench.runner import check_prompts_fit, run_bench, windowed
    from specula.draft_choice import AUTO_DRAFT, why_no_auto_draft
    from specula.methods import DEFAULT_METHOD, NO_DRAFT_GIVEN
    from specula.models.loading import NO_DRAFT, DraftInfo
    from specula.models.skipping import SKIP_DRAFT

    if draft_info is None:
        draft_info = NO_DRAFT if draft is None else DraftInfo(args.draft)
    # An earlier bench's files go first: interrupted before its first prompt, this one must not leave
    # them to be read as its own (exit 130 says the prompts done are in results.json).
    for name in (RESULTS_FILE, REPORT_FILE, *PLOTS):
        (Path(args.out) / name).unlink(missing_ok=True)

    engine = engine_config(args)  # no prefix cache: each prompt prefilled whole, as `hf:greedy` does
    # --draft skip: no draft model was loaded; every method gets it as an option (`make_drafters`)
    draft_skip = {"draft_skip": True, "skip_layers": args.skip_layers} if args.draft == SKIP_DRAFT else {}
    # a draft model's flag fusion would not read: why there is no draft model (--draft auto may pick none)
    no_draft = why_no_auto_draft(DEFAULT_METHOD, target) if args.draft == AUTO_DRAFT else NO_DRAFT_GIVEN

    def specula_methods():
        return build_specula_methods(bench.methods, target, tokenizer, draft,
                                     lambda m: {**drafter_options(args, m), **draft_skip}, engine,
                                     lambda m: planner_from_args(args), command_flags(args), draft_info, no_draft)

    methods = specula_methods()
    eos = sorted(methods[0].spec.eos_token_ids)
    from specula.bench.llamacpp import LLAMACPP_PEERS, build_llamacpp_peers

    hf_names = [p for p in bench.peers if p not in LLAMACPP_PEERS]
    assistant, assistant_info = (load_assistant(args, target, tokenizer) if args.assistant and hf_names
                                 else (draft, draft_info))
    peers = build_peers(hf_names, target.reference_model(), eos,
                        assistant.reference_model() if assistant is not None else None, tokenizer,
                        assistant_info) if hf_names else []
    peers += build_llamacpp_peers([p for p in bench.peers if p in LLAMACPP_PEERS], args.target, eos, args.threads)
    if load_line:
        print(load_line, file=sys.stderr)
    # before the cost curve and the first timed prompt: a turn that cannot fit the window is refused
    settings = windowed(bench.settings, [*methods, *peers])
    for note in check_prompts_fit(bench.prompts, tokenizer, settings):  # once: run_bench is told it was
        print(f"note: {note}", file=sys.stderr)
    curve_start = time.perf_counter()
    cost_curve = _cost_curve(args, target)
    load = dict(load or {})
    if cost_curve is not None:
        load["cost_curve_s"] = round(time.perf_counter() - curve_start, 3)
    header = {
        "machine": machine_info(target.device),
        "config": _config_record(args, bench, eos),
        "cost_curve": cost_curve,
        "backend": target.cost_key(),
        "greedy_guarantee": target.greedy_guarantee,
        "load": load,
    }
    # The reference model (the Hugging Face model of the target's weights) is loaded only if an output
    # differs from plain decoding, to measure the logit gap there.
    result = run_bench([*methods, *peers], tokenizer, bench.prompts, settings, Path(args.out), header,
                       reference_model=target.reference_model,
                       fresh_methods=lambda: [*specula_methods(), *(p.fresh() for p in peers)], fit_checked=True)
    doc = result.document
    for name, entry in ordered(doc):
        parts = [f"{entry['tokens_per_s']:.2f} tok/s" if entry["tokens_per_s"] is not None else "no output"]
        if entry["speedup"] is not None:
            decode = entry.get("decode_speedup")
            parts.append(f"{entry['speedup']:.2f}x vs none" + (f" ({decode:.2f}x after the prefill)"
                                                               if decode is not None and name != PLAIN else ""))
        if name == PLAIN and entry.get("prefill_fraction") is not None:
            parts.append(f"prefill {entry['prefill_fraction']:.0%} of its time")
        if entry["speedup_vs_hf"] is not None:
            parts.append(f"{entry['speedup_vs_hf']:.2f}x vs hf:greedy")
        if entry["mean_accepted_tokens"] is not None:
            drafting, paused = entry.get("mean_accepted_per_drafting_step"), entry.get("paused_step_fraction")
            notes = [f"{drafting:.2f} per drafting step"] if drafting is not None \
                and entry.get("drafting_step_fraction", 1) < 1 else []
            notes += [f"{paused:.0%} of steps paused by the back-off"] if paused else []
            parts.append(f"mean accepted {entry['mean_accepted_tokens']:.2f}"
                         + (f" ({', '.join(notes)})" if notes else ""))
        spread = (entry.get("rounds") or {}).get("speedup")
        if spread:
            parts.append(f"{spread['min']:.2f} / {spread['median']:.2f} / {spread['max']:.2f}x min / median / max "
                         f"over {entry['rounds']['count']} rounds")
        if entry["identical_fraction"] is not None:
            parts.append(f"identical {entry['identical_fraction']:.0%}")
        if entry.get("schema_valid_fraction") is not None:
            parts.append(f"schema-valid {entry['schema_valid_fraction']:.0%}")
        print(f"{name:>24}: " + ", ".join(parts))
    print(f"wrote {', '.join(str(f) for f in result.files)}")
    if result.interrupted:
        print(f"interrupted: results for {doc['prompts_done']} of {doc['prompts_total']} prompts in {args.out}",
              file=sys.stderr)
        return 130
    if result.mismatches:
        m = result.mismatches[0]
        gap = f", logit gap {m['logit_gap']:.3g}" if m.get("logit_gap") is not None else ""
        where = (f"{m['method']} output differs from plain decoding on prompt {m['id']} ({m['category']}, "
                 f"turn {m['turn']}, first different token at {m['first_difference']}{gap}); "
                 f"{len(result.mismatches)} output(s) differ in total, see {Path(args.out) / 'results.json'} mismatches")
        if target.greedy_guarantee == "near-ties":  # expected in bfloat16: reported, not an error
            print(f"note: {where}; {target.dtype} verification can flip near-tied tokens (guarantee "
                  "'near-ties'); --dtype float32 restores identical outputs", file=sys.stderr)
            return 0
        print(f"error: {where}", file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """`kill` / `timeout` (SIGTERM) end the bench like Ctrl-C: partial results and report kept."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    bench = plan(args)
    import time

    from specula.models.loading import peak_rss_bytes

    start = time.perf_counter()
    target, tokenizer, draft, *report = load_models(args)
    if report and report[0] is not None:
        load, line, draft_info = report[0].to_dict(), report[0].summary(), report[0].draft
    else:  # a loader without a report: the time and memory as seen from here
        load = {"total_s": round(time.perf_counter() - start, 3), "peak_rss_bytes": peak_rss_bytes()}
        line = draft_info = None
    with _sigterm_as_interrupt():
        return execute(args, bench, target, tokenizer, draft, load, line, draft_info)
