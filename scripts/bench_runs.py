"""Min / median / max over several `specula bench` runs of the same methods (each run's speedups
are against its own plain decoding, taken side by side in that run).

    python3 scripts/bench_runs.py runs/i28b-everyday-1 runs/i28b-everyday-2 runs/i28b-everyday-3
    python3 scripts/bench_runs.py --over fusion:head=none runs/i28b-everyday-*   # ratios to another method

Prints a markdown table: per method, tokens/s vs plain decoding (or vs `--over`) and mean accepted
tokens, each as min / median / max over the runs, and the share of outputs identical to plain
decoding.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def spread(values: list[float], spec: str = ".2f") -> str:
    """"min / median / max" of `values`, each formatted by `spec` (".3f", ".0%", ...)."""
    return " / ".join(format(v, spec) for v in (min(values), statistics.median(values), max(values)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="bench output directories (each holds results.json)")
    parser.add_argument("--over", default=None, help="also give each method's tokens/s over this method's, per run")
    args = parser.parse_args()
    summaries = [json.loads((Path(d) / "results.json").read_text())["summary"] for d in args.runs]
    names = [name for name in summaries[0] if all(name in s for s in summaries)]
    header = ("| method | vs none | mean accepted | per drafting step | steps paused by the back-off "
              "| draft / plain step per proposed token | identical |")
    if args.over:
        header = header.replace(" | identical", f" | vs {args.over} | identical")
    print(f"{len(summaries)} runs: min / median / max\n")
    print(header)
    print("|" + "---|" * header.count(" | ") + "---|")
    for name in names:
        rows = [s[name] for s in summaries]
        cells = [spread([r["speedup"] for r in rows]) + "x", spread([r["mean_accepted_tokens"] for r in rows])]
        drafting = [r.get("mean_accepted_per_drafting_step") for r in rows]
        cells.append(spread(drafting) if all(v is not None for v in drafting) else "-")
        paused = [r.get("paused_step_fraction") for r in rows]
        cells.append(spread(paused, ".0%") if all(v is not None for v in paused) else "-")
        per_token = [r.get("draft_fraction_of_plain_step_per_token") for r in rows]
        cells.append(spread([v for v in per_token if v is not None], ".3f") if any(per_token) else "-")
        if args.over:
            cells.append(spread([s[name]["tokens_per_s"] / s[args.over]["tokens_per_s"] for s in summaries]) + "x")
        cells.append(f"{min(r['identical_fraction'] for r in rows):.0%}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
