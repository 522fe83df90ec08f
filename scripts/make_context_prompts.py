"""Long-context training prompts from the target's own answers: summaries, key points,
simplification, questions over several documents (specula/training/context_prompts.py,
docs/training.md).

    python3 scripts/make_context_prompts.py --target smollm2-135m --from runs/magpie/smollm2.jsonl \
        --max-new-tokens 128 --count 800 --out runs/magpie/smollm2-context.jsonl

The target's greedy answers to the --from prompts come from the corpus cache `specula train`
writes (same target and --max-new-tokens: nothing is generated again), or are generated and
cached. Writes OUT (JSONL {"id", "prompt", "source"}) and <stem>.manifest.json (sources, licence,
counts per task, passages dropped); prompts a benchmark check flags are dropped and counted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specula.commands.common import add_load_args, load_config  # noqa: E402
from specula.errors import SpeculaError  # noqa: E402
from specula.training.context_prompts import DEFAULT_TASKS, TASKS, check_tasks  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, metavar="MODEL", help="the model whose answers become passages")
    p.add_argument("--from", dest="sources", required=True, action="append", metavar="FILE",
                   help="training prompt files whose answers are the passages (repeatable)")
    p.add_argument("--out", required=True, metavar="FILE", help="the prompt file to write (JSONL)")
    p.add_argument("--count", type=int, default=800, help="prompts to compose (default 800)")
    p.add_argument("--max-new-tokens", type=int, default=160, metavar="N",
                   help="answer length, as given to `specula train` (its corpus cache is reused; default 160)")
    p.add_argument("--max-documents", type=int, default=4, metavar="N", help="most documents in one prompt (default 4)")
    p.add_argument("--min-documents", type=int, default=2, metavar="N", help="fewest documents in one prompt (default 2)")
    p.add_argument("--passages", default="1", metavar="LO[-HI]",
                   help="passages in the text of a one-passage task, e.g. 4-8 for article-length texts (default 1)")
    p.add_argument("--min-words", type=int, default=40, help="shortest passage, in words (default 40)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS), metavar="T1,T2",
                   help=f"tasks to cycle through, of {', '.join(TASKS)} (default {','.join(DEFAULT_TASKS)})")
    p.add_argument("--seed", type=int, default=0)
    add_load_args(p)
    args = p.parse_args(argv)

    from specula.models.loading import load_backend
    from specula.training.contamination import find_contaminated
    from specula.training.context_prompts import Passage, clean_passage, compose
    from specula.training.corpus import CorpusConfig, generate_corpus, read_prompts, write_prompt_file
    from specula.training.run import cache_paths

    out = Path(args.out)
    if out.exists():  # before the slow load
        print(f"error: {out} exists: delete it or choose another output file", file=sys.stderr)
        return 2
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        lo, _, hi = args.passages.partition("-")
        text_passages = (int(lo), int(hi or lo))
    except ValueError:
        print(f"error: --passages {args.passages!r}: give a count or a range, e.g. 1 or 4-8", file=sys.stderr)
        return 2
    try:
        check_tasks(tasks)  # before the slow load
    except ValueError as exc:
        print(f"error: --tasks {args.tasks!r}: {exc}", file=sys.stderr)
        return 2
    try:
        per_file = [(Path(f), read_prompts([f])) for f in args.sources]
        target, tokenizer = load_backend(args.target, load_config(args), name="target")
        config = CorpusConfig(max_new_tokens=args.max_new_tokens)
        eos = set(target.eos_token_ids)
        passages, dropped = [], 0
        for path, prompts in per_file:
            text_of = dict(prompts)
            for entry in generate_corpus(target, tokenizer, prompts, cache_paths(target, path, config)[0], config):
                finished = bool(entry.output_ids) and entry.output_ids[-1] in eos
                text = clean_passage(tokenizer.decode(entry.output_ids, skip_special_tokens=True), finished,
                                     args.min_words)
                if text is None:
                    dropped += 1
                else:
                    passages.append(Passage(text_of[entry.id], text))
        rows = compose(passages, args.count, args.seed, args.max_documents, tasks, args.min_documents, text_passages)
    except (SpeculaError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    flagged = {m.index for m in find_contaminated([r["prompt"] for r in rows])}
    kept = [r for i, r in enumerate(rows) if i not in flagged]
    source = f"context:{args.target}"
    manifest = {
        "file": out.name, "prompts": len(kept),
        "sources": [{"source": source, "built_from": [str(f) for f, _ in per_file],
                     "licence": f"passages generated by {args.target} (licence of the model); instructions written "
                                "for specula", "passages": len(passages), "passages_dropped_short": dropped,
                     "composed": len(rows), "dropped_benchmark": len(flagged),
                     "tasks": dict(Counter(r["task"] for r in kept))}],
        "settings": {"max_new_tokens": args.max_new_tokens, "max_documents": args.max_documents,
                     "min_documents": args.min_documents, "passages_per_text": list(text_passages),
                     "min_words": args.min_words, "seed": args.seed, "tasks": tasks},
    }
    write_prompt_file(out, [{"id": r["id"], "prompt": r["prompt"], "source": f"{source}:{r['task']}"} for r in kept],
                      manifest)
    print(json.dumps(manifest["sources"], indent=2))
    print(f"{len(kept)} prompts -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
