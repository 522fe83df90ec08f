"""A training prompt file drawn from others: N prompts (a seeded sample) from each source file,
for a target that should answer prompts another model wrote (docs/training.md: the Qwen pair
answers SmolLM2's Magpie prompts, whose generation is far cheaper than theirs on a CPU).

    python3 scripts/mix_prompts.py --take runs/magpie/smollm2.jsonl:250 --take runs/magpie/smollm2-code.jsonl:150 \
        --seed 0 --out runs/magpie/qwen-a.jsonl

Writes OUT (JSONL {"id", "prompt", "source"}; ids are "<source stem>:<id>", unique across
sources) and <stem>.manifest.json: per source file its path, the prompts taken of those it
holds, and the sources and licences its own manifest records. `--exclude FILE` skips prompts
already drawn into an earlier mix (by id), so successive mixes never repeat a prompt. Every
prompt passes the benchmark check again (`read_prompts`); nothing is written on an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specula.errors import SpeculaError  # noqa: E402


def _take(spec: str) -> tuple[Path, int]:
    path, sep, n = spec.rpartition(":")
    if not sep or not n.isdigit() or int(n) < 1:
        raise argparse.ArgumentTypeError(f"--take wants FILE:N (N >= 1 prompts from FILE), got {spec!r}")
    return Path(path), int(n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--take", type=_take, action="append", required=True, metavar="FILE:N",
                   help="take N prompts from FILE (repeatable)")
    p.add_argument("--exclude", action="append", default=[], metavar="FILE",
                   help="an earlier mix whose prompts are not taken again (repeatable)")
    p.add_argument("--out", required=True, metavar="FILE", help="the prompt file to write (JSONL)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from specula.paths import atomic_path, atomic_write_json
    from specula.training.mix import mix_prompts

    out = Path(args.out)
    if out.exists():
        print(f"error: {out} exists: delete it or choose another output file", file=sys.stderr)
        return 2
    try:
        rows, sources = mix_prompts(args.take, [Path(f) for f in args.exclude], seed=args.seed)
    except SpeculaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    atomic_write_json(out.with_name(out.stem + ".manifest.json"),
                      {"file": out.name, "prompts": len(rows), "seed": args.seed,
                       "excluded": args.exclude, "taken_from": sources})
    print(f"{len(rows)} prompts -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
