"""Tool calling on a real model (Qwen2.5-Coder-0.5B-Instruct, whose chat template renders tools in the
hermes style; slow): the tools reach the prompt, tool_choice auto generates plain greedy decoding's tokens
and parses them, required and a named tool answer tool calls."""

from __future__ import annotations

import json

import pytest

from serve_helpers import http_call

from specula.models import install as inst
from specula.sampling import SamplingParams
from specula.serve import ServerConfig, create_server
from specula.serve.tool_calls import HermesParser

pytestmark = pytest.mark.slow

MODEL = "qwen2.5-coder-0.5b"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def qwen():
    import specula.api as specula

    status = inst.state(MODEL).status
    if status != inst.CONVERTED:
        pytest.skip(f"{MODEL} is {status}; run `specula models install {MODEL}`")
    return specula.load(MODEL, method="prompt-lookup")


@pytest.fixture(scope="module")
def qwen_server(qwen):
    server = create_server(qwen, ServerConfig(model_name=MODEL, port=0, max_batch_size=1,
                                              enable_auto_tool_choice=True, tool_call_parser="hermes")).start()
    try:
        yield server
    finally:
        server.close()


def ask(server, **extra) -> dict:
    status, _, body = http_call(server, "POST", "/v1/chat/completions",
                                {"model": MODEL, "messages": ASK, "tools": [WEATHER], "temperature": 0,
                                 "max_tokens": 48, **extra})
    assert status == 200, body
    return body


def test_the_template_renders_the_tools(qwen_server):
    counts = []
    for extra in ({}, {"tools": [WEATHER]}):
        status, _, body = http_call(qwen_server, "POST", "/tokenize", {"model": MODEL, "messages": ASK, **extra})
        assert status == 200, body
        counts.append(body["count"])
    assert counts[1] > counts[0] + 20  # the tool's JSON and the hermes instructions
    status, _, text = http_call(qwen_server, "POST", "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert "<tools>" in text["prompt"] and '"get_weather"' in text["prompt"] and "<tool_call>" in text["prompt"]


def test_auto_generates_plain_greedy_decodings_tokens_and_parses_them(qwen, qwen_server):
    from specula.api import build_decoder
    from specula.prompts import encode_prompt

    ids = encode_prompt(qwen.tokenizer, ASK, tools=[WEATHER])
    plain = build_decoder("none", qwen.target, qwen.tokenizer).generate(ids, SamplingParams(max_new_tokens=48))
    body = ask(qwen_server, logprobs=True)
    choice = body["choices"][0]
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == len(plain.token_ids)
    assert len(choice["logprobs"]["content"]) == len(plain.token_ids)
    parser = HermesParser()
    content, calls = parser.feed(plain.text)
    rest, more = parser.finish()
    content, calls = content + rest, calls + more
    message = choice["message"]
    assert message["content"] == (content or None if calls else content)
    assert [c["function"] for c in message.get("tool_calls", [])] == [c["function"] for c in calls]


def test_required_and_a_named_tool_answer_tool_calls(qwen_server):
    required = ask(qwen_server, tool_choice="required", max_tokens=128)["choices"][0]
    assert required["finish_reason"] == "tool_calls" and required["message"]["content"] is None
    assert {c["function"]["name"] for c in required["message"]["tool_calls"]} == {"get_weather"}
    assert all("city" in json.loads(c["function"]["arguments"]) for c in required["message"]["tool_calls"])
    named = ask(qwen_server, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                max_tokens=128)["choices"][0]
    assert named["finish_reason"] == "stop"
    (call,) = named["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
