"""Tool calls parsed out of generated text (`specula.serve.tool_calls`): the hermes, llama3_json, mistral,
pythonic and llama4_pythonic formats of tool_choice auto, the JSON list of required, a named tool's arguments;
streamed piece by piece, they add up to what the whole text gives, and no piece of a `<tool_call>` or `[TOOL_CALLS]` tag
leaks as content."""

from __future__ import annotations

import json
import random
import re

import pytest

from specula.serve.tool_calls import (AUTO_PARSERS, HermesParser, Llama3JsonParser, Llama4PythonicParser,
                                      MistralParser, NamedParser, PythonicParser, RequiredParser, ToolCallOutput,
                                      join_tool_calls, mistral_tool_call_id, tool_call_id)
from specula.serve.tools import TOOL_PARSERS, ToolUse

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
CALL2 = '{"name": "get_time", "arguments": {"zone": "Zürich"}}'


def whole(parser, text: str) -> tuple[str, list[dict]]:
    """(content, tool calls) of `text` read at once."""
    content, deltas = parser.feed(text)
    rest, more = parser.finish()
    return content + rest, join_tool_calls(deltas + more)


def streamed(parser, pieces: list[str]) -> tuple[str, list[dict], list[str]]:
    """(content, tool calls, content sent after each piece) of `pieces` read one after another."""
    content, deltas, sent = "", [], []
    for piece in pieces:
        text, calls = parser.feed(piece)
        content += text
        deltas += calls
        sent.append(content)
    text, calls = parser.finish()
    return content + text, join_tool_calls(deltas + calls), sent


def plain(calls: list[dict]) -> list[tuple[str, dict]]:
    """Calls without their (random) ids: (name, arguments object)."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


HERMES_CASES = [
    # (generated text, content, calls)
    ("The weather is fine.", "The weather is fine.", []),
    (f"<tool_call>\n{CALL}\n</tool_call>", "", [("get_weather", {"city": "Paris", "unit": "c"})]),
    (f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>", "Let me check.\n",
     [("get_weather", {"city": "Paris", "unit": "c"})]),
    (f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL2}\n</tool_call>\n", "",
     [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": "Zürich"})]),
    (f"<tool_call>{CALL}</tool_call>\nDone.", "\nDone.", [("get_weather", {"city": "Paris", "unit": "c"})]),
    (f"<tool_call>\n{CALL}\n", "", [("get_weather", {"city": "Paris", "unit": "c"})]),  # stopped before the end tag
    ("<tool_call>\n{\"name\": \"get_weather\", \"argu", "<tool_call>\n{\"name\": \"get_weather\", \"argu", []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),  # no arguments
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    ("a < b and <tool_c", "a < b and <tool_c", []),  # a tag's start that never finished is text
    ("1 <tool_call> 2 </tool_call> 3", "1 <tool_call> 2 </tool_call> 3", []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_blocks_become_tool_calls(text, content, calls):
    got_content, got_calls = whole(HermesParser(), text)
    assert (got_content, plain(got_calls)) == (content, calls)
    for call in got_calls:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")


def test_arguments_are_written_as_vllm_writes_them():
    """json.dumps with ensure_ascii=False: what the model wrote, in one layout."""
    text = '<tool_call>{"name":"f","arguments":{"city":"Zürich","n":[1,2]}}</tool_call>'
    content, calls = whole(HermesParser(), text)
    assert calls[0]["function"] == {"name": "f", "arguments": '{"city": "Zürich", "n": [1, 2]}'}


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_streamed_in_any_pieces_adds_up_to_the_whole(text, content, calls):
    rng = random.Random(0)
    functions = [c["function"] for c in whole(HermesParser(), text)[1]]
    splits = [list(text)] + [_random_pieces(rng, text) for _ in range(20)]
    for pieces in splits:
        got_content, got_calls, sent = streamed(HermesParser(), pieces)
        assert (got_content, [c["function"] for c in got_calls]) == (content, functions), pieces
        assert all(content.startswith(s) for s in sent)  # nothing sent is taken back


def test_text_that_may_start_a_tag_is_held_back_until_it_is_known():
    parser = HermesParser()
    assert parser.feed("Let me check. <") == ("Let me check. ", [])
    assert parser.feed("tool_") == ("", [])
    assert parser.feed("cal") == ("", [])
    assert parser.feed("m here") == ("<tool_calm here", [])  # not the tag after all: given out at once
    assert parser.feed(" <tool_call>") == (" ", [])  # the text before the first block is content
    content, calls = parser.feed(CALL + "</tool")
    assert content == "" and plain(calls) == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert calls[0]["index"] == 0 and parser.called
    assert parser.feed("_call>") == ("", [])


def deltas_by_piece(parser, pieces: list[str]) -> list[list[dict]]:
    """The tool call deltas each piece gave (the last list: finish's)."""
    out = [parser.feed(piece)[1] for piece in pieces]
    return out + [parser.finish()[1]]


def test_a_hermes_call_streams_its_name_then_its_arguments_as_they_come():
    """vLLM's streaming: a first delta with index, id, type and name once the name is whole (and the
    arguments have begun), then deltas of `index` and more arguments only, as the arguments are generated."""
    text = f"<tool_call>\n{CALL}\n</tool_call>"
    got = deltas_by_piece(HermesParser(), list(text))
    flat = [d for ds in got for d in ds]
    assert all(len(ds) <= 1 for ds in got)  # one delta a piece
    first, rest = flat[0], flat[1:]
    assert first["function"]["name"] == "get_weather" and first["type"] == "function" and first["index"] == 0
    assert first["id"].startswith("chatcmpl-tool-") and first["function"]["arguments"] == "{"
    sent_at = [i for i, ds in enumerate(got) if ds]
    assert text[:sent_at[0] + 1].endswith('"arguments": {')  # named as soon as the arguments begin
    assert len(rest) > 10 and all(d.keys() == {"index", "function"} and d["function"].keys() == {"arguments"}
                                  and d["index"] == 0 for d in rest)
    assert sent_at[-1] < text.index("</tool_call>")  # the arguments were all out before the end tag
    assert join_tool_calls(flat)[0]["function"] == {"name": "get_weather",
                                                    "arguments": '{"city": "Paris", "unit": "c"}'}


ODD = ('<tool_call>{"arguments" :{"n":12,"x":[1.50,-0,1E2,true,null],"s":"a\\u00e9\\ud83d\\ude00\\n\\/b",'
       '"e":{}},\n "name":"f\\u00fc"}</tool_call>')


@pytest.mark.parametrize("text", [CALL, ODD.removeprefix("<tool_call>").removesuffix("</tool_call>")])
def test_streamed_arguments_are_exactly_the_whole_responses_in_json_dumps_layout(text):
    """What goes out is never taken back: each piece's arguments extend what was sent, and all of them add up
    to json.dumps(arguments, ensure_ascii=False), what the whole text gives (vLLM's non-streamed form),
    however the text is split (numbers wait for their end, escapes for their last character)."""
    block = f"<tool_call>{text}</tool_call>"
    value = json.loads(text)
    expected = [{"name": value["name"], "arguments": json.dumps(value["arguments"], ensure_ascii=False)}]
    rng = random.Random(3)
    for pieces in [[block], list(block)] + [_random_pieces(rng, block) for _ in range(30)]:
        calls = join_tool_calls([d for ds in deltas_by_piece(HermesParser(), pieces) for d in ds])
        assert [c["function"] for c in calls] == expected, pieces
    if text.startswith('{"arguments"'):  # the name comes last: the call goes out with its arguments whole
        got = deltas_by_piece(HermesParser(), list(block))
        assert [len(ds) for ds in got if ds] == [1] and got[block.index('"}')][0]["function"] == expected[0]


@pytest.mark.parametrize("text, content, function", [
    ('<tool_call>{"name": "f", "arguments": {"a": 1, "b": tru}}</tool_call> x', " x",
     {"name": "f", "arguments": '{"a": 1, "b"'}),  # malformed after the arguments began
    ('<tool_call>{"name": "f", "arguments": {"a": [1, 2', "", {"name": "f", "arguments": '{"a": [1, 2'}),  # cut
    ('<tool_call>{"name": "f", "arguments": {}} and more</tool_call>', "", {"name": "f", "arguments": "{}"}),
])
def test_a_call_that_breaks_off_keeps_the_arguments_read_up_to_there(text, content, function):
    """Once a call has begun going out it cannot be taken back: a stream and a whole response both answer the
    call with the arguments read before the JSON broke off."""
    for pieces in ([text], list(text)):
        got_content, calls, _ = streamed(HermesParser(), pieces)
        assert got_content == content and [c["function"] for c in calls] == [function]


def test_a_lone_surrogate_in_a_name_becomes_the_replacement_character():
    """A name is text: an unpaired escape in it (json.loads keeps a lone surrogate, which UTF-8 cannot
    encode) becomes U+FFFD, streamed or not; the arguments keep theirs as the escape (JSON text)."""
    text = '<tool_call>{"name": "get_\\udc00\\ud83d\\ude00", "arguments": {"a": "\\ud83d"}}</tool_call>'
    for pieces in ([text], list(text)):
        _, calls, _ = streamed(HermesParser(), pieces)
        assert [c["function"] for c in calls] == [{"name": "get_\ufffd\U0001f600", "arguments": '{"a": "\\ud83d"}'}]


def test_each_call_has_its_own_index_and_id():
    parser = HermesParser()
    _, first = parser.feed(f"<tool_call>{CALL}</tool_call>\n<tool_call>{CALL2[:10]}")
    assert [c["index"] for c in first] == [0] and first[0]["function"]["name"] == "get_weather"
    _, second = parser.feed(CALL2[10:] + "</tool_call>")
    assert [c["index"] for c in second] == [1] and second[0]["id"] != first[0]["id"]


REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Pa]}\\"ris", "tags": ["a", {"b": 1}]}}, '
            '{"name": "get_time", "parameters": {}}]')


def test_required_output_becomes_its_calls_each_streamed_as_it_comes():
    content, calls = whole(RequiredParser(), REQUIRED)
    assert content == "" and plain(calls) == [
        ("get_weather", {"city": 'Pa]}"ris', "tags": ["a", {"b": 1}]}), ("get_time", {})]
    assert [c["function"]["arguments"] for c in calls] == [json.dumps(v) for _, v in plain(calls)]
    got = deltas_by_piece(RequiredParser(), list(REQUIRED))
    flat = [d for ds in got for d in ds]
    begun = [i for i, ds in enumerate(got) if ds and "id" in ds[0]]
    assert [REQUIRED[:i + 1][-15:] for i in begun] == ['"parameters": {'] * 2  # each named as its parameters begin
    assert sum("id" not in d for d in flat) > 10  # then its parameters, piece by piece
    assert join_tool_calls(flat) == calls[:0] + [{**c, "id": join_tool_calls(flat)[i]["id"]}
                                                 for i, c in enumerate(calls)]
    for pieces in ([REQUIRED], list(REQUIRED), _random_pieces(random.Random(1), REQUIRED)):
        assert [c["function"] for c in streamed(RequiredParser(), pieces)[1]] == [c["function"] for c in calls]


def test_a_required_output_cut_before_a_call_began_is_content():
    text = '[{"name": "get_weather", "paramet'
    assert whole(RequiredParser(), text) == (text, [])
    content, calls = whole(RequiredParser(), REQUIRED[:REQUIRED.index("}}, ") + 6])  # a call, then cut
    assert content == "" and len(calls) == 1
    content, calls = whole(RequiredParser(), '[{"name": "get_weather", "parameters": {"ci')  # cut inside a call
    assert content == "" and [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"ci'}]


def test_a_named_choice_streams_its_arguments():
    parser = NamedParser("get_weather")
    _, first = parser.feed('{"city": ')
    assert first[0]["function"] == {"name": "get_weather", "arguments": '{"city": '} and first[0]["index"] == 0
    _, more = parser.feed('"Paris"}')
    assert more == [{"index": 0, "function": {"arguments": '"Paris"}'}}]
    assert parser.finish() == ("", [])
    assert join_tool_calls(first + more)[0]["function"]["arguments"] == '{"city": "Paris"}'
    empty = NamedParser("f")
    _, calls = empty.finish()
    assert join_tool_calls(calls)[0]["function"] == {"name": "f", "arguments": ""} and empty.called


def test_the_output_of_a_request_and_its_finish_reason():
    tools = ({"type": "function", "function": {"name": "get_weather"}},)
    assert ToolCallOutput.for_request(None) is None
    assert ToolCallOutput.for_request(ToolUse(tools, "none")) is None
    two = f"<tool_call>{CALL}</tool_call><tool_call>{CALL2}</tool_call>"
    auto = ToolCallOutput.for_request(ToolUse(tools, "auto"))
    assert len(auto.feed(two)[1]) == 2 and auto.finish_reason("stop") == "tool_calls"
    assert auto.finish_reason("length") == "length"  # cut short: the client should know
    single = ToolCallOutput.for_request(ToolUse(tools, "auto", parallel=False))
    assert [c["index"] for c in single.feed(two)[1]] == [0]  # parallel_tool_calls false: the first call only
    text = ToolCallOutput.for_request(ToolUse(tools, "auto"))
    assert text.feed("hello") == ("hello", []) and text.finish_reason("stop") == "stop"
    named = ToolCallOutput.for_request(ToolUse(tools, "named", "get_weather"))
    named.feed("{}")
    assert named.finish_reason("stop") == "stop"  # OpenAI's (and vLLM's) rule for a named choice
    required = ToolCallOutput.for_request(ToolUse(tools, "required"))
    required.feed('[{"name": "get_weather", "parameters": {}}]')
    assert required.finish_reason("stop") == "tool_calls"
    assert tool_call_id() != tool_call_id()


def assert_streams_add_up(parser, text: str, content: str) -> None:
    """`text` fed to a new `parser()` split at every character, into token-like pieces, at every single boundary
    and at random: the same content and calls as the whole text, and content once sent is never taken back."""
    functions = [c["function"] for c in whole(parser(), text)[1]]
    rng = random.Random(0)
    splits = [list(text), token_pieces(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for pieces in splits + [_random_pieces(rng, text) for _ in range(10)]:
        got_content, got_calls, sent = streamed(parser(), pieces)
        assert (got_content, [c["function"] for c in got_calls]) == (content, functions), pieces
        assert all(content.startswith(s) for s in sent), pieces


def _random_pieces(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


# --------------------------------------------------------------------------- llama3_json and mistral

WEATHER_ARGS = {"city": "Paris", "unit": "c"}
WEATHER = json.dumps(WEATHER_ARGS)
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
LLAMA_CASES = [
    # (generated text, content, calls)
    ("The weather is fine.", "The weather is fine.", []),
    (LLAMA, "", [("get_weather", WEATHER)]),
    ("\n<|python_tag|>" + LLAMA, "", [("get_weather", WEATHER)]),
    ('{"name":"get_time","arguments":{"zone":"Zürich"}}', "", [("get_time", '{"zone": "Zürich"}')]),  # vLLM's too
    (f"{LLAMA}; {LLAMA.replace('get_weather', 'get_time')};", "",
     [("get_weather", WEATHER), ("get_time", WEATHER)]),
    (f"Let me check. {LLAMA}", "Let me check. ", [("get_weather", WEATHER)]),  # content, then a call (vLLM's)
    (f"Sure.\n{LLAMA}; {LLAMA}", "Sure.\n", [("get_weather", WEATHER), ("get_weather", WEATHER)]),
    (f"Use {{x}} then {LLAMA}", f"Use {{x}} then {LLAMA}", []),  # the first object is no call: all content
    (f"{LLAMA}\nDone.", "\nDone.", [("get_weather", WEATHER)]),
    ('{"name": "get_weather", "parameters": {"city": "Par', "", [("get_weather", '{"city": "Par')]),  # max_tokens
    ('{"name": "get_weather", "param', '{"name": "get_weather", "param', []),  # cut before a call began
    ('{"answer": 42} is the JSON', '{"answer": 42} is the JSON', []),  # an object that is no call
    ("{braces} and a name", "{braces} and a name", []),
    ('<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
    ("<|python", "<|python", []),
    ("  ", "  ", []),
]
MISTRAL = ('[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
           '{"name": "get_time", "arguments": {}}]')
MISTRAL_CASES = [
    ("The weather is fine.", "The weather is fine.", []),
    ("[TOOL_CALLS]" + MISTRAL, "", [("get_weather", WEATHER), ("get_time", "{}")]),
    ("Let me check.[TOOL_CALLS] " + MISTRAL, "Let me check.", [("get_weather", WEATHER), ("get_time", "{}")]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", WEATHER), ("get_time", "{}")]),  # the newer form, each call after its own tag
    ('Sure.[TOOL_CALLS]get_weather{"city":"Paris","unit":"c"}', "Sure.", [("get_weather", WEATHER)]),
    ('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "unit": "c"}', "",
     [("get_weather", WEATHER)]),  # the id some models write: not part of the name
    ("[TOOL_CALLS]get_weather[CALL_ID]a1 b[ARGS]{}", "[TOOL_CALLS]get_weather[CALL_ID]a1 b[ARGS]{}", []),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} Done.', " Done.", [("get_weather", '{"city": "Paris"}')]),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa', "", [("get_weather", '{"city": "Pa')]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', "", [("get_weather", '{"city": "Pa')]),  # cut by max_tokens
    ('[TOOL_CALLS][{"name": "get_weath', '[TOOL_CALLS][{"name": "get_weath', []),  # cut before a call began
    ("[TOOL_CALLS]get_wea", "[TOOL_CALLS]get_wea", []),
    ("a [TOOLS] b [TOOL_CALL", "a [TOOLS] b [TOOL_CALL", []),  # brackets and a tag's start that never finished
    ("use [TOOL_CALLS] here", "use [TOOL_CALLS] here", []),  # the tag word, no call after it
    ("[TOOL_CALLS][1, 2] [ARGS]", "[TOOL_CALLS][1, 2] [ARGS]", []),
    ('[TOOL_CALLS]get_weather[ARGS]"Paris"', '[TOOL_CALLS]get_weather[ARGS]"Paris"', []),  # arguments no object
    ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
]
PARSER_CASES = ([pytest.param(Llama3JsonParser, *case, id=f"llama3_json-{i}") for i, case in enumerate(LLAMA_CASES)]
                + [pytest.param(MistralParser, *case, id=f"mistral-{i}") for i, case in enumerate(MISTRAL_CASES)])
_TOKEN = re.compile(r"\[TOOL_CALLS\]|\[ARGS\]|<\|python_(?:tag|start|end)\|>|\s*\w+|\s+|.")


def token_pieces(text: str) -> list[str]:
    """`text` in pieces as a tokenizer's tokens would bring it: each tag whole, words with the space before them,
    every other character alone."""
    pieces = _TOKEN.findall(text)
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize("parser, text, content, calls", PARSER_CASES)
def test_llama3_json_and_mistral_outputs_become_tool_calls(parser, text, content, calls):
    """(content, [(name, arguments)]): the arguments in json.dumps's layout, as vLLM's whole response writes them."""
    got_content, got_calls = whole(parser(), text)
    assert (got_content, [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls]) == (content, calls)


@pytest.mark.parametrize("parser, text, content, calls", PARSER_CASES)
def test_llama3_json_and_mistral_streamed_in_any_pieces_add_up_to_the_whole(parser, text, content, calls):
    assert_streams_add_up(parser, text, content)


def test_a_llama3_json_call_streams_its_name_then_its_arguments_as_they_come():
    got = deltas_by_piece(Llama3JsonParser(), token_pieces(LLAMA))
    flat = [d for ds in got for d in ds]
    first, rest = flat[0], flat[1:]
    assert first["function"] == {"name": "get_weather", "arguments": "{"} and first["index"] == 0
    assert first["id"].startswith("chatcmpl-tool-") and first["type"] == "function"
    assert len(rest) > 3 and all(d.keys() == {"index", "function"} and d["index"] == 0 for d in rest)
    assert join_tool_calls(flat)[0]["function"]["arguments"] == json.dumps(WEATHER_ARGS)


def test_llama3_json_holds_back_only_what_could_still_be_a_call():
    parser = Llama3JsonParser()
    assert parser.feed("  ") == ("", [])  # leading whitespace: a call may follow
    assert parser.feed("Hi {") == ("  Hi ", [])  # content as it comes, up to an object that may be a call
    assert parser.feed('"name": "f"}') == ('{"name": "f"}', []) and not parser.called  # none: content
    assert parser.feed(' {"name": "g", "parameters": {}}') == (' {"name": "g", "parameters": {}}', [])  # the rest too
    parser = Llama3JsonParser()
    assert parser.feed('{"answer": ') == ("", [])  # an object: held until it shows whether it is a call
    assert parser.feed("42}") == ('{"answer": 42}', [])
    assert parser.feed(" more") == (" more", [])


def test_mistral_holds_back_a_tag_start_and_names_each_call_with_a_mistral_id():
    parser = MistralParser()
    assert parser.feed("Let me check. [TOOL") == ("Let me check. ", [])
    assert parser.feed("_CALLS]get_wea") == ("", [])
    content, calls = parser.feed('ther[ARGS]{"city": ')
    assert content == "" and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert re.fullmatch("[A-Za-z0-9]{9}", calls[0]["id"]) and parser.called
    assert parser.feed('"Paris"}') == ("", [{"index": 0, "function": {"arguments": ': "Paris"}'}}])
    assert parser.finish() == ("", [])
    assert re.fullmatch("[A-Za-z0-9]{9}", mistral_tool_call_id()) and mistral_tool_call_id() != mistral_tool_call_id()


@pytest.mark.parametrize("parser, text, function", [
    (Llama3JsonParser, '{"name": "f", "parameters": {"a": 1, "b": tru}} x; {"name": "g", "parameters": {}}',
     {"name": "f", "arguments": '{"a": 1, "b"'}),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1, "b": tru}}] x',
     {"name": "f", "arguments": '{"a": 1, "b"'}),
    (MistralParser, '[TOOL_CALLS]f[ARGS]{"a": 1, "b": tru} x', {"name": "f", "arguments": '{"a": 1, "b"'}),
])
def test_a_llama3_json_or_mistral_call_that_breaks_off_keeps_its_arguments_and_drops_the_rest(parser, text,
                                                                                             function):
    for pieces in ([text], list(text), token_pieces(text)):
        got_content, calls, _ = streamed(parser(), pieces)
        assert got_content == "" and [c["function"] for c in calls] == [function]


def test_a_mistral_call_after_a_broken_one_is_still_read():
    text = '[TOOL_CALLS]f[ARGS]{"a": tru} junk [TOOL_CALLS]g[ARGS]{"b": 2}'
    _, calls = whole(MistralParser(), text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("f", '{"a"'), ("g", '{"b": 2}')]
    assert calls[0]["id"] != calls[1]["id"]


REPEATED = '{"a": 1, "b": {"c": 2, "c": 3}, "a": 4}'
"""Arguments that give keys twice: json.loads (vLLM's whole response) keeps each key's last value."""


@pytest.mark.parametrize("parser, text", [
    (HermesParser, f'<tool_call>{{"name": "f", "arguments": {REPEATED}}}</tool_call>'),
    (Llama3JsonParser, f'{{"name": "f", "parameters": {REPEATED}}}'),
    (MistralParser, f'[TOOL_CALLS][{{"name": "f", "arguments": {REPEATED}}}]'),
    (MistralParser, f"[TOOL_CALLS]f[ARGS]{REPEATED}"),
    (RequiredParser, f'[{{"name": "f", "parameters": {REPEATED}}}]'),
])
def test_arguments_that_repeat_a_key_read_as_pythons_json_reads_them_streamed_or_not(parser, text):
    """A key's first value goes out as it settles, before any later one is known, so the arguments text keeps
    both (vLLM's json.dumps writes the last only): read as JSON, it is vLLM's value, the last at the first's
    place, and a stream says exactly what the whole response says."""
    for pieces in ([text], list(text), token_pieces(text)):
        _, calls, _ = streamed(parser(), pieces)
        assert [c["function"]["arguments"] for c in calls] == ['{"a": 1, "b": {"c": 2, "c": 3}, "a": 4}'], pieces
        assert list(json.loads(calls[0]["function"]["arguments"]).items()) == list(json.loads(REPEATED).items())


@pytest.mark.parametrize("parser, text, function", [
    (HermesParser, '<tool_call>{"name": "f", "name": "g", "arguments": {"x": 1}}</tool_call>',
     {"name": "g", "arguments": '{"x": 1}'}),
    (HermesParser, '<tool_call>{"name": 3, "name": "g", "arguments": {}}</tool_call>',
     {"name": "g", "arguments": "{}"}),
    (HermesParser, '<tool_call>{"arguments": {"x": 1}, "arguments": {"y": 2}, "name": "g"}</tool_call>',
     {"name": "g", "arguments": '{"y": 2}'}),
    (Llama3JsonParser, '{"parameters": {"x": 1}, "parameters": {"y": 2}, "name": "g"}',
     {"name": "g", "arguments": '{"y": 2}'}),
    (RequiredParser, '[{"name": "f", "name": "g", "parameters": {"x": 1}}]', {"name": "g", "arguments": '{"x": 1}'}),
    # the call went out at its arguments' start: what follows cannot take it back (vLLM's json.loads: g, {"y": 2})
    (HermesParser, '<tool_call>{"name": "f", "arguments": {"x": 1}, "name": "g", "arguments": {"y": 2}}</tool_call>',
     {"name": "f", "arguments": '{"x": 1}'}),
])
def test_a_call_that_gives_its_name_or_arguments_twice_keeps_the_last_until_it_goes_out(parser, text, function):
    for pieces in ([text], list(text), token_pieces(text)):
        _, calls, _ = streamed(parser(), pieces)
        assert [c["function"] for c in calls] == [function], pieces


def test_the_server_parsers_are_the_tool_call_parsers_it_offers():
    tools = ({"type": "function", "function": {"name": "get_weather"}},)
    assert tuple(AUTO_PARSERS) == TOOL_PARSERS == ("hermes", "llama3_json", "llama4_pythonic", "mistral", "pythonic")
    for name, kind in AUTO_PARSERS.items():
        assert type(ToolCallOutput.for_request(ToolUse(tools, "auto", parser=name)).parser) is kind
    llama = ToolCallOutput.for_request(ToolUse(tools, "auto", parallel=False, parser="llama3_json"))
    content, calls = llama.feed(f"{LLAMA}; {LLAMA}")
    assert content == "" and [c["index"] for c in calls] == [0] and llama.finish_reason("stop") == "tool_calls"
    mistral = ToolCallOutput.for_request(ToolUse(tools, "auto", parser="mistral"))
    assert mistral.feed("[TOOL_CALLS]" + MISTRAL)[0] == "" and mistral.finish_reason("length") == "length"


# --------------------------------------------------------------------------- pythonic

PYTHONIC = '[get_weather(city="Paris", unit="c"), get_time(zone="CET")]'
PYTHONIC_CASES = [
    # (generated text, content, calls)
    ("The weather is fine.", "The weather is fine.", []),
    (PYTHONIC, "", [("get_weather", WEATHER), ("get_time", '{"zone": "CET"}')]),
    ("\n [get_weather(city='Zürich')]", "", [("get_weather", '{"city": "Zürich"}')]),  # whitespace, single quotes
    ("[f(a=-1, b=+2.5, c=[1, -3e2, {'k': None, 2: True}], d=False, e={})]", "",
     [("f", '{"a": -1, "b": 2.5, "c": [1, -300.0, {"k": null, "2": true}], "d": false, "e": {}}')]),
    ("[f(s='a), b], c', t=\"it's \\\"q\\\"\", u='\\\\')]", "",
     [("f", '{"s": "a), b], c", "t": "it\'s \\"q\\"", "u": "\\\\"}')]),  # strings holding ) , ] and quotes
    ("[f( ), g (x=1,), ]", "", [("f", "{}"), ("g", '{"x": 1}')]),  # Python's spaces and trailing commas
    ("[f(s='''it's (1)''', t=\"\"\"say \"hi\")\"\"\"), g(u='''a')b''')]", "",
     [("f", '{"s": "it\'s (1)", "t": "say \\"hi\\")"}'), ("g", '{"u": "a\')b"}')]),  # triple quotes hold ' " )
    ("[f(s='''two\nlines''', t='''a\\'''', u='''''', v='', w=\"\")]", "",
     [("f", '{"s": "two\\nlines", "t": "a\'", "u": "", "v": "", "w": ""}')]),  # escapes, empty strings
    (f"{PYTHONIC}\nDone.", "\nDone.", [("get_weather", WEATHER), ("get_time", '{"zone": "CET"}')]),
    (f"{PYTHONIC}\n ", "", [("get_weather", WEATHER), ("get_time", '{"zone": "CET"}')]),
    ('[get_weather(city="Paris", unit="c"), get_time(zone="C', "", [("get_weather", WEATHER)]),  # cut by max_tokens
    ('[get_weather(city="Paris", unit="c"), 2, get_time()]', "", [("get_weather", WEATHER)]),  # the rest dropped
    ('[get_weather(city="Paris", unit="c"), f(x=y)]', "", [("get_weather", WEATHER)]),
    ('[get_weather(city="Par', '[get_weather(city="Par', []),  # cut before a call went out: content
    ("[1, 2]", "[1, 2]", []),
    ("[link](https://example.com) is a link", "[link](https://example.com) is a link", []),
    ("[a b] c", "[a b] c", []),
    ("[f(x)] positional", "[f(x)] positional", []),
    ("[f(x=a + 1)]", "[f(x=a + 1)]", []),
    ("[f(**kw)]", "[f(**kw)]", []),
    ("[f(x=(1, 2))]", "[f(x=(1, 2))]", []),  # a tuple: not a JSON value (vLLM's neither)
    ("[f(x=b'a')]", "[f(x=b'a')]", []),
    ("[f(x=1e999)]", "[f(x=1e999)]", []),  # inf: not JSON
    ("[obj.f(x=1)]", "[obj.f(x=1)]", []),
    ("[]", "[]", []),
    ("[", "[", []),
    ("  ", "  ", []),
    ("Call [f(x=1)]", "Call [f(x=1)]", []),  # text first: all content
]


LLAMA4_CASES = [
    # (generated text, content, calls): pythonic's, and Llama 4's tags around the list, dropped
    (f"<|python_start|>{PYTHONIC}<|python_end|>", "", [("get_weather", WEATHER), ("get_time", '{"zone": "CET"}')]),
    ("\n<|python_start|> [f(x=1)]<|python_end|>\nDone.", "\nDone.", [("f", '{"x": 1}')]),
    ("[f(x=1)]", "", [("f", '{"x": 1}')]),  # no tags: as pythonic
    ("<|python_start|>[1, 2]<|python_end|>", "[1, 2]", []),  # no calls: the text without its tags, as vLLM's
    ("<|python_start|>Hello", "Hello", []),
    ("a <|python <|pyth", "a <|python <|pyth", []),  # a tag's start that never finished is text
]
PYTHONIC_PARSER_CASES = (
    [pytest.param(PythonicParser, *case, id=f"pythonic-{i}") for i, case in enumerate(PYTHONIC_CASES)]
    + [pytest.param(Llama4PythonicParser, *case, id=f"llama4-{i}") for i, case in enumerate(PYTHONIC_CASES)]
    + [pytest.param(Llama4PythonicParser, *case, id=f"llama4-tags-{i}") for i, case in enumerate(LLAMA4_CASES)])


@pytest.mark.parametrize("parser, text, content, calls", PYTHONIC_PARSER_CASES)
def test_pythonic_outputs_become_tool_calls(parser, text, content, calls):
    """(content, [(name, arguments)]): the arguments in json.dumps's layout (ensure_ascii=False), as vLLM's."""
    got_content, got_calls = whole(parser(), text)
    assert (got_content, [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls]) == (content, calls)
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in got_calls)


@pytest.mark.parametrize("parser, text, content, calls", PYTHONIC_PARSER_CASES)
def test_pythonic_streamed_in_any_pieces_adds_up_to_the_whole(parser, text, content, calls):
    assert_streams_add_up(parser, text, content)


def test_llama4_pythonic_holds_back_only_what_could_begin_a_tag():
    parser = Llama4PythonicParser()
    assert parser.feed("<|python_st") == ("", [])
    content, calls = parser.feed('art|>[get_weather(city="Paris", unit="c")')
    assert content == "" and [(c["index"], c["function"]) for c in calls] == [
        (0, {"name": "get_weather", "arguments": WEATHER})]
    assert parser.feed("]<|python_e") == ("", [])
    assert parser.feed("nd|>") == ("", []) and parser.finish() == ("", []) and parser.called
    parser = Llama4PythonicParser()
    assert parser.feed("Hi <|py") == ("Hi ", [])  # content, but for a tail that could begin a tag
    assert parser.feed("thon_end|> there") == (" there", [])


def test_a_pythonic_call_goes_out_whole_as_soon_as_its_parenthesis_closes():
    parser = PythonicParser()
    assert parser.feed('[get_weather(city="Paris", unit="c"') == ("", [])
    content, calls = parser.feed(")")
    assert content == "" and [(c["index"], c["function"]) for c in calls] == [
        (0, {"name": "get_weather", "arguments": WEATHER})] and parser.called
    assert parser.feed(", get_time(zone='CET'") == ("", [])
    assert [(c["index"], c["function"]["name"]) for c in parser.feed(")]")[1]] == [(1, "get_time")]
    assert parser.finish() == ("", [])


def test_pythonic_holds_back_a_list_until_it_shows_whether_it_is_calls():
    parser = PythonicParser()
    assert parser.feed(" ") == ("", [])
    assert parser.feed("[link") == ("", [])  # could still be a call's name
    assert parser.feed("]") == (" [link]", [])  # not a call: content, all of it
    assert parser.feed("(url)") == ("(url)", []) and not parser.called
    parser = PythonicParser()
    assert parser.feed("No [f(x=1)]") == ("No [f(x=1)]", [])  # not a list at the start: content as it comes


def test_a_lone_surrogate_in_a_pythonic_string_stays_an_escape():
    _, calls = whole(PythonicParser(), '[f(a="\\ud83d!", b="\\ud83d\\ude00")]')
    arguments = calls[0]["function"]["arguments"]
    assert arguments == '{"a": "\\ud83d!", "b": "\\ud83d\\ude00"}' and arguments.encode("utf-8")
    assert json.loads(arguments) == {"a": "\ud83d!", "b": "😀"}
