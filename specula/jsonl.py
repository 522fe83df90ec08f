"""JSONL text split into its lines."""

from __future__ import annotations


def json_lines(text: str, keepends: bool = False) -> list[str]:
    """The lines of a JSONL text: split at "\n" only (a "\r" before it dropped unless `keepends`).
    `str.splitlines` also splits at U+2028, U+2029, U+0085 and other separators that JSON strings
    hold raw (`json.dumps(ensure_ascii=False)` writes them so), cutting such a line in two."""
    lines = text.split("\n")
    if keepends:
        return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
    return [line.removesuffix("\r") for line in (lines[:-1] if not lines[-1] else lines)]
