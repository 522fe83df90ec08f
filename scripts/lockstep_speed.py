"""Batched generation with lockstep drafting against each session drafting alone, side by side in one process.

    python scripts/lockstep_speed.py --target qwen2.5-coder-1.5b --method fusion --batch 4 --rounds 3

The everyday prompts (24: chat, instructions, code, math; not a benchmark's) are decoded with
`Specula.generate_batch` at `--batch` sessions, rounds alternating which way goes first: with the
engine's lockstep drafting (`drafters.lockstep.drive_many`: a level's draft passes of the whole
batch in one call) and with each session's drafters run on their own in turn
(`drafters.lockstep.drive_each`: each pass on its own, as before session 121). Prints each round's tokens/s, mean
accepted tokens a step and drafting seconds, then min / median / max and the per-round ratio; every
output must be identical across rounds (the planner shares what it learns between them, so a
round's trees may differ, never its output). JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import specula  # noqa: F401 (before torch: the OpenMP spin setting)
import specula.api as api
from specula import engine
from specula.drafters.lockstep import drive_each, drive_many

PROMPTS = Path(__file__).resolve().parents[1] / "specula" / "data" / "everyday" / "prompts.jsonl"
WAYS = {"lockstep": drive_many, "each alone": drive_each}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--method", default="fusion")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=24, help="the first N everyday prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    prompts = [json.loads(line)["turns"][0] for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = prompts[:args.prompts]
    off = api.EngineConfig(prefix_cache_mib=0)  # prompts repeat: measure without the prefix cache
    spec = api.load(args.target, method=args.method, engine=off)
    spec.prepare_batch(args.batch)
    spec.generate_batch(prompts[:args.batch], max_new_tokens=8, max_batch_size=args.batch)  # warm-up
    rounds: dict[str, list[dict]] = {way: [] for way in WAYS}
    reference = None
    for r in range(args.rounds):
        for way in (list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]):
            engine.drive_many = WAYS[way]  # what `SpeculativeDecoder._draft` drives a batch's drafters with
            t0 = time.perf_counter()
            outs = spec.generate_batch(prompts, max_new_tokens=args.max_new_tokens, max_batch_size=args.batch)
            seconds = time.perf_counter() - t0
            ids = [o.token_ids for o in outs]
            reference = reference or ids
            if ids != reference:
                raise SystemExit(f"round {r}, {way}: an output differs from the first round's")
            steps = sum(o.stats.steps for o in outs)
            row = {"tokens_per_s": sum(map(len, ids)) / seconds,
                   "mean_accepted": (sum(o.stats.accepted_tokens for o in outs) + steps) / steps,
                   "draft_seconds": sum(o.stats.draft_seconds for o in outs)}
            rounds[way].append(row)
            if not args.json:
                print(f"round {r} {way:10s} {row['tokens_per_s']:7.1f} tokens/s, mean accepted "
                      f"{row['mean_accepted']:.2f}, drafting {row['draft_seconds']:.2f} s", flush=True)
    engine.drive_many = drive_many
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rounds["lockstep"], rounds["each alone"])]
    if args.json:
        print(json.dumps({"target": args.target, "method": args.method, "batch": args.batch, "rounds": rounds,
                          "ratios": ratios, "identical": True}, indent=1))
        return
    for way, rows in rounds.items():
        rates = sorted(row["tokens_per_s"] for row in rows)
        print(f"{way:10s}: {rates[0]:.1f} / {statistics.median(rates):.1f} / {rates[-1]:.1f} tokens/s "
              f"(min / median / max of rounds)")
    print(f"lockstep over each alone: {' / '.join(f'{x:.3f}' for x in sorted(ratios))}x per round "
          f"(min / median / max: {min(ratios):.3f} / {statistics.median(ratios):.3f} / {max(ratios):.3f}); "
          "outputs identical")


if __name__ == "__main__":
    main()
