"""Prompts to token ids: text (through the tokenizer's chat template unless raw), chat messages,
or ids. The one place prompts become ids (the API, the server, the bench, training)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from specula.errors import ConfigError

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]
"""What `encode_prompt` takes: text, chat messages (`{"role", "content"}`), or token ids."""


def apply_chat_template(tokenizer: Any, prompt: str | Sequence[Mapping[str, str]], raw: bool = False) -> list[int]:
    """Token ids for a prompt.

    A string is wrapped as one user message in the tokenizer's chat template (with the
    generation prompt) when the tokenizer has one, unless `raw`; without a template, or with
    `raw=True`, the string is encoded as is (with the tokenizer's usual special tokens). A list
    of `{"role", "content"}` messages always goes through the chat template."""
    if tokenizer is None:
        raise ConfigError("text prompts and chat messages need the target's tokenizer: pass token ids, or build "
                          "the decoder with a tokenizer")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, str):
        if raw or not has_template:
            return list(tokenizer.encode(prompt))
        messages: list[Mapping[str, str]] = [{"role": "user", "content": prompt}]
    else:
        messages = list(prompt)
        if raw:
            raise ConfigError("a raw prompt must be a string, not a list of chat messages")
        if not has_template:
            raise ConfigError("this tokenizer has no chat template; pass the prompt as a string (raw text)")
        for message in messages:
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise ConfigError(f"chat messages must be {{'role': ..., 'content': ...}} mappings, got {message!r}")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_prompt(tokenizer: Any, prompt: Prompt, raw: bool = False) -> list[int]:
    """Token ids of any prompt: text (chat template applied unless `raw`), chat messages, or token ids
    (checked against nothing but being integers). The one place prompts become ids."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ConfigError("the prompt is empty: give some text")
        return apply_chat_template(tokenizer, prompt, raw=raw)
    if not isinstance(prompt, Iterable) or isinstance(prompt, Mapping):
        raise ConfigError(f"a prompt is text, a list of token ids or a list of chat messages, got "
                          f"{type(prompt).__name__}")
    prompt = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)  # numpy arrays, torch tensors
    if not prompt:
        raise ConfigError("the prompt is empty: give some text, at least one message, or token ids")
    if isinstance(prompt[0], Mapping):
        return apply_chat_template(tokenizer, prompt, raw=raw)
    if not all(is_integer(t) for t in prompt):
        raise ConfigError("a prompt list must hold token ids (integers) or chat messages ({'role', 'content'})")
    return [int(t) for t in prompt]


def is_integer(value: Any) -> bool:
    """An integer (numpy's and torch's integer scalars too), not a bool: a token id, a seed, a count."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
