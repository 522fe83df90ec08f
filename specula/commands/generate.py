"""`specula generate`: one prompt, printed text and a one-line stats summary (or JSON)."""

from __future__ import annotations

import argparse
import json
import sys

from specula.commands.common import (
    add_method_args, add_model_args, add_sampling_args, drafter_options, load_config, method_help, planner_from_args,
    sampling_params,
)


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from one prompt with speculative decoding",
                       description="Generate from one prompt. Greedy output is identical to plain decoding.")
    add_model_args(p)
    p.add_argument("--method", default=None, help=method_help() + " (default: fusion = every available drafter, sized by the planner)")
    p.add_argument("--prompt", required=True, help="prompt text (the chat template is applied unless --raw)")
    add_method_args(p)
    add_sampling_args(p)
    p.add_argument("--compare", action="store_true",
                   help="also run plain decoding (method none) on the same prompt and print the speedup")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from specula.api import load
    from specula.drafters import check_method, make_drafter
    from specula.engine import EngineConfig, SpeculativeDecoder

    params = sampling_params(args)  # validate everything before loading models
    method = args.method or "fusion"
    check_method(method)
    planner = planner_from_args(args)
    spec = load(args.target, draft=args.draft, method=method, config=load_config(args),
                engine=EngineConfig(max_tree_nodes=args.max_tree_nodes), planner=planner,
                **drafter_options(args, method))
    ids = spec.encode(args.prompt, raw=args.raw)
    token_ids: list[int] = []
    text_parts: list[str] = []
    stats = None
    for chunk in spec.decoder.stream(ids, params):
        token_ids.extend(chunk.token_ids)
        text_parts.append(chunk.text)
        stats = chunk.stats
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    baseline = None
    if args.compare and method != "none":
        baseline = SpeculativeDecoder(spec.target, make_drafter("none"), spec.tokenizer).generate(ids, params)
    projection = spec.decoder.planner.projection() if spec.decoder.planner is not None else None
    if args.json:
        payload = {"text": "".join(text_parts), "token_ids": token_ids, "stats": stats.to_dict()}
        if projection is not None:
            payload["planner"] = projection
        if baseline is not None:
            payload["baseline"] = baseline.stats.to_dict()
            payload["speedup"] = round(stats.tokens_per_s / baseline.stats.tokens_per_s, 3)
            payload["identical_to_plain"] = baseline.token_ids == token_ids
        print(json.dumps(payload))
        return 0
    print()
    print(stats.summary(), file=sys.stderr)
    if projection is not None:
        print(f"planner: {projection}", file=sys.stderr)
    if baseline is not None:
        print(baseline.stats.summary(), file=sys.stderr)
        same = "identical" if baseline.token_ids == token_ids else "DIFFERENT"
        print(f"speedup vs plain decoding (same run): {stats.tokens_per_s / baseline.stats.tokens_per_s:.2f}x; "
              f"output {same} to plain decoding", file=sys.stderr)
    return 0
