"""Pure parts of the wire protocol: stop-string trimming of streamed text, request defaults."""

from __future__ import annotations


import pytest

from specula.serve.protocol import APIError, parse_request


def test_openai_defaults():
    completion = parse_request("completions", {"model": "m", "prompt": "hi"}, "m")
    assert completion.max_tokens == 16 and completion.temperature == 1.0 and completion.top_p == 1.0
    assert not completion.stream and completion.stop == ()
    chat = parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "m")
    assert chat.max_tokens is None  # the worker fills the remaining context (capped)
    chat = parse_request("chat", {"model": "m", "max_completion_tokens": 7, "stop": "x", "user": "u",
                                  "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "m")
    assert chat.max_tokens == 7 and chat.stop == ("x",) and chat.messages[0]["content"] == "hi"
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    chat = parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": parts}]}, "m")
    assert chat.messages[0]["content"] == "first\nsecond"  # text parts joined by a newline, as vLLM joins them


def test_bool_is_not_an_integer():
    with pytest.raises(APIError) as err:
        parse_request("completions", {"model": "m", "prompt": "hi", "max_tokens": True}, "m")
    assert err.value.status == 400 and err.value.param == "max_tokens"


def test_another_model_is_a_404_worded_for_whoever_reads_it():
    """The server's client is pointed at GET /v1/models; run-batch words its own (the flag that sets the name)."""
    body = {"model": "gpt-4", "prompt": "hi"}
    with pytest.raises(APIError) as err:
        parse_request("completions", body, "m")
    assert (err.value.status, err.value.param, err.value.code) == (404, "model", "model_not_found")
    assert err.value.message == "The model 'gpt-4' does not exist; this server serves 'm' (see GET /v1/models)"
    with pytest.raises(APIError) as err:
        parse_request("completions", body, "m", "no {model}, only {served}")
    assert err.value.message == "no gpt-4, only m"


def test_response_format_becomes_the_request_constraint():
    from specula.constraints import Constraint

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_request("chat", body, "m").constraint is None
    assert parse_request("chat", {**body, "response_format": {"type": "text"}}, "m").constraint is None
    assert parse_request("chat", {**body, "response_format": {"type": "json_object"}}, "m").constraint == Constraint.json()
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    assert parse_request("chat", {**body, "response_format": rf}, "m").constraint == Constraint.json_schema(schema)


@pytest.mark.parametrize("rf, words", [
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}}, "objekt"),
    ({"type": "json_schema", "json_schema": {"name": "a"}}, "schema"),
    ({"type": "yaml"}, "json_object"),
])
def test_a_response_format_that_cannot_compile_is_a_400_with_the_reason(rf, words):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": rf}
    with pytest.raises(APIError) as err:
        parse_request("chat", body, "m")
    assert err.value.status == 400 and words in str(err.value) and err.value.param == "response_format"


def test_vllms_guided_decoding_parameters_become_the_request_constraint():
    from specula.constraints import Constraint

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def constraint(**extra):
        return parse_request("chat", {**body, **extra}, "m").constraint

    assert constraint(guided_json=schema) == Constraint.json_schema(schema)
    assert constraint(guided_json='{"type": "object"}') == Constraint.json_schema({"type": "object"})
    assert constraint(guided_regex="[a-c]+") == Constraint.regex("[a-c]+")
    assert constraint(guided_choice=["yes", "no (1.5)"]) == Constraint.regex(r"yes|no \(1\.5\)")
    assert constraint(guided_grammar='start: "x"') == Constraint.grammar('start: "x"')
    assert constraint(structured_outputs={"choice": ["a", "b"]}) == Constraint.choice(["a", "b"])
    assert constraint(structured_outputs={"json": schema, "backend": None}) == Constraint.json_schema(schema)
    assert constraint(structured_outputs={"json_object": True}) == Constraint.json()


@pytest.mark.parametrize("extra, param, words", [
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one constraint"),
    ({"guided_json": {"type": "object"}, "guided_choice": ["a"]}, "guided_choice", "one constraint"),
    ({"guided_choice": "yes"}, "guided_choice", "list of strings"),
    ({"guided_choice": []}, "guided_choice", "list of non-empty strings"),
    ({"guided_regex": "(a"}, "guided_regex", "cannot compile the regex"),
    ({"guided_json": 3}, "guided_json", "JSON schema"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
])
def test_guided_decoding_given_wrong_is_a_400_naming_the_parameter(extra, param, words):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(APIError) as err:
        parse_request("chat", body, "m")
    assert err.value.status == 400 and words in str(err.value) and err.value.param == param


@pytest.mark.parametrize("endpoint, extra, param", [
    ("completions", {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ("completions", {"prompt_logprobs": 2}, "prompt_logprobs"),
    ("completions", {"add_special_tokens": False}, "add_special_tokens"),
    ("chat", {"add_special_tokens": True}, "add_special_tokens"),
    ("completions", {"add_generation_prompt": False}, "add_generation_prompt"),  # the chat template's options
    ("completions", {"continue_final_message": True}, "continue_final_message"),
    ("chat", {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ("chat", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("completions", {"truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
    ("completions", {"allowed_token_ids": [5]}, "allowed_token_ids"),  # extras that change the output
    ("completions", {"bad_words": ["w5"]}, "bad_words"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
])
def test_vllm_extras_this_server_would_ignore_are_a_400(endpoint, extra, param):
    body = {"model": "m", **({"prompt": "hi"} if endpoint == "completions" else
                             {"messages": [{"role": "user", "content": "hi"}]}), **extra}
    with pytest.raises(APIError) as err:
        parse_request(endpoint, body, "m")
    assert err.value.status == 400 and err.value.param == param
    same = {k: v for k, v in body.items() if k != param}
    parse_request(endpoint, {**same, "add_special_tokens": endpoint == "completions"}, "m")  # the default is fine


def test_tokenize_refuses_the_options_it_does_not_honour():
    from specula.serve.protocol import parse_tokenize

    for extra, param in (({"add_special_tokens": False}, "add_special_tokens"),
                         ({"return_token_strs": True}, "return_token_strs")):
        with pytest.raises(APIError) as err:
            parse_tokenize({"model": "m", "prompt": "hi", **extra}, "m")
        assert err.value.param == param
    assert parse_tokenize({"model": "m", "prompt": "hi", "add_special_tokens": True}, "m") == ("hi", True)


def test_tokenize_takes_the_chat_templates_options_with_messages_only():
    from specula.serve.protocol import parse_tokenize_template

    messages = [{"role": "user", "content": "hi"}]
    assert parse_tokenize_template({"messages": messages}) == {"add_generation_prompt": True,
                                                               "continue_final_message": False}
    assert parse_tokenize_template({"messages": messages, "add_generation_prompt": False,
                                    "continue_final_message": True}) == {"add_generation_prompt": False,
                                                                         "continue_final_message": True}
    for body, param in (({"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt"),
                        ({"messages": messages, "continue_final_message": True}, "continue_final_message")):
        with pytest.raises(APIError) as err:
            parse_tokenize_template(body)
        assert err.value.param == param
    assert parse_tokenize_template({"prompt": "hi", "add_generation_prompt": True}) == {}


def test_a_prompt_the_server_cannot_encode_is_a_400_worded_for_http():
    """No chat template: the fix named is the completions endpoint, not "pass a string"; a template
    that refuses the messages (its raise_exception) is a 400, not a 500."""
    from specula.prompts import NoChatTemplate
    from specula.serve.protocol import prompt_error

    err = prompt_error(NoChatTemplate("no template"), "messages")
    assert err.status == 400 and "/v1/completions" in str(err) and err.param == "messages"


@pytest.mark.parametrize("raw", [b"[" * 50_000, b'{"prompt": "hi", "seed": ' + b"1" * 5000 + b"}"])
def test_a_body_json_cannot_hold_is_a_400_not_a_500(raw):
    """Deep nesting (RecursionError) and a 4300+ digit integer (ValueError) are the client's JSON."""
    from specula.serve.protocol import parse_json_body

    with pytest.raises(APIError) as err:
        parse_json_body(raw)
    assert err.value.status == 400 and err.value.code == "invalid_json"


def test_stream_options_it_does_not_honour_are_a_400():
    body = {"model": "m", "prompt": "hi", "stream": True}
    with pytest.raises(APIError) as err:  # vLLM's usage on every chunk: only the final usage chunk here
        parse_request("completions", {**body, "stream_options": {"include_usage": True,
                                                                 "continuous_usage_stats": True}}, "m")
    assert err.value.param == "stream_options.continuous_usage_stats"
    assert parse_request("completions", {**body, "stream_options": {"include_usage": True,
                                                                    "continuous_usage_stats": False}}, "m").include_usage


@pytest.mark.parametrize("value", [True, False])
def test_stream_options_include_obfuscation_is_accepted_and_ignored(value):
    """OpenAI's include_obfuscation (an `obfuscation` field on each chunk) was a 400; vLLM ignores it."""
    body = {"model": "m", "prompt": "hi", "stream": True}
    for usage in (True, False):
        options = {"include_usage": usage, "include_obfuscation": value}
        assert parse_request("completions", {**body, "stream_options": options}, "m").include_usage is usage
    with pytest.raises(APIError) as err:  # still a boolean
        parse_request("completions", {**body, "stream_options": {"include_obfuscation": "yes"}}, "m")
    assert err.value.status == 400 and err.value.param == "stream_options.include_obfuscation"


def test_the_request_remembers_which_field_gave_max_tokens():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_request("chat", {**body, "max_completion_tokens": 5}, "m").max_tokens_param == "max_completion_tokens"
    assert parse_request("chat", {**body, "max_tokens": 5}, "m").max_tokens_param == "max_tokens"
