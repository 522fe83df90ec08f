"""A chat's second turn with the engine's prefix cache against without it, side by side in one process.

    python scripts/prefix_cache_speed.py --target qwen2.5-coder-1.5b --method fusion --rounds 3

Each of the first `--prompts` everyday prompts (chat, instructions, code, math; not a benchmark's) starts a
conversation: the model answers it, then a follow-up (`FOLLOW_UPS`, in turn) is asked after that answer, as a
chat client sends it: the whole conversation again. Conversations alternate which way goes first, and the
cache is emptied before each, so a second turn reads only its own first turn's cache. Prints per round the
second turns' seconds to the first token (the prefill, or what is left of it), their total seconds and the
prompt tokens read from the cache; then min / median / max of rounds and the per-round ratios. Every output
must be identical with and without the cache. JSON with --json.
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
FOLLOW_UPS = ("Now give a shorter version of that.", "Can you add one more example?",
              "What is the most common mistake here?", "Summarize your answer in two sentences.")
WAYS = ("cache", "no cache")


def prefix_caches(spec) -> list[tuple[object, object]]:
    """(holder, cache) of every prefix cache of `spec`: the engine's, and its draft model's."""
    holders = (spec.decoder, *spec.decoder.drafters)
    return [(h, h.prefix_cache) for h in holders if getattr(h, "prefix_cache", None) is not None]


def second_turn(spec, caches, on: bool, prompt: str, follow_up: str, max_new_tokens: int) -> dict:
    """Both turns of one conversation with the prefix caches `caches` on (each emptied first) or off; the
    second turn's timings and output."""
    for holder, cache in caches:
        cache.clear()
        holder.prefix_cache = cache if on else None
    messages = [{"role": "user", "content": prompt}]
    first = spec.generate(messages, max_new_tokens=max_new_tokens)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": follow_up}]
    t0 = time.perf_counter()
    out = spec.generate(messages, max_new_tokens=max_new_tokens)
    return {"seconds": time.perf_counter() - t0, "prefill_seconds": out.stats.prefill_seconds,
            "cached_tokens": out.stats.cached_tokens, "prompt_tokens": out.stats.prompt_tokens,
            "ids": first.token_ids + out.token_ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--method", default="fusion")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8, help="the first N everyday prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    prompts = [json.loads(line)["turns"][0] for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = prompts[:args.prompts]
    spec = api.load(args.target, method=args.method)
    caches = prefix_caches(spec)
    if not caches:
        raise SystemExit(f"{args.target} has no prefix cache on this backend (see EngineConfig.prefix_cache_mib)")
    spec.generate(prompts[0], max_new_tokens=8)  # warm-up
    rounds: dict[str, list[dict]] = {way: [] for way in WAYS}
    reference: dict[int, list[int]] = {}
    for r in range(args.rounds):
        sums = {way: {"first_token_seconds": 0.0, "seconds": 0.0, "cached_tokens": 0, "prompt_tokens": 0}
                for way in WAYS}
        for i, prompt in enumerate(prompts):
            for way in (WAYS if (r + i) % 2 == 0 else WAYS[::-1]):
                row = second_turn(spec, caches, way == "cache", prompt, FOLLOW_UPS[i % len(FOLLOW_UPS)],
                                  args.max_new_tokens)
                if reference.setdefault(i, row["ids"]) != row["ids"]:
                    raise SystemExit(f"round {r}, conversation {i}, {way}: an output differs")
                s = sums[way]
                s["first_token_seconds"] += row["prefill_seconds"]
                s["seconds"] += row["seconds"]
                s["cached_tokens"] += row["cached_tokens"]
                s["prompt_tokens"] += row["prompt_tokens"]
        for way in WAYS:
            rounds[way].append(sums[way])
            if not args.json:
                s = sums[way]
                print(f"round {r} {way:8s}: second turns {s['seconds']:.2f} s, "
                      f"prefill {s['first_token_seconds']:.2f} s, "
                      f"{s['cached_tokens']} of {s['prompt_tokens']} prompt tokens from the cache", flush=True)
    ratios = {key: [b[key] / a[key] for a, b in zip(rounds["cache"], rounds["no cache"])]
              for key in ("first_token_seconds", "seconds")}
    if args.json:
        print(json.dumps({"target": args.target, "method": args.method, "rounds": rounds, "ratios": ratios,
                          "identical": True}, indent=1))
        return
    for key, label in (("first_token_seconds", "prefill of the second turns"), ("seconds", "second turns in all")):
        xs = sorted(ratios[key])
        print(f"{label}: no cache / cache {xs[0]:.2f} / {statistics.median(xs):.2f} / {xs[-1]:.2f}x "
              "(min / median / max of rounds)")
    print("outputs identical with and without the cache")


if __name__ == "__main__":
    main()
