"""Tool calling on /v1/chat/completions, as vLLM's OpenAI server does it: tools rendered by the chat
template, the tool-calling conversation's messages, tool_choice checked with 400s naming the field."""

from __future__ import annotations

import pytest

import json

import openai

from serve_helpers import MODEL, http_call, make_spec, running
from tiny import reference_greedy
from tool_kit import SCRIPT, TOOLS, WEATHER, script_tokenizer, scripted_model, tool, tool_tokenizer

from specula.prompts import encode_prompt
from specula.serve.protocol import APIError, parse_request
from specula.serve.tool_calls import HermesParser

USER = [{"role": "user", "content": "w10 w11 w12"}]
CHAT = {"model": MODEL, "messages": USER, "max_tokens": 8, "temperature": 0}
HISTORY = [
    {"role": "user", "content": "w10"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "w20", "type": "function", "function": {"name": "w07", "arguments": '{"arg": "w21"}'}}]},
    {"role": "tool", "tool_call_id": "w20", "content": "w22"},
]
"""A tool-calling conversation: the user asks, the assistant calls w07 (no text), the tool answers."""


def chat(**extra) -> dict:
    return {"model": "m", "messages": USER, **extra}


def parse_error(body: dict, endpoint: str = "chat") -> APIError:
    with pytest.raises(APIError) as err:
        parse_request(endpoint, body, "m")
    assert err.value.status == 400
    return err.value


# --------------------------------------------------------------------------- request checks


def test_tools_and_tool_choice_none_are_taken_and_kept_for_the_template():
    request = parse_request("chat", chat(tools=TOOLS, tool_choice="none"), "m")  # no tool parser needed
    assert request.tools == tuple(TOOLS) and request.tool_use.choice == "none" and request.constraint is None
    assert parse_request("chat", chat(), "m").tool_use is None
    for choice in ("none", "auto"):  # a tool_choice that means nothing without tools, as before
        assert parse_request("chat", chat(tool_choice=choice), "m").tool_use is None
    assert parse_request("chat", chat(tools=[], tool_choice="none"), "m").tool_use is None


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": {"name": "f"}}, "tools", "must be a list"),
    ({"tools": ["f"]}, "tools[0]", "must be an object"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", "'function'"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "with a 'name'"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name", "non-empty string"),
    ({"tools": [tool("a"), {"type": "function", "function": {"name": "b", "parameters": "x"}}]},
     "tools[1].function.parameters", "JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "b", "description": 3}}]}, "tools[0].function.description",
     "a string"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", 'Only named tools, "none", "auto" or "required"'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "does not match any of the specified `tools`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "Correct usage"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice", "Expected field `name`"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tool_choice": {"type": "function", "function": {"name": "w07"}}}, "tool_choice", "`tools` must be set"),
    ({"tools": TOOLS, "tool_choice": "none", "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"function_call": {"name": "f"}}, "function_call", "not supported"),
])
def test_tools_and_tool_choice_given_wrong_are_400s_naming_the_field(extra, param, words):
    err = parse_error(chat(**extra))
    assert err.param == param and words in err.message, err.message


@pytest.mark.parametrize("extra", [{"tools": TOOLS}, {"tool_choice": "required"}, {"parallel_tool_calls": False}])
def test_completions_take_no_tools(extra):
    err = parse_error({"model": "m", "prompt": "hi", **extra}, "completions")
    assert err.param == next(iter(extra)) and "/v1/chat/completions parameter" in err.message


def test_a_tool_calling_conversation_reaches_the_template():
    """An assistant message with tool_calls (null content) and a tool message with tool_call_id: their
    fields are kept for the template, the arguments' JSON text parsed into an object (as vLLM passes it)."""
    request = parse_request("chat", chat(messages=HISTORY, tools=TOOLS, tool_choice="none"), "m")
    assistant, answer = request.messages[1], request.messages[2]
    assert assistant["content"] == "" and assistant["tool_calls"] == [
        {"id": "w20", "type": "function", "function": {"name": "w07", "arguments": {"arg": "w21"}}}]
    assert answer == {"role": "tool", "content": "w22", "tool_call_id": "w20"}
    assert "tool_calls" not in request.messages[0] and "tool_call_id" not in request.messages[0]


@pytest.mark.parametrize("message, param, words", [
    ({"role": "user", "content": "w10", "tool_calls": []}, "messages[0].tool_calls", "only allowed on an assistant"),
    ({"role": "assistant", "content": None, "tool_calls": {"id": "x"}}, "messages[0].tool_calls", "must be a list"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}, "messages[0].tool_calls[0]",
     "'function'"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
     "messages[0].tool_calls[0].function.name", "non-empty string"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{nope"}}]},
     "messages[0].tool_calls[0].function.arguments", "must be JSON text"),
    ({"role": "tool", "content": "w22", "tool_call_id": 7}, "messages[0].tool_call_id", "must be the id"),
    ({"role": "user", "content": "w22", "tool_call_id": "x"}, "messages[0].tool_call_id",
     "only allowed on a tool message, not a 'user' one"),
    ({"role": "assistant", "content": "w22", "tool_call_id": "x"}, "messages[0].tool_call_id",
     "only allowed on a tool message, not an 'assistant' one"),  # "an" before a vowel
    ({"role": "tool", "content": "w22", "tool_calls": []}, "messages[0].tool_calls",
     "only allowed on an assistant message, not a 'tool' one"),
])
def test_tool_calling_messages_given_wrong_are_400s_naming_the_field(message, param, words):
    err = parse_error(chat(messages=[message]))
    assert err.param == param and words in err.message, err.message


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def tool_server(target_model):
    """The tiny target (plain decoding) with a chat template that renders tools and tool calls; tool_choice
    auto parses hermes tool calls."""
    with running(make_spec(target_model, tool_tokenizer(), "none"), enable_auto_tool_choice=True,
                 tool_call_parser="hermes") as srv:
        yield srv


@pytest.fixture(scope="module")
def tool_reference(reference, tokenizer):
    """reference(messages, max_tokens, tools) -> greedy text of the prompt the tool template renders."""
    template_tokenizer = tool_tokenizer()

    def text(messages, max_tokens: int, tools=None) -> str:
        request = parse_request("chat", chat(messages=messages, tools=tools, tool_choice="none"), "m")
        ids = encode_prompt(template_tokenizer, list(request.messages), tools=tools)
        return reference(tuple(ids), max_tokens)

    return text


def test_tool_choice_none_renders_the_tools_and_answers_text(tool_server, tool_reference):
    """The tools change the prompt (the template renders them), not how it is decoded: the answer is the
    plain greedy continuation of the rendered prompt."""
    status, _, body = http_call(tool_server, "POST", "/v1/chat/completions", {**CHAT, "tools": TOOLS,
                                                                               "tool_choice": "none"})
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert message["content"] == tool_reference(USER, 8, TOOLS) != tool_reference(USER, 8)
    assert "tool_calls" not in message


def test_a_tool_calling_conversation_is_answered(tool_server, tool_reference):
    body = {**CHAT, "messages": HISTORY, "tools": TOOLS, "tool_choice": "none"}
    status, _, payload = http_call(tool_server, "POST", "/v1/chat/completions", body)
    assert status == 200, payload
    assert payload["choices"][0]["message"]["content"] == tool_reference(HISTORY, 8, TOOLS)


def test_tokenize_renders_the_tools_as_chat_completions_do(tool_server):
    tokenizer = tool_tokenizer()
    status, _, body = http_call(tool_server, "POST", "/tokenize", {"model": MODEL, "messages": USER, "tools": TOOLS})
    assert status == 200, body
    assert body["tokens"] == encode_prompt(tokenizer, USER, tools=TOOLS) != encode_prompt(tokenizer, USER)
    status, _, chat_body = http_call(tool_server, "POST", "/v1/chat/completions",
                                     {**CHAT, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1})
    assert chat_body["usage"]["prompt_tokens"] == body["count"]
    status, _, error = http_call(tool_server, "POST", "/tokenize", {"model": MODEL, "prompt": "w05", "tools": TOOLS})
    assert status == 400 and error["error"]["param"] == "tools"


def test_tool_choice_auto_without_the_servers_tool_parser_is_a_400_naming_the_flags(server):
    for body in ({**CHAT, "tools": TOOLS}, {**CHAT, "tools": TOOLS, "tool_choice": "auto"}):
        status, _, error = http_call(server, "POST", "/v1/chat/completions", body)
        assert status == 400 and error["error"]["param"] == "tool_choice", error
        assert "--enable-auto-tool-choice and --tool-call-parser" in error["error"]["message"]
    assert parse_request("chat", chat(tools=TOOLS), "m", tool_parser="hermes").tool_use.choice == "auto"


def test_auto_leaves_an_answer_without_tool_calls_as_it_is(tool_server, tool_reference):
    """No <tool_call> in the output: the answer is the plain greedy continuation of the rendered prompt."""
    status, _, body = http_call(tool_server, "POST", "/v1/chat/completions", {**CHAT, "tools": TOOLS})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["message"]["content"] == tool_reference(USER, 8, TOOLS) and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] in ("stop", "length")


# --------------------------------------------------------------------------- a model that calls a tool

WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCRIPT_TEXT = "".join(SCRIPT)


@pytest.fixture(scope="module")
def script():
    tokenizer = script_tokenizer()
    return tokenizer, scripted_model(tokenizer)


@pytest.fixture(scope="module")
def script_server(script):
    """The scripted model (it answers every chat prompt with `SCRIPT`: some text, then a hermes tool call),
    drafted by a copy of itself (whole steps accepted), tool_choice auto enabled."""
    tokenizer, model = script
    with running(make_spec(model, tokenizer, "draft-model", model), enable_auto_tool_choice=True,
                 tool_call_parser="hermes") as srv:
        yield srv


@pytest.fixture(scope="module")
def script_client(script_server):
    return openai.OpenAI(base_url=script_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def script_greedy(script, messages, tools, max_tokens: int = 32) -> list[int]:
    """Plain greedy decoding (HF forward, no specula code) of the prompt the template renders."""
    tokenizer, model = script
    ids = encode_prompt(tokenizer, messages, tools=tools)
    return reference_greedy(model, ids, max_tokens, eos=tokenizer.eos_token_id)


def test_auto_turns_a_hermes_tool_call_into_tool_calls(script_client):
    out = script_client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER], temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_generates_exactly_what_plain_greedy_decoding_does(script, script_server):
    """Tool calling changes the response, never the tokens: the generated tokens (logprobs' tokens, usage) are
    plain greedy decoding's of the rendered prompt, and the message is that text parsed."""
    tokenizer = script[0]
    expected = script_greedy(script, WEATHER_ASK, [WEATHER])
    body = {"model": MODEL, "messages": WEATHER_ASK, "tools": [WEATHER], "temperature": 0, "logprobs": True}
    status, _, payload = http_call(script_server, "POST", "/v1/chat/completions", body)
    assert status == 200, payload
    choice = payload["choices"][0]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [tokenizer.decode([t]) for t in expected]
    assert payload["usage"]["completion_tokens"] == len(expected)
    assert payload["usage"]["prompt_tokens"] == len(encode_prompt(tokenizer, WEATHER_ASK, tools=[WEATHER]))
    content, calls = HermesParser().feed(tokenizer.decode(expected, skip_special_tokens=True))
    assert choice["message"]["content"] == content and [c["function"] for c in choice["message"]["tool_calls"]] == [
        c["function"] for c in calls]


def test_tool_choice_none_leaves_the_tool_call_as_text(script_client):
    out = script_client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER],
                                                tool_choice="none", temperature=0)
    assert out.choices[0].message.content == SCRIPT_TEXT and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


def test_an_output_cut_by_max_tokens_says_length(script_client):
    """Cut inside the block: what JSON came is whole, so it is the call (as vLLM reads an unclosed block);
    cut before it: the text. Either way finish_reason says the output was cut."""
    def ask(max_tokens):
        return script_client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER],
                                                     temperature=0, max_tokens=max_tokens).choices[0]

    cut = ask(3)
    assert cut.message.content == "Let me check." and cut.message.tool_calls[0].function.name == "get_weather"
    assert cut.finish_reason == "length"
    before = ask(2)
    assert before.message.content == "Let me check.<tool_call>" and not before.message.tool_calls
    assert before.finish_reason == "length"


def test_streamed_tool_calls_add_up_to_the_response(script_client):
    """Content streams until the tool call opens (no piece of the tag leaks); the call, one token here (see
    test_serve_tool_stream for one of several), comes in one delta; the last chunk says tool_calls; usage
    and logprobs are those of the whole response."""
    args = dict(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER], temperature=0, logprobs=True, n=2)
    whole = script_client.chat.completions.create(**args)
    chunks = list(script_client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    for index in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        content = "".join(c.delta.content or "" for c in mine)
        assert content == whole.choices[index].message.content == "Let me check."
        assert all("<" not in (c.delta.content or "") for c in mine)
        deltas = [d for c in mine for d in (c.delta.tool_calls or [])]
        (delta,) = deltas
        assert delta.index == 0 and delta.id.startswith("chatcmpl-tool-") and delta.type == "function"
        assert delta.function.name == "get_weather" and json.loads(delta.function.arguments) == {"city": "Paris"}
        assert mine[-1].finish_reason == "tool_calls" and [c.finish_reason for c in mine[:-1]] == [None] * (
            len(mine) - 1)
        tokens = [e.token for c in mine if c.logprobs for e in c.logprobs.content]
        assert tokens == [e.token for e in whole.choices[index].logprobs.content]


def test_a_tool_calling_conversation_continues(script_client, script):
    """The call and the tool's answer go back in; the template writes them; the model answers."""
    history = [*WEATHER_ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny"}]
    out = script_client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0)
    tokenizer = script[0]
    prompt = tokenizer.decode(encode_prompt(tokenizer, [*history[:1], {**history[1], "tool_calls": [
        {**history[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        history[2]], tools=[WEATHER]))
    assert f"<tool_call>{json.dumps({'name': 'get_weather', 'arguments': {'city': 'Paris'}})}</tool_call>" in prompt
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert out.choices[0].finish_reason == "tool_calls"


def test_run_batch_parses_tool_calls_when_given_the_parser(script, tmp_path):
    from specula.serve.batch import read_batch, run_batch

    tokenizer, model = script
    body = {"model": MODEL, "messages": WEATHER_ASK, "tools": [WEATHER], "temperature": 0}
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": body}) + "\n")
    for parser, status in ((None, 400), ("hermes", 200)):
        run_batch(make_spec(model, tokenizer, "none"), read_batch(source), tmp_path / "out.jsonl", MODEL,
                  tool_parser=parser)
        (answer,) = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert answer["response"]["status_code"] == status
    message = answer["response"]["body"]["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather" and message["content"] == "Let me check."


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "llama4_pythonic", "mistral", "pythonic"])
def test_auto_parses_with_the_parser_the_server_was_started_with(parser):
    """--tool-call-parser reaches the request's tool use, which picks the output's parser by it."""
    request = parse_request("chat", chat(tools=TOOLS), "m", tool_parser=parser)
    assert request.tool_use.choice == "auto" and request.tool_use.parser == parser


@pytest.mark.parametrize("command", ["serve", "run-batch"])
@pytest.mark.parametrize("args, message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser, one of hermes, "
     "llama3_json, llama4_pythonic, mistral, pythonic: the format the model writes its tool calls in (e.g. "
     "--tool-call-parser hermes)"),
    (["--tool-call-parser", "granite"],
     "--tool-call-parser 'granite' is not one this server has; choose hermes, llama3_json, llama4_pythonic, "
     "mistral, pythonic"),
])
def test_the_tool_flags_given_wrong_fail_in_one_line(tmp_path, capsys, command, args, message):
    from specula.cli import main

    source = tmp_path / "in.jsonl"
    source.write_text("")
    extra = ["-i", str(source), "-o", str(tmp_path / "out.jsonl")] if command == "run-batch" else []
    assert main([command, "--target", str(tmp_path / "no-model"), *extra, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, err


# --------------------------------------------------------------------------- required and a named tool

TIME = tool("get_time")  # no parameters: its arguments are an object ({} when empty), as vLLM's schema says
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def close_the_list(script) -> dict[str, float]:
    """logit_bias that makes the scripted model close objects and lists where it may (it has no opinion where
    the grammar forbids its script, and would add properties and calls until max_tokens)."""
    return {str(script[0].convert_tokens_to_ids(c)): 5.0 for c in "}]"}


def test_required_and_named_become_the_request_constraint():
    from specula.constraints import Constraint

    tools = [WEATHER, TIME]
    required = parse_request("chat", chat(tools=tools, tool_choice="required"), "m")
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}}}, "required": ["name", "parameters"]}]}}
    assert required.constraint == Constraint.json_schema(schema) and required.constraint_param == "tool_choice"
    named = parse_request("chat", chat(tools=tools, tool_choice=NAMED), "m")
    assert named.constraint == Constraint.json_schema(WEATHER["function"]["parameters"])
    time = parse_request("chat", chat(tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}}),
                         "m")
    assert time.constraint == Constraint.json_schema({"type": "object", "properties": {}})


@pytest.mark.parametrize("extra, param, words", [
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with response_format"),
    ({"tool_choice": NAMED, "guided_regex": "a+"}, "tool_choice", "cannot be combined with guided_regex"),
    ({"tool_choice": "required", "min_tokens": 2}, "min_tokens", "cannot be combined with tool_choice"),
    ({"tool_choice": NAMED, "tools": [tool("get_weather", {"type": "objekt"})]}, "tools", "objekt"),
])
def test_a_tool_constraint_given_wrong_is_a_400(extra, param, words):
    err = parse_error(chat(**{"tools": [WEATHER, TIME], **extra}))
    assert err.param == param and words in err.message, err.message


def test_a_tool_constraint_the_tokenizer_cannot_write_names_tool_choice(server):
    """The word-level test tokenizer carries no bytes a grammar could match: found by the worker."""
    status, _, error = http_call(server, "POST", "/v1/chat/completions",
                                 {**CHAT, "tools": [WEATHER], "tool_choice": "required"})
    assert status == 400 and error["error"]["param"] == "tool_choice", error


def test_required_answers_tool_calls(script_client, script):
    out = script_client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER, TIME],
                                                tool_choice="required", temperature=0,
                                                logit_bias=close_the_list(script))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.id.startswith("chatcmpl-tool-") and call.function.name in ("get_weather", "get_time")
    assert json.loads(call.function.arguments) == ({"city": "Paris"} if call.function.name == "get_weather" else {})


def test_a_named_tool_answers_its_call(script_client):
    out = script_client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER, TIME],
                                                tool_choice=NAMED, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's and vLLM's rule for a named tool
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'


def test_required_generates_what_its_schema_as_guided_json_generates(script, script_server):
    """required is structured output with vLLM's schema, nothing more: the same tokens as guided_json with that
    schema (and the tools rendered, their output left as text)."""
    from specula.serve.tools import ToolUse

    tools = [WEATHER, TIME]
    base = {"model": MODEL, "messages": WEATHER_ASK, "tools": tools, "temperature": 0, "logprobs": True,
            "logit_bias": close_the_list(script)}
    _, _, required = http_call(script_server, "POST", "/v1/chat/completions", {**base, "tool_choice": "required"})
    schema = ToolUse(tuple(tools), "required").schema()
    _, _, guided = http_call(script_server, "POST", "/v1/chat/completions",
                             {**base, "tool_choice": "none", "guided_json": schema})
    tokens = [[e["token"] for e in body["choices"][0]["logprobs"]["content"]] for body in (required, guided)]
    assert tokens[0] == tokens[1] and required["usage"] == guided["usage"]
    (call,) = required["choices"][0]["message"]["tool_calls"]
    listed = json.loads(guided["choices"][0]["message"]["content"])
    assert [{"name": call["function"]["name"], "parameters": json.loads(call["function"]["arguments"])}] == listed


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_streamed_required_and_named_calls_add_up_to_the_response(script_client, script, choice):
    args = dict(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER], tool_choice=choice, temperature=0,
                logit_bias=close_the_list(script))
    whole = script_client.chat.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in script_client.chat.completions.create(**args, stream=True)]
    assert "".join(c.delta.content or "" for c in chunks) == ""
    deltas = [d for c in chunks for d in (c.delta.tool_calls or [])]
    assert deltas[0].id.startswith("chatcmpl-tool-") and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == whole.message.tool_calls[0].function.arguments
    assert chunks[-1].finish_reason == whole.finish_reason == ("tool_calls" if choice == "required" else "stop")


def test_required_gathers_the_tools_defs_where_their_refs_point():
    """A tool's parameters with `$defs` (as pydantic writes them): under required, each tool's schema sits
    inside the list's items, so its `#/$defs/...` refs would point nowhere; they go to the root, as vLLM
    puts them, and two tools giving one name two schemas is a 400."""
    from specula.serve.tools import ToolUse

    city = {"type": "object", "properties": {"name": {"type": "string"}}}
    located = tool("locate", {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
                              "$defs": {"City": city}})
    schema = ToolUse((located, WEATHER), "required").schema()
    assert schema["$defs"] == {"City": city} and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert located["function"]["parameters"]["$defs"] == {"City": city}  # the request's tool is left as it was
    assert parse_request("chat", chat(tools=[located], tool_choice="required"), "m").constraint is not None
    other = tool("other", {"type": "object", "properties": {}, "$defs": {"City": {"type": "string"}}})
    err = parse_error(chat(tools=[located, other], tool_choice="required"))
    assert err.param == "tools" and "Tool definition 'City' has multiple schemas" in err.message
