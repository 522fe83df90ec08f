"""Tool calling on /v1/chat/completions, as vLLM's OpenAI server does it: tools rendered by the chat
template, the tool-calling conversation's messages, tool_choice checked with 400s naming the field."""

from __future__ import annotations

import pytest

from serve_helpers import MODEL, http_call, make_spec, running
from tool_kit import TOOLS, tool, tool_tokenizer

from specula.prompts import encode_prompt
from specula.serve.protocol import APIError, parse_request

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
    request = parse_request("chat", chat(tools=TOOLS, tool_choice="none"), "m")
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
    ({"role": "user", "content": "w22", "tool_call_id": "x"}, "messages[0].tool_call_id", "only allowed on a tool"),
])
def test_tool_calling_messages_given_wrong_are_400s_naming_the_field(message, param, words):
    err = parse_error(chat(messages=[message]))
    assert err.param == param and words in err.message, err.message


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def tool_server(target_model):
    """The tiny target (plain decoding) with a chat template that renders tools and tool calls."""
    with running(make_spec(target_model, tool_tokenizer(), "none")) as srv:
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
