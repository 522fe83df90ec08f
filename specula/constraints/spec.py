"""What a request constrains its output to: a JSON value, a JSON schema, a regex or a grammar.

A `Constraint` is plain data (hashable, checkable before any model loads); `Constraint.grammar()`
turns it into the grammar text of llguidance, the library that matches it (see
`specula.constraints.matcher`). Why llguidance: docs/structured.md compares it with xgrammar and
outlines-core.

JSON is generated in one fixed layout unless a schema says otherwise ("x-guidance" options):
`{"key": value, "key": value}` with `": "` and `", "` separators and no other whitespace, the
layout Python's `json.dumps` writes and models copy. Whitespace the grammar allows freely is
whitespace a small model may repeat without end; and with a fixed layout the grammar alone decides
many tokens (keys, quotes, separators), which enter the draft tree for free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from specula.errors import ConfigError

ConstraintKind = Literal["json", "json_schema", "regex", "grammar"]

JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
"""llguidance's JSON options used unless a schema sets its own "x-guidance"."""

REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")
"""The characters a literal escapes in a (Rust) regex: the set `regex_syntax::escape` escapes."""


class ConstraintError(ConfigError):
    """A schema, regex or grammar that cannot be compiled; the message says why."""


@dataclass(frozen=True)
class Constraint:
    """The output of one request must match this (the target's distribution is masked to it)."""

    kind: ConstraintKind
    """json: any JSON object; json_schema: a JSON schema; regex: a regular expression (Rust regex
    syntax, whole output); grammar: a Lark or GBNF (llama.cpp) context-free grammar."""
    text: str = ""
    """The schema (JSON text), regex or grammar; empty for `json`."""

    def __post_init__(self) -> None:
        if self.kind not in ("json", "json_schema", "regex", "grammar"):
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; use json, json_schema, regex or grammar")
        if not isinstance(self.text, str):
            raise ConstraintError(f"the {self.kind.replace('_', ' ')} constraint must be text, got "
                                  f"{type(self.text).__name__}")
        if self.kind != "json" and not self.text.strip():
            raise ConstraintError(f"the {self.kind.replace('_', ' ')} constraint is empty: give its text")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ConstraintError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def json(cls) -> "Constraint":
        """Any JSON object."""
        return cls("json")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Constraint":
        """A JSON schema, as a dict or JSON text."""
        if isinstance(schema, str):
            schema = json.loads(cls("json_schema", schema).text)  # checked there; written again below
        if not isinstance(schema, dict):
            raise ConstraintError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema)  # key order kept: properties come out in schema order
        except (TypeError, ValueError) as exc:
            raise ConstraintError(f"the JSON schema cannot be written as JSON: {exc}") from None
        return cls("json_schema", text)

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> "Constraint":
        """Exactly one of `options` (vLLM's `guided_choice`): a regex of the options, escaped."""
        if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
            raise ConstraintError(f"a choice needs a list of non-empty strings, got {options!r}")
        return cls("regex", "|".join("".join("\\" + c if c in REGEX_META else c for c in o) for o in options))

    @classmethod
    def grammar(cls, text: str) -> "Constraint":
        """A Lark grammar (llguidance's dialect) or a GBNF grammar (llama.cpp's)."""
        return cls("grammar", text)

    @classmethod
    def from_response_format(cls, response_format: dict | None) -> "Constraint | None":
        """OpenAI's `response_format`: {"type": "text"} (None), {"type": "json_object"} or
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise ConstraintError("response_format must be an object with a \"type\"")
        kind = response_format.get("type")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return cls.json()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ConstraintError("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                                      "\"schema\": {...}}}")
            return cls.json_schema(spec["schema"])
        raise ConstraintError(f"unknown response_format type {kind!r}; use text, json_object or json_schema")

    # ------------------------------------------------------------------ grammar
    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output follows (json: any object), or None for regex/grammar."""
        if self.kind == "json":
            return {"type": "object"}
        if self.kind == "json_schema":
            return json.loads(self.text)
        return None

    def grammar_text(self) -> str:
        """llguidance's grammar for this constraint, checked (without a tokenizer): ConstraintError
        with the library's reason, on one line, when it cannot be compiled."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        schema = self.schema
        try:
            if schema is not None:
                schema = {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}
                grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
            elif self.kind == "regex":
                grammar = LLMatcher.grammar_from_regex(self.text)
            else:
                grammar = LLMatcher.grammar_from_lark(any_to_lark(self.text))
        except Exception as exc:  # the library and the GBNF converter raise assorted error types
            raise ConstraintError(f"cannot compile the {self.label}: {_one_line(str(exc))}") from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise ConstraintError(f"cannot compile the {self.label}: {_one_line(' '.join(messages))}")
        return grammar

    @property
    def label(self) -> str:
        """What the user gave: "JSON schema", "regex", "grammar" or "JSON object"."""
        return {"json": "JSON object", "json_schema": "JSON schema", "regex": "regex", "grammar": "grammar"}[self.kind]

    def describe(self) -> str:
        """One line for logs and reports."""
        if self.kind == "json":
            return "any JSON object"
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return f"{self.kind.replace('_', ' ')} {text}"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def as_constraint(value: "Constraint | dict | str | None") -> Constraint | None:
    """The API's spellings of a constraint: a `Constraint`, a dict (a JSON schema), "json" (any
    JSON object) or None."""
    if value is None or isinstance(value, Constraint):
        return value
    if isinstance(value, dict):
        return Constraint.json_schema(value)
    if value == "json":
        return Constraint.json()
    raise ConstraintError(f"constraint {value!r}: give a Constraint (Constraint.regex(...), Constraint.grammar(...)), "
                          "a JSON schema dict, or \"json\"")
