"""vLLM's chat template options on the server: `add_generation_prompt` (default true) and
`continue_final_message` (default false). With continue_final_message and no generation prompt, the last
message is rendered open (no end of turn: "w03" in the tests' template) and the model continues it; with echo
the answer is the whole message. Prompt ids are checked against a plain rendering of the template."""

from __future__ import annotations

import json

import pytest

from serve_helpers import MODEL, chat_ids, http_call, text_ids

PREFILLED = [{"role": "user", "content": "w05 w06"}, {"role": "assistant", "content": "w10 w11"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
OPEN = "w02 w05 w06 w03 w02 w10 w11"
"""PREFILLED rendered with the assistant's message left open (the template: `w02 {content} w03` a message, then
`w04` for the generation prompt)."""


def _post(server, path, body) -> tuple[int, dict | str]:
    status, _, payload = http_call(server, "POST", path, {"model": MODEL, **body})
    return status, payload


def _chat(server, messages, **extra) -> dict:
    status, body = _post(server, "/v1/chat/completions",
                         {"messages": messages, "max_tokens": 6, "temperature": 0, **extra})
    assert status == 200, body
    return body


def test_the_last_message_is_rendered_open(server, tokenizer):
    open_ids = list(text_ids(tokenizer, OPEN))
    for options, text in ((CONTINUE, OPEN), ({"add_generation_prompt": False}, OPEN + " w03"),
                          ({}, OPEN + " w03 w04")):
        status, body = _post(server, "/tokenize", {"messages": PREFILLED, **options})
        assert status == 200 and body["tokens"] == list(text_ids(tokenizer, text)), (options, body)
    assert open_ids == list(chat_ids(tokenizer, PREFILLED))[:len(open_ids)]  # the default prompt, less its end
    status, body = _post(server, "/tokenize", {"prompt": "w05", "continue_final_message": True})
    assert status == 400 and body["error"]["param"] == "continue_final_message"


def test_the_output_continues_the_final_message(server, tokenizer, reference):
    open_ids = text_ids(tokenizer, OPEN)
    body = _chat(server, PREFILLED, **CONTINUE)
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": reference(open_ids, 6), "refusal": None}
    assert body["usage"]["prompt_tokens"] == len(open_ids)
    assert body["usage"]["completion_tokens"] == len(reference.tokens(open_ids, 6))
    assert message["content"] != _chat(server, PREFILLED)["choices"][0]["message"]["content"]  # not a new turn


def test_echo_with_continue_final_message_answers_the_whole_message(server, tokenizer, reference):
    whole = "w10 w11" + reference(text_ids(tokenizer, OPEN), 6)
    body = _chat(server, PREFILLED, echo=True, **CONTINUE)
    assert body["choices"][0]["message"]["content"] == whole
    status, events = _post(server, "/v1/chat/completions", {"messages": PREFILLED, "max_tokens": 6, "temperature": 0,
                                                            "stream": True, "echo": True, **CONTINUE})
    assert status == 200
    chunks = [json.loads(e[len("data: "):]) for e in events.split("\n\n") if e and e != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[:2] == [{"role": "assistant", "content": ""}, {"content": "w10 w11"}]
    assert "".join(d.get("content", "") for d in deltas) == whole


def test_without_the_generation_prompt_the_answer_has_the_last_messages_role(server, tokenizer, reference):
    """vLLM's role: the assistant's after the generation prompt, else the last message's, whose continuation
    the output is (transformers and vLLM continue a last message of any role)."""
    user_last = PREFILLED[:1]
    body = _chat(server, user_last, echo=True, **CONTINUE)
    ids = text_ids(tokenizer, "w02 w05 w06")
    assert body["choices"][0]["message"]["role"] == "user"
    assert body["choices"][0]["message"]["content"] == "w05 w06" + reference(ids, 6)
    closed = _chat(server, PREFILLED, add_generation_prompt=False)
    assert closed["choices"][0]["message"]["role"] == "assistant"
    assert closed["choices"][0]["message"]["content"] == reference(text_ids(tokenizer, OPEN + " w03"), 6)
    status, events = _post(server, "/v1/chat/completions", {"messages": user_last, "max_tokens": 2, "stream": True,
                                                            "add_generation_prompt": False})
    assert status == 200 and json.loads(events.split("\n\n")[0][len("data: "):])["choices"][0]["delta"] == {
        "role": "user", "content": ""}


@pytest.mark.parametrize("extra, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is true by default
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"add_generation_prompt": "no"}, "add_generation_prompt"),
    ({"continue_final_message": 1, "add_generation_prompt": False}, "continue_final_message"),
])
def test_options_given_wrong_are_a_400(server, extra, param):
    status, body = _post(server, "/v1/chat/completions", {"messages": PREFILLED, **extra})
    assert status == 400 and body["error"]["param"] == param
    if extra.get("continue_final_message") is True:
        message = body["error"]["message"]
        assert "Cannot set both `continue_final_message` and `add_generation_prompt` to True." in message


def test_run_batch_continues_the_final_message_too(target_model, tokenizer, reference, tmp_path):
    from serve_helpers import make_spec
    from specula.serve.batch import read_batch, run_batch

    body = {"messages": PREFILLED, "max_tokens": 6, "temperature": 0, "echo": True, **CONTINUE}
    (tmp_path / "in.jsonl").write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                                   "body": body}) + "\n")
    run_batch(make_spec(target_model, tokenizer, "prompt-lookup"), read_batch(tmp_path / "in.jsonl"),
              tmp_path / "out.jsonl", MODEL)
    answer = json.loads((tmp_path / "out.jsonl").read_text())["response"]["body"]
    assert answer["choices"][0]["message"]["content"] == "w10 w11" + reference(text_ids(tokenizer, OPEN), 6)
