"""The OpenAI-compatible server over real HTTP, driven by the official `openai` client:
responses equal offline decoding, streaming format, stop strings, errors, metrics, health."""

from __future__ import annotations

import http.client
import json
import socket

import openai
import pytest

from serve_helpers import EOS, MODEL, chat_ids, http_call, make_spec, running, scrape, text_ids

from specula.sampling import SamplingParams

PROMPTS = ["w05 w06 w07", "w10 w11 w12 w10 w11", "w40 w03 w77 w08 w09 w30", "w02", "w60 w61 w62 w63 w64 w65 w66"]
SPEC_KEYS = {"method", "steps", "drafted_tokens", "accepted_tokens", "mean_accepted_tokens", "acceptance_rate",
             "tokens_per_s"}


def check_speculation(sd: dict, completion_tokens: int) -> None:
    assert SPEC_KEYS <= set(sd)
    assert sd["method"] == "draft-model"
    assert sd["steps"] >= 1 and sd["drafted_tokens"] >= 1
    assert 0 <= sd["accepted_tokens"] <= sd["drafted_tokens"]
    assert sd["acceptance_rate"] == pytest.approx(sd["accepted_tokens"] / sd["drafted_tokens"], abs=1e-4)
    # Every step emits its accepted tokens plus one; the last step may be cut (EOS / max_tokens).
    assert sd["steps"] <= completion_tokens <= sd["accepted_tokens"] + sd["steps"]
    assert sd["mean_accepted_tokens"] >= 1.0


def long_prompt(tokenizer, reference, words: int = 8) -> tuple[str, str]:
    """A prompt whose greedy continuation has at least `words` words (no early EOS)."""
    for prompt in PROMPTS:
        full = reference(text_ids(tokenizer, prompt), 24)
        if len(full.split()) >= words:
            return prompt, full
    raise AssertionError("no prompt with a long enough continuation")


# --------------------------------------------------------------------------- completions & chat


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_offline(client, tokenizer, reference, prompt):
    ids = text_ids(tokenizer, prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == MODEL
    assert isinstance(out.created, int)
    choice = out.choices[0]
    assert choice.index == 0 and choice.logprobs is None
    assert choice.text == reference(ids, 24)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    expected = reference.tokens(ids, 24)
    assert out.usage.completion_tokens == len(expected)
    assert choice.finish_reason == ("stop" if expected[-1] == EOS else "length")
    check_speculation(out.speculative_decoding, out.usage.completion_tokens)


def test_completion_default_max_tokens_is_16_and_prompt_list(client, tokenizer, reference):
    prompt, full = long_prompt(tokenizer, reference, words=16)
    out = client.completions.create(model=MODEL, prompt=[prompt], temperature=0)
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
    assert out.choices[0].text == reference(text_ids(tokenizer, prompt), 16)
    by_ids = client.completions.create(model=MODEL, prompt=list(text_ids(tokenizer, prompt)), temperature=0)
    assert by_ids.choices[0].text == out.choices[0].text


@pytest.mark.parametrize("named", [None, ""])
def test_a_request_naming_no_model_is_for_the_served_one(server, tokenizer, reference, named):
    """No `model` (or an empty one), as vLLM takes it: the served model answers, and says its name."""
    body = {"prompt": "w05 w06 w07", "max_tokens": 6, "temperature": 0}
    if named is not None:
        body["model"] = named
    status, _, payload = http_call(server, "POST", "/v1/completions", body)
    assert status == 200 and payload["model"] == MODEL
    assert payload["choices"][0]["text"] == reference(text_ids(tokenizer, "w05 w06 w07"), 6)
    chat = {"messages": [{"role": "user", "content": "w05"}], "max_tokens": 4, "temperature": 0, "model": named}
    status, _, payload = http_call(server, "POST", "/v1/chat/completions", chat)
    assert status == 200 and payload["model"] == MODEL and payload["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("content", ["w05 w06 w07", "w09 w09 w09 w20"])
def test_chat_greedy_equals_offline(client, tokenizer, reference, content):
    messages = [{"role": "system", "content": "w70"}, {"role": "user", "content": content}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    message = out.choices[0].message
    assert message.role == "assistant"
    ids = chat_ids(tokenizer, messages)
    assert message.content == reference(ids, 20)
    assert out.usage.prompt_tokens == len(ids)
    check_speculation(out.speculative_decoding, out.usage.completion_tokens)


def test_chat_default_max_tokens_fills_the_context(server, tokenizer, reference):
    messages = [{"role": "user", "content": "w50 w51"}]
    status, _, body = http_call(server, "POST", "/v1/chat/completions",
                                {"model": MODEL, "messages": messages, "temperature": 0})
    assert status == 200
    n = body["usage"]["completion_tokens"]
    room = server.worker.max_context - len(chat_ids(tokenizer, messages))
    assert n <= min(room, server.config.chat_max_tokens)
    assert body["choices"][0]["finish_reason"] == ("length" if n == min(room, 512) else "stop")
    assert body["choices"][0]["message"]["content"] == reference(chat_ids(tokenizer, messages), n)


def test_streaming_chat_equals_offline(client, tokenizer, reference):
    messages = [{"role": "user", "content": "w05 w06 w07"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference(chat_ids(tokenizer, messages), 20)
    finishing, usage_chunk = chunks[-2], chunks[-1]
    assert finishing.choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens >= 1
    check_speculation(finishing.speculative_decoding, usage_chunk.usage.completion_tokens)
    assert usage_chunk.speculative_decoding == finishing.speculative_decoding


def test_streaming_completion_wire_format(server, tokenizer, reference):
    """Raw SSE: `data: {json}` events, the last one `data: [DONE]`, OpenAI's chunk fields."""
    status, headers, body = http_call(server, "POST", "/v1/completions",
                                      {"model": MODEL, "prompt": "w05 w06 w07", "max_tokens": 12, "temperature": 0,
                                       "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    for c in chunks:
        assert set(c) >= {"id", "object", "created", "model", "choices"}
        assert c["object"] == "text_completion"
        assert set(c["choices"][0]) == {"text", "index", "logprobs", "finish_reason"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference(text_ids(tokenizer, "w05 w06 w07"), 12)
    assert "speculative_decoding" in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


# --------------------------------------------------------------------------- stop strings


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_are_cut_from_the_text(client, tokenizer, reference, stream):
    prompt, full = long_prompt(tokenizer, reference)
    words = full.split()
    # A stop string that spans a token boundary and ends inside a token ("wA wB" -> "wA w" + first char).
    spanning = f"{words[3]} {words[4][:2]}"
    missing = "w999"
    for stop in ([spanning], spanning, [missing, f" {words[5]}"]):
        stops = [stop] if isinstance(stop, str) else stop
        cut = min(i for i in (full.find(s) for s in stops) if i >= 0) if any(s in full for s in stops) else None
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop)
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            out = client.completions.create(**kwargs)
            text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert cut is not None
        assert text == full[:cut], stop
        assert finish == "stop"


def test_stop_string_never_seen_changes_nothing(client, tokenizer, reference):
    prompt, full = long_prompt(tokenizer, reference)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=["w999"])
    assert out.choices[0].text == full


# --------------------------------------------------------------------------- sampling


def test_sampling_honours_default_temperature_top_p_and_seed(client, tokenizer, target_model, draft_model):
    """No temperature = OpenAI's 1.0: the server's output equals offline sampling with the same seed."""
    offline = make_spec(target_model, tokenizer, "draft-model", draft_model)
    ids = list(text_ids(tokenizer, "w05 w06 w07"))
    for extra, params in (({}, SamplingParams(temperature=1.0, seed=7, max_new_tokens=20)),
                          ({"top_p": 0.6, "temperature": 0.8}, SamplingParams(temperature=0.8, top_p=0.6, seed=7,
                                                                              max_new_tokens=20))):
        out = client.completions.create(model=MODEL, prompt="w05 w06 w07", max_tokens=20, seed=7, **extra)
        assert out.choices[0].text == offline.decoder.generate(ids, params).text
    greedy = offline.decoder.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=20)).text
    sampled = {client.completions.create(model=MODEL, prompt="w05 w06 w07", max_tokens=20, seed=s).choices[0].text
               for s in range(4)}
    assert sampled != {greedy}  # temperature 1 really samples


# --------------------------------------------------------------------------- models, health


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    status, _, body = http_call(server, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == MODEL and body["method"] == "draft-model"


# --------------------------------------------------------------------------- errors


def _err(server, method, path, body=None, raw=None, headers=None):
    status, _, payload = http_call(server, method, path, body, headers, raw)
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["message"]
    return status, payload["error"]


OK_COMPLETION = {"model": MODEL, "prompt": "w05 w06", "max_tokens": 4}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w05"}], "max_tokens": 4}
BAD_REQUESTS = [
    # (path, body, status, param)
    ("/v1/completions", {**OK_COMPLETION, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {**OK_CHAT, "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {**OK_COMPLETION, "model": 7}, 400, "model"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": "   "}, 400, "prompt"),  # no tokens
    ("/v1/completions", {**OK_COMPLETION, "prompt": ["w05", 5]}, 400, "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": ["w05", ""]}, 400, "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": [[5, 6], []]}, 400, "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": "w05"}, 400, "messages"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"content": "w05"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "wizard", "content": "w05"}]}, 400, "messages[0].role"),
    # a lone surrogate (an unpaired \\udcff escape) is not text a tokenizer reads: it was a 500 (TypeError)
    ("/v1/completions", {**OK_COMPLETION, "prompt": "w05 \udcff"}, 400, "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": ["w05", "w06 \ud800"]}, 400, "prompt"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": "w05 \ud800"}]}, 400,
     "messages[0].content"),
    ("/v1/completions", {**OK_COMPLETION, "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {**OK_COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**OK_COMPLETION, "max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/chat/completions", {**OK_CHAT, "max_tokens": 300}, 400, "max_tokens"),
    ("/v1/completions", {**OK_COMPLETION, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**OK_COMPLETION, "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {**OK_COMPLETION, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**OK_COMPLETION, "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {**OK_COMPLETION, "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {**OK_COMPLETION, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**OK_COMPLETION, "stop": 5}, 400, "stop"),
    ("/v1/completions", {**OK_COMPLETION, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {**OK_COMPLETION, "n": 0}, 400, "n"),
    ("/v1/completions", {**OK_COMPLETION, "n": 2.5}, 400, "n"),
    ("/v1/chat/completions", {**OK_CHAT, "n": 129}, 400, "n"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": ["w05"] * 65, "n": 2}, 400, "n"),
    ("/v1/completions", {**OK_COMPLETION, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {**OK_COMPLETION, "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {**OK_COMPLETION, "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {**OK_COMPLETION, "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/completions", {**OK_COMPLETION, "echo": "yes"}, 400, "echo"),
    ("/v1/chat/completions", {**OK_CHAT, "logprobs": 1}, 400, "logprobs"),
    ("/v1/chat/completions", {**OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**OK_CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**OK_CHAT, "echo": 1}, 400, "echo"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": [5, 500]}, 400, "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "best_of": 3}, 400, "best_of"),
    ("/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tool_choice"),  # tool_choice auto (the default with tools) needs --enable-auto-tool-choice
    ("/v1/completions", {**OK_COMPLETION, "min_tokens": 40}, 400, "min_tokens"),  # more than max_tokens
    ("/v1/completions", {**OK_COMPLETION, "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/chat/completions", {**OK_CHAT, "min_tokens": 2, "response_format": {"type": "json_object"}}, 400,
     "min_tokens"),
    ("/v1/chat/completions", {**OK_CHAT, "max_tokens": None, "min_tokens": 300}, 400, "min_tokens"),  # past the room
    # the served tokenizer (word-level) cannot take a constraint: found by the worker, named like the parser's
    ("/v1/chat/completions", {**OK_CHAT, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/v1/completions", {**OK_COMPLETION, "guided_regex": "w0[2-5]"}, 400, "guided_regex"),
    ("/v1/completions", {**OK_COMPLETION, "structured_outputs": {"choice": ["w02"]}}, 400,
     "structured_outputs.choice"),
    ("/v1/chat/completions", {**OK_CHAT, "include_stop_str_in_output": True}, 400, "include_stop_str_in_output"),
    ("/v1/completions", {**OK_COMPLETION, "skip_special_tokens": False}, 400, "skip_special_tokens"),
    ("/v1/chat/completions", {**OK_CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests(server, path, body, status, param):
    got, error = _err(server, "POST", path, body)
    assert (got, error["param"]) == (status, param), error
    assert error["type"] == "invalid_request_error"


def test_context_length_error_names_the_limit(server):
    status, error = _err(server, "POST", "/v1/completions", {**OK_COMPLETION, "max_tokens": 10_000})
    assert status == 400 and error["code"] == "context_length_exceeded" and "256" in error["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", "{\"prompt\": \"\xe9\"}".encode("latin-1")])
def test_malformed_json(server, raw):
    status, error = _err(server, "POST", "/v1/completions", raw=raw)
    assert status == 400 and error["code"] == "invalid_json"


def test_routes_and_methods(server):
    assert _err(server, "GET", "/v2/nothing")[0] == 404
    assert _err(server, "POST", "/v1/embeddings", OK_COMPLETION)[0] == 404
    status, _, _ = http_call(server, "GET", "/v1/completions")
    assert status == 405
    status, headers, body = http_call(server, "POST", "/v1/models", {})
    assert status == 405 and headers["Allow"] == "GET" and body["error"]["code"] == "method_not_allowed"
    assert _err(server, "DELETE", "/v1/chat/completions")[0] == 405


PREFLIGHT = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_browsers_may_call_from_any_origin_by_default(server, tokenizer, reference):
    """vLLM's and llama.cpp's default: a page on another origin (a chat UI on localhost:3000) gets
    its preflight answered and may read the responses, streamed ones included."""
    status, headers, _ = http_call(server, "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "authorization" in headers["Access-Control-Allow-Headers"].lower()
    origin = {"Origin": "http://localhost:3000"}
    status, headers, body = http_call(server, "POST", "/v1/completions",
                                      {"model": MODEL, "prompt": "w05 w06 w07", "max_tokens": 4, "temperature": 0},
                                      origin)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    assert body["choices"][0]["text"] == reference(text_ids(tokenizer, "w05 w06 w07"), 4)
    status, headers, _ = http_call(server, "POST", "/v1/completions",
                                   {"model": MODEL, "prompt": "w05", "max_tokens": 2, "stream": True}, origin)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    status, headers, _ = http_call(server, "POST", "/v1/completions", {"model": MODEL}, origin)
    assert status == 400 and headers["Access-Control-Allow-Origin"] == "*"  # errors readable too
    assert http_call(server, "OPTIONS", "/v1/models")[0] == 405  # not a preflight: no Origin


def test_allowed_origins_limit_browsers(target_model, tokenizer):
    with running(make_spec(target_model, tokenizer, "prompt-lookup"), api_key="s3cret",
                 allowed_origins=("http://localhost:3000",)) as srv:
        status, headers, _ = http_call(srv, "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"  # no key asked
        status, headers, _ = http_call(srv, "OPTIONS", "/v1/chat/completions",
                                       headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert status == 400 and "Access-Control-Allow-Origin" not in headers
        status, headers, _ = http_call(srv, "GET", "/v1/models", headers={"Origin": "http://evil.example",
                                                                          "Authorization": "Bearer s3cret"})
        assert status == 200 and "Access-Control-Allow-Origin" not in headers  # the browser hides it
    with running(make_spec(target_model, tokenizer, "prompt-lookup"), allowed_origins=()) as srv:
        status, headers, _ = http_call(srv, "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
        assert status == 405 and "Access-Control-Allow-Origin" not in headers


@pytest.mark.parametrize("value", ["*", ("*", ""), (3,)])
def test_allowed_origins_must_be_a_list_of_strings(value):
    from specula.errors import ConfigError
    from specula.serve import ServerConfig

    with pytest.raises(ConfigError, match=r"^allowed_origins must be a list of non-empty strings, e.g. \('\*',\)"):
        ServerConfig(model_name=MODEL, allowed_origins=value)


def test_the_tool_parser_is_derived_once_at_start_up_not_for_every_request(monkeypatch):
    """`ServerConfig.auto_tool_parser`, read by every request, checked the tool flags again each time."""
    from specula.errors import ConfigError
    from specula.serve import ServerConfig, app

    calls = []
    real = app.auto_tool_parser
    monkeypatch.setattr(app, "auto_tool_parser", lambda *args: calls.append(args) or real(*args))
    config = ServerConfig(model_name=MODEL, enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert [config.auto_tool_parser for _ in range(3)] == ["hermes"] * 3 and len(calls) == 1
    assert ServerConfig(model_name=MODEL).auto_tool_parser is None
    with pytest.raises(ConfigError, match="tool_call_parser 'granite' is not one this server has"):
        ServerConfig(model_name=MODEL, tool_call_parser="granite")  # still refused at start-up


def test_body_over_the_limit_is_413(server):
    key = ("specula_requests_total", (("endpoint", "/v1/completions"), ("status", "413")))
    before = scrape(server).get(key, 0)
    big = {**OK_COMPLETION, "prompt": "w05 " * 3000}
    status, error = _err(server, "POST", "/v1/completions", big)
    assert status == 413 and error["code"] == "request_too_large"
    # With `Expect: 100-continue` the server refuses before the body is sent.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\nExpect: 100-continue\r\n\r\n")
        head = sock.recv(65536).decode()
    assert head.startswith("HTTP/1.1 413"), head
    # The server still answers afterwards, and counted both refusals.
    assert http_call(server, "GET", "/health")[0] == 200
    assert scrape(server)[key] == before + 2


def test_a_chunked_body_is_read_as_vllm_reads_it_and_held_to_the_limit(server):
    """Transfer-Encoding: chunked (Go's and Node's clients with a streamed body, curl -T -) was a 411
    'send Content-Length'; vLLM's server reads it. A chunked body past --max-body-bytes is a 413."""
    def chunked(body: dict) -> tuple[int, dict]:
        data = json.dumps(body).encode()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", "/v1/completions", body=(data[i:i + 100] for i in range(0, len(data), 100)),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        resp = conn.getresponse()
        payload = json.loads(resp.read())
        conn.close()
        return resp.status, payload

    status, payload = chunked({**OK_COMPLETION, "temperature": 0})
    assert status == 200 and payload["choices"][0]["text"], payload
    status, payload = chunked({**OK_COMPLETION, "prompt": "w05 " * 3000})
    assert status == 413 and payload["error"]["code"] == "request_too_large", payload
    assert http_call(server, "GET", "/health")[0] == 200


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="w05")
    with pytest.raises(openai.BadRequestError, match="n=200"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w05"}], n=200)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt="w05", max_tokens=1000)


@pytest.mark.parametrize("path, body", [("/v1/completions", {**OK_COMPLETION, "model": "m\ud83d"}),
                                        ("/v1/chat/completions", {**OK_CHAT, "model": "m\ud83d", "stream": True}),
                                        ("/detokenize", {"model": "m\ud83d", "tokens": [5]})])
def test_a_model_name_holding_a_lone_surrogate_is_named_in_the_404(server, path, body):
    """The message echoes the name; its lone surrogate (an unpaired escape in the request) goes out as its
    escape: Starlette's UTF-8 encoding raised, a bare 500 "Internal Server Error" with no error object."""
    status, error = _err(server, "POST", path, body)
    assert (status, error["param"], error["code"]) == (404, "model", "model_not_found")
    assert error["message"].startswith("The model 'm\ud83d' does not exist")


# --------------------------------------------------------------------------- metrics


def test_metrics_parse_and_counters_move(server, client):
    before = scrape(server)
    out = client.completions.create(model=MODEL, prompt="w10 w11 w12", max_tokens=16, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="w05")
    after = scrape(server)
    sd = out.speculative_decoding

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("specula_requests_total", endpoint="/v1/completions", status="200") == 1
    assert delta("specula_requests_total", endpoint="/v1/completions", status="404") == 1
    assert delta("specula_drafted_tokens_total") == sd["drafted_tokens"]
    assert delta("specula_accepted_tokens_total") == sd["accepted_tokens"]
    assert delta("specula_verify_steps_total") == sd["steps"]
    assert delta("specula_accepted_length_count") == sd["steps"]
    assert delta("specula_accepted_length_sum") == sd["accepted_tokens"] + sd["steps"]
    assert delta("specula_generated_tokens_total") == out.usage.completion_tokens
    assert delta("specula_prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("specula_request_duration_seconds_count") == 1  # the 404 never reached the worker
    assert after[("specula_tokens_per_second", ())] > 0
    assert after[("specula_queue_depth", ())] == 0
    assert after[("specula_accepted_length_bucket", (("le", "+Inf"),))] == after[("specula_accepted_length_count", ())]


def test_a_served_name_with_slashes_is_retrieved(target_model, tokenizer):
    """The served name defaults to the target, often an `org/name` id or a path: `models.retrieve`
    asks for /v1/models/org/name."""
    from openai import OpenAI

    with running(make_spec(target_model, tokenizer, "none"), model_name="org/tiny-qwen2") as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.models.retrieve("org/tiny-qwen2").id == "org/tiny-qwen2"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("org/other")


def test_top_k_minus_one_means_every_token(client):
    """vLLM's top_k = -1 (every token, as 0): the same seeded sample as top_k 0."""
    texts = [client.completions.create(model=MODEL, prompt="w05 w06 w07", max_tokens=8, seed=5, temperature=1.0,
                                       extra_body={"top_k": k}).choices[0].text for k in (-1, 0)]
    assert texts[0] == texts[1]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="w05", max_tokens=2, extra_body={"top_k": -2})


# --------------------------------------------------------------------------- API key


def test_api_key(target_model, tokenizer, reference):
    from openai import OpenAI

    with running(make_spec(target_model, tokenizer, "prompt-lookup"), api_key="s3cret") as srv:
        status, error = _err(srv, "POST", "/v1/completions", OK_COMPLETION)
        assert status == 401 and error["code"] == "missing_api_key"
        status, error = _err(srv, "POST", "/v1/completions", OK_COMPLETION, headers={"Authorization": "Bearer nope"})
        assert status == 401 and error["code"] == "invalid_api_key"
        assert _err(srv, "GET", "/v1/models", headers={"Authorization": "Basic s3cret"})[0] == 401
        with pytest.raises(openai.AuthenticationError):
            OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        out = good.completions.create(model=MODEL, prompt="w05 w06 w07", max_tokens=10, temperature=0)
        assert out.choices[0].text == reference(text_ids(tokenizer, "w05 w06 w07"), 10)
        assert out.speculative_decoding["method"] == "prompt-lookup"
        assert http_call(srv, "GET", "/health")[0] == 200
        assert http_call(srv, "GET", "/metrics")[0] == 200
        assert _err(srv, "POST", "/tokenize", {"prompt": "w05"})[0] == 401  # it reads the model's tokenizer
        assert http_call(srv, "POST", "/tokenize", {"prompt": "w05"}, {"Authorization": "Bearer s3cret"})[0] == 200
