"""Benchmark contamination: which training prompts are (or contain) a benchmark's prompt.

A head must never train on what it is measured on, so the training corpus refuses any prompt
that matches a turn of a known benchmark. The known benchmarks ship with specula and are read
offline: Spec-Bench (`specula/data/spec_bench/question.jsonl`, 480 questions; ids 81-160 are
MT-bench's), and the bench's own prompt sets `specula/data/everyday/prompts.jsonl` and
`specula/data/structured/prompts.jsonl`.

The rule, on a normalised form of both sides (`normalise`: Unicode NFKC, case-folded, every
punctuation or symbol character replaced by a space, whitespace collapsed):

* **exact**: the prompt's normalised text equals a benchmark turn's;
* **shared passage**: the prompt contains `shingle_words` (12) consecutive words that also occur
  consecutively in a benchmark turn. Shingles that occur in `boilerplate_prompts` (3) or more
  different benchmark prompts are the benchmark's template text (a shared instruction), not its
  content, and do not count;
* **contained turn**: a turn of `contained_words` (4) to 11 words (most of Spec-Bench's qa
  questions) inside the prompt, whole ("Question: <turn> Answer in one sentence."), unless it is
  template text by the same count; turns of fewer words match only exactly.

Everything here is pure but `known_benchmarks` (which reads the shipped files) and the cached
`default_index` built from them.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from specula.jsonl import json_lines

DATA = Path(__file__).resolve().parents[1] / "data"

BENCHMARK_FILES: tuple[tuple[str, Path, str], ...] = (
    ("Spec-Bench", DATA / "spec_bench" / "question.jsonl", "question_id"),
    ("specula everyday bench set", DATA / "everyday" / "prompts.jsonl", "id"),
    ("specula structured bench set", DATA / "structured" / "prompts.jsonl", "id"),
)
"""(name, JSONL file with `turns`, id field) of every benchmark a training prompt is checked against."""

MT_BENCH_IDS = range(81, 161)
"""Spec-Bench question ids that are MT-bench's 80 questions."""


@dataclass(frozen=True)
class ContaminationRule:
    """When a prompt counts as a benchmark's."""

    shingle_words: int = 12
    """Consecutive (normalised) words a prompt must share with a benchmark turn to match it."""
    boilerplate_prompts: int = 3
    """A shingle found in this many different benchmark prompts is template text and ignored."""
    contained_words: int = 4
    """A turn shorter than `shingle_words` words, but of at least this many, matches a prompt that
    contains it whole (a short question with an instruction around it); shorter turns match only
    exactly."""


@dataclass(frozen=True)
class BenchmarkPrompt:
    """One turn of one benchmark prompt."""

    benchmark: str
    """The benchmark's name (`BENCHMARK_FILES`)."""
    id: str
    """The prompt's id in the benchmark (Spec-Bench: the question id)."""
    text: str
    """The turn's text, as the benchmark has it."""

    @property
    def label(self) -> str:
        """How an error names it: "Spec-Bench question 81 (MT-bench)"."""
        if self.benchmark == "Spec-Bench":
            mt = " (MT-bench)" if self.id.isdigit() and int(self.id) in MT_BENCH_IDS else ""
            return f"Spec-Bench question {self.id}{mt}"
        return f"{self.benchmark} prompt {self.id}"


@dataclass(frozen=True)
class Match:
    """A prompt found to be a benchmark's."""

    index: int
    """Position of the prompt in the texts checked."""
    prompt: BenchmarkPrompt
    """The benchmark turn it matches."""
    kind: str
    """"exact" (same normalised text) or "passage" (a shared run of `shingle_words` words)."""
    passage: str
    """The shared normalised text (the whole turn, or the first shared shingle)."""


@dataclass(frozen=True)
class BenchmarkIndex:
    """Benchmark turns indexed for `find_contaminated` (build with `build_index`)."""

    rule: ContaminationRule
    """The rule the index was built for."""
    exact: dict[str, BenchmarkPrompt] = field(repr=False)
    """Normalised turn text -> its benchmark turn."""
    shingles: dict[str, BenchmarkPrompt] = field(repr=False)
    """Content shingle (normalised words joined by spaces) -> a benchmark turn holding it."""
    short: dict[str, BenchmarkPrompt] = field(default_factory=dict, repr=False)
    """Normalised text of a turn of `contained_words` to `shingle_words` - 1 words (not template
    text) -> its benchmark turn: matched anywhere inside a prompt."""


_SPACES = re.compile(r"\s+")


def normalise(text: str) -> str:
    """Case-folded NFKC text with invisible format characters (soft hyphens, zero-width spaces and
    joiners: category Cf) removed, punctuation and symbols replaced by spaces, whitespace collapsed.
    (A format character read as a space split a word in two: one every few words hid a benchmark
    turn from every shingle.)"""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = "".join("" if (cat := unicodedata.category(c)) == "Cf" else " " if cat[0] in "PSZC" else c for c in text)
    return _SPACES.sub(" ", text).strip()


def shingles(words: Sequence[str], n: int) -> list[str]:
    """Every run of `n` consecutive words, joined by single spaces (none when fewer words)."""
    return [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]


def build_index(prompts: Iterable[BenchmarkPrompt], rule: ContaminationRule = ContaminationRule()) -> BenchmarkIndex:
    """Index benchmark turns: their normalised texts, and their content shingles (those found in
    fewer than `rule.boilerplate_prompts` different benchmark prompts)."""
    exact: dict[str, BenchmarkPrompt] = {}
    owner: dict[str, BenchmarkPrompt] = {}
    holders: dict[str, set[tuple[str, str]]] = {}
    prompts_seen = list(prompts)
    for prompt in prompts_seen:
        norm = normalise(prompt.text)
        if not norm:
            continue
        exact.setdefault(norm, prompt)
        for sh in shingles(norm.split(), rule.shingle_words):
            owner.setdefault(sh, prompt)
            holders.setdefault(sh, set()).add((prompt.benchmark, prompt.id))
    content = {sh: p for sh, p in owner.items() if len(holders[sh]) < rule.boilerplate_prompts}
    turn_holders: dict[str, set[tuple[str, str]]] = {}
    for prompt in prompts_seen:
        turn_holders.setdefault(normalise(prompt.text), set()).add((prompt.benchmark, prompt.id))
    short = {norm: p for norm, p in exact.items()
             if rule.contained_words <= len(norm.split()) < rule.shingle_words
             and len(turn_holders[norm]) < rule.boilerplate_prompts}
    return BenchmarkIndex(rule, exact, content, short)


def find_contaminated(texts: Sequence[str], index: BenchmarkIndex | None = None) -> list[Match]:
    """The texts that are a benchmark's prompt (exact, or sharing a passage), one `Match` each
    (the first found), in order. `index`: the shipped benchmarks (`default_index`) when None."""
    index = default_index() if index is None else index
    n = index.rule.shingle_words
    found: list[Match] = []
    for i, text in enumerate(texts):
        norm = normalise(text)
        hit = index.exact.get(norm)
        if hit is not None:
            found.append(Match(i, hit, "exact", norm))
            continue
        words = norm.split()
        hit = next(((index.shingles[sh], sh) for sh in shingles(words, n) if sh in index.shingles), None)
        if hit is None and index.short:
            runs = (sh for k in range(index.rule.contained_words, n) for sh in shingles(words, k))
            hit = next(((index.short[sh], sh) for sh in runs if sh in index.short), None)
        if hit is not None:
            found.append(Match(i, hit[0], "passage", hit[1]))
    return found


def read_benchmark(name: str, path: Path, id_field: str) -> list[BenchmarkPrompt]:
    """Every turn of every prompt of one benchmark JSONL file (`turns`: [str, ...] per line)."""
    out = []
    for n, line in enumerate(json_lines(path.read_text(encoding="utf-8")), 1):
        if line.strip():
            row = json.loads(line)
            out += [BenchmarkPrompt(name, str(row.get(id_field, n)), t) for t in row["turns"] if isinstance(t, str)]
    return out


def known_benchmarks() -> list[BenchmarkPrompt]:
    """The turns of every benchmark in `BENCHMARK_FILES`."""
    return [p for name, path, id_field in BENCHMARK_FILES for p in read_benchmark(name, path, id_field)]


@functools.cache
def default_index() -> BenchmarkIndex:
    """The shipped benchmarks, indexed with the default rule (built once per process)."""
    return build_index(known_benchmarks())
