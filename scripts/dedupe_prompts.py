"""Drop from new prompt files every prompt that repeats one of earlier files (exact after
normalising, or a near duplicate by word shingles), rewriting each new file and its manifest.

    python3 scripts/dedupe_prompts.py --new D/magpie3-*.jsonl --earlier D/magpie-*.jsonl D/magpie2-*.jsonl

New files are checked in order, each against the earlier files and the new files before it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specula.errors import SpeculaError  # noqa: E402
from specula.training.magpie import drop_repeats  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new", nargs="+", required=True, metavar="FILE", help="prompt files to clean (rewritten)")
    p.add_argument("--earlier", nargs="+", required=True, metavar="FILE", help="prompt files they must not repeat")
    args = p.parse_args(argv)
    earlier = [Path(f) for f in args.earlier]
    try:
        for f in args.new:
            manifest = drop_repeats(f, earlier)
            print(f"{f}: {manifest['repeats_of_earlier_files']['dropped']} repeats dropped, {manifest['prompts']} kept")
            earlier.append(Path(f))
    except SpeculaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
