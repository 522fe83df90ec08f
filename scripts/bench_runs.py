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


def spread(values: list[float | None], spec: str = ".2f", suffix: str = "") -> str:
    """"min / median / max" of `values`, each formatted by `spec` (".3f", ".0%", ...), then `suffix`;
    "-" when a run lacks the figure (a peer has no steps, a sampled run no identity check)."""
    if not values or any(v is None for v in values):
        return "-"
    return " / ".join(format(v, spec) for v in (min(values), statistics.median(values), max(values))) + suffix


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
        cells = [spread([r["speedup"] for r in rows], suffix="x"), spread([r["mean_accepted_tokens"] for r in rows]),
                 spread([r.get("mean_accepted_per_drafting_step") for r in rows]),
                 spread([r.get("paused_step_fraction") for r in rows], ".0%"),
                 spread([r.get("draft_fraction_of_plain_step_per_token") for r in rows], ".3f")]
        if args.over:
            cells.append(spread([_over(s[name], s[args.over]) for s in summaries], suffix="x"))
        identical = [r.get("identical_fraction") for r in rows]
        cells.append("-" if any(v is None for v in identical) else f"{min(identical):.0%}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def _over(entry: dict, other: dict) -> float | None:
    """`entry`'s tokens/s over `other`'s (None when either has none)."""
    return entry["tokens_per_s"] / other["tokens_per_s"] if entry.get("tokens_per_s") and other.get("tokens_per_s") \
        else None


if __name__ == "__main__":
    main()
