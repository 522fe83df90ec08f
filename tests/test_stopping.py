"""Stop strings (OpenAI's rule: not returned) and incremental text, as the engine streams them."""

from __future__ import annotations

import random

import pytest

from specula.stopping import StopTrimmer, TextStream, cut_at_stop


def _stream(text: str, stops: tuple[str, ...], rng: random.Random) -> str:
    trimmer, out, i = StopTrimmer(stops), [], 0
    while i < len(text):
        j = min(len(text), i + rng.randint(0, 4))
        out.append(trimmer.feed(text[i:j]))
        i = j
    return "".join(out) + trimmer.flush()


@pytest.mark.parametrize("seed", range(20))
def test_streamed_trim_equals_trim_of_the_whole_text(seed):
    rng = random.Random(seed)
    alphabet = "ab c\n"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))})
    assert _stream(text, stops, rng) == cut_at_stop(text, stops)[0]


def test_trimmer_holds_back_a_possible_stop_prefix():
    t = StopTrimmer(("END",))
    assert t.feed("hello E") == "hello "
    assert t.feed("N") == ""
    assert t.feed("x") == "ENx"
    assert t.feed("ENDtail") == ""
    assert t.stopped and t.flush() == ""


def test_cut_at_stop_earliest_of_several():
    assert cut_at_stop("one two three", ("three", "two")) == ("one ", True)
    assert cut_at_stop("one", ("x",)) == ("one", False)


def test_text_stream_holds_back_an_incomplete_character_and_cuts_stops(tiny_tokenizer):
    stream = TextStream(tiny_tokenizer, stops=("w5",))
    ids = [3, 4, 5, 6]
    assert stream.stop_cut([3, 4]) is None
    assert stream.stop_cut(ids) == 3  # the third token completes "w5"
    text = stream.feed(ids[:3], final=True)
    assert stream.stopped and "w5" not in text and text == tiny_tokenizer.decode([3, 4], skip_special_tokens=True) + " "
