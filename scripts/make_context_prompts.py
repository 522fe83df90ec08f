"""Long-context training prompts from the target's own answers: summaries, key points,
simplification, questions over several documents (specula/training/context_prompts.py,
docs/training.md).

    python3 scripts/make_context_prompts.py --target smollm2-135m --from runs/magpie/smollm2.jsonl \
        --max-new-tokens 128 --count 800 --out runs/magpie/smollm2-context.jsonl

The target's greedy answers to the --from prompts come from the corpus cache `specula train`
writes (same target and --max-new-tokens: nothing is generated again), or are generated and
cached. With --passages-from DIR --passage-model MODEL the passages are another model's stored
answers instead (DIR holds `specula train`'s answer caches of MODEL, corpus-*.jsonl or the
corpus.part* tars of them that data/answers/ stores; answers holding code are skipped): text the
target did not write, which its head cannot guess and has to copy.

    python3 scripts/make_context_prompts.py --target smollm2-135m --passages-from data/answers/qwen2.5-coder-1.5b \
        --passage-model qwen2.5-coder-1.5b --passage-tokenizer qwen2.5-coder-0.5b --max-new-tokens 128 \
        --passages 4-7 --tasks summary,key_points,summary,title --count 600 --seed 66 \
        --out specula/data/training/smollm2-135m/context-qwen.jsonl

Writes OUT (JSONL {"id", "prompt", "source"}) and <stem>.manifest.json (sources, licence, counts
per task, passages dropped); prompts a benchmark check flags are dropped and counted.
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
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="sources", action="append", metavar="FILE",
                     help="training prompt files whose answers are the passages (repeatable)")
    src.add_argument("--passages-from", metavar="DIR",
                     help="another model's stored answers (corpus-*.jsonl, or corpus.part* tars of them) as the passages; "
                          "with --passage-model")
    p.add_argument("--passage-model", metavar="MODEL", help="the model whose answers --passages-from holds (named in the manifest)")
    p.add_argument("--passage-tokenizer", metavar="MODEL",
                   help="an installed model with --passage-model's tokenizer, to decode its answers (default: --passage-model)")
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
    if args.passages_from is not None and (args.passage_model is None or "documents" in tasks):
        print("error: --passages-from needs --passage-model MODEL (whose answers it holds) and one-passage tasks only "
              "(not documents: the stored answers' questions are not kept)", file=sys.stderr)
        return 2
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
        passages, dropped, with_code = [], 0, 0
        per_file = [(Path(f), read_prompts([f])) for f in args.sources or []]
        if args.passages_from is not None:
            passages, dropped, with_code = stored_passages(Path(args.passages_from),
                                                           args.passage_tokenizer or args.passage_model,
                                                           args.max_new_tokens, args.min_words)
        else:
            target, tokenizer = load_backend(args.target, load_config(args), name="target")
            config = CorpusConfig(max_new_tokens=args.max_new_tokens)
            eos = set(target.eos_token_ids)
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
    writer = args.passage_model or args.target
    source = f"context:{writer}"
    manifest = {
        "file": out.name, "prompts": len(kept),
        "sources": [{"source": source, "built_from": [str(f) for f, _ in per_file] or [args.passages_from],
                     "licence": f"passages generated by {writer} (licence of the model); instructions written "
                                "for specula", "passages": len(passages), "passages_dropped_short": dropped,
                     **({"passages_dropped_code": with_code} if args.passages_from is not None else {}),
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


def corpus_texts(directory: Path) -> dict[str, str]:
    """The answer caches in `directory` by file name: its corpus-*.jsonl files, or those inside
    its corpus.part* xz tars as `data/answers/` stores them (read in memory, nothing unpacked)."""
    import tarfile

    texts = {f.name: f.read_text(encoding="utf-8") for f in directory.glob("corpus-*.jsonl")}
    for part in sorted(directory.glob("corpus.part*")):
        with tarfile.open(part, "r:xz") as tar:
            for member in tar.getmembers():
                if member.isfile() and Path(member.name).name.startswith("corpus-"):
                    texts[Path(member.name).name] = tar.extractfile(member).read().decode("utf-8")
    if not texts:
        raise ValueError(f"{directory} holds no answer caches (corpus-*.jsonl, or corpus.part* tars of them)")
    return texts


def stored_passages(directory: Path, tokenizer_model: str, max_new_tokens: int, min_words: int
                    ) -> tuple[list, int, int]:
    """Passages from the answer caches in `directory` (`corpus_texts`, in name order):
    (passages, dropped as short, dropped as holding code). An answer of `max_new_tokens` tokens was
    cut off (cut back to its last full sentence); one with a code fence is not prose to summarise."""
    from specula.models.loading import load_tokenizer
    from specula.training.context_prompts import Passage, prose_passage
    from specula.training.corpus import _from_line

    texts = corpus_texts(directory)
    tokenizer = load_tokenizer(tokenizer_model)
    passages, short, code = [], 0, 0
    for name in sorted(texts):
        for entry in map(_from_line, filter(str.strip, texts[name].splitlines())):
            text = tokenizer.decode(entry.output_ids, skip_special_tokens=True)
            passage = prose_passage(text, len(entry.output_ids) < max_new_tokens, min_words)
            if passage is not None:
                passages.append(Passage("", passage))
            elif "```" in text:
                code += 1
            else:
                short += 1
    return passages, short, code


if __name__ == "__main__":
    sys.exit(main())
