"""Magpie-style training prompts: the target writes user messages from its chat template's
user-turn prefix alone; duplicates, garbage and benchmark prompts are filtered out
(specula/training/magpie.py, docs/training.md).

    python3 scripts/make_magpie_prompts.py --target smollm2-135m --count 2000 --out runs/magpie/smollm2.jsonl
    python3 -m specula train --target smollm2-135m --data runs/magpie/smollm2.jsonl --out runs/heads/smollm2

Writes OUT (JSONL {"id", "prompt", "source"}) and OUT's <stem>.manifest.json (source, licence,
counts generated / kept / dropped by reason). Interrupted, the same command resumes from OUT.partial.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specula.commands.common import add_load_args, load_config  # noqa: E402
from specula.errors import SpeculaError  # noqa: E402
from specula.training.magpie import FilterConfig, MagpieConfig, manifest_path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    defaults, filters = MagpieConfig(), FilterConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, metavar="MODEL", help="a chat model (alias, directory, .gguf)")
    p.add_argument("--out", required=True, metavar="FILE", help="the prompt file to write (JSONL)")
    p.add_argument("--count", type=int, default=defaults.count, help=f"messages to generate (default {defaults.count})")
    p.add_argument("--temperature", type=float, default=defaults.temperature)
    p.add_argument("--top-p", type=float, default=defaults.top_p)
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens, metavar="N")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, metavar="N")
    p.add_argument("--seed", type=int, default=defaults.seed,
                   help="request i samples with seed + i: two files with the same --system need seeds at least "
                        "--count apart, or they repeat each other's prompts (seeds 10 and 20 gave 99%% the same)")
    p.add_argument("--system", metavar="TEXT", help="a system message steering the requests (e.g. math problems); "
                   "default: the template's own system turn")
    p.add_argument("--min-words", type=int, default=filters.min_words)
    p.add_argument("--max-words", type=int, default=filters.max_words)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_load_args(p)
    args = p.parse_args(argv)

    from tqdm import tqdm

    from specula.models.loading import load_backend
    from specula.training.magpie import synthesise

    if Path(args.out).exists():  # before the slow load
        print(f"error: {args.out} exists: delete it or choose another output file", file=sys.stderr)
        return 2
    try:
        config = MagpieConfig(count=args.count, temperature=args.temperature, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                              system=args.system)
        target, tokenizer = load_backend(args.target, load_config(args), name="target")
        with tqdm(total=config.count, desc="magpie (user turns)", unit="msg", disable=args.quiet) as bar:
            manifest = synthesise(target, tokenizer, args.target, Path(args.out), config,
                                  FilterConfig(min_words=args.min_words, max_words=args.max_words), progress=bar.update)
    except SpeculaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(manifest["sources"], indent=2))
    print(f"{manifest['prompts']} prompts -> {args.out} (manifest {manifest_path(Path(args.out))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
