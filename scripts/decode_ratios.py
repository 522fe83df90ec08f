"""Decode-phase speedups from a bench's results.json: prefill taken out of every specula method's
time, so the ratio shows what speculation does to the generation itself (the bench's own ratios
include prefill, which is the same for every method and, on a 2-core CPU, a large share of
Spec-Bench's long prompts).

    python scripts/decode_ratios.py runs/i17-qwen-specbench/results.json

Prefill per run: `time.prefill` where the bench recorded it; for older files, the `none` run's
non-step time on the same prompt and turn (its prefill plus a few ms of loop overhead), labelled
as an estimate. Peers (Hugging Face, llama.cpp) are left out: their prefill is not separated.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> int:
    doc = json.load(open(path))
    runs = [r for r in doc["runs"] if r.get("kind") == "specula" and r.get("time")]
    none_other = {(r.get("round", 1), r["id"], r["turn"]): r["time"]["other"] for r in runs if r["method"] == "none"}
    estimated = False
    tokens: dict = defaultdict(float)
    seconds: dict = defaultdict(float)
    for r in runs:
        prefill = r["time"].get("prefill")
        if prefill is None:
            prefill, estimated = none_other.get((r.get("round", 1), r["id"], r["turn"])), True
            if prefill is None:
                continue
        for key in ((r["method"], "overall"), (r["method"], r["category"])):
            tokens[key] += r["new_tokens"]
            seconds[key] += max(1e-9, r["seconds"] - prefill)
    categories = list(dict.fromkeys(c for _, c in tokens if c != "overall"))
    methods = list(dict.fromkeys(m for m, _ in tokens))
    rate = {k: tokens[k] / seconds[k] for k in tokens}
    print(f"decode phase, prefill excluded{' (estimated from none)' if estimated else ''}: speedup vs none")
    print("| method | tokens/s | " + " | ".join(["overall", *categories]) + " |")
    print("|---|---|" + "---|" * (len(categories) + 1))
    for m in methods:
        cells = [f"{rate[(m, c)] / rate[('none', c)]:.2f}x" if (m, c) in rate and ("none", c) in rate else "-"
                 for c in ["overall", *categories]]
        print(f"| {m} | {rate[(m, 'overall')]:.2f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
