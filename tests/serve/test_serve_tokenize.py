"""vLLM's /tokenize and /detokenize: the server's own encoding of a completions prompt or of chat
messages (its chat template), and token ids back to text."""

from __future__ import annotations

import pytest

from serve_helpers import MODEL, chat_ids, http_call, text_ids


def test_tokenize_a_prompt_as_completions_encode_it(server, tokenizer):
    status, _, body = http_call(server, "POST", "/tokenize", {"model": MODEL, "prompt": "w05 w06 w07"})
    assert status == 200
    assert body["tokens"] == list(text_ids(tokenizer, "w05 w06 w07")) and body["count"] == 3
    assert body["max_model_len"] == server.worker.max_context


def test_tokenize_messages_through_the_chat_template(server, tokenizer):
    messages = [{"role": "system", "content": "w70"}, {"role": "user", "content": "w05"}]
    status, _, body = http_call(server, "POST", "/tokenize", {"messages": messages})
    assert status == 200 and body["tokens"] == list(chat_ids(tokenizer, messages))


def test_detokenize_gives_the_text_back(server, tokenizer):
    ids = list(text_ids(tokenizer, "w05 w06 w07"))
    status, _, body = http_call(server, "POST", "/detokenize", {"model": MODEL, "tokens": ids})
    assert status == 200 and body["prompt"] == "w05 w06 w07"


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "w05", "messages": [{"role": "user", "content": "w05"}]}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": ["w05", "w06"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "w05 \udcff"}, 400, "prompt"),  # a lone surrogate: was a 500 (TypeError)
    ("/tokenize", {"messages": [{"role": "user", "content": "w05 \ud800"}]}, 400, "messages[0].content"),
    ("/tokenize", {"model": "gpt-4", "prompt": "w05"}, 404, "model"),
    ("/detokenize", {"tokens": "w05"}, 400, "tokens"),
    ("/detokenize", {"tokens": [5, 100_000]}, 400, "tokens"),
])
def test_bad_requests_name_the_parameter(server, path, body, status, param):
    got, _, payload = http_call(server, "POST", path, body)
    assert (got, payload["error"]["param"]) == (status, param), payload
