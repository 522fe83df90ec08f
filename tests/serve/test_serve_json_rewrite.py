"""JSON text rewritten as it is generated (`specula.serve.json_rewrite`): whatever the pieces, the text
written is json.dumps(json.loads(text), ensure_ascii=False) (a lone surrogate kept as its escape), and no
piece changes what an earlier one wrote; text json.loads refuses fails."""

from __future__ import annotations

import json
import random
import re

import pytest

from specula.serve.json_rewrite import JsonRewriter

GOOD = [
    '{"a": 1}', "[]", "{}", '[[],[{}], {"": ""}]', '"x"', "12", "  [1 , 2 ]\n", "-0",
    '{"n":[1,2.0,-0,1e5,1E400,-1.5e-3,0.10,12345678901234567890,true,false,null,NaN,Infinity,-Infinity],"b":{}}',
    r'["\n\"\\\/\b\f\r\t", "\u00e9\ud83d\ude00", "\ud83dx", "\ud83d\u0041", "\udc00", "\u0000\u001f\u007f"]',
    r'["\ud83d", "\ud83d\ud83d\ude00", "\ud83d\n", "é😀 \u2028"]',
]
BAD = ['{"a": 01}', "[1,]", '{"a" 1}', '{"a": tru}', r'"\x"', '"a\nb"', "[1] x", '{"a":1,}', r'"\u12g4"',
       "[-]", "[1.]", "[.5]", "[+1]", "{'a': 1}", "[1 2]", '{"a":1 "b":2}', "[1٣]", r'["\ud83d\u12g4"]', "[1e]",
       '{"a"}', "[", '{"a": [}', "\ufeff[]", "[1\u00a0]"]


def rewrite(pieces: list[str]) -> tuple[str | None, list[str]]:
    """(the text once all is read, or None where it failed or is not whole; the text after each piece)."""
    rewriter, seen = JsonRewriter(), []
    for piece in pieces:
        rewriter.feed(piece)
        seen.append(rewriter.text)
    rewriter.close()
    return (rewriter.text if rewriter.done else None), seen


def random_pieces(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def dumps(value) -> str:
    """json.dumps(value, ensure_ascii=False), a lone surrogate written as its escape (as ensure_ascii does)."""
    return re.sub("[\ud800-\udfff]", lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))


def check(text: str) -> None:
    try:
        expected = dumps(json.loads(text))
    except ValueError:
        expected = None
    rng = random.Random(text)
    for pieces in [[text], list(text)] + [random_pieces(rng, text) for _ in range(10)]:
        final, seen = rewrite(pieces)
        assert final == expected, pieces
        if expected is not None:
            assert all(expected.startswith(s) for s in seen), pieces  # written once, never rewritten


@pytest.mark.parametrize("text", GOOD + BAD)
def test_json_is_rewritten_as_json_dumps_writes_what_json_loads_reads(text):
    check(text)


@pytest.mark.parametrize("text, written", [
    (r'"\ud83d"', r'"\ud83d"'), (r'"\uD83Dx\uDC00"', r'"\ud83dx\udc00"'), (r'"\udc00\ud83d\ude00"', r'"\udc00😀"'),
    (r'{"\ud800": "é\ud83d"}', r'{"\ud800": "é\ud83d"}'), ('"\ud83d"', r'"\ud83d"'),  # the character itself
])
def test_a_lone_surrogate_stays_an_escape_so_the_text_is_utf8_and_reads_back_the_same(text, written):
    final, _ = rewrite(list(text))
    assert final == written and final.encode("utf-8") and json.loads(final) == json.loads(text)


def random_string(rng: random.Random) -> str:
    return "".join(rng.choice('ab"\\/\n\t\x01é😀\u2028 ') for _ in range(rng.randrange(6)))


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([0, -7, 10**20, 0.5, -1e-7, 1e300, True, False, None])
    if kind in (1, 2, 3):
        return random_string(rng)
    if kind in (4, 5):
        return {random_string(rng): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def test_random_json_in_any_layout_is_rewritten_as_json_dumps_writes_it():
    """Values written with and without indentation, ASCII escapes and spaces: the same text comes out."""
    rng = random.Random(0)
    for _ in range(200):
        value = random_value(rng)
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 0, 2]),
                          separators=rng.choice([None, (",", ":"), (" ,", " : ")]))
        check(text)


def test_the_listener_hears_where_each_value_lies():
    heard = []
    rewriter = JsonRewriter(lambda event, path, offset, kind: heard.append((event, path, offset, kind)))
    rewriter.feed('{"a": [1, {"b": "x"}], "c": tru')
    rewriter.feed("e}")
    assert rewriter.text == '{"a": [1, {"b": "x"}], "c": true}' and rewriter.done
    starts = {path: offset for event, path, offset, _ in heard if event == "start"}
    ends = {path: offset for event, path, offset, _ in heard if event == "end"}
    assert {path: rewriter.text[starts[path]:ends[path]] for path in starts} == {
        (): rewriter.text, ("a",): '[1, {"b": "x"}]', ("a", 0): "1", ("a", 1): '{"b": "x"}', ("a", 1, "b"): '"x"',
        ("c",): "true"}
    assert [kind for event, _, _, kind in heard if event == "start"] == ["{", "[", "s", "{", '"', "s"]


@pytest.mark.parametrize("text, read, fails", [
    ('{"a": 1} ; {"b": 2}', 8, True), ('[1, [2]]]', 8, True), ('{"a": "}"}x', 10, True), ("  {} ", 4, False),
    ('{"a": ', 6, False), ("[1 2]", 4, True),  # not whole yet; failed at the 2
])
def test_read_stops_where_the_root_value_ends(text, read, fails):
    """`read` takes the text up to the root value's end (or where it failed) and says how far: what follows
    is the caller's (llama3_json's `;` and next call), not a failure; `feed` fails on it as json.loads does."""
    for pieces in ([text], list(text)):
        rewriter, taken = JsonRewriter(), 0
        for piece in pieces:
            taken += rewriter.read(piece)
        assert taken == read, pieces
    fed = JsonRewriter()
    fed.feed(text)
    assert fed.failed == fails
