"""Prompts to token ids: text (through the tokenizer's chat template unless raw), chat messages,
or ids. The one place prompts become ids (the API, the server, the bench, training)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from specula.errors import ConfigError

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]
"""What `encode_prompt` takes: text, chat messages (`{"role", "content"}`), or token ids."""

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles a chat message may have (OpenAI's and vLLM's)."""


class MessageError(ConfigError):
    """A chat message that is not one (`chat_message`): `param` names the field (`messages[i].role`),
    `code` says how (OpenAI's "invalid_type" or "invalid_value"), for the server's 400."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class NoChatTemplate(ConfigError):
    """Chat messages for a tokenizer without a chat template."""


class TemplateRefused(ConfigError):
    """The model's chat template refused the messages (its `raise_exception`, jinja2's TemplateError)."""


def _json(value: Any) -> str:
    import json

    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError):
        return repr(value)[:80]


def unicode_problem(text: str) -> str | None:
    """What keeps `text` from being Unicode a tokenizer can read (None: nothing): a lone surrogate, which
    undecodable bytes (a file or command line that is not UTF-8, read with surrogateescape) or an unpaired
    JSON escape (\\ud800-\\udfff) leave in a str; a fast tokenizer refused it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"it holds {text[exc.start]!r} at character {exc.start}, a lone surrogate (bytes that are not "
                f"UTF-8, or an unpaired \\ud800-\\udfff escape); give valid UTF-8 text")
    return None


def chat_message(message: Any, index: int) -> dict[str, str]:
    """Message `index` as the chat template reads it: the message with a role of `CHAT_ROLES` and
    text content (a list of text parts joined by newlines, as vLLM joins them; an assistant's null
    content as ""), its other keys (tool_calls, tool_call_id, name) kept for the template; a
    `MessageError` naming the field otherwise. The one check of messages (the API, the server, the
    bench)."""
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise MessageError(f"'{where}' must be an object with 'role' and 'content', got {_json(message)}", where,
                           "invalid_type")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise MessageError(f"'{where}.role' must be a non-empty string, got {_json(role)}", f"{where}.role",
                           "invalid_type")
    if role not in CHAT_ROLES:
        raise MessageError(f"Invalid value for '{where}.role': {role!r}; supported roles are "
                           f"{', '.join(repr(r) for r in CHAT_ROLES)}", f"{where}.role", "invalid_value")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text parts are understood
        if not all(isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise MessageError(f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                               f"{where}.content", "invalid_type")
        content = "\n".join(part["text"] for part in content)
    elif content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise MessageError(f"'{where}.content' must be a string, got {_json(content)}", f"{where}.content",
                           "invalid_type")
    problem = unicode_problem(content)
    if problem:
        raise MessageError(f"'{where}.content' is not valid Unicode: {problem}", f"{where}.content", "invalid_value")
    return {**message, "role": role, "content": content}  # other keys (tool_calls, name, ...) for the template


def apply_chat_template(tokenizer: Any, prompt: str | Sequence[Mapping[str, str]], raw: bool = False,
                        tools: Sequence[Mapping[str, Any]] | None = None, *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False) -> list[int]:
    """Token ids for a prompt.

    A string is wrapped as one user message in the tokenizer's chat template (with the
    generation prompt) when the tokenizer has one, unless `raw`; without a template, or with
    `raw=True`, the string is encoded as is (with the tokenizer's usual special tokens). A list
    of `{"role", "content"}` messages always goes through the chat template. `tools` (OpenAI's
    `{"type": "function", "function": {...}}` objects) reach the template as its `tools`, which
    tool-calling templates render into the prompt; a raw prompt cannot take them.

    `add_generation_prompt` and `continue_final_message` are the template's (vLLM's and transformers'):
    by default the conversation is closed and the answer's turn opened; `continue_final_message=True`
    with `add_generation_prompt=False` leaves the last message open (no end-of-turn) for the model to
    continue (an assistant message: prefilling the answer; the template decides, as in vLLM, and any
    role is continued). Both true is a ConfigError, as in vLLM; a raw prompt cannot take either."""
    if tokenizer is None:
        raise ConfigError("text prompts and chat messages need the target's tokenizer: pass token ids, or build "
                          "the decoder with a tokenizer")
    check_template_options(add_generation_prompt, continue_final_message)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, str):
        problem = unicode_problem(prompt)
        if problem:
            raise ConfigError(f"the prompt is not valid Unicode: {problem}")
        if raw or not has_template:
            _no_template_options(tools, add_generation_prompt, continue_final_message,
                                 "a raw prompt (or a tokenizer without a chat template)")
            return list(tokenizer.encode(prompt))
        messages: list[Mapping[str, str]] = [{"role": "user", "content": prompt}]
    else:
        messages = list(prompt)
        if raw:
            raise ConfigError("a raw prompt must be a string, not a list of chat messages")
        if not has_template:
            raise NoChatTemplate("this tokenizer has no chat template; pass the prompt as a string (raw text)")
        messages = [chat_message(message, i) for i, message in enumerate(messages)]
    from jinja2.exceptions import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             continue_final_message=continue_final_message,
                                             tools=list(tools) if tools else None)
    except TemplateError as exc:  # the template's raise_exception: "roles must alternate", "no system role", ...
        raise TemplateRefused(f"the model's chat template refused these messages: {exc}") from None
    except ValueError as exc:  # transformers: the template drops (part of) the final message, so it cannot stay open
        if not continue_final_message:
            raise
        raise ConfigError(f"the model's chat template cannot continue the final message: "
                          f"{str(exc).splitlines()[0]}") from None
    problem = unicode_problem(text)  # a message's other keys (name, tool_calls) reach the template unchecked
    if problem:
        raise ConfigError(f"the chat messages are not valid Unicode: {problem}")
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_prompt(tokenizer: Any, prompt: Prompt, raw: bool = False,
                  tools: Sequence[Mapping[str, Any]] | None = None, *, add_generation_prompt: bool = True,
                  continue_final_message: bool = False) -> list[int]:
    """Token ids of any prompt: text (chat template applied unless `raw`), chat messages, or token ids
    (checked against nothing but being integers). The one place prompts become ids. `tools`,
    `add_generation_prompt` and `continue_final_message` go to the chat template (`apply_chat_template`);
    token ids cannot take them."""
    options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
    if isinstance(prompt, str):
        if not prompt:  # whitespace is text ("\n" opens a base model's unconditional generation)
            raise ConfigError("the prompt is empty: give some text")
        return _some_tokens(apply_chat_template(tokenizer, prompt, raw=raw, tools=tools, **options))
    if isinstance(prompt, (bytes, bytearray, memoryview)):  # an iterable of byte values, not token ids
        raise ConfigError("a prompt is text, token ids or chat messages, not bytes: decode it to a str first")
    if not isinstance(prompt, Iterable) or isinstance(prompt, Mapping):
        raise ConfigError(f"a prompt is text, a list of token ids or a list of chat messages, got "
                          f"{type(prompt).__name__}")
    prompt = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)  # numpy arrays, torch tensors
    if not prompt:
        raise ConfigError("the prompt is empty: give some text, at least one message, or token ids")
    if isinstance(prompt[0], Mapping):
        return _some_tokens(apply_chat_template(tokenizer, prompt, raw=raw, tools=tools, **options))
    if not all(is_integer(t) for t in prompt):
        raise ConfigError("a prompt list must hold token ids (integers) or chat messages ({'role', 'content'})")
    check_template_options(add_generation_prompt, continue_final_message)  # vLLM's error first
    _no_template_options(tools, add_generation_prompt, continue_final_message, "a prompt of token ids")
    return [int(t) for t in prompt]


BOTH_TEMPLATE_OPTIONS = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
"""vLLM's error for a request that both continues the final message and opens a new turn."""


def check_template_options(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """Refuse both `add_generation_prompt` and `continue_final_message` (vLLM's error, a ConfigError)."""
    if add_generation_prompt and continue_final_message:
        raise ConfigError(f"{BOTH_TEMPLATE_OPTIONS} add_generation_prompt is true by default: set it to false to "
                          "continue the final message")


def _no_template_options(tools: Sequence[Mapping[str, Any]] | None, add_generation_prompt: bool,
                         continue_final_message: bool, what: str) -> None:
    """Refuse the chat template's inputs (`tools`, and its options away from their defaults) for a prompt that
    does not go through it (`what`). Both options true is vLLM's error, which the callers give first
    (`check_template_options`)."""
    if tools:
        raise ConfigError(f"tools are rendered by the chat template: {what} cannot take them")
    if not add_generation_prompt or continue_final_message:
        raise ConfigError(f"add_generation_prompt and continue_final_message are the chat template's: {what} "
                          "cannot take them")


def _some_tokens(ids: list[int]) -> list[int]:
    """`ids` of a text: refused when empty (a tokenizer that drops whitespace, as word-level ones do,
    makes nothing of "   "; the engine then called it an empty prompt, as if no text had been given)."""
    if not ids:
        raise ConfigError("the prompt's text tokenized to no tokens (the tokenizer drops all of it): give text "
                          "it keeps, or token ids")
    return ids


def is_integer(value: Any) -> bool:
    """An integer (numpy's and torch's integer scalars too), not a bool: a token id, a seed, a count."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
