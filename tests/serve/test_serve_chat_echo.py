"""Chat completions' `echo` (vLLM's extension): each choice's content starts with the last message's content
when that message has the answer's role (an assistant message), streamed as one chunk a choice after the role
chunks; the usage counts the generated tokens only."""

from __future__ import annotations

import json

import pytest

from serve_helpers import MODEL, chat_ids, http_call

ASSISTANT_LAST = [{"role": "user", "content": "w05 w06"}, {"role": "assistant", "content": "w10 w11"}]
USER_LAST = [{"role": "assistant", "content": "w10 w11"}, {"role": "user", "content": "w05 w06"}]


def _chat(server, messages, **extra) -> dict:
    status, _, body = http_call(server, "POST", "/v1/chat/completions",
                                {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, **extra})
    assert status == 200, body
    return body


def _events(server, messages, **extra) -> list[dict]:
    status, _, body = http_call(server, "POST", "/v1/chat/completions",
                                {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0,
                                 "stream": True, **extra})
    assert status == 200, body
    events = [e[len("data: "):] for e in body.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_echo_puts_the_last_assistant_message_before_each_choice(server, tokenizer, reference):
    ids = chat_ids(tokenizer, ASSISTANT_LAST)
    body = _chat(server, ASSISTANT_LAST, echo=True, n=2)
    assert [c["message"]["content"] for c in body["choices"]] == ["w10 w11" + reference(ids, 6)] * 2
    assert [c["message"]["role"] for c in body["choices"]] == ["assistant"] * 2
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == 2 * len(reference.tokens(ids, 6))  # the echo is not generated
    plain = _chat(server, ASSISTANT_LAST, echo=False)
    assert plain["choices"][0]["message"]["content"] == reference(ids, 6)


def test_streamed_echo_is_one_chunk_a_choice_after_the_roles(server, tokenizer, reference):
    ids = chat_ids(tokenizer, ASSISTANT_LAST)
    chunks = _events(server, ASSISTANT_LAST, echo=True, n=2, logprobs=True)
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["logprobs"]) for c in chunks]
    role = {"role": "assistant", "content": ""}
    assert deltas[:4] == [(0, role, None), (1, role, None),
                          (0, {"content": "w10 w11"}, None), (1, {"content": "w10 w11"}, None)]
    for index in (0, 1):
        mine = [(delta, lp) for i, delta, lp in deltas[4:] if i == index]
        assert "".join(delta.get("content", "") for delta, _ in mine) == reference(ids, 6)
        assert sum(len(lp["content"]) for _, lp in mine if lp) == len(reference.tokens(ids, 6))  # generated only


@pytest.mark.parametrize("stream", [False, True])
def test_echo_adds_nothing_when_the_last_message_is_not_the_assistants(server, tokenizer, reference, stream):
    """vLLM echoes the last message only when it has the answer's role (assistant, with the generation prompt)."""
    ids = chat_ids(tokenizer, USER_LAST)
    if not stream:
        assert _chat(server, USER_LAST, echo=True)["choices"][0]["message"]["content"] == reference(ids, 6)
        return
    chunks = _events(server, USER_LAST, echo=True)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:]) == reference(ids, 6)


def test_echo_must_be_a_boolean(server):
    status, _, body = http_call(server, "POST", "/v1/chat/completions",
                                {"model": MODEL, "messages": ASSISTANT_LAST, "echo": "yes"})
    assert status == 400 and body["error"]["param"] == "echo" and "boolean" in body["error"]["message"]


def test_echo_beside_tool_calls_is_text_as_vllm_writes_it():
    """vLLM writes the echo before the content, and the content as text ("" for none) under echo."""
    from specula.serve.protocol import ChoiceResult, _message

    call = [{"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert _message(ChoiceResult(0, "", "tool_calls", tool_calls=call))["content"] is None
    assert _message(ChoiceResult(0, "", "tool_calls", tool_calls=call, echo=""))["content"] == ""
    assert _message(ChoiceResult(0, "w05", "tool_calls", tool_calls=call, echo="w10 "))["content"] == "w10 w05"
