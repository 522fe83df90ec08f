"""Prompts to token ids (`specula.prompts`): one check of chat messages for the API and the server,
template refusals as one-line errors, and what counts as an empty prompt."""

from __future__ import annotations

import pytest

from tiny import word_tokenizer
from specula.errors import ConfigError
from specula.prompts import MessageError, encode_prompt

TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
            "{% endif %}{{ m.role }} {{ m.content }} {% endfor %}{% if add_generation_prompt %}assistant{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer(["w0", "user", "assistant", "hi", "there", "a", "b"], chat_template=TEMPLATE)


def test_messages_are_checked_and_text_parts_joined_as_the_server_does(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    assert encode_prompt(tok, parts) == encode_prompt(tok, [{"role": "user", "content": "hi\nthere"}])
    for bad, field in (([{"role": "usr", "content": "hi"}], "messages[0].role"),
                       ([{"role": "user", "content": 5}], "messages[0].content"),
                       ([{"role": "user", "content": None}], "messages[0].content"),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages[0].content"),
                       ([{"role": "user", "content": "hi"}, "there"], "messages[1]")):
        with pytest.raises(MessageError) as err:
            encode_prompt(tok, bad)
        assert err.value.param == field
    assert encode_prompt(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}])


def test_a_template_that_refuses_the_messages_is_a_config_error(tok):
    with pytest.raises(ConfigError, match="chat template refused these messages: System role not supported"):
        encode_prompt(tok, [{"role": "system", "content": "a"}, {"role": "user", "content": "hi"}])


def test_whitespace_is_a_prompt_and_bytes_are_not(tok):
    assert encode_prompt(tok, "\nhi\n", raw=True) == list(tok.encode("\nhi\n"))
    with pytest.raises(ConfigError, match="the prompt is empty"):
        encode_prompt(tok, "", raw=True)
    with pytest.raises(ConfigError, match="not bytes: decode it to a str first"):
        encode_prompt(tok, b"hi there")


def test_a_text_that_tokenizes_to_nothing_is_not_called_empty(tok):
    """A word-level tokenizer drops whitespace (a byte-level one keeps it): "\n" was given, so it is not
    "the prompt is empty"; its text made no tokens (the engine's message named no text at all)."""
    for text in ("\n", "  \t "):
        with pytest.raises(ConfigError, match="the prompt's text tokenized to no tokens"):
            encode_prompt(tok, text, raw=True)


def test_a_messages_other_keys_reach_the_template():
    """tool_calls, tool_call_id and name are the template's to read (checking role and content must
    not strip them)."""
    template = "{% for m in messages %}{{ m.role }} {{ m.content }}{% if m.name %} {{ m.name }}{% endif %} {% endfor %}"
    tok = word_tokenizer(["w0", "user", "hi", "a", "b"], chat_template=template)
    named = encode_prompt(tok, [{"role": "user", "content": "hi", "name": "a"}])
    assert named == encode_prompt(tok, [{"role": "user", "content": "hi a"}]) != encode_prompt(tok, [{"role": "user", "content": "hi"}])


def test_a_lone_surrogate_is_named_not_a_tokenizer_type_error(tok):
    """Bytes that are not UTF-8 (a command line or stdin read with surrogateescape) or an unpaired JSON
    escape leave a lone surrogate in a str; the fast tokenizer raised TypeError ("TextEncodeInput must be
    Union[...]"), a traceback on the command line and a 500 on the server."""
    for raw in (True, False):
        with pytest.raises(ConfigError, match=r"the prompt is not valid Unicode: it holds '\\udcff' at character 3"):
            encode_prompt(tok, "hi \udcff", raw=raw)
    with pytest.raises(MessageError, match="'messages\\[1\\].content' is not valid Unicode") as err:
        encode_prompt(tok, [{"role": "user", "content": "hi"}, {"role": "user", "content": "\ud800 a"}])
    assert (err.value.param, err.value.code) == ("messages[1].content", "invalid_value")
    with pytest.raises(ConfigError, match="the chat messages are not valid Unicode"):  # a key the template reads
        encode_prompt(word_tokenizer(["w0", "hi"], chat_template="{% for m in messages %}{{ m.name }}{% endfor %}"),
                      [{"role": "user", "content": "hi", "name": "\udcff"}])
    assert encode_prompt(tok, "hi \U0001F600 there", raw=True)  # a pair written out is a character


def test_tools_reach_the_chat_template():
    """A tool-calling template renders the tools it is given into the prompt (as it renders them for
    `tokenizer.apply_chat_template(..., tools=...)`); without tools the prompt is the one it always was."""
    template = ("{% if tools %}{% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
                "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}")
    tok = word_tokenizer(["w0", "user", "hi", "a", "b"], chat_template=template)
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]
    assert encode_prompt(tok, messages, tools=tools) == tok.encode("a b user hi")
    assert encode_prompt(tok, messages) == encode_prompt(tok, messages, tools=[]) == tok.encode("user hi")
    assert encode_prompt(tok, "hi", tools=tools) == tok.encode("a b user hi")  # text through the template
    for prompt, raw in (("hi", True), ([1, 2], False)):
        with pytest.raises(ConfigError, match="tools are rendered by the chat template"):
            encode_prompt(tok, prompt, raw=raw, tools=tools)


def test_continue_final_message_leaves_the_last_message_open():
    """vLLM's and transformers' chat template options: by default the conversation is closed and the answer's
    turn opened; add_generation_prompt=False closes it and opens nothing; continue_final_message=True (with
    add_generation_prompt=False) leaves the last message open, without its end of turn ("w0" here)."""
    template = ("{% for m in messages %}{{ m.role }} {{ m.content }} w0 {% endfor %}"
                "{% if add_generation_prompt %}assistant{% endif %}")
    tok = word_tokenizer(["w0", "user", "assistant", "hi", "there", "a", "b"], chat_template=template)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there a"}]
    assert encode_prompt(tok, messages) == tok.encode("user hi w0 assistant there a w0 assistant")
    assert encode_prompt(tok, messages, add_generation_prompt=False) == tok.encode("user hi w0 assistant there a w0")
    assert encode_prompt(tok, messages, add_generation_prompt=False, continue_final_message=True) == tok.encode(
        "user hi w0 assistant there a")
    # any last message is continued, as transformers (and so vLLM) continue it
    assert encode_prompt(tok, messages[:1], add_generation_prompt=False, continue_final_message=True) == tok.encode(
        "user hi")
    with pytest.raises(ConfigError, match="Cannot set both `continue_final_message` and `add_generation_prompt`"):
        encode_prompt(tok, messages, continue_final_message=True)  # add_generation_prompt is true by default
    for prompt, raw in (("hi", True), ([1, 2], False)):
        for options in ({"add_generation_prompt": False}, {"add_generation_prompt": False,
                                                           "continue_final_message": True}):
            with pytest.raises(ConfigError, match="are the chat template's"):
                encode_prompt(tok, prompt, raw=raw, **options)


@pytest.mark.parametrize("prompt, raw", [("hi", True), ("hi", False), ([1, 2], False)])
def test_the_template_options_are_checked_once_for_a_prompt_that_skips_the_template(monkeypatch, prompt, raw):
    """A raw prompt (or text for a tokenizer without a template) had both options checked twice: by
    `apply_chat_template` and again by `_no_template_options`. Once now, and both true is still refused."""
    import specula.prompts as prompts

    tok = word_tokenizer(["w0", "hi"])  # no chat template: "hi" is encoded as is, as a raw prompt is
    calls = []
    real = prompts.check_template_options
    monkeypatch.setattr(prompts, "check_template_options", lambda *args: calls.append(args) or real(*args))
    assert encode_prompt(tok, prompt, raw=raw) == (tok.encode("hi") if isinstance(prompt, str) else prompt)
    assert calls == [(True, False)]
    with pytest.raises(ConfigError, match="Cannot set both `continue_final_message` and `add_generation_prompt`"):
        encode_prompt(tok, prompt, raw=raw, continue_final_message=True)


def test_a_template_that_drops_the_final_message_cannot_continue_it():
    template = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }} {% endif %}{% endfor %}"
    tok = word_tokenizer(["w0", "hi", "there"], chat_template=template)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there"}]
    with pytest.raises(ConfigError, match="chat template cannot continue the final message"):
        encode_prompt(tok, messages, add_generation_prompt=False, continue_final_message=True)
