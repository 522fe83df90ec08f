"""Benchmark prompts: Spec-Bench (shipped) or a custom JSONL file, in a fixed seeded order.

Spec-Bench (Xia et al. 2024, https://github.com/hemingkx/Spec-Bench, Apache-2.0, see
`specula/data/spec_bench/LICENSE`) holds 480 prompts in six groups of 80. Its file labels the
MT-bench questions (ids 81-160, two turns each) by their MT-bench category (writing, roleplay,
reasoning, math, coding, extraction, stem, humanities); the bench reports them as one group,
`mt_bench`, like Spec-Bench does. The other groups keep their file names: translation,
summarization, qa, math_reasoning, rag.

A custom JSONL file has one object per line: `id` (or `question_id`), `turns` (a list of
user messages; later turns are asked after the model's own answer to the earlier ones) and
an optional `category` (default "custom"). Blank lines are skipped.

Selection: within each category the prompts are shuffled with a seed derived from
(`seed`, category) and the first N are kept; the kept prompts are then interleaved across
categories (1st of each category, 2nd of each, ...), so an interrupted run covers every
category and `--per-category 2` is a prefix of `--per-category 10` for the same seed.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Sequence

from specula.errors import ConfigError
from specula.jsonl import json_lines

SPEC_BENCH = "spec-bench"
"""Name of the shipped Spec-Bench prompt set (as given to `--prompts`)."""
EVERYDAY = "everyday"
"""Name of the shipped set of 24 everyday prompts (chat, instructions, code, math) written for specula,
so speed claims are checked on prompts that are not Spec-Bench (`specula/data/everyday/README.md`)."""

STRUCTURED = "structured"
"""Name of the shipped set of structured-output prompts written for specula: each asks for JSON and
carries the JSON schema its output is constrained to (`specula/data/structured/README.md`)."""

SPEC_BENCH_GROUPS: dict[str, str] = {
    **{c: "mt_bench" for c in (
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
    )},
    "translation": "translation",
    "summarization": "summarization",
    "qa": "qa",
    "math_reasoning": "math_reasoning",
    "rag": "rag",
}
"""Spec-Bench file category -> reported group."""

SPEC_BENCH_ORDER = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
"""Group order of the Spec-Bench paper's tables."""


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt (one conversation)."""

    id: int | str
    """Question id as given in the file (Spec-Bench: question_id)."""
    category: str
    """Reported group (Spec-Bench MT-bench categories become `mt_bench`)."""
    turns: tuple[str, ...]
    """User messages; turn k > 1 follows the model's own answers to turns 1..k-1."""
    source_category: str
    """The category as written in the file."""
    schema: dict | None = None
    """A JSON schema every turn's output is constrained to (the row's optional `schema`), or None."""

    @property
    def constraint(self):
        """The `Constraint` of `schema` (None: free text)."""
        from specula.constraints import Constraint

        return None if self.schema is None else Constraint.json_schema(self.schema)


def _parse_line(text: str, lineno: int, origin: str) -> dict:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{origin} line {lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                          "each line must be one JSON object") from exc
    if not isinstance(row, dict):
        raise ConfigError(f"{origin} line {lineno}: expected a JSON object with id, category and turns, "
                          f"got {type(row).__name__}")
    return row


def _prompt_from_row(row: dict, lineno: int, origin: str, groups: dict[str, str] | None) -> BenchPrompt:
    where = f"{origin} line {lineno}"
    pid = row.get("id", row.get("question_id"))
    if pid is None or isinstance(pid, bool) or not isinstance(pid, (int, str)) or pid == "":
        raise ConfigError(f"{where}: missing or invalid 'id' (give a string or integer id per prompt)")
    turns = row.get("turns")
    if isinstance(turns, str):
        turns = [turns]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ConfigError(f"{where}: 'turns' must be a non-empty list of non-empty strings (the user messages)")
    category = row.get("category", "custom")
    if not isinstance(category, str) or not category.strip():
        raise ConfigError(f"{where}: 'category' must be a non-empty string")
    group = groups.get(category, category) if groups is not None else category
    schema = row.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise ConfigError(f"{where}: 'schema' must be a JSON schema object (or absent)")
    return BenchPrompt(pid, group, tuple(turns), category, schema)


def parse_prompts(lines: Sequence[str], origin: str = "prompts", groups: dict[str, str] | None = None) -> list[BenchPrompt]:
    """Prompts from JSONL lines (validated; errors name the line). `groups` maps file categories
    to reported groups (None: keep the file's categories)."""
    prompts: list[BenchPrompt] = []
    seen: dict[int | str, int] = {}
    for lineno, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        prompt = _prompt_from_row(_parse_line(text, lineno, origin), lineno, origin, groups)
        if prompt.id in seen:
            raise ConfigError(f"{origin} line {lineno}: duplicate id {prompt.id!r} (first on line {seen[prompt.id]})")
        seen[prompt.id] = lineno
        prompts.append(prompt)
    if not prompts:
        raise ConfigError(f"{origin} holds no prompts; give one JSON object per line with id, category and turns")
    return prompts


def load_prompts(source: str = SPEC_BENCH) -> list[BenchPrompt]:
    """The shipped Spec-Bench prompts (`"spec-bench"`), the shipped everyday prompts (`"everyday"`),
    or those of a JSONL file. Its errors name `source=` (`specula bench` and `analyze` show `--prompts`:
    `commands.common.PROMPTS_SPELLING`)."""
    if source == SPEC_BENCH:
        text = resources.files("specula").joinpath("data/spec_bench/question.jsonl").read_text(encoding="utf-8")
        return parse_prompts(json_lines(text), "spec-bench question.jsonl", SPEC_BENCH_GROUPS)
    if source in (EVERYDAY, STRUCTURED):
        text = resources.files("specula").joinpath(f"data/{source}/prompts.jsonl").read_text(encoding="utf-8")
        return parse_prompts(json_lines(text), f"{source} prompts.jsonl")
    path = Path(source).expanduser()
    if not path.is_file():
        problem = "is a directory" if path.is_dir() else "not found"
        raise ConfigError(f"prompts file {source!r} {problem}; give source= one of spec-bench, everyday, structured "
                          "or a JSONL file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is not JSON
    except UnicodeDecodeError as exc:
        raise ConfigError(f"prompts file {source!r} is not UTF-8 text ({exc.reason})") from exc
    return parse_prompts(json_lines(text), str(path))


def categories_of(prompts: Sequence[BenchPrompt]) -> list[str]:
    """Categories in report order: Spec-Bench's order first, then by first appearance."""
    present = list(dict.fromkeys(p.category for p in prompts))
    known = [c for c in SPEC_BENCH_ORDER if c in present]
    return known + [c for c in present if c not in known]


def parse_categories(values: str | Sequence[str], available: Sequence[str]) -> list[str]:
    """`select_prompts`' `categories=` (`--categories` of `specula bench` and `specula analyze`): group names
    separated by commas and / or spaces, in one argument or several ("rag,qa", "rag qa", "rag, qa"), in the order
    given, repeats dropped. ConfigError naming `categories=` (the commands show their flag) and the valid names
    (`available`) for none, or for a name not there."""
    given = [values] if isinstance(values, str) else values
    names = list(dict.fromkeys(n for value in given for n in re.split(r"[,\s]+", value) if n))
    if not names:
        raise ConfigError(f"categories= names no category; pass one or more of: {', '.join(available)} "
                          "(or leave it out for all)")
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ConfigError(f"categories= names {'an unknown category' if len(unknown) == 1 else 'unknown categories'} "
                          f"{', '.join(map(repr, unknown))}; choose from: {', '.join(available)}")
    return names


def select_prompts(
    prompts: Sequence[BenchPrompt],
    per_category: int | None = None,
    categories: Sequence[str] | None = None,
    seed: int = 0,
) -> list[BenchPrompt]:
    """Seeded shuffle within each category, first `per_category` (all when None), interleaved
    across categories. `categories` (as `parse_categories` reads them) restricts and orders the groups."""
    if per_category is not None and per_category < 1:
        raise ConfigError(f"per_category must be >= 1, got {per_category}")
    available = categories_of(prompts)
    chosen = available if categories is None else parse_categories(categories, available)
    columns: list[list[BenchPrompt]] = []
    for category in chosen:
        items = [p for p in prompts if p.category == category]
        random.Random(f"specula-bench:{seed}:{category}").shuffle(items)
        columns.append(items[:per_category] if per_category is not None else items)
    ordered: list[BenchPrompt] = []
    for row in range(max((len(c) for c in columns), default=0)):
        ordered.extend(column[row] for column in columns if row < len(column))
    return ordered
