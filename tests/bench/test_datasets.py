"""Prompt sets: Spec-Bench grouping, seeded selection, custom JSONL and its validation errors."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from specula.bench.datasets import SPEC_BENCH_ORDER, load_prompts, parse_categories, parse_prompts, select_prompts
from specula.errors import ConfigError


@pytest.fixture(scope="module")
def spec_bench():
    return load_prompts("spec-bench")


def test_spec_bench_groups(spec_bench):
    assert len(spec_bench) == 480
    assert Counter(p.category for p in spec_bench) == {c: 80 for c in SPEC_BENCH_ORDER}
    mt = [p for p in spec_bench if p.category == "mt_bench"]
    assert sorted(p.id for p in mt) == list(range(81, 161))
    assert all(len(p.turns) == 2 for p in mt)
    assert {p.source_category for p in mt} == {
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    assert all(len(p.turns) == 1 for p in spec_bench if p.category != "mt_bench")


def test_selection_is_seeded_interleaved_and_prefix_stable(spec_bench):
    two = select_prompts(spec_bench, per_category=2, seed=0)
    assert [p.category for p in two] == list(SPEC_BENCH_ORDER) * 2  # interleaved across categories
    assert [p.id for p in two] == [p.id for p in select_prompts(spec_bench, per_category=2, seed=0)]
    other = select_prompts(spec_bench, per_category=2, seed=1)
    assert [p.id for p in other] != [p.id for p in two]
    five = select_prompts(spec_bench, per_category=5, seed=0)
    for category in SPEC_BENCH_ORDER:  # --per-category 2 is a prefix of --per-category 5
        assert [p.id for p in two if p.category == category] == [p.id for p in five if p.category == category][:2]
    # A seeded shuffle, not the file order.
    assert [p.id for p in five if p.category == "translation"] != list(range(161, 166))
    assert len(select_prompts(spec_bench)) == 480


def test_category_filter_and_errors(spec_bench):
    chosen = select_prompts(spec_bench, per_category=3, categories=["rag", "qa"], seed=0)
    assert [p.category for p in chosen] == ["rag", "qa"] * 3
    with pytest.raises(ConfigError, match="^categories= names an unknown category 'writing'; choose from: mt_bench, transl"):
        select_prompts(spec_bench, categories=["writing"])
    with pytest.raises(ConfigError, match="^categories= names no category; pass one or more of: mt_bench, trans"):
        select_prompts(spec_bench, categories=[])  # was every category
    with pytest.raises(ConfigError, match="^per_category must be >= 1, got 0$"):  # the keyword; bench: the flag
        select_prompts(spec_bench, per_category=0)


@pytest.mark.parametrize("values", ["rag,qa", "rag, qa", "rag qa,rag", ["rag", "qa"], ["rag,", " qa", "rag"]])
def test_categories_are_read_from_commas_or_spaces_in_the_order_given(values):
    assert parse_categories(values, SPEC_BENCH_ORDER) == ["rag", "qa"]


@pytest.mark.parametrize("values, message", [
    ("", "^categories= names no category; pass one or more of: mt_bench, translation, summarization, qa"),
    ([",", " "], "^categories= names no category"),
    ("rag,writing,code", "^categories= names unknown categories 'writing', 'code'; choose from: mt_bench, trans"),
])
def test_categories_refuse_none_and_unknown_names_listing_the_valid_ones(values, message):
    with pytest.raises(ConfigError, match=message):
        parse_categories(values, SPEC_BENCH_ORDER)


def test_custom_jsonl(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"id": "a1", "category": "code", "turns": ["write a loop", "now in C"]},
        {"question_id": 7, "category": "chat", "turns": ["hello"]},
        {"id": "x", "turns": "one string turn"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    prompts = load_prompts(str(path))
    assert [(p.id, p.category, p.turns) for p in prompts] == [
        ("a1", "code", ("write a loop", "now in C")), (7, "chat", ("hello",)), ("x", "custom", ("one string turn",))]
    # Custom categories are kept as written (no Spec-Bench grouping), in first-appearance order.
    assert [p.category for p in select_prompts(prompts, per_category=1)] == ["code", "chat", "custom"]


def test_a_prompt_holding_a_line_separator_reads_whole(tmp_path):
    """U+2028 / U+2029 / U+0085 inside a JSON string (written raw by ensure_ascii=False) split the
    line in two, refused as not JSON; a byte-order mark is dropped."""
    path = tmp_path / "mine.jsonl"
    turns = ["one\u2028two", "three\u2029four\u0085five"]
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps({"id": "a", "turns": turns}, ensure_ascii=False) + "\n").encode())
    assert [p.turns for p in load_prompts(str(path))] == [tuple(turns)]


@pytest.mark.parametrize("lines, message", [
    (['{"id": 1, "turns": ["a"]}', '{"id": 2, "turns": ["b"]', '{"id": 3, "turns": ["c"]}'],
     r"line 2: not valid JSON"),
    (['{"id": 1, "turns": ["a"]}', '["not", "an", "object"]'], r"line 2: expected a JSON object"),
    (['{"id": 1, "category": "c"}'], r"line 1: 'turns' must be a non-empty list"),
    (['{"id": 1, "turns": []}'], r"line 1: 'turns' must be a non-empty list"),
    (['{"id": 1, "turns": ["ok", 3]}'], r"line 1: 'turns' must be a non-empty list"),
    (['{"category": "c", "turns": ["a"]}'], r"line 1: missing or invalid 'id'"),
    (['{"id": 1, "turns": ["a"]}', '', '{"id": 1, "turns": ["b"]}'], r"line 3: duplicate id 1 \(first on line 1\)"),
    (['', '  '], r"holds no prompts"),
])
def test_validation_errors_name_the_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=message):
        load_prompts(str(path))


def test_missing_file():
    with pytest.raises(ConfigError, match="not found; give source= one of spec-bench, everyday, structured or a JSONL file$"):
        load_prompts("/nonexistent/prompts.jsonl")


def test_a_directory_is_named_as_one_not_as_missing(tmp_path):
    with pytest.raises(ConfigError, match="is a directory; give source= one of "):
        load_prompts(str(tmp_path))


def test_parse_prompts_groups_mapping():
    prompts = parse_prompts(['{"id": 1, "category": "writing", "turns": ["x"]}'], groups={"writing": "mt_bench"})
    assert prompts[0].category == "mt_bench" and prompts[0].source_category == "writing"


def test_everyday_prompts_are_shipped():
    prompts = load_prompts("everyday")
    assert len(prompts) >= 20
    assert {p.category for p in prompts} == {"chat", "instructions", "code", "math"}
    assert all(p.turns and p.turns[0].strip() for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)


def test_structured_prompts_carry_schemas_that_compile():
    prompts = load_prompts("structured")
    assert len(prompts) >= 24
    assert {p.category for p in prompts} == {"extraction", "function_call", "records", "nested", "classification"}
    for p in prompts:
        assert p.schema is not None
        p.constraint.grammar_text()  # every schema compiles


def test_a_schema_must_be_an_object():
    with pytest.raises(ConfigError, match="'schema' must be a JSON schema object"):
        parse_prompts(['{"id": 1, "turns": ["x"], "schema": "string"}'])
