"""Decode-phase speedups from a bench's results.json: prefill taken out of every specula method's
time, so the ratio shows what speculation does to the generation itself (the bench's own ratios
include prefill, which is the same for every method and, on a 2-core CPU, a large share of
Spec-Bench's long prompts).

    python scripts/decode_ratios.py runs/i17-qwen-specbench/results.json

The ratios are `bench.summary`'s `decode_speedup` (the bench reports it itself since session 147).
Prefill per run: `time.prefill` where the bench recorded it; for older files, the `none` run's
non-step time on the same prompt and turn (its prefill plus a few ms of loop overhead), labelled
as an estimate. Peers (Hugging Face, llama.cpp) are left out: their prefill is not separated.
"""

from __future__ import annotations

import copy
import json
import sys

from specula.bench.summary import summarize


def main(path: str) -> int:
    doc = json.load(open(path))
    runs = [copy.deepcopy(r) for r in doc["runs"] if r.get("kind") == "specula" and r.get("time")]
    none_other = {(r.get("round", 1), r["id"], r["turn"]): r["time"]["other"] for r in runs if r["method"] == "none"}
    estimated = False
    timed = []
    for r in runs:
        if r["time"].get("prefill") is None:
            r["time"]["prefill"], estimated = none_other.get((r.get("round", 1), r["id"], r["turn"])), True
            if r["time"]["prefill"] is None:
                continue
        timed.append(r)
    methods = [{"name": m, "kind": "specula", "lossless": True} for m in dict.fromkeys(r["method"] for r in timed)]
    categories = list(dict.fromkeys(r["category"] for r in timed))
    summary = summarize(timed, methods, categories)
    print(f"decode phase, prefill excluded{' (estimated from none)' if estimated else ''}: speedup vs none")
    print("| method | tokens/s | " + " | ".join(["overall", *categories]) + " |")
    print("|---|---|" + "---|" * (len(categories) + 1))
    for name, entry in summary.items():
        parts = [entry, *(entry["by_category"].get(c) for c in categories)]
        cells = [f"{p['decode_speedup']:.2f}x" if p and p.get("decode_speedup") is not None else "-" for p in parts]
        rate = entry["new_tokens"] / entry["decode_seconds"] if entry.get("decode_seconds") else None
        print(f"| {name} | {'-' if rate is None else f'{rate:.2f}'} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
