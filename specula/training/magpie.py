"""Magpie-style prompt synthesis: the target writes the user turns of its own training prompts.

An aligned chat model given only its template's user-turn prefix (ChatML: `<|im_start|>system
...<|im_end|>\\n<|im_start|>user\\n`) continues with a plausible user message and then closes the
turn (Magpie, Xu et al. 2024). `user_turn` derives that prefix from the tokenizer's own chat
template (a conversation with a sentinel user message, cut at the sentinel: nothing is
hard-coded); `synthesise` samples many such messages at once through the engine's batched step
(as `corpus.generate_corpus` does) and keeps those `filter_prompts` lets through: deduplicated
(normalised exact, then near-duplicates by word shingles), neither too short nor too long, no
garbage (non-printable text, leaked special tokens, mostly symbols, one word repeated), nothing
`contamination` flags as a benchmark's prompt.

Output: JSONL `{"id", "prompt", "source": "magpie:<target>"}` (usable as `specula train --data`),
written atomically once every request is done, and a manifest `<stem>.manifest.json` next to it:
the source and its licence, the counts generated / kept / dropped by reason, the settings. Raw
generations go to `<out>.partial` as requests finish, so an interrupted run resumes (same
settings only: the partial's first line records them).
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from specula.errors import ConfigError
from specula.training.contamination import BenchmarkIndex, default_index, find_contaminated, normalise, shingles
from specula.training.corpus import complete_lines

SENTINEL = "SPECULAMAGPIESENTINEL"
"""A user message no template alters: rendered, then cut at, to find the user-turn prefix."""

DROP_REASONS = ("empty", "unfinished", "garbage", "too_short", "too_long", "benchmark", "duplicate", "near_duplicate")
"""Why a generated prompt is dropped, in the order the filter checks."""


@dataclass(frozen=True)
class MagpieConfig:
    """How user messages are sampled."""

    count: int = 1000
    """User messages to generate (before filtering)."""
    temperature: float = 1.0
    """Sampling temperature (Magpie samples at 1.0: diverse requests)."""
    top_p: float = 0.95
    """Nucleus sampling mass."""
    max_new_tokens: int = 96
    """Longest user message, in tokens; one that has not closed its turn by then is `unfinished`."""
    batch_size: int = 16
    """Requests generated at once (one packed pass per step on batching backends)."""
    seed: int = 0
    """Request i samples with seed `seed + i`: a run (and a resumed run) is reproducible."""
    system: str | None = None
    """A system message that steers what users ask (Magpie's task-specific system prompts, e.g.
    math problems to solve step by step); None keeps the template's own (default) system turn.
    It only steers the synthesis: the target answers the kept prompts under its default template."""


@dataclass(frozen=True)
class FilterConfig:
    """Which generated user messages are kept."""

    min_words: int = 4
    """Fewer words: `too_short`."""
    max_words: int = 120
    """More words: `too_long`."""
    min_alnum: float = 0.6
    """Least share of letters and digits among the non-space characters (less: `garbage`)."""
    max_repeat: float = 0.5
    """Most share of the commonest word in a message of 8 words or more (more: `garbage`)."""
    near_duplicate: float = 0.7
    """Jaccard similarity of word shingles at or above which a message duplicates a kept one."""
    shingle_words: int = 3
    """Words per shingle for the near-duplicate test."""
    require_end: bool = True
    """Drop messages that did not close their turn within `max_new_tokens` (`unfinished`)."""


@dataclass(frozen=True)
class UserTurn:
    """Where a user message goes in the target's chat template."""

    prefix: str
    """Template text before the user's message (system turn included where the template adds one)."""
    end: str
    """Text that closes the user turn (ChatML: `<|im_end|>`); "" when the template has none."""
    prefix_ids: tuple[int, ...]
    """`prefix` as token ids: what the target is fed."""
    end_ids: tuple[int, ...]
    """The end-of-turn token when `end` is one token (generation stops at it), else ()."""


def user_turn(tokenizer, system: str | None = None) -> UserTurn:
    """The user-turn prefix and end-of-turn marker of the tokenizer's chat template: a one-message
    conversation (after a `system` message, if given) with a sentinel user message, rendered and cut
    at the sentinel."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("magpie needs a chat template: use an instruct (chat) model whose tokenizer has one")
    messages = [{"role": "user", "content": SENTINEL}]
    if system is not None:
        if not system.strip():
            raise ConfigError("the magpie system message is empty: give it text, or leave it out")
        messages.insert(0, {"role": "system", "content": system})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if text.count(SENTINEL) != 1:
        raise ConfigError(f"the chat template renders a user message {text.count(SENTINEL)} times, not once; "
                          "magpie needs a template that places the user message once")
    prefix, suffix = text.split(SENTINEL)
    end = suffix.split()[0] if suffix.split() else ""
    prefix_ids = tuple(tokenizer.encode(prefix, add_special_tokens=False))
    if not prefix_ids:
        raise ConfigError("the chat template puts nothing before the user message; magpie needs a user-turn prefix")
    end_ids = tuple(tokenizer.encode(end, add_special_tokens=False)) if end else ()
    return UserTurn(prefix, end, prefix_ids, end_ids if len(end_ids) == 1 else ())


def clean(text: str, end: str) -> str:
    """The message without what follows its end-of-turn marker, stripped."""
    if end and end in text:
        text = text[:text.index(end)]
    return text.strip()


def _printable(c: str) -> bool:
    cat = unicodedata.category(c)
    return c in "\n\t" or (cat[0] != "C" and c != "\ufffd")


def drop_reason(text: str, ended: bool, config: FilterConfig = FilterConfig(), specials: Sequence[str] = ()) -> str | None:
    """Why one message (cleaned) is dropped on its own, or None: empty, unfinished, garbage,
    too_short, too_long. `specials`: the tokenizer's special-token strings (leaked ones = garbage)."""
    if not text.strip():
        return "empty"
    if config.require_end and not ended:
        return "unfinished"
    chars = [c for c in text if not c.isspace()]
    words = normalise(text).split()
    top = Counter(words).most_common(1)[0][1] if words else 0
    if (not all(map(_printable, text)) or any(s and s in text for s in specials)
            or sum(c.isalnum() for c in chars) < config.min_alnum * len(chars)
            or (len(words) >= 8 and top > config.max_repeat * len(words))):
        return "garbage"
    if len(words) < config.min_words:
        return "too_short"
    if len(words) > config.max_words:
        return "too_long"
    return None


def jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def filter_prompts(items: Sequence[tuple[str, str, bool]], config: FilterConfig = FilterConfig(),
                   index: BenchmarkIndex | None = None, specials: Sequence[str] = ()
                   ) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """(id, text) of the kept messages in order, and the dropped count per reason (`DROP_REASONS`),
    from (id, cleaned text, ended) items. `index`: the benchmarks (`default_index` when None). An
    exact duplicate (same normalised text) or a near one (shingle Jaccard >= `near_duplicate`) of
    an earlier kept message is dropped."""
    dropped = dict.fromkeys(DROP_REASONS, 0)
    alone = [(pid, text, drop_reason(text, ended, config, specials)) for pid, text, ended in items]
    for _, _, reason in alone:
        if reason is not None:
            dropped[reason] += 1
    candidates = [(pid, text) for pid, text, reason in alone if reason is None]
    flagged = {m.index for m in find_contaminated([t for _, t in candidates], index)}
    dropped["benchmark"] = len(flagged)
    kept: list[tuple[str, str]] = []
    seen: set[str] = set()
    kept_shingles: list[set[str]] = []
    by_shingle: dict[str, list[int]] = {}
    for i, (pid, text) in enumerate(candidates):
        if i in flagged:
            continue
        norm = normalise(text)
        if norm in seen:
            dropped["duplicate"] += 1
            continue
        words = norm.split()
        mine = set(shingles(words, config.shingle_words)) or {norm}
        near = {j for sh in mine for j in by_shingle.get(sh, ())}
        if any(jaccard(mine, kept_shingles[j]) >= config.near_duplicate for j in near):
            dropped["near_duplicate"] += 1
            continue
        seen.add(norm)
        for sh in mine:
            by_shingle.setdefault(sh, []).append(len(kept_shingles))
        kept_shingles.append(mine)
        kept.append((pid, text))
    return kept, dropped


def manifest_path(out: Path) -> Path:
    """The manifest next to the prompt file: `<stem>.manifest.json`."""
    return out.with_name(f"{out.stem}.manifest.json")


def _settings_key(target_name: str, turn: UserTurn, config: MagpieConfig) -> str:
    """What a raw row depends on: not `count` (request i is seeded with seed + i), so a run stopped
    early can be finished with a smaller count, or a partial grown with a larger one."""
    settings = {k: v for k, v in asdict(config).items() if k != "count"}
    blob = json.dumps({"target": target_name, "prefix": turn.prefix, "config": settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _json_object(line: str) -> bool:
    """Whether `line` holds a JSON object (a line a crash damaged does not: it is dropped and redone)."""
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _resume(partial: Path, key: str) -> dict[str, dict]:
    """The raw rows of an earlier run with the same settings (a line cut by a kill is dropped)."""
    if not partial.is_file():
        partial.write_text(json.dumps({"settings": key}) + "\n", encoding="utf-8")
        return {}
    lines = complete_lines(partial, _json_object)
    if not lines or json.loads(lines[0]).get("settings") != key:
        raise ConfigError(f"{partial} was written with other settings (target, template or sampling): delete it "
                          "or rerun with the same settings")
    rows = (json.loads(ln) for ln in lines[1:])
    return {r["id"]: r for r in rows}


def generate_user_turns(target, tokenizer, turn: UserTurn, partial: Path, config: MagpieConfig, key: str,
                        progress: Callable[[int], None] | None = None) -> list[dict]:
    """Raw rows `{"id", "text", "ended"}` of `config.count` sampled user messages, appended to
    `partial` as they finish (resumed from it)."""
    from specula.engine import SpeculativeDecoder
    from specula.sampling import SamplingParams

    done = _resume(partial, key)
    if progress is not None and done:
        progress(len(done))
    ids = [f"m{i:06d}" for i in range(config.count)]
    eos = set(target.eos_token_ids) | set(turn.end_ids)
    decoder = SpeculativeDecoder(target, [], tokenizer, eos_token_ids=sorted(eos))
    specials = set(getattr(tokenizer, "all_special_ids", ()) or ()) | eos
    jobs = ((pid, list(turn.prefix_ids),
             SamplingParams(temperature=config.temperature, top_p=config.top_p, seed=config.seed + i,
                            max_new_tokens=config.max_new_tokens, stop=(turn.end,) if turn.end else ()))
            for i, pid in enumerate(ids) if pid not in done)
    with partial.open("a", encoding="utf-8") as sink:
        for pid, out in decoder.generate_many(jobs, config.batch_size):
            tokens = [t for t in out.token_ids if t not in specials]
            text = clean(tokenizer.decode(tokens, skip_special_tokens=True), turn.end)
            row = {"id": pid, "text": text, "ended": out.stats.finish_reason == "stop"}
            done[pid] = row
            sink.write(json.dumps(row, ensure_ascii=False) + "\n")
            sink.flush()
            if progress is not None:
                progress(1)
    return [done[pid] for pid in ids]


def synthesise(target, tokenizer, target_name: str, out: str | os.PathLike, config: MagpieConfig = MagpieConfig(),
               filters: FilterConfig = FilterConfig(), progress: Callable[[int], None] | None = None) -> dict:
    """Generate `config.count` user messages with `target`, filter them, write `out` (JSONL) and its
    manifest atomically; returns the manifest. Resumes from `<out>.partial`."""
    from specula.paths import atomic_path, atomic_write_json

    out = Path(out)
    if out.exists():
        raise ConfigError(f"{out} exists: delete it or choose another output file")
    if config.count <= 0:
        raise ConfigError(f"count must be a positive number of prompts, got {config.count}")
    turn = user_turn(tokenizer, config.system)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    rows = generate_user_turns(target, tokenizer, turn, partial, config, _settings_key(target_name, turn, config),
                               progress)
    specials = [s for s in getattr(tokenizer, "all_special_tokens", ()) or () if s]
    if turn.end:
        specials.append(turn.end)
    index = default_index()
    kept, dropped = filter_prompts([(r["id"], r["text"], r["ended"]) for r in rows], filters, index, specials)
    source = f"magpie:{target_name}"
    manifest = {
        "file": out.name,
        "prompts": len(kept),
        "sources": [{"source": source, "licence": f"generated by {target_name}; licence of the model",
                     "generated": len(rows), "kept": len(kept), "dropped": dropped}],
        "user_turn": {"prefix": turn.prefix, "end": turn.end},
        "sampling": asdict(config),
        "filters": asdict(filters),
        "contamination_rule": asdict(index.rule),
    }
    atomic_write_json(manifest_path(out), manifest)
    with atomic_path(out) as tmp:  # last: the prompt file's presence means the run is complete
        tmp.write_text("".join(json.dumps({"id": pid, "prompt": text, "source": source}, ensure_ascii=False) + "\n"
                               for pid, text in kept), encoding="utf-8")
    partial.unlink()
    return manifest


def drop_repeats(path: str | os.PathLike, earlier: Sequence[str | os.PathLike],
                 filters: FilterConfig = FilterConfig()) -> dict:
    """Remove from the prompt file `path` every prompt that repeats one of the `earlier` files
    (normalised exact, or a near duplicate by `filter_prompts`' shingle rule), so a new round of
    Magpie prompts adds only new ones; rewrites `path` and its manifest atomically (the counts
    under "repeats_of_earlier_files") and returns the manifest."""
    from specula.jsonl import json_lines
    from specula.paths import atomic_path, atomic_write_json
    from specula.training.corpus import read_prompts

    path = Path(path)
    rows = [json.loads(line) for line in json_lines(path.read_text(encoding="utf-8")) if line.strip()]
    old = [(f"old:{i}", text, True) for i, (_, text) in enumerate(read_prompts([Path(f) for f in earlier]))]
    new = [(f"new:{i}", row["prompt"], True) for i, row in enumerate(rows)]
    index = default_index()
    _, among_old = filter_prompts(old, filters, index)  # the earlier files' own repeats: not this file's
    kept, dropped = filter_prompts(old + new, filters, index)  # in order: old rows are decided as above
    keep = {int(pid.split(":")[1]) for pid, _ in kept if pid.startswith("new:")}
    manifest_file = manifest_path(path)
    manifest = json.loads(manifest_file.read_text(encoding="utf-8")) if manifest_file.is_file() else {"file": path.name}
    manifest["repeats_of_earlier_files"] = {
        "files": [Path(f).name for f in earlier], "dropped": len(rows) - len(keep),
        "duplicate_or_near": {k: dropped[k] - among_old[k] for k in ("duplicate", "near_duplicate")}}
    manifest["prompts"] = len(keep)
    atomic_write_json(manifest_file, manifest)
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for i, row in enumerate(rows) if i in keep),
                       encoding="utf-8")
    return manifest
