"""Decoding with the output screen (`specula/models/native/screen.py`) against without it, side by side in one
process: each method's seconds both ways, and whether every output is the same (greedy, or `--temperature T`:
sampled at a temperature, seeded, the race taken through the screen; `--top-k` with `--top-p` within it,
`--min-p`, and `--top-p` alone (top-p over every id, session 130) truncate it).

    python scripts/output_screen.py --target qwen2.5-coder-1.5b --methods none,draft-model,fusion --per-group 2

The prompts are the everyday set's (`specula/data/everyday`, not a benchmark's), `--per-group` from each group;
`--prompts structured`: the structured-output set's, each constrained to its JSON schema. `--repetition-penalty`,
`--frequency-penalty`, `--presence-penalty`, `--min-new-tokens`, `--temperature`, `--top-k`, `--top-p` and
`--min-p` shape every request.
Per prompt the two ways run one after the other, the order alternating from prompt to prompt; each way's total
over the prompts is printed, with their ratio (without / with: above 1, the screen is faster), per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import specula  # noqa: F401 (before torch: the OpenMP spin setting)
import specula.api as api
import torch

from specula.bench.datasets import load_prompts, select_prompts
from specula.models.native import screen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--methods", default="none,prompt-lookup,draft-model,fusion",
                        help="methods, ';'-separated where a variant lists options (fusion:head=none); "
                             "else comma-separated (default: %(default)s)")
    parser.add_argument("--prompts", default="everyday", choices=("everyday", "structured"))
    parser.add_argument("--per-group", type=int, default=2, help="prompts from each group")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="rounds over the prompts, each method")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the per-round seconds here")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--min-new-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature (seeded: both ways give the same tokens)")
    parser.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sampling: top-p (within --top-k, or over every id)")
    parser.add_argument("--min-p", type=float, default=0.0, help="sampling: min-p")
    parser.add_argument("--seed", type=int, default=1, help="each request's seed when sampling")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [(p.turns[0], p.constraint) for p in select_prompts(load_prompts(args.prompts), args.per_group)]
    floor = screen.SCREEN_MIN_WEIGHTS
    shaping = {"repetition_penalty": args.repetition_penalty, "frequency_penalty": args.frequency_penalty,
               "presence_penalty": args.presence_penalty, "min_new_tokens": args.min_new_tokens,
               "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
               "seed": args.seed}
    report = {}
    for method in args.methods.split(";" if ";" in args.methods else ","):
        name, _, variant = method.partition(":")  # a bench variant: fusion:head=none
        options = dict(option.split("=", 1) for option in variant.split(",") if option)
        spec = api.load(args.target, method=name, **options)
        spec.generate(prompts[0][0], max_new_tokens=8)  # kernels built, weights paged in, the cost curve timed
        ratios, rounds = [], []
        for r in range(args.rounds):
            seconds = {"screen": 0.0, "without": 0.0}
            for i, (prompt, constraint) in enumerate(prompts):
                outs = {}
                for way in (("screen", "without") if (i + r) % 2 == 0 else ("without", "screen")):
                    screen.SCREEN_MIN_WEIGHTS = floor if way == "screen" else 1 << 62
                    t = time.perf_counter()
                    out = spec.generate(prompt, max_new_tokens=args.max_new_tokens, constraint=constraint, **shaping)
                    outs[way] = out.token_ids
                    seconds[way] += time.perf_counter() - t
                if outs["screen"] != outs["without"]:
                    raise SystemExit(f"{method}: the outputs differ on prompt {i}: {prompt[:60]!r}")
            screen.SCREEN_MIN_WEIGHTS = floor
            ratios.append(seconds["without"] / seconds["screen"])
            rounds.append(seconds)
            print(f"{args.target} {method} round {r + 1}: with the screen {seconds['screen']:.2f} s, without "
                  f"{seconds['without']:.2f} s: {ratios[-1]:.3f}x; outputs identical", flush=True)
        print(f"{args.target} {method}: {min(ratios):.3f} / {statistics.median(ratios):.3f} / {max(ratios):.3f}x "
              f"(min / median / max of {len(ratios)} rounds, {len(prompts)} prompts)", flush=True)
        report[method] = rounds
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": args.target, "prompts": len(prompts), "rounds": report}, f, indent=1)


if __name__ == "__main__":
    main()
