"""Requests that begin alike, with the engine's prefix cache against without it, side by side in one process.

    python scripts/prefix_cache_speed.py --target qwen2.5-coder-1.5b --method fusion --rounds 3
    python scripts/prefix_cache_speed.py --target qwen2.5-coder-1.5b --scenario shared --batch 4 --rounds 2

Two scenarios over the first `--prompts` everyday prompts (chat, instructions, code, math; not a benchmark's):
- `chat`: each prompt starts a conversation: the model answers it, then a follow-up (`FOLLOW_UPS`, in turn) is
  asked after that answer, as a chat client sends it: the whole conversation again. The second turn is timed.
- `shared`: the prompts go in groups of `--batch`, each after one long system prompt (`SYSTEM`), decoded
  together (`generate_batch`): requests running at once that share their opening. The group is timed.
Each unit runs both ways, alternating which goes first, every cache emptied before it (the draft model's, where
the method has one, is on and off with the target's). Prints per round the timed seconds, their prefill
seconds (what is left of it with the cache), the prompt tokens read from the cache and what each prefix cache
keeps a token at the unit's end (`bytes` over `held_tokens`: keys, values and a head's features); then min / median /
max of rounds and the per-round ratios. Every output must be identical with and without the cache. JSON with --json.
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
SYSTEM = " ".join(3 * [
    "You are a careful senior engineer who explains decisions. Follow these rules in every answer. Keep answers "
    "short and concrete. Prefer standard library solutions. Explain the reason for each choice in one sentence. "
    "When you write code, write Python 3 with type hints and a docstring, and show one example call. When the "
    "question is ambiguous, state the assumption you make before answering. Never invent APIs; if you are unsure "
    "whether a function exists, say so. Mention the time and memory cost of any algorithm you propose. Use plain "
    "words, no marketing language. If the user asks about security, point out the main risk first. If the user "
    "asks about performance, say what to measure before what to change."])
"""A system prompt of about 450 tokens, as a deployment puts before every request."""
WAYS = ("cache", "no cache")


def prefix_caches(spec) -> list[tuple[object, object]]:
    """(holder, cache) of every prefix cache of `spec`: the engine's, and its draft model's."""
    holders = (spec.decoder, *spec.decoder.drafters)
    return [(h, h.prefix_cache) for h in holders if getattr(h, "prefix_cache", None) is not None]


def set_caches(caches, on: bool) -> None:
    """Every prefix cache emptied, then on or off."""
    for holder, cache in caches:
        cache.clear()
        holder.prefix_cache = cache if on else None


def measured(outs, seconds: float) -> dict:
    return {"seconds": seconds, "prefill_seconds": sum(o.stats.prefill_seconds for o in outs),
            "cached_tokens": sum(o.stats.cached_tokens for o in outs),
            "prompt_tokens": sum(o.stats.prompt_tokens for o in outs), "ids": [o.token_ids for o in outs]}


def second_turn(spec, prompt: str, follow_up: str, max_new_tokens: int) -> dict:
    """Both turns of one conversation; the second turn measured (its output with the first's)."""
    messages = [{"role": "user", "content": prompt}]
    first = spec.generate(messages, max_new_tokens=max_new_tokens)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": follow_up}]
    t0 = time.perf_counter()
    out = spec.generate(messages, max_new_tokens=max_new_tokens)
    row = measured([out], time.perf_counter() - t0)
    row["ids"] = [first.token_ids] + row["ids"]
    return row


def shared_group(spec, group: list[str], max_new_tokens: int) -> dict:
    """One group of requests after the system prompt, decoded together."""
    messages = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in group]
    t0 = time.perf_counter()
    outs = spec.generate_batch(messages, max_new_tokens=max_new_tokens, max_batch_size=len(group))
    return measured(outs, time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--method", default="fusion")
    parser.add_argument("--scenario", choices=("chat", "shared"), default="chat")
    parser.add_argument("--batch", type=int, default=4, help="shared: requests decoded together")
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
    if args.scenario == "chat":
        units = [lambda i=i: second_turn(spec, prompts[i], FOLLOW_UPS[i % len(FOLLOW_UPS)], args.max_new_tokens)
                 for i in range(len(prompts))]
        spec.generate(prompts[0], max_new_tokens=8)  # warm-up
    else:
        groups = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
        units = [lambda g=g: shared_group(spec, g, args.max_new_tokens) for g in groups]
        spec.prepare_batch(args.batch)
        set_caches(caches, False)
        shared_group(spec, groups[0], 8)  # warm-up: a batch's first passes
    rounds: dict[str, list[dict]] = {way: [] for way in WAYS}
    reference: dict[int, list] = {}
    for r in range(args.rounds):
        sums = {way: {"seconds": 0.0, "prefill_seconds": 0.0, "cached_tokens": 0, "prompt_tokens": 0} for way in WAYS}
        kept = [[0, 0] for _ in caches]  # per prefix cache: bytes and tokens held at the units' ends
        for i, unit in enumerate(units):
            for way in (WAYS if (r + i) % 2 == 0 else WAYS[::-1]):
                set_caches(caches, way == "cache")
                row = unit()
                if reference.setdefault(i, row["ids"]) != row["ids"]:
                    raise SystemExit(f"round {r}, unit {i}, {way}: an output differs")
                for key in sums[way]:
                    sums[way][key] += row[key]
                if way == "cache":
                    for k, (_, cache) in enumerate(caches):
                        kept[k][0] += cache.bytes
                        kept[k][1] += cache.held_tokens
        sums["cache"]["kept_bytes_per_token"] = [b / max(1, t) for b, t in kept]
        for way in WAYS:
            rounds[way].append(sums[way])
            if not args.json:
                s = sums[way]
                kept = "".join(f", {b / 1024:.1f} KiB kept a token ({name})" for b, name in
                               zip(s.get("kept_bytes_per_token", ()), ("target", "draft model")))
                print(f"round {r} {way:8s}: {s['seconds']:.2f} s, prefill {s['prefill_seconds']:.2f} s, "
                      f"{s['cached_tokens']} of {s['prompt_tokens']} prompt tokens from the cache{kept}", flush=True)
    ratios = {key: [b[key] / a[key] for a, b in zip(rounds["cache"], rounds["no cache"])]
              for key in ("prefill_seconds", "seconds")}
    if args.json:
        print(json.dumps({"target": args.target, "method": args.method, "scenario": args.scenario,
                          "rounds": rounds, "ratios": ratios, "identical": True}, indent=1))
        return
    timed = "second turns" if args.scenario == "chat" else "groups"
    for key, label in (("prefill_seconds", f"prefill of the {timed}"), ("seconds", f"the {timed} in all")):
        xs = sorted(ratios[key])
        print(f"{label}: no cache / cache {xs[0]:.2f} / {statistics.median(xs):.2f} / {xs[-1]:.2f}x "
              "(min / median / max of rounds)")
    print("outputs identical with and without the cache")


if __name__ == "__main__":
    main()
