"""The self-distillation corpus: the target's own greedy answers to prompts we wrote.

A head must predict what the target will accept, so its training text is what the target
itself generates (Medusa-2 / EAGLE "self-distillation"), not a dataset's answers. Prompts come
from JSONL files (`{"turns": [...]}` or `{"prompt": ...}` per line, the shipped
`specula/data/training/prompts.jsonl` by default); answers are generated greedily, many
requests at once through the engine's batched step (plain decoding, no drafting).

The corpus is cached as JSONL (one `{"id", "prompt_ids", "output_ids"}` per line) under a key of
the target, the prompt files and the generation settings. Generation appends to a `.partial`
file as sequences finish, so an interrupted run resumes where it stopped; the final file
appears (atomic rename) only when every prompt is done.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from specula.errors import ConfigError
from specula.jsonl import json_lines
from specula.prompts import is_integer

if TYPE_CHECKING:
    import torch

EVAL_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "everyday" / "prompts.jsonl"
"""The held-out report's default prompts: the everyday set (chat, instructions, code, math written
for evaluation), a different source from any training prompts, which may not contain them."""

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "training" / "prompts.jsonl"
"""Prompts written for specula's shipped heads (scripts/make_training_prompts.py); no benchmark's."""


@dataclass(frozen=True)
class CorpusConfig:
    """How the self-distillation corpus is generated."""

    max_new_tokens: int = 160
    """Tokens the target writes per prompt (greedy)."""
    batch_size: int = 16
    """Requests generated at once (one packed pass per step on batching backends)."""
    max_prompt_tokens: int = 768
    """Prompts longer than this (in tokens) are cut from the left (their end is kept)."""


@dataclass(frozen=True)
class PaddedConfig:
    """Padded batches through a Hugging Face model (`training.padded`): the GPU path of the corpus
    and its features. Not part of the cache key: the answers are the target's greedy ones either way."""

    max_rows: int = 512
    """Prompts answered at once (left-padded, one forward per new token for all of them)."""
    max_tokens: int = 524_288
    """Padded tokens per batch (rows x longest prompt + answer): bounds the KV cache's memory."""
    feature_tokens: int = 65_536
    """Padded tokens per feature pass (rows x longest sequence): bounds the hidden states' memory.
    On a CPU at most `CPU_FEATURE_TOKENS` (`on`)."""

    def on(self, device: torch.device) -> PaddedConfig:
        """These settings as `device` runs them: on a CPU, feature passes of at most
        `CPU_FEATURE_TOKENS` padded tokens."""
        if device.type != "cpu":
            return self
        return replace(self, feature_tokens=min(self.feature_tokens, CPU_FEATURE_TOKENS))


CPU_FEATURE_TOKENS = 1024
"""Padded tokens per feature pass on a CPU: passes of about a thousand tokens already keep the
bfloat16 matrix units busy, and larger ones ran slower (Qwen2.5-Coder-1.5B on 2 cores with AMX: 376
tokens/s at 1,024 against 297 at 4,096; the GPU's 65,536 slower still)."""


@dataclass(frozen=True)
class CorpusEntry:
    """One corpus entry: prompt and the target's greedy answer."""

    id: str
    """The prompt's id in its file."""
    prompt_ids: list[int]
    """The prompt as the target reads it (chat template applied, cut to `max_prompt_tokens`)."""
    output_ids: list[int]
    """The target's greedy answer."""

    @property
    def ids(self) -> list[int]:
        """Prompt then answer: the token sequence the target's features are taken over."""
        return [*self.prompt_ids, *self.output_ids]


def read_prompts(files: Iterable[str | os.PathLike], training: bool = True) -> list[tuple[str, str]]:
    """(id, first turn text) of every prompt in the JSONL files; a ConfigError names a bad line, an
    id given twice in one file, or, for training data, a line holding a benchmark's prompt (`contamination`: a head never
    trains on what it is measured on; `training=False` reads evaluation prompts, which may be)."""
    out: list[tuple[str, str]] = []
    for file in files:
        path = Path(file)
        if not path.is_file():
            what, option = ("training data", "data=") if training else ("held-out data", "eval_data")
            state = "is not a file" if path.exists() else "does not exist"
            raise ConfigError(f"{what} {path} {state}: pass JSONL prompt files with {option}")
        rows = list(_read_rows(path))
        first: dict[str, int] = {}
        for n, rid, _ in rows:
            if first.setdefault(rid, n) != n:
                raise ConfigError(f"{path}:{n}: id {rid!r} is also the id of line {first[rid]}; give each prompt "
                                  "of a file its own id (answers are cached and matched by id)")
        if not rows:  # named here: among several files, the message of an empty set named none, after the load
            what, option = ("training data", "data=") if training else ("held-out data", "eval_data")
            raise ConfigError(f"{what} {path} holds no prompts: pass JSONL prompt files with {option}, one "
                              '{"prompt": ...} or {"turns": [...]} a line')
        if training:
            refuse_benchmark_prompts(path, rows)
        out += [(f"{path.stem}:{rid}", turns[0]) for _, rid, turns in rows]
    if not out:
        none = "eval_data (or none: eval_data=[])"
        what, option = ("training data", "data=") if training else ("held-out data", none)
        raise ConfigError(f"the {what} holds no prompts: pass JSONL prompt files with {option}")
    return out


def write_prompt_file(out: Path, rows: Sequence[dict], manifest: dict) -> None:
    """A prompt file the scripts compose (rows {"id", "prompt", "source"}, one JSON line each) and
    its OUT_STEM.manifest.json, each written atomically (the manifest first)."""
    from specula.paths import atomic_path, atomic_write_json

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_name(f"{out.stem}.manifest.json"), manifest)
    with atomic_path(out) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def _read_rows(path: Path) -> Iterable[tuple[int, str, list[str]]]:
    """(line number, id, turns) of every prompt line of a JSONL file."""
    for n, line in enumerate(json_lines(_utf8(path)), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}: not JSON ({exc.msg}); each line must be an object with "
                              "'turns' or 'prompt'") from None
        turns = None
        if isinstance(row, dict):
            turns = [row["prompt"]] if row.get("prompt") is not None else row.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns) \
                or not turns[0].strip():
            raise ConfigError(f"{path}:{n}: no prompt text; give 'prompt': str or 'turns': [str, ...]")
        yield n, str(row.get("id", n)), turns


def refuse_benchmark_prompts(path: Path, rows: Sequence[tuple[int, str, list[str]]]) -> None:
    """ConfigError naming the first line of `path` whose prompt (any turn) is a benchmark's."""
    from specula.training.contamination import find_contaminated

    where = [(n, t) for n, _, turns in rows for t in turns]
    matches = find_contaminated([t for _, t in where])
    if not matches:
        return
    lines = sorted({where[m.index][0] for m in matches})
    first = matches[0]
    more = f" (and {len(lines) - 1} more line{'s' * (len(lines) > 2)})" if len(lines) > 1 else ""
    how = "is" if first.kind == "exact" else f"shares the passage {first.passage!r} with"
    raise ConfigError(f"{path}:{where[first.index][0]}: this prompt {how} {first.prompt.label}{more}; a head must not "
                      "train on a benchmark's prompts: remove those lines from the file (or pass other data=)")


def corpus_key(target_key: dict, files: Sequence[str | os.PathLike], config: CorpusConfig) -> str:
    """A short hash of what the corpus depends on."""
    h = hashlib.sha256(json.dumps({"target": target_key, "config": config.__dict__}, sort_keys=True).encode())
    for file in files:
        h.update(Path(file).read_bytes())
    return h.hexdigest()[:16]


def _utf8(path: Path, data: bytes | None = None) -> str:
    """A text file's contents (`data`: its bytes, already read; a leading byte-order mark dropped,
    as editors on Windows write one); a ConfigError where it is not UTF-8."""
    try:
        return (path.read_bytes() if data is None else data).decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None


def complete_lines(partial: Path, valid: Callable[[str], bool] = lambda line: True) -> list[str]:
    """The whole lines of an append-only `.partial` file that `valid` accepts; where a line was cut
    by a kill (or damaged by a crash), the file is rewritten atomically without it, so its work is
    done again (the file is never truncated in place: a kill then would lose every line)."""
    from specula.paths import atomic_path

    text = partial.read_bytes().decode("utf-8", errors="replace")
    every = json_lines(text, keepends=True)
    lines = [ln for ln in every if ln.endswith("\n") and valid(ln)]
    if len(lines) != len(every):
        with atomic_path(partial) as tmp:
            tmp.write_text("".join(lines), encoding="utf-8")
    return lines


def load_corpus(path: Path) -> list[CorpusEntry]:
    """The entries of a corpus file; a damaged line is a ConfigError naming it and the fix."""
    entries = []
    for n, line in enumerate(json_lines(_utf8(path)), 1):
        if line.strip():
            try:
                entries.append(_from_line(line))
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{path}:{n}: not a corpus line ({exc}); delete {path} and run again") from None
    return entries


def _parses(line: str) -> bool:
    """Whether `line` is a corpus line (`_from_line`)."""
    try:
        _from_line(line)
    except (ValueError, KeyError, TypeError):
        return False
    return True


def _to_line(e: CorpusEntry) -> str:
    """One line of a corpus file (or of its `.partial`)."""
    return json.dumps({"id": e.id, "prompt_ids": e.prompt_ids, "output_ids": e.output_ids}) + "\n"


def _from_line(line: str) -> CorpusEntry:
    """A corpus line's entry (ValueError, KeyError or TypeError where it is not one)."""
    r = json.loads(line)
    if not isinstance(r, dict):
        raise TypeError("not a JSON object")
    for key in ("prompt_ids", "output_ids"):
        ids = r[key]
        if not isinstance(ids, list) or not all(is_integer(t) for t in ids):
            raise TypeError(f"{key} must be a list of token ids")
    return CorpusEntry(r["id"], r["prompt_ids"], r["output_ids"])


def match_answers(tokenizer, prompts: Sequence[tuple[str, str]], answers: dict[tuple[int, ...], list[int]],
                  config: CorpusConfig, missing: str) -> list[CorpusEntry]:
    """The corpus of `prompts` ((id, text)) from `answers` (answer ids by prompt ids): each prompt
    encoded as the target reads it (`max_prompt_tokens`) and looked up; a prompt without an answer
    is a `ConfigError` of `missing` formatted with its id."""
    from specula.prompts import encode_prompt

    encoded = [encode_prompt(tokenizer, text)[-config.max_prompt_tokens:] for _, text in prompts]
    absent = next((pid for (pid, _), ids in zip(prompts, encoded) if tuple(ids) not in answers), None)
    if absent is not None:
        raise ConfigError(missing.format(absent))
    return [CorpusEntry(pid, ids, list(answers[tuple(ids)])) for (pid, _), ids in zip(prompts, encoded)]


def answers_hash(entries: Sequence[CorpusEntry]) -> str:
    """A short hash of a file's corpus taken from `--answers` (its prompt and answer ids, in order):
    the features' cache key, so a file's features depend on the answers it took and on no other."""
    h = hashlib.sha256()
    for entry in entries:
        h.update(json.dumps([entry.prompt_ids, entry.output_ids]).encode())
    return h.hexdigest()[:16]


def answer_files(paths: Iterable[str | os.PathLike], option: str = "answers") -> list[Path]:
    """The corpus files `read_answers` reads: the files given, and the `corpus-*.jsonl` files of the
    folders given; a missing path, or none found, is a `ConfigError` naming `option`, the keyword that gave them
    (`run_training`'s answers or vocab_from)."""
    paths = list(paths)
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(path.glob("corpus-*.jsonl"))
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"{option}={str(path)!r}: no such file or folder")
    if not files:
        raise ConfigError(f"{option}= {' '.join(map(str, paths))}: no corpus-*.jsonl files there")
    return files


def read_answers(paths: Iterable[str | os.PathLike], vocab_size: int,
                 option: str = "answers") -> tuple[dict[tuple[int, ...], list[int]], str]:
    """Answers written earlier, e.g. by a smaller model with the target's tokenizer: corpus files
    as `specula train` caches them (`corpus-*.jsonl` under $SPECULA_CACHE/training/), or folders of
    them. Returns (answer ids by prompt ids, a short hash of the files' bytes, which the report
    records). A missing path, a file of other lines, or ids outside the target's vocabulary (another
    tokenizer's answers) is a `ConfigError` naming `option`, the keyword that gave the paths."""
    files = answer_files(paths, option)
    table: dict[tuple[int, ...], list[int]] = {}
    h = hashlib.sha256()
    for file in files:
        data = file.read_bytes()
        h.update(data)
        for n, line in enumerate(json_lines(_utf8(file, data)), 1):
            if not line.strip():
                continue
            try:
                entry = _from_line(line)
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{file}:{n}: not a corpus line ({{\"id\", \"prompt_ids\", \"output_ids\"}}): {e}") from None
            if any(not 0 <= t < vocab_size for t in (*entry.prompt_ids, *entry.output_ids)):
                raise ConfigError(f"{file}:{n}: token ids outside the target's vocabulary of {vocab_size}: answers "
                                  "from a model with another tokenizer cannot be used")
            table[tuple(entry.prompt_ids)] = entry.output_ids
    return table, h.hexdigest()[:16]


def generate_corpus(target, tokenizer, prompts: Sequence[tuple[str, str]], out: Path,
                    config: CorpusConfig = CorpusConfig(), progress: Callable[[int], None] | None = None,
                    padded: PaddedConfig | None = None) -> list[CorpusEntry]:
    """The target's greedy answers to `prompts`, cached at `out` (resumed from `out.partial`);
    `progress(n)` as sequences are done, cached or resumed ones included. `padded`: generate in
    padded batches through the target's Hugging Face model (`training.padded`, the GPU path) when
    it has one; the engine's batched step otherwise."""
    from specula.paths import atomic_path
    from specula.prompts import encode_prompt
    from specula.training.padded import generate_padded, padded_model

    if out.is_file():
        cached = load_corpus(out)
        if len(cached) != len(prompts):
            raise ConfigError(f"{out} holds {len(cached)} answers for {len(prompts)} prompts: delete it and run again")
        # The cache is keyed by the file's bytes, the ids carry its name: the same file under another
        # name reads the same answers under its own ids. Entries are matched to prompts by their
        # prompt's tokens, not by position: files written before they were put in prompt order hold
        # them in the order the answers finished.
        entries = match_answers(tokenizer, prompts, {tuple(e.prompt_ids): e.output_ids for e in cached}, config,
                                f"{out} holds no answer to prompt {{}}: delete it and run again")
        if progress is not None:
            progress(len(cached))
        return entries
    partial = out.with_name(out.name + ".partial")
    done: dict[str, CorpusEntry] = {}
    if partial.is_file():
        for line in complete_lines(partial, _parses):
            entry = _from_line(line)
            done[entry.id] = entry
    if progress is not None and done:
        progress(len(done))
    jobs = ((pid, encode_prompt(tokenizer, text)[-config.max_prompt_tokens:]) for pid, text in prompts if pid not in done)
    model = padded_model(target) if padded is not None else None
    out.parent.mkdir(parents=True, exist_ok=True)
    with partial.open("a", encoding="utf-8") as sink:
        def record(pid: str, prompt_ids: list[int], output_ids: list[int]) -> None:
            done[pid] = entry = CorpusEntry(pid, list(prompt_ids), list(output_ids))
            sink.write(_to_line(entry))
            sink.flush()
            if progress is not None:
                progress(1)

        if model is not None:
            generate_padded(model, list(jobs), config.max_new_tokens, target.eos_token_ids, padded.max_rows,
                            padded.max_tokens, record)
        else:
            from specula.engine import SpeculativeDecoder
            from specula.sampling import SamplingParams

            params = SamplingParams(max_new_tokens=config.max_new_tokens)
            answers = SpeculativeDecoder(target, [], tokenizer).generate_many(
                (((pid, ids), ids, params) for pid, ids in jobs), config.batch_size)
            for (pid, ids), answer in answers:
                record(pid, ids, answer.token_ids)
    ordered = [done[pid] for pid, _ in prompts]
    with atomic_path(out) as tmp:  # in prompt order (the partial file holds them as they finished)
        tmp.write_text("".join(_to_line(e) for e in ordered), encoding="utf-8")
    partial.unlink()
    return ordered
