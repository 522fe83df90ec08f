"""Streamed tool calls on the server, as vLLM streams them: a call's name as soon as it is known, then its
arguments piece by piece as the tokens come; joined, the deltas are the whole response's tool calls. And
`<tool_call>` (mistral's `[TOOL_CALLS]`, `[ARGS]`) tags that the tokenizer makes special tokens: kept in
the text the parser reads. The same for the llama3_json and mistral parsers; pythonic sends each call whole."""

from __future__ import annotations

import json
import re

import openai
import pytest

from serve_helpers import MODEL, http_call, make_spec, running
from tiny import reference_greedy
from tool_kit import CALL, SCRIPT, WEATHER, script_tokenizer, scripted_model

from specula.prompts import encode_prompt
from specula.serve.tool_calls import special_tags

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SPLIT = ["Let me check.", "<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"', "}}",
         "</tool_call>"]
"""A script whose tool call takes several tokens (each piece one)."""


@pytest.fixture(scope="module")
def split_client():
    """The scripted model answering `SPLIT`, decoded one token a step (no drafting), tool_choice auto on."""
    tokenizer = script_tokenizer(SPLIT)
    with running(make_spec(scripted_model(tokenizer, SPLIT), tokenizer, "none"), enable_auto_tool_choice=True,
                 tool_call_parser="hermes") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_call_streams_its_name_then_its_arguments_token_by_token(split_client):
    args = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0)
    whole = split_client.chat.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in split_client.chat.completions.create(**args, stream=True)]
    assert "".join(c.delta.content or "" for c in chunks) == whole.message.content == "Let me check."
    deltas = [c.delta.tool_calls for c in chunks if c.delta.tool_calls]
    assert all(len(d) == 1 for d in deltas)
    first, *rest = [d[0] for d in deltas]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id.startswith("chatcmpl-tool-") and first.function.arguments == '{"city"'  # as the arguments begin
    assert [(d.index, d.id, d.type, d.function.name, d.function.arguments) for d in rest] == [
        (0, None, None, None, ': "Paris"'), (0, None, None, None, "}")]  # a token's worth each
    (call,) = whole.message.tool_calls
    assert (first.function.arguments + "".join(d.function.arguments for d in rest) == call.function.arguments
            == json.dumps({"city": "Paris"}))
    assert chunks[-1].finish_reason == whole.finish_reason == "tool_calls"


def test_a_required_call_streams_its_parameters_token_by_token(split_client):
    """tool_choice required (constrained to vLLM's list of {"name", "parameters"}): each list element is
    named once its parameters begin, its parameters then sent as the tokens write them."""
    tokenizer = script_tokenizer(SPLIT)
    bias = {str(tokenizer.convert_tokens_to_ids(c)): 5.0 for c in "}]"}  # close where the grammar allows
    args = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, logit_bias=bias)
    whole = split_client.chat.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in split_client.chat.completions.create(**args, stream=True)]
    deltas = [d for c in chunks for d in (c.delta.tool_calls or [])]
    first, *rest = deltas
    assert first.function.name == "get_weather" and first.function.arguments == "{"
    assert len(rest) > 3 and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    (call,) = whole.message.tool_calls
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments == '{"city": "Paris"}'
    assert "".join(c.delta.content or "" for c in chunks) == "" and chunks[-1].finish_reason == "tool_calls"


# --------------------------------------------------------------------------- tags that are special tokens

TAGS = ("<tool_call>", "</tool_call>")


@pytest.fixture(scope="module")
def special_script():
    """The scripted model (`SCRIPT`: text, then a hermes call) on a tokenizer whose tags are added special
    tokens, which decoding with skip_special_tokens drops."""
    tokenizer = script_tokenizer(SCRIPT, special=TAGS)
    return tokenizer, scripted_model(tokenizer)


@pytest.fixture(scope="module")
def special_server(special_script):
    tokenizer, model = special_script
    with running(make_spec(model, tokenizer, "draft-model", model), enable_auto_tool_choice=True,
                 tool_call_parser="hermes") as server:
        yield server


def test_the_tags_are_found_where_they_are_special_tokens(special_script):
    tokenizer = special_script[0]
    ids = special_tags(tokenizer)
    assert tokenizer.convert_ids_to_tokens(list(ids)) == list(TAGS)
    assert tokenizer.decode(list(ids), skip_special_tokens=True) == ""  # what the server's text would lose
    assert special_tags(script_tokenizer()) == ()  # tags that decode as text need nothing kept


def test_a_call_between_special_token_tags_is_parsed(special_script, special_server):
    """vLLM's hermes parser keeps special tokens in the text it reads; the server keeps these two (others,
    EOS among them, still decode to nothing), and only where tool_choice auto parses the output. The tokens
    are plain greedy decoding's either way."""
    tokenizer, model = special_script
    client = openai.OpenAI(base_url=special_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    args = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, logprobs=True)
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    assert choice.message.content == "Let me check." and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    expected = reference_greedy(model, encode_prompt(tokenizer, ASK, tools=[WEATHER]), 32, eos=tokenizer.eos_token_id)
    assert [e.token for e in choice.logprobs.content] == [tokenizer.decode([t]) for t in expected]
    assert whole.usage.completion_tokens == len(expected)
    chunks = [c.choices[0] for c in client.chat.completions.create(**args, stream=True)]
    assert "".join(c.delta.content or "" for c in chunks) == "Let me check."
    deltas = [d for c in chunks for d in (c.delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    plain = client.chat.completions.create(**{**args, "tool_choice": "none"}).choices[0]  # the text as before
    assert plain.message.content == tokenizer.decode(expected, skip_special_tokens=True) == "Let me check." + CALL
    assert not plain.message.tool_calls


# --------------------------------------------------------------------------- lone surrogates in the JSON

LONE = ["Sure.", "<tool_call>", '{"name": "get_weather", "arguments": {"city": "\\ud83d', '!", "note": ',
        '"\\udc00\\ud83d\\ude00"}}', "</tool_call>", '<tool_call>{"name": "get_\\udc00", "arguments": {}}</tool_call>']
"""A call whose arguments hold unpaired surrogate escapes (json.loads keeps each as a lone surrogate, which
UTF-8 cannot encode), the first one's string going on in the next token; a pair is joined as ever. Then a
call whose name holds one."""
LONE_ARGUMENTS = '{"city": "\\ud83d!", "note": "\\udc00😀"}'


@pytest.fixture(scope="module")
def lone_server():
    """The scripted model answering `LONE`, on a template that leaves the tools out of the prompt (a tool
    whose name holds a lone surrogate reaches the output, not a prompt the tokenizer refuses)."""
    tokenizer = script_tokenizer(LONE)
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ '\\n' }}{% endfor %}assistant:"
    with running(make_spec(scripted_model(tokenizer, LONE), tokenizer, "none"), enable_auto_tool_choice=True,
                 tool_call_parser="hermes") as server:
        yield server


@pytest.fixture(scope="module")
def lone_client(lone_server):
    return openai.OpenAI(base_url=lone_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_lone_surrogate_in_the_arguments_stays_an_escape_streamed_or_not(lone_client):
    """The arguments keep a lone surrogate as the escape the model wrote (as json.dumps' ensure_ascii writes
    it), not as the character: the whole response was a 500 (UnicodeEncodeError), the stream sent a string
    no UTF-8 client could send back. json.loads reads the model's values from them."""
    args = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0)
    whole = lone_client.chat.completions.create(**args).choices[0]
    assert whole.message.content == "Sure." and whole.finish_reason == "tool_calls"
    call = whole.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.function.arguments == LONE_ARGUMENTS
    assert json.loads(call.function.arguments) == {"city": "\ud83d!", "note": "\udc00\U0001f600"}
    chunks = [c.choices[0] for c in lone_client.chat.completions.create(**args, stream=True)]
    deltas = [d for c in chunks for d in (c.delta.tool_calls or []) if d.index == 0]
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert "".join(d.function.arguments for d in deltas) == LONE_ARGUMENTS
    assert chunks[-1].finish_reason == "tool_calls"


def test_a_lone_surrogate_in_a_name_the_model_wrote_is_the_replacement_character(lone_client):
    """A name is text: its lone surrogate becomes U+FFFD, streamed or not (the whole response was a 500,
    then a name the openai client cannot send back)."""
    args = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0)
    calls = lone_client.chat.completions.create(**args).choices[0].message.tool_calls
    chunks = [c.choices[0] for c in lone_client.chat.completions.create(**args, stream=True)]
    named = [(d.index, d.function.name) for c in chunks for d in (c.delta.tool_calls or []) if d.function.name]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", LONE_ARGUMENTS),
                                                                        ("get_\ufffd", "{}")]
    assert named == [(0, "get_weather"), (1, "get_\ufffd")]


def test_a_named_tool_whose_name_holds_a_lone_surrogate_is_called_by_that_name(lone_server):
    """A named tool_choice echoes the request's name; its lone surrogate (an unpaired escape in the request,
    which the openai client cannot even send) goes out as its escape, as the stream already sent it: the
    whole response was a 500."""
    odd = {"type": "function", "function": {"name": "w\ud83d", "parameters": {"type": "object", "properties": {}}}}
    body = {"model": MODEL, "messages": ASK, "tools": [odd], "temperature": 0, "max_tokens": 8,
            "tool_choice": {"type": "function", "function": {"name": "w\ud83d"}}}
    status, _, whole = http_call(lone_server, "POST", "/v1/chat/completions", body)
    assert status == 200, whole
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    status, _, events = http_call(lone_server, "POST", "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(e[len("data: "):]) for e in events.split("\n\n") if e.startswith("data: {")]
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert call["function"]["name"] == deltas[0]["function"]["name"] == "w\ud83d"
    assert "".join(d["function"]["arguments"] for d in deltas) == call["function"]["arguments"]


# --------------------------------------------------------------------------- llama3_json and mistral

LLAMA_SCRIPT = ['{"name": "get_weather", ', '"parameters": {"city": ', '"Paris"', "}}"]
"""A Llama 3.x answer: the call's JSON object alone, its arguments under "parameters"."""
MISTRAL_SCRIPT = ["Let me check.", "[TOOL_CALLS]", "get_weather", "[ARGS]", '{"city": ', '"Paris"', "}"]
"""A Mistral Small 3 answer: content, then `[TOOL_CALLS]name[ARGS]{...}` (both tags special tokens)."""
MISTRAL_TAGS = ("[TOOL_CALLS]", "[ARGS]")


def whole_and_streamed(client, **extra):
    """The whole response's choice, and the stream's chunks' choices, of the weather question."""
    args = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, **extra)
    whole = client.chat.completions.create(**args).choices[0]
    return whole, [c.choices[0] for c in client.chat.completions.create(**args, stream=True)]


@pytest.fixture(scope="module", params=["llama3_json", "mistral"])
def parser_server(request):
    """(parser, tokenizer, client) of a server of the scripted model answering the parser's script (one token
    a piece, decoded one a step), tool_choice auto parsed by that parser."""
    script, special = (LLAMA_SCRIPT, ()) if request.param == "llama3_json" else (MISTRAL_SCRIPT, MISTRAL_TAGS)
    tokenizer = script_tokenizer(script, special=special)
    with running(make_spec(scripted_model(tokenizer, script), tokenizer, "none"), enable_auto_tool_choice=True,
                 tool_call_parser=request.param) as server:
        yield request.param, tokenizer, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                                      timeout=60)


def test_llama3_json_and_mistral_calls_stream_token_by_token_and_join_to_the_whole(parser_server):
    parser, tokenizer, client = parser_server
    whole, chunks = whole_and_streamed(client)
    content = "Let me check." if parser == "mistral" else None
    assert whole.message.content == content and whole.finish_reason == chunks[-1].finish_reason == "tool_calls"
    assert "".join(c.delta.content or "" for c in chunks) == (content or "")
    (call,) = whole.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    first, *rest = [d for c in chunks for d in (c.delta.tool_calls or [])]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function", "get_weather",
                                                                                       '{"city"')
    assert [(d.index, d.id, d.function.name, d.function.arguments) for d in rest] == [
        (0, None, None, ': "Paris"'), (0, None, None, "}")]  # a token's worth each
    id_form = "[A-Za-z0-9]{9}" if parser == "mistral" else "chatcmpl-tool-[0-9a-f]{32}"
    assert re.fullmatch(id_form, call.id) and re.fullmatch(id_form, first.id)


def test_mistral_tags_are_kept_where_they_are_special_tokens(parser_server):
    """`[TOOL_CALLS]` and `[ARGS]` are special tokens in Mistral's tokenizers: the server keeps them in the text
    under tool_choice auto (the call above was parsed); under none the text drops them as ever."""
    parser, tokenizer, client = parser_server
    ids = special_tags(tokenizer, parser)
    if parser == "llama3_json":
        assert ids == ()  # nothing to keep (vLLM's llama3_json reads the text without <|python_tag|>)
        return
    assert tokenizer.convert_ids_to_tokens(list(ids)) == list(MISTRAL_TAGS)
    assert special_tags(tokenizer, "hermes") == ()
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0,
                                           tool_choice="none").choices[0]
    assert plain.message.content == 'Let me check.get_weather{"city": "Paris"}' and not plain.message.tool_calls


def test_a_llama3_json_or_mistral_call_cut_by_max_tokens_keeps_what_was_read(parser_server):
    parser, _, client = parser_server
    tokens = 2 if parser == "llama3_json" else 5  # the call named, its arguments begun, "Paris" not yet
    whole, chunks = whole_and_streamed(client, max_tokens=tokens)
    assert whole.finish_reason == chunks[-1].finish_reason == "length"
    (call,) = whole.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city"')
    assert "".join(d.function.arguments for c in chunks for d in (c.delta.tool_calls or [])) == '{"city"'


# --------------------------------------------------------------------------- pythonic

PYTHONIC_SCRIPT = ["[get_weather(", 'city="Paris"', ", ", 'unit="c")', ", get_time(", "zone='CET'", ")]"]
"""A Llama 3.2 answer with its pythonic template: a Python list of calls (each piece one token)."""


@pytest.fixture(scope="module")
def pythonic_client():
    """The scripted model answering `PYTHONIC_SCRIPT` one token a step, tool_choice auto parsed by pythonic."""
    tokenizer = script_tokenizer(PYTHONIC_SCRIPT)
    with running(make_spec(scripted_model(tokenizer, PYTHONIC_SCRIPT), tokenizer, "none"),
                 enable_auto_tool_choice=True, tool_call_parser="pythonic") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_pythonic_calls_stream_each_whole_as_it_closes_and_join_to_the_whole(pythonic_client):
    whole, chunks = whole_and_streamed(pythonic_client)
    assert whole.message.content is None and whole.finish_reason == chunks[-1].finish_reason == "tool_calls"
    assert "".join(c.delta.content or "" for c in chunks) == ""
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", '{"zone": "CET"}')]
    deltas = [[(d.index, d.type, d.function.name, d.function.arguments) for d in c.delta.tool_calls]
              for c in chunks if c.delta.tool_calls]
    assert deltas == [[(0, "function", "get_weather", '{"city": "Paris", "unit": "c"}')],  # at `unit="c")`
                      [(1, "function", "get_time", '{"zone": "CET"}')]]  # at `)]`
    streamed_ids = [d.id for c in chunks for d in (c.delta.tool_calls or [])]
    assert all(re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", i) for i in streamed_ids + [
        c.id for c in whole.message.tool_calls])


@pytest.mark.parametrize("tokens, content, names", [
    (5, None, ["get_weather"]),  # cut inside the second call: the first stays, the rest is dropped
    (2, '[get_weather(city="Paris"', []),  # cut before a call closed: content, as written
])
def test_a_pythonic_output_cut_by_max_tokens(pythonic_client, tokens, content, names):
    whole, chunks = whole_and_streamed(pythonic_client, max_tokens=tokens)
    assert whole.finish_reason == chunks[-1].finish_reason == "length"
    assert whole.message.content == content
    assert "".join(c.delta.content or "" for c in chunks) == (content or "")
    assert [c.function.name for c in whole.message.tool_calls or []] == names
    assert [d.function.name for c in chunks for d in (c.delta.tool_calls or [])] == names


LLAMA4_SCRIPT = ["<|python_start|>", "[get_weather(", 'city="Paris"', ", ", 'unit="c")', "]", "<|python_end|>"]
"""A Llama 4 answer with its pythonic template, its tags left in the text (each piece one token)."""


def test_llama4_pythonic_drops_its_tags_streamed_or_not():
    tokenizer = script_tokenizer(LLAMA4_SCRIPT)
    with running(make_spec(scripted_model(tokenizer, LLAMA4_SCRIPT), tokenizer, "none"),
                 enable_auto_tool_choice=True, tool_call_parser="llama4_pythonic") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        whole, chunks = whole_and_streamed(client)
    assert whole.message.content is None and whole.finish_reason == chunks[-1].finish_reason == "tool_calls"
    assert "".join(c.delta.content or "" for c in chunks) == ""
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("get_weather", '{"city": "Paris", "unit": "c"}')]
    assert [(d.function.name, d.function.arguments) for c in chunks for d in (c.delta.tool_calls or [])] == [
        ("get_weather", '{"city": "Paris", "unit": "c"}')]
