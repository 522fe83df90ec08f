"""Plot several `specula profile` results in one figure (docs/cpu.md).

    python scripts/plot_cost_curves.py float32=runs/profile-f32/cost_curve.json int8=runs/profile-int8/cost_curve.json \\
        --title "Qwen2.5-Coder-1.5B, 2 threads, context 256" --out docs/img/cpu_cost_curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specula.bench.plots import plot_cost_curves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("curves", nargs="+", metavar="LABEL=FILE", help="a label and a cost_curve.json")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    curves = {}
    for item in args.curves:
        label, sep, file = item.partition("=")
        if not sep:
            ap.error(f"{item!r}: write LABEL=FILE")
        curves[label] = json.loads(Path(file).read_text())
    print(plot_cost_curves(curves, Path(args.out), args.title))


if __name__ == "__main__":
    main()
