"""Random requests over real HTTP, several clients at once (the official `openai` client): completions (one or two
prompts, text or token ids, echo) and chat (one to three messages; a last assistant's message continued), streamed or
not, `n` choices, greedy or seeded samples (top-p, top-k, min-p, penalties, a logit bias), stop strings, min_tokens,
ignore_eos, logprobs, usage in the stream, structured output (response_format, guided_*), tool calls (tools with
tool_choice required, named or auto, parallel or not). Each seed draws the server's method, planner, batch size,
prefill chunks and prefix cache, and its tokenizer: whole words, raw bytes (characters whole, split or invalid),
Llama-style byte pieces, or JSON's characters (most requests constrained then). Every choice carries what plain
decoding gives its prompt alone: its text (the prompt's first under echo), why it ended, one logprob a token with
plain decoding's value, the tool calls its text says, and the usage counts its tokens; a stream ends each choice once,
sends nothing for it after, starts each chat choice with the role, and sends usage last, only where asked. (The worker
alone, under schedules it controls: `test_serve_schedules.py`.)"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from grammar_kit import (JSON_CHARS, JSON_MERGES, SCHEMA, VOCAB as JSON_VOCAB, all_bytes_tokenizer,
                         byte_level_tokenizer, byte_merges)
from serve_helpers import METHODS, MODEL, make_tokenizer, method_spec, native_spec, running
from tiny import VOCAB, byte_pieces_tokenizer, perturbed_copy, random_stop, tiny_model

from specula.constraints import Constraint
from specula.prompts import encode_prompt
from specula.models.native import kernels
from specula.serve.protocol import choice_seed, parse_request
from specula.serve.tool_calls import ToolCallOutput, join_tool_calls

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels do not run here")

WIDE = 300
"""The byte tokenizers' vocabulary (and their models' logit width)."""


def _templated(tokenizer, template: str):
    tokenizer.chat_template = template
    return tokenizer


TOKENIZERS = {
    "words": (make_tokenizer, VOCAB),
    "bytes": (lambda: _templated(all_bytes_tokenizer(byte_merges(WIDE - 258)),
                                 "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                                 "{% if add_generation_prompt %}<|assistant|>{% endif %}"), WIDE),
    "pieces": (lambda: _templated(byte_pieces_tokenizer(WIDE),
                                  "{% for m in messages %}w260 {{ m['content'] }} w261 {% endfor %}"
                                  "{% if add_generation_prompt %}w262{% endif %}"), WIDE),
    "json": (lambda: _templated(byte_level_tokenizer(JSON_CHARS, JSON_MERGES),
                                "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
                                "{% if add_generation_prompt %}a: {% endif %}"), JSON_VOCAB),
}
"""Builders of the server's tokenizer (each with a chat template), and the vocabulary its model needs. Under "json"
(JSON's characters, a few merges: a tokenizer a grammar can read) most requests are constrained (`CONSTRAINTS`)."""

REGEX = r"[a-c]{2,6}-(x|yz)+\."
GRAMMAR = 'start: item ("," item)* "."\nitem: "ab" | "cd" | /[0-9]{1,3}/'
CONSTRAINTS = {
    "json_object": ({"response_format": {"type": "json_object"}}, Constraint.json()),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}},
                    Constraint.json_schema(SCHEMA)),
    "guided_json": ({"extra_body": {"guided_json": SCHEMA}}, Constraint.json_schema(SCHEMA)),
    "guided_regex": ({"extra_body": {"guided_regex": REGEX}}, Constraint.regex(REGEX)),
    "guided_grammar": ({"extra_body": {"guided_grammar": GRAMMAR}}, Constraint.grammar(GRAMMAR)),
}
"""A request's structured output as the client asks for it (chat's response_format, vLLM's guided_* fields), and the
`Constraint` plain decoding is given."""

TOOLS = [{"type": "function", "function": {"name": "ab", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "cd", "parameters": {
             "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["x"], "additionalProperties": False}}}]
"""Tools whose names and arguments the JSON tokenizer's characters can write (chat under "json": tool_choice required
or one of them named constrains the output to calls; auto leaves it free and parses it)."""
TOOL_PARSER = "llama3_json"
"""The parser of tool_choice auto's output under "json" (calls as plain JSON objects, which its characters can write;
another parser's tags they cannot)."""


@pytest.fixture(scope="module")
def models_of():
    """models_of(vocab) -> (target, draft) over that many tokens (`TOKENIZERS`), made once."""
    made = {}

    def models(vocab: int):
        if vocab not in made:
            target = tiny_model("qwen2", seed=3, vocab=vocab)
            made[vocab] = (target, perturbed_copy(target, scale=0.05))
        return made[vocab]

    return models


@dataclass
class Call:
    """One request: the `openai` client's keyword arguments and what they mean for plain decoding."""

    chat: bool
    kwargs: dict
    prompts: list
    """Completions: each prompt (text or token ids); chat: the messages."""
    delay: float
    """Seconds its client waits before sending (so requests arrive while others run)."""
    constraint: Constraint | None = None
    """What its structured output asks (`CONSTRAINTS`), for plain decoding."""
    tools: bool = False
    """Chat with `TOOLS` and a tool_choice that constrains its output (`parse_request` reads how, as the server
    does)."""

    @property
    def extra(self) -> dict:
        return self.kwargs.get("extra_body", {})


@dataclass
class Got:
    """A response, streamed or not, by choice index."""

    texts: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)
    roles: dict[int, int] = field(default_factory=dict)
    """Chat: how many of a choice's messages or deltas named its role."""
    usage: tuple[int, int] | None = None
    """(prompt_tokens, completion_tokens)."""
    calls: dict[int, list[list]] = field(default_factory=dict)
    """Chat with tools: each choice's tool calls as [name, arguments], in order (none: no entry); a reference's
    arguments are a dict where they are compared as JSON (`tool_reference`)."""


def random_text(rng: random.Random, tokenizer, vocab: int) -> str:
    """The text of 1-12 random tokens (not empty: the server refuses an empty prompt)."""
    text = ""
    while not text:
        text = tokenizer.decode([rng.randrange(2, vocab) for _ in range(rng.randint(1, 12))], skip_special_tokens=True)
    return text


def random_call(rng: random.Random, k: int, tokenizer, vocab: int, constrained: bool = False) -> Call:
    """The k-th request of a seed: chat every third, streamed every other (so each seed has both of each); where
    `constrained`, two in three ask for structured output."""
    chat, stream = k % 3 == 1, k % 2 == 0
    kw: dict = {"model": MODEL, "max_tokens": rng.randint(1, 14), "n": rng.choice((1, 1, 2, 3)), "stream": stream}
    extra: dict = {}
    if rng.random() < 0.5:
        kw.update(temperature=rng.choice((0.7, 1.0, 1.5)), seed=rng.randrange(1 << 20))
        if rng.random() < 0.4:
            kw["top_p"] = rng.choice((0.5, 0.9))
        if rng.random() < 0.4:
            extra["top_k"] = rng.choice((1, 3, 20))
        if rng.random() < 0.3:
            extra["min_p"] = rng.choice((0.05, 0.2))
    else:
        kw["temperature"] = 0
    if rng.random() < 0.25:
        kw["presence_penalty"] = rng.choice((-1.0, 0.6))
    if rng.random() < 0.25:
        kw["frequency_penalty"] = rng.choice((-0.5, 1.5))
    if rng.random() < 0.15:
        kw["logit_bias"] = {str(rng.randrange(2, vocab)): rng.choice((-100, 4, 100))}
    if rng.random() < 0.4:
        kw["stop"] = [random_stop(rng, tokenizer, vocab) for _ in range(rng.choice((1, 2)))]
    constraint, tools = None, False
    if constrained and chat and rng.random() < 1 / 2:
        choice = rng.choice(("required", "ab", "cd", "auto"))  # auto: the server parses the output (`TOOL_PARSER`)
        named = {"type": "function", "function": {"name": choice}}
        kw.update(tools=TOOLS, tool_choice=choice if choice in ("required", "auto") else named)
        if rng.random() < 0.3:
            kw["parallel_tool_calls"] = False
        kw["max_tokens"] = rng.randint(8, 60)  # room for whole calls (required's list of them, 20-40 tokens each)
        tools = True
    elif constrained and rng.random() < 2 / 3:
        name = rng.choice([n for n in CONSTRAINTS if chat or not n.startswith("json_")])  # (response_format: chat's)
        asked, constraint = CONSTRAINTS[name]
        kw.update({key: value for key, value in asked.items() if key != "extra_body"})
        extra.update(asked.get("extra_body", {}))
    elif rng.random() < 0.2:  # (not with a constraint: a 400)
        extra["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.2:
        extra["ignore_eos"] = True
    if stream and rng.random() < 0.5:
        kw["stream_options"] = {"include_usage": True}
    if rng.random() < 0.3:
        kw.update({"logprobs": True, "top_logprobs": rng.choice((0, 2))} if chat else {"logprobs": rng.choice((0, 2))})
    if chat:
        prompts = [{"role": ("user", "assistant")[i % 2], "content": random_text(rng, tokenizer, vocab)}
                   for i in range(rng.choice((1, 2, 3)))]
        kw["messages"] = prompts
        if len(prompts) == 2 and not tools and rng.random() < 0.5:  # vLLM's: the answer goes on with its message
            extra.update(add_generation_prompt=False, continue_final_message=True)
    else:
        prompts = [random_text(rng, tokenizer, vocab) if rng.random() < 0.6
                   else [rng.randrange(2, vocab) for _ in range(rng.randint(1, 12))] for _ in range(rng.choice((1, 2)))]
        kw["prompt"] = prompts if len(prompts) > 1 else prompts[0]
        kw["echo"] = rng.random() < 0.2
    if extra:
        kw["extra_body"] = extra
    return Call(chat, kw, prompts, rng.choice((0.0, 0.0, 0.01, 0.05)), constraint, tools)


def send(client, call: Call) -> Got:
    """The response to `call`, streamed or not, as a `Got`."""
    time.sleep(call.delay)
    create = client.chat.completions.create if call.chat else client.completions.create
    got = Got()
    if not call.kwargs["stream"]:
        out = create(**call.kwargs)
        for c in out.choices:
            got.texts[c.index] = (c.message.content if call.chat else c.text) or ""
            got.reasons[c.index] = c.finish_reason
            if call.chat and c.message.tool_calls:
                got.calls[c.index] = [[t.function.name, t.function.arguments] for t in c.message.tool_calls]
            if call.chat:
                got.roles[c.index] = int(c.message.role == "assistant")
            if c.logprobs is not None:
                got.logprobs[c.index] = ([e.logprob for e in c.logprobs.content] if call.chat
                                         else list(c.logprobs.token_logprobs))
        got.usage = (out.usage.prompt_tokens, out.usage.completion_tokens)
        return got
    for chunk in create(**call.kwargs):
        assert got.usage is None, "a chunk after the usage"
        if not chunk.choices:
            got.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            continue
        for c in chunk.choices:
            assert c.index not in got.reasons, f"choice {c.index} streamed after it finished"
            got.texts[c.index] = got.texts.get(c.index, "") + ((c.delta.content if call.chat else c.text) or "")
            if call.chat:
                got.roles[c.index] = got.roles.get(c.index, 0) + (c.delta.role == "assistant")
                for t in c.delta.tool_calls or ():  # a call's first delta names it, the next ones add arguments
                    calls = got.calls.setdefault(c.index, [])
                    if t.index == len(calls):
                        calls.append([t.function.name, ""])
                    assert t.index == len(calls) - 1, f"choice {c.index}: tool call {t.index} out of order"
                    calls[t.index][1] += t.function.arguments or ""
            if c.logprobs is not None:
                got.logprobs.setdefault(c.index, []).extend(
                    [e.logprob for e in c.logprobs.content or ()] if call.chat else c.logprobs.token_logprobs)
            if c.finish_reason is not None:
                got.reasons[c.index] = c.finish_reason
    return got


def sampling(call: Call, j: int) -> dict:
    """Choice j's `SamplingParams` fields."""
    kw, extra = call.kwargs, call.extra
    seed = kw.get("seed")
    logprobs = kw.get("top_logprobs", 0) if kw.get("logprobs") is True else kw.get("logprobs")
    return dict(max_new_tokens=kw["max_tokens"], temperature=kw["temperature"], top_p=kw.get("top_p", 1.0),
                top_k=extra.get("top_k", 0), min_p=extra.get("min_p", 0.0),
                seed=None if seed is None else choice_seed(seed, j), stop=tuple(kw.get("stop", ())),
                ignore_eos=extra.get("ignore_eos", False), min_new_tokens=extra.get("min_tokens", 0),
                presence_penalty=kw.get("presence_penalty", 0.0), frequency_penalty=kw.get("frequency_penalty", 0.0),
                logit_bias={int(t): b for t, b in kw.get("logit_bias", {}).items()}, logprobs=logprobs,
                prompt_logprobs=logprobs if kw.get("echo") else None)


def tool_reference(tool_use, text: str, reason: str) -> tuple[str, list[list], str]:
    """A choice's content, tool calls ([name, arguments]) and finish reason from plain decoding's text, read without
    the server's parsers where the text says it whole: a named choice's text is its arguments; required's, when it
    ended by itself, is a JSON list of {"name", "parameters"} (the arguments then compared as JSON: a dict here). A
    required output cut short (max_tokens, a stop string), and auto's, go through the server's parser
    (`ToolCallOutput`)."""
    if tool_use.choice == "named":
        return "", [[tool_use.name, text]], reason
    if tool_use.choice == "required" and reason == "stop":
        try:
            listed = json.loads(text)
        except json.JSONDecodeError:
            listed = None
        if isinstance(listed, list) and listed:
            calls = [[c["name"], c["parameters"]] for c in listed]
            return "", calls if tool_use.parallel else calls[:1], "tool_calls"
    parser = ToolCallOutput(tool_use)
    (fed, deltas), (rest, more) = parser.feed(text), parser.finish()
    calls = [[c["function"]["name"], c["function"]["arguments"]] for c in join_tool_calls(deltas + more)]
    return fed + rest, calls, parser.finish_reason(reason)


def wanted(call: Call, plain, tokenizer) -> Got:
    """What each choice gets from plain decoding alone."""
    want, outputs, prompt_tokens = Got(), [], 0
    sources = [call.prompts] if call.chat else call.prompts
    constraint, tool_use = call.constraint, None
    if call.tools:  # the constraint and the parser as the server reads the request
        request = parse_request("chat", {key: value for key, value in call.kwargs.items() if key != "extra_body"},
                                MODEL, tool_parser=TOOL_PARSER)
        constraint, tool_use = request.constraint, request.tool_use
    n = call.kwargs["n"]
    for i, source in enumerate(sources):
        continued = call.extra.get("continue_final_message", False)
        ids = encode_prompt(plain.tokenizer, source, raw=not call.chat, tools=TOOLS if call.tools else None,
                            add_generation_prompt=not continued, continue_final_message=continued)
        prompt_tokens += len(ids)
        echo = bool(call.kwargs.get("echo"))  # its text may be empty (ids of unused tokens): its logprobs are not
        echoed = (source if isinstance(source, str) else tokenizer.decode(ids, skip_special_tokens=True)) * echo
        for j in range(n):
            out = plain.generate(ids, raw=True, constraint=constraint, **sampling(call, j))
            outputs.append(out)
            want.texts[i * n + j] = echoed + out.text
            want.reasons[i * n + j] = out.stats.finish_reason or "length"
            if tool_use is not None:
                content, calls, reason = tool_reference(tool_use, out.text, want.reasons[i * n + j])
                want.texts[i * n + j], want.reasons[i * n + j] = content, reason
                if calls:
                    want.calls[i * n + j] = calls
            if call.chat:
                want.roles[i * n + j] = 1
            if out.logprobs is not None:
                prompt = [None if e is None else e.logprob for e in out.prompt_logprobs] if echo else []
                want.logprobs[i * n + j] = prompt + [e.logprob for e in out.logprobs]
    want.usage = (prompt_tokens, sum(len(out.token_ids) for out in outputs))
    return want


def check(call: Call, got: Got, want: Got, where: str) -> None:
    where = f"{where}: {call.kwargs}"
    assert got.texts == want.texts, where
    assert got.reasons == want.reasons, where
    assert got.roles == want.roles, where
    assert got.calls.keys() == want.calls.keys(), where
    for index, calls in want.calls.items():  # arguments read as JSON where the reference holds them so
        assert [[name, json.loads(args) if isinstance(expected, dict) else args]
                for (name, args), (_, expected) in zip(got.calls[index], calls)] == calls, where
        assert len(got.calls[index]) == len(calls), where
    assert got.logprobs.keys() == want.logprobs.keys(), where
    for index, values in want.logprobs.items():
        assert got.logprobs[index] == pytest.approx(values, abs=1e-4), where
    usage = not call.kwargs["stream"] or call.kwargs.get("stream_options", {}).get("include_usage")
    assert got.usage == (want.usage if usage else None), where


@pytest.mark.parametrize("seed", range(20))
def test_random_requests_over_http_get_what_plain_decoding_gives_each_alone(seed, target_model, draft_model,
                                                                           models_of):
    from openai import OpenAI

    rng = random.Random(seed)
    kind = tuple(TOKENIZERS)[seed % len(TOKENIZERS)]
    build, vocab = TOKENIZERS[kind]
    tokenizer = build()
    target, draft = (target_model, draft_model) if vocab == VOCAB else models_of(vocab)
    method, planner = METHODS[seed % len(METHODS)], rng.random() < 0.5
    spec = method_spec(method, target, draft, tokenizer, planner=planner, prefix_cache_mib=rng.choice((0, 1)))
    calls = [random_call(rng, k, tokenizer, vocab, constrained=kind == "json") for k in range(8)]
    config = {"max_batch_size": rng.choice((1, 2, 4, 8)), "chunked_prefill_size": rng.choice((None, 1, 3, 8))}
    if kind == "json":  # tool_choice auto's requests (`random_call`)
        config.update(enable_auto_tool_choice=True, tool_call_parser=TOOL_PARSER)
    where = f"seed {seed}: {method} ({kind}, planner {planner}, {config})"
    with running(spec, **config) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda call: send(client, call), calls))
    plain = native_spec(target, tokenizer, "none")
    for call, got in zip(calls, responses):
        check(call, got, wanted(call, plain, tokenizer), where)
