"""Pure parts of the wire protocol: stop-string trimming of streamed text, request defaults."""

from __future__ import annotations

import random

import pytest

from specula.serve.protocol import APIError, StopTrimmer, cut_at_stop, parse_request


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


def test_openai_defaults():
    completion = parse_request("completions", {"model": "m", "prompt": "hi"}, "m")
    assert completion.max_tokens == 16 and completion.temperature == 1.0 and completion.top_p == 1.0
    assert not completion.stream and completion.stop == ()
    chat = parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "m")
    assert chat.max_tokens is None  # the worker fills the remaining context (capped)
    chat = parse_request("chat", {"model": "m", "max_completion_tokens": 7, "stop": "x", "user": "u",
                                  "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "m")
    assert chat.max_tokens == 7 and chat.stop == ("x",) and chat.messages[0]["content"] == "hi"


def test_bool_is_not_an_integer():
    with pytest.raises(APIError) as err:
        parse_request("completions", {"model": "m", "prompt": "hi", "max_tokens": True}, "m")
    assert err.value.status == 400 and err.value.param == "max_tokens"
