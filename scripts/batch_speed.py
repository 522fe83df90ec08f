"""Offline batch generation against one prompt at a time, side by side in one process.

    python scripts/batch_speed.py --target smollm2-135m --rounds 3 --max-batch-size 8 --max-new-tokens 64

The everyday prompts (24: chat, instructions, code, math; not a benchmark's) are decoded with
`Specula.generate` one after another and with `Specula.generate_batch`, rounds alternating which
goes first. Prints tokens/s of each (min / median / max over rounds), the ratio, and whether every
greedy output is identical. JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import specula  # noqa: F401 (before torch: the OpenMP spin setting)
import specula.api as api

PROMPTS = Path(__file__).resolve().parents[1] / "specula" / "data" / "everyday" / "prompts.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--method", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--methods", default=None,
                        help="comma-separated methods to run batched side by side instead (e.g. fusion,none), "
                             "interleaved group by group of --max-batch-size prompts: each one's batch tokens/s "
                             "and the ratio of the first to the second")
    args = parser.parse_args()
    prompts = [json.loads(line)["turns"][0] for line in PROMPTS.read_text().splitlines() if line.strip()]
    if args.methods:
        return compare_methods(args, prompts)
    off = api.EngineConfig(prefix_cache_mib=0)  # prompts repeat: measure without the prefix cache
    spec = api.load(args.target, method=args.method, engine=off)
    spec.prepare_batch(args.max_batch_size)
    params = api.SamplingParams(max_new_tokens=args.max_new_tokens)
    rates = {"one at a time": [], "batch": []}
    identical = True
    for r in range(args.rounds):
        order = ["one at a time", "batch"] if r % 2 == 0 else ["batch", "one at a time"]
        outs = {}
        for kind in order:
            t0 = time.perf_counter()
            if kind == "batch":
                outs[kind] = spec.generate_batch(prompts, params=params, max_batch_size=args.max_batch_size)
            else:
                outs[kind] = [spec.generate(p, params=params) for p in prompts]
            seconds = time.perf_counter() - t0
            rates[kind].append(sum(len(o.token_ids) for o in outs[kind]) / seconds)
        identical &= all(a.token_ids == b.token_ids for a, b in zip(outs["batch"], outs["one at a time"]))
    summary = {kind: {"min": min(v), "median": statistics.median(v), "max": max(v)} for kind, v in rates.items()}
    ratios = [b / a for a, b in zip(rates["one at a time"], rates["batch"])]
    report = {"target": args.target, "method": spec.method, "prompts": len(prompts),
              "max_batch_size": args.max_batch_size, "tokens_per_s": summary,
              "ratio": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)},
              "identical": identical}
    if args.json:
        print(json.dumps(report))
        return
    for kind, s in summary.items():
        print(f"{kind:>14}: {s['min']:.1f} / {s['median']:.1f} / {s['max']:.1f} tokens/s (min / median / max)")
    r = report["ratio"]
    print(f"batch over one at a time: {r['min']:.2f}x / {r['median']:.2f}x / {r['max']:.2f}x; "
          f"outputs {'identical' if identical else 'DIFFERENT'}")


def compare_methods(args, prompts: list[str]) -> None:
    """Batched generation by each method of --methods, interleaved finely: the prompts go in groups
    of --max-batch-size (each group decoded together to the end), every method decodes a group
    before the next group starts, the order alternating group by group and round by round, so a
    drift in the machine's speed hits every method alike. Tokens/s per method and round; the ratio
    of the first method to the second over all rounds and per round."""
    methods = args.methods.split(",")
    specs = {m: api.load(args.target, method=m, engine=api.EngineConfig(prefix_cache_mib=0)) for m in methods}
    params = api.SamplingParams(max_new_tokens=args.max_new_tokens)
    for spec in specs.values():
        spec.prepare_batch(args.max_batch_size)
    size = args.max_batch_size
    groups = [prompts[i:i + size] for i in range(0, len(prompts), size)]
    seconds = {m: [0.0] * args.rounds for m in methods}
    tokens = {m: [0] * args.rounds for m in methods}
    outputs: dict[str, list] = {m: [] for m in methods}
    for r in range(args.rounds):
        for g, group in enumerate(groups):
            for m in methods if (r + g) % 2 == 0 else methods[::-1]:
                t0 = time.perf_counter()
                outs = specs[m].generate_batch(group, params=params, max_batch_size=size)
                seconds[m][r] += time.perf_counter() - t0
                tokens[m][r] += sum(len(o.token_ids) for o in outs)
                if r == 0:
                    outputs[m].extend(outs)
    rates = {m: [t / s for t, s in zip(tokens[m], seconds[m])] for m in methods}
    identical = all(len({tuple(outputs[m][i].token_ids) for m in methods}) == 1 for i in range(len(prompts)))
    ratios = [a / b for a, b in zip(rates[methods[0]], rates[methods[1]])] if len(methods) > 1 else []
    total = {m: sum(tokens[m]) / sum(seconds[m]) for m in methods}
    report = {"target": args.target, "max_batch_size": size, "prompts": len(prompts), "rounds": args.rounds,
              "tokens_per_s": {m: {"min": min(v), "median": statistics.median(v), "max": max(v), "all_rounds": total[m]}
                               for m, v in rates.items()},
              "ratio": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios),
                        "all_rounds": total[methods[0]] / total[methods[1]]} if ratios else None,
              "identical": identical}
    if args.json:
        print(json.dumps(report))
        return
    for m, v in report["tokens_per_s"].items():
        print(f"{m:>14}: {v['min']:.1f} / {v['median']:.1f} / {v['max']:.1f} tokens/s (min / median / max of rounds)")
    if ratios:
        r = report["ratio"]
        print(f"{methods[0]} over {methods[1]}: {r['all_rounds']:.3f}x over all rounds ({r['min']:.2f}x / "
              f"{r['median']:.2f}x / {r['max']:.2f}x per round); outputs {'identical' if identical else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
