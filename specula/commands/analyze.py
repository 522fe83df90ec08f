"""`specula analyze acceptance`: measured multi-draft acceptance vs the optimal bounds."""

from __future__ import annotations

import argparse
import sys
import time

from specula.commands.common import (
    PROMPTS_SPELLING, add_categories_arg, add_model_args, check_model_name, explicit_draft, flags_in_errors,
    load_config,
)


def register(sub) -> None:
    p = sub.add_parser("analyze", help="analyses of speculative decoding (multi-draft acceptance bounds)",
                       description="Analyses of speculative decoding on real models.")
    kinds = p.add_subparsers(dest="analysis", metavar="ANALYSIS")
    kinds.required = True
    a = kinds.add_parser(
        "acceptance", help="acceptance of multi-draft verifiers vs the optimal bounds, on real distributions",
        description="On the target's own sampled continuations (teacher-forced), compute at every position the "
                    "optimal acceptance alpha* of n i.i.d., without-replacement and greedy drafts (n = 1..N) and "
                    "the acceptance of RRS with and without replacement and SpecTr K-SEQ; write results.json, "
                    "report.md and acceptance.png to --out.")
    add_model_args(a)
    a.add_argument("--prompts", default="spec-bench",
                   help="spec-bench, everyday or structured (shipped; structured: each prompt is analysed under its "
                        "JSON schema as the engine decodes structured output, p masked by it, q not: "
                        "docs/structured.md) or a JSONL file of {id, category, turns[, schema]} (default spec-bench)")
    a.add_argument("--per-category", type=int, default=1, help="prompts per category (default 1)")
    add_categories_arg(a)
    a.add_argument("--drafts", type=int, default=8, help="analyse n = 1..DRAFTS drafts (default 8)")
    a.add_argument("--temperature", type=float, nargs="+", default=[1.0],
                   help="one or more sampling temperatures > 0 (default 1.0)")
    a.add_argument("--positions", type=int, default=24, help="continuation tokens analysed per prompt (default 24)")
    a.add_argument("--seed", type=int, default=0, help="seed of the continuations and Monte Carlo (default 0)")
    a.add_argument("--lump-mass", type=float, default=1e-4,
                   help="per position, merge the tail tokens holding at most this mass of p and of q (default 1e-4)")
    a.add_argument("--trajectories", type=int, default=128,
                   help="Monte Carlo trajectories per position for RRS without replacement (default 128)")
    a.add_argument("--out", required=True, help="output directory (results.json, report.md, acceptance.png)")
    a.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from specula.analysis.measure import ACCEPTANCE_FLAGS, AcceptanceConfig, measure
    from specula.analysis.plots import PLOT_FILE, REPORT_FILE, plot_acceptance, render_markdown
    from specula.bench.datasets import load_prompts, select_prompts
    from specula.errors import ConfigError
    from specula.paths import atomic_write_json, atomic_write_text, check_not_input, check_output

    from specula.models.skipping import SKIP_DRAFT, check_skip_layers

    if not explicit_draft(args) or args.draft == SKIP_DRAFT:
        raise ConfigError("analyze acceptance needs a draft model: pass --draft MODEL (same tokenizer as the target) "
                          "or --draft self")
    with flags_in_errors(args):  # the library names load's skip_layers and draft="skip"
        check_skip_layers(args.draft, args.skip_layers)
    check_model_name(args.draft, "--draft")  # before the target loads
    with flags_in_errors(args, ["positions", "lump_mass", "trajectories"], ACCEPTANCE_FLAGS):  # its fields
        config = AcceptanceConfig(temperatures=tuple(args.temperature), max_drafts=args.drafts,
                                  positions=args.positions, seed=args.seed, lump_mass=args.lump_mass,
                                  trajectories=args.trajectories)
    # the library names load_prompts' and select_prompts' keywords (source= for --prompts, per_category=)
    with flags_in_errors(args, ["per_category", "categories"], PROMPTS_SPELLING):
        prompts = select_prompts(load_prompts(args.prompts), args.per_category, args.categories, args.seed)
    out = check_output(args.out, "--out", "dir")
    for name in ("results.json", REPORT_FILE, PLOT_FILE):
        check_not_input(out / name, "--out", [("the --prompts file", args.prompts)])  # --out: made by the first write

    from specula.api import load_backend, load_draft
    from specula.models.loading import draft_quantize_named

    t0 = time.perf_counter()
    with flags_in_errors(args):  # the library names LoadConfig's fields and load's keywords (quantize="int8")
        target, tokenizer = load_backend(args.target, load_config(args), "target")
        with draft_quantize_named(args.draft, args.draft_quantize):  # load_draft names it quantize
            draft = load_draft(args.draft, tokenizer, target, load_config(args), target_name=args.target,
                               quantize=args.draft_quantize, vocab=args.draft_vocab)
    document = measure(target, draft, tokenizer, prompts, config,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
    document["models"] = {"target": args.target, "draft": args.draft, "prompts": args.prompts,
                          "per_category": args.per_category, "dtype": args.dtype, "quantize": args.quantize,
                          "constrained_prompts": sum(p.schema is not None for p in prompts),
                          "seconds": round(time.perf_counter() - t0, 1)}
    atomic_write_json(out / "results.json", document)
    atomic_write_text(out / REPORT_FILE, render_markdown(document))
    plot_acceptance(document, out / PLOT_FILE)
    for run_ in document["runs"]:
        o, c = run_["overall"], run_["checks"]
        n = len(o["iid"])
        print(f"T={run_['temperature']:g} n={n}: alpha* iid {o['iid'][-1]:.4f}, w/o repl. {o['without_replacement'][-1]:.4f}, "
              f"greedy {o['greedy'][-1]:.4f}; RRS iid {o['rrs_iid'][-1]:.4f}, K-SEQ {o['kseq'][-1]:.4f}, "
              f"RRS w/o repl. {o['rrs_without_replacement'][-1]:.4f}; verifiers above bound at "
              f"{sum(v['positions_above_bound'] for v in c['verifiers'].values())} positions", file=sys.stderr)
    print(f"wrote {out / 'results.json'}, {out / REPORT_FILE}, {out / PLOT_FILE}", file=sys.stderr)
    return 0
