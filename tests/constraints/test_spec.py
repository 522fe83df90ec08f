"""Constraint spellings and their errors (no model, no tokenizer)."""

from __future__ import annotations

import json

import pytest

from specula.constraints import Constraint, ConstraintError, as_constraint


def test_constructors_and_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert Constraint.json_schema(schema) == Constraint.json_schema(json.dumps(schema))
    assert Constraint.json_schema(schema).schema == schema
    assert Constraint.json().schema == {"type": "object"}
    assert Constraint.from_response_format(None) is None
    assert Constraint.from_response_format({"type": "text"}) is None
    assert Constraint.from_response_format({"type": "json_object"}) == Constraint.json()
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert Constraint.from_response_format(rf) == Constraint.json_schema(schema)
    assert as_constraint(schema) == Constraint.json_schema(schema)
    assert as_constraint("json") == Constraint.json()
    assert as_constraint(None) is None


@pytest.mark.parametrize("make, words", [
    (lambda: Constraint.regex("a(b").grammar_text(), "unclosed group"),
    (lambda: Constraint.json_schema({"type": "objekt"}).grammar_text(), "objekt"),
    (lambda: Constraint.json_schema("{not json").grammar_text(), "not valid JSON"),
    (lambda: Constraint.grammar("start: foo").grammar_text(), "unknown name"),
    (lambda: Constraint.from_response_format({"type": "xml"}), "json_object"),
    (lambda: Constraint.from_response_format({"type": "json_schema"}), "schema"),
    (lambda: Constraint.regex(""), "empty"),
    (lambda: as_constraint("yaml"), "Constraint.regex"),
    (lambda: Constraint("json_schema", "not json"), "not valid JSON"),
    (lambda: Constraint("json_schema", "[1, 2]"), "must be a JSON object"),
    (lambda: as_constraint({"enum": {1, 2}}), "cannot be written as JSON"),
    (lambda: Constraint.choice("yes"), "list of non-empty strings"),
    (lambda: Constraint.choice(["a", ""]), "list of non-empty strings"),
])
def test_bad_constraints_fail_on_one_line_naming_the_problem(make, words):
    with pytest.raises(ConstraintError) as err:
        make()
    assert words in str(err.value)
    assert "\n" not in str(err.value)


def test_json_is_compact_unless_the_schema_says_otherwise():
    text = Constraint.json_schema({"type": "object"}).grammar_text()
    assert '"whitespace_flexible":false' in text.replace(" ", "")
    loose = Constraint.json_schema({"type": "object", "x-guidance": {"whitespace_flexible": True}}).grammar_text()
    assert '"whitespace_flexible":true' in loose.replace(" ", "")


def test_gbnf_grammars_are_read_too():
    assert Constraint.grammar('root ::= "yes" | "no"').grammar_text()


def test_a_choice_matches_each_option_exactly_whatever_characters_it_holds():
    from llguidance import LLMatcher

    options = ["yes", "no (1.5)", "a|b", "[x]-{y}^$.*+?#&~\\"]
    grammar = Constraint.choice(options).grammar_text()
    assert LLMatcher.validate_grammar_with_warnings(grammar)[0] is False
    import re

    pattern = Constraint.choice(options).text  # Rust regex syntax; these escapes read the same in Python's
    assert all(re.fullmatch(pattern, o) for o in options)
    assert not any(re.fullmatch(pattern, o) for o in ("ye", "no 1.5", "a", "b", "[x]-{y}"))
