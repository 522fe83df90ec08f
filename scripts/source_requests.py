"""What the prompt-writing scripts that ask a model of ours for text share
(make_translation_prompts.py, make_question_prompts.py): their requests written to
OUT_STEM-sources.jsonl, answered greedily through the corpus cache `specula train` keeps (a rerun
reuses the answers), and the prompts made from those answers checked against the benchmarks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specula.commands.common import add_load_args, load_config  # noqa: E402
from specula.errors import ConfigError  # noqa: E402


def holds(path: Path, rows: list[dict]) -> bool:
    """Whether the JSONL file `path` holds exactly `rows` (a file of other lines, or not JSON, does not)."""
    try:
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == rows
    except json.JSONDecodeError:
        return False


def sources_path(out: Path, asked: list[dict]) -> Path:
    """OUT_STEM-sources.jsonl, checked before any slow load: a ConfigError when OUT exists or the
    sources file holds other requests than `asked`."""
    if out.exists():
        raise ConfigError(f"{out} exists: delete it or choose another output file")
    sources = out.with_name(f"{out.stem}-sources.jsonl")
    if sources.exists() and not holds(sources, asked):
        raise ConfigError(f"{sources} holds other requests: delete it or choose another output file")
    return sources


def add_request_args(parser, *, writes: str, requests: int, max_new_tokens: int, seed: int) -> None:
    """The options every such script takes (the ones `source_answers` and `write_made` read), with
    its own defaults; `writes`: what the source model writes (for --source-model's help)."""
    parser.add_argument("--source-model", required=True, metavar="MODEL", help=f"the model that writes {writes}")
    parser.add_argument("--requests", type=int, default=requests, metavar="N",
                        help=f"requests to the source model (default {requests})")
    parser.add_argument("--out", required=True, metavar="FILE", help="the prompt file to write (JSONL)")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
                        help="the source model's answer length, as given to `specula train` (its corpus cache is "
                             f"reused; default {max_new_tokens})")
    parser.add_argument("--seed", type=int, default=seed)
    add_load_args(parser)


def source_answers(args, sources: Path, asked: list[dict], script: str, entry: dict) -> Iterator[tuple[str, str]]:
    """Write the requests (`asked`) to `sources` with their manifest (`entry`: the requests' source,
    licence and counts), load `args.source_model` and yield (prompt id as the corpus names it,
    answer text) for every request, answered greedily in `args.max_new_tokens` tokens."""
    from specula.models.loading import load_backend
    from specula.training.corpus import CorpusConfig, generate_corpus, read_prompts, write_prompt_file
    from specula.training.run import cache_paths

    write_prompt_file(sources, asked, {"file": sources.name, "prompts": len(asked), "sources": [entry],
                                       "settings": {"script": script, "seed": args.seed, "requests": len(asked)}})
    model, tokenizer = load_backend(args.source_model, load_config(args), name="source model")
    config = CorpusConfig(max_new_tokens=args.max_new_tokens)
    for entry in generate_corpus(model, tokenizer, read_prompts([sources]), cache_paths(model, sources, config)[0],
                                 config):
        yield entry.id, tokenizer.decode(entry.output_ids, skip_special_tokens=True)


def unflagged(rows: list[dict]) -> tuple[list[dict], int]:
    """The rows whose "prompt" no benchmark check flags, and how many were dropped."""
    from specula.training.contamination import find_contaminated

    flagged = {m.index for m in find_contaminated([r["prompt"] for r in rows])}
    return [r for i, r in enumerate(rows) if i not in flagged], len(flagged)


def write_made(out: Path, args, script: str, entry: dict, rows: list[dict]) -> None:
    """Write the prompts made (`rows`: {"id", "prompt", "source"}) to `out` with their manifest
    (`entry`: the source's licence and counts; the settings read from `args`), and print both."""
    from specula.training.corpus import write_prompt_file

    manifest = {"file": out.name, "prompts": len(rows), "sources": [entry],
                "settings": {"script": script, "source_model": args.source_model,
                             "max_new_tokens": args.max_new_tokens, "seed": args.seed}}
    write_prompt_file(out, rows, manifest)
    print(json.dumps(manifest["sources"], indent=2))
    print(f"{len(rows)} prompts -> {out}")
