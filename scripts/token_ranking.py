"""Count the tokens of answer caches and write a draft-vocabulary ranking (`specula.models.draft_vocab`).

    mkdir -p /tmp/ans15 && tar -xJf data/answers/qwen2.5-coder-1.5b/corpus.part00 -C /tmp/ans15
    python scripts/token_ranking.py /tmp/ans15 qwen2.5-coder-1.5b specula/data/vocab/qwen2.5.json

Counts every prompt and answer token of the caches' lines (`prompt_ids`, `output_ids`: `specula
train`'s answer caches, as `data/answers/` ships them; no benchmark prompt is among them) and writes
the ids most frequent first, with the tokenizer's fingerprint, so the file only ever applies to
that tokenizer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import specula  # noqa: F401  (before torch)
from specula.models.draft_vocab import rank_tokens, write_ranking
from specula.models.loading import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("answers", help="a folder of corpus-*.jsonl answer caches")
    parser.add_argument("model", help="the model whose tokenizer wrote the ids (an embedded model name)")
    parser.add_argument("out", help="the ranking file to write")
    parser.add_argument("--source", default="data/answers/qwen2.5-coder-1.5b (corpus.part00): Qwen2.5-Coder-1.5B-"
                        "Instruct's greedy answers to 31,040 SmolLM2-written training prompts, prompts and answers "
                        "counted; no benchmark prompt among them; Apache-2.0")
    args = parser.parse_args()
    files = sorted(Path(args.answers).glob("corpus-*.jsonl"))
    if not files:
        raise SystemExit(f"error: no corpus-*.jsonl in {args.answers}; unpack an answers corpus there first")
    sequences = []
    for f in files:
        for line in f.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            sequences += [row["prompt_ids"], row["output_ids"]]
    ranked = rank_tokens(sequences)
    counted = sum(len(s) for s in sequences)
    path = write_ranking(args.out, load_tokenizer(args.model), args.model, ranked, args.source, counted)
    print(f"{path}: {len(ranked)} tokens ranked from {counted} counted in {len(sequences)} sequences")


if __name__ == "__main__":
    main()
