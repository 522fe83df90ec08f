"""The OpenAI wire format: request validation and response bodies (pure functions, no I/O).

Requests are checked here, before anything reaches the model: every problem becomes an
`APIError` whose body is OpenAI's `{"error": {"message", "type", "param", "code"}}`.
Responses follow OpenAI's objects field for field (`text_completion`, `chat.completion`,
`chat.completion.chunk`), plus one extension on every response and on the last streamed
chunk: `speculative_decoding` (method, drafted / accepted tokens, mean accepted tokens,
acceptance rate, steps).

Logprobs are the target's raw distribution (`specula.logprobs`) in each API's own shape: chat's
`{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}` (`chat_logprobs`), completions'
`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (`CompletionLogprobs`, with the
prompt's tokens first under `echo`).
"""

from __future__ import annotations

import codecs
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from specula.constraints import Constraint, ConstraintError
from specula.logprobs import MAX_LOGPROBS, TokenLogprob
from specula.errors import ConfigError
from specula.prompts import MessageError, NoChatTemplate, chat_message, check_template_options
from specula.serve.tools import ToolError, ToolUse, parse_tool_use, parse_tools, template_message
from specula.stats import GenerationStats
from specula.token_bytes import TokenBytes

Endpoint = Literal["completions", "chat"]

MAX_STOP_STRINGS = 4
"""OpenAI accepts at most four stop sequences."""

MAX_CHOICES = 128
"""Most choices one request may ask for (prompts times n): each is a sequence decoded in the batch."""

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default `max_tokens` for /v1/completions."""


class APIError(Exception):
    """An error answered to the client as OpenAI's error object with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class GenerationRequest:
    """One validated /v1/completions or /v1/chat/completions request."""

    endpoint: Endpoint
    """Which API it came from (decides the response objects)."""
    model: str
    """The model id the client asked for (already checked against the served one)."""
    prompts: tuple[str | tuple[int, ...], ...] = ()
    """Completions: each prompt's raw text (no chat template) or token ids (one or more)."""
    messages: tuple[dict[str, Any], ...] | None = None
    """Chat: `{"role", "content"}` messages (with their tool-calling fields: `tools.template_message`),
    rendered with the tokenizer's chat template."""
    add_generation_prompt: bool = True
    """Chat (vLLM's): the template opens the answer's turn after the messages; false: it does not, and the
    answer's message has the last message's role (as vLLM answers)."""
    continue_final_message: bool = False
    """Chat (vLLM's, with add_generation_prompt false): the template leaves the last message open (no end of
    turn) and the model continues it: the output is the rest of that message."""
    max_tokens: int | None = None
    """Most tokens to generate; None = the endpoint's default (see `Worker`)."""
    max_tokens_param: str = "max_tokens"
    """The field that gave `max_tokens` (chat: max_completion_tokens where given), for errors."""
    temperature: float = 1.0
    """OpenAI's default is 1.0 (sampling); 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = 0
    """Extension (as in vLLM): keep the k most likely tokens (0 = off)."""
    min_p: float = 0.0
    """Extension (as in vLLM): keep tokens at least min_p times as likely as the most likely (0 = off)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extension (as in vLLM): token ids that end the generation (kept in the output)."""
    ignore_eos: bool = False
    """Extension (as in vLLM): generate past the end-of-sequence token (fixed-length benchmarks)."""
    min_tokens: int = 0
    """Extension (as in vLLM): the fewest tokens generated before EOS, a stop id or a stop string may
    end the completion (`SamplingParams.min_new_tokens`)."""
    seed: int | None = None
    """Seed for reproducible sampling."""
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Stop strings; the returned text ends before the first one (OpenAI semantics)."""
    stream: bool = False
    """Answer as server-sent events."""
    include_usage: bool = False
    """stream_options.include_usage: one more chunk with `choices: []` and the usage."""
    constraint: Constraint | None = None
    """response_format json_object / json_schema: the output matches it (None: free text)."""
    constraint_param: str | None = None
    """The request field the constraint came from (`response_format`, `guided_regex`, ...): named by
    the 400 when the constraint fails against the model's tokenizer (only the worker has it)."""
    logprobs: int | None = None
    """Return each generated token's logprob with this many alternatives (None: no logprobs):
    chat's `top_logprobs` (0 when absent) under `logprobs: true`, completions' `logprobs`."""
    echo: bool = False
    """Completions: the prompt's text comes back before the completion (with `logprobs`, its tokens'
    logprobs too, the first one null). Chat (vLLM's extension): each choice's content starts with the
    last message's content when that message has the answer's role (`chat_echo`)."""
    n: int = 1
    """Choices per prompt (choice j sampled with seed + j when a seed is given)."""
    penalties: dict[str, Any] = field(default_factory=dict)
    """`SamplingParams` penalty fields given (presence_penalty, frequency_penalty, repetition_penalty
    (vLLM's extra), logit_bias as {token id: bias})."""
    tool_use: ToolUse | None = None
    """Chat: the request's tools (rendered by the chat template) and its tool_choice (None: no tools)."""

    @property
    def tools(self) -> tuple[dict[str, Any], ...] | None:
        """The tools the chat template renders (None: none)."""
        return self.tool_use.tools if self.tool_use is not None else None

    @property
    def echoes_prompt(self) -> bool:
        """Completions' echo: each choice starts with its prompt's text (and logprobs)."""
        return self.echo and self.endpoint == "completions"

    @property
    def role(self) -> str:
        """Chat: the role of the answer's message: the assistant's after the generation prompt, else the last
        message's (the one continued), as vLLM answers."""
        if self.add_generation_prompt or self.messages is None:
            return "assistant"
        return self.messages[-1]["role"]

    def template_options(self) -> dict[str, bool]:
        """The chat template's options (`prompts.encode_prompt`'s keywords)."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    @property
    def chat_echo(self) -> str | None:
        """Chat's echo (vLLM's): what each choice's content starts with, the last message's content when that
        message has the answer's role ("" when it has another); None without echo."""
        if not self.echo or self.messages is None:
            return None
        last = self.messages[-1]
        return (last.get("content") or "") if last["role"] == self.role else ""

    def prompt_sources(self) -> list[str | tuple[int, ...] | list[dict[str, str]]]:
        """What each prompt is encoded from: the chat's messages, or each completions prompt."""
        return [list(self.messages)] if self.messages is not None else list(self.prompts)

    def sampling(self) -> dict[str, Any]:
        """`SamplingParams` fields, except max_new_tokens (which needs the prompt length)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
                "seed": self.seed, "stop": self.stop, "logprobs": self.logprobs,
                "prompt_logprobs": self.logprobs if self.echoes_prompt else None, **self.penalties}


# Parameters OpenAI defines that this server cannot honour: rejected unless left at their no-op value.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),  # the legacy function calling: give tools and tool_choice instead
    "function_call": (None, "none", "auto"),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "guided_whitespace_pattern": (None,),
    "return_tokens_as_token_ids": (None, False),
    "prompt_logprobs": (None,),  # completions give the prompt's logprobs through echo + logprobs
    # vLLM's extras that change the prompt: honoured only at the value that leaves it as this server builds it
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None, []),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None, []),  # vLLM's extras that change the output: not honoured here
    "bad_words": (None, []),
    "use_beam_search": (None, False),
}

_ADD_SPECIAL_TOKENS = {"completions": True, "chat": False}
"""vLLM's `add_special_tokens` default per endpoint: the only value this server honours."""

# vLLM's structured-output parameters: the old guided_* fields, and structured_outputs' keys.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def choice_seed(seed: int, j: int) -> int:
    """Choice j's seed of a request seeded `seed` (seed + j, as vLLM seeds them), kept in the 64 bits
    a generator takes: past 2**64 - 1 it wraps round."""
    seeded = seed + j
    return seeded - 2**64 if seeded >= 2**64 else seeded


def json_text(value: Any, **options: Any) -> str:
    """`value` as JSON text that UTF-8 encodes: json.dumps(value, ensure_ascii=False, **options), or where a
    string holds a lone surrogate (a request's unpaired \\ud800-\\udfff escape, echoed: a model name, a
    tool's name, a batch line's custom_id), ensure_ascii's text, which writes it as its escape (as a stream's
    events write every string) instead of raising UnicodeEncodeError."""
    text = json.dumps(value, ensure_ascii=False, **options)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, **options)
    return text


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 naming what is wrong."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: not JSON, or a 4300+ digit int
        raise APIError(400, f"We could not parse the JSON body of your request ({exc}); send a JSON object "
                            "with Content-Type: application/json", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


UNKNOWN_MODEL = "The model '{model}' does not exist; this server serves '{served}' (see GET /v1/models)"
"""The 404's message for a request naming another model than the served one (`{model}`: the one named,
`{served}`: the served one), as the server's client reads it; `specula run-batch` words its own."""


def parse_request(endpoint: Endpoint, body: Mapping[str, Any], served_model: str,
                  unknown_model: str = UNKNOWN_MODEL, *, tool_parser: str | None = None) -> GenerationRequest:
    """Validate a request body for `endpoint` (raises `APIError`). A request naming no model (no
    `model`, null or "") is for the served one, as vLLM serves it (one model per server); a model
    named otherwise must be the served one (else a 404 worded by `unknown_model`, see `UNKNOWN_MODEL`).
    `tool_parser` parses tool_choice auto's output (the server's `--enable-auto-tool-choice
    --tool-call-parser`; None: auto with tools is a 400, as in vLLM)."""
    model = _model(body, served_model, unknown_model)
    _refuse_unsupported(body)
    _default_only(body, "add_special_tokens", _ADD_SPECIAL_TOKENS[endpoint])
    n = _opt_int(body, "n", minimum=1) or 1
    prompts: tuple = ()
    messages = None
    echo = False
    max_tokens_param = "max_tokens"
    tool_use = None
    template = {"add_generation_prompt": True, "continue_final_message": False}
    if endpoint == "completions":
        _no_tools(body)
        _no_template_options(body)
        prompts = _prompts(body)
        echo = _opt_bool(body, "echo")
        max_tokens = _opt_int(body, "max_tokens", minimum=0 if echo else 1)  # echo with 0: the prompt alone
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        logprobs = _completion_logprobs(body)
    else:
        logprobs = _chat_logprobs(body)
        messages = _messages(body)
        echo = _opt_bool(body, "echo")  # vLLM's: the last message's content first (`chat_echo`)
        template = _template_options(body)
        tool_use = _tool_use(body, tool_parser)
        max_tokens = _opt_int(body, "max_completion_tokens", minimum=1)
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens", minimum=1)
        else:
            max_tokens_param = "max_completion_tokens"
    temperature = _opt_number(body, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"temperature must be between 0 and 2, got {temperature}; use 0 for greedy decoding",
                       param="temperature", code="invalid_value")
    top_p = _opt_number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise APIError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p", code="invalid_value")
    top_k = _opt_int(body, "top_k", minimum=-1)
    if top_k == -1:  # vLLM's "every token", as 0
        top_k = 0
    min_p = _opt_number(body, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise APIError(400, f"min_p must be in [0, 1], got {min_p}", param="min_p", code="invalid_value")
    seed = _opt_int(body, "seed")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise APIError(400, f"seed must fit in 64 bits, got {seed}", param="seed", code="invalid_value")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _type_error("stream", "a boolean", stream)
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
        raise _type_error("user", "a string", body["user"])
    min_tokens = _opt_int(body, "min_tokens", minimum=0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({min_tokens}) must not exceed {max_tokens_param} ({max_tokens})",
                       param="min_tokens", code="invalid_value")
    constraint, constraint_param = _with_tool_constraint(tool_use, *_constraint(body))
    if min_tokens and constraint is not None:
        raise APIError(400, f"min_tokens cannot be combined with {constraint_param} (a complete match allows only "
                            "the end of the output): drop one of them", param="min_tokens", code="invalid_value")
    choices = max(1, len(prompts)) * n
    if choices > MAX_CHOICES:
        raise APIError(400, f"the request asks for {choices} choices ({max(1, len(prompts))} prompts times n={n}); "
                            f"this server takes at most {MAX_CHOICES} a request: send several requests",
                       param="n", code="invalid_value")
    return GenerationRequest(
        endpoint=endpoint, model=model, prompts=prompts, messages=messages, **template, max_tokens=max_tokens,
        max_tokens_param=max_tokens_param, n=n,
        temperature=temperature, top_p=top_p, top_k=top_k or 0, min_p=min_p, seed=seed,
        stop_token_ids=_stop_token_ids(body), ignore_eos=_opt_bool(body, "ignore_eos"), min_tokens=min_tokens,
        stop=_stop(body), stream=stream, include_usage=_include_usage(body, stream),
        constraint=constraint, constraint_param=constraint_param, logprobs=logprobs, echo=echo,
        penalties=_penalties(body), tool_use=tool_use,
    )


def _penalties(body: Mapping[str, Any]) -> dict[str, Any]:
    """presence_penalty and frequency_penalty (-2..2), repetition_penalty (> 0, vLLM's extra) and
    logit_bias ({token id: -100..100}), where given."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            value = _opt_number(body, name, 0.0)
            if not -2.0 <= value <= 2.0:
                raise APIError(400, f"'{name}' must be between -2 and 2, got {value}", param=name, code="invalid_value")
            out[name] = value
    if body.get("repetition_penalty") is not None:
        value = _opt_number(body, "repetition_penalty", 1.0)
        if not value > 0:
            raise APIError(400, f"'repetition_penalty' must be > 0 (1 turns it off), got {value}",
                           param="repetition_penalty", code="invalid_value")
        out["repetition_penalty"] = value
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _type_error("logit_bias", "an object mapping token ids to numbers", bias)
        parsed = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(400, f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias",
                               code="invalid_value") from None
            if token < 0 or isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise APIError(400, f"'logit_bias' maps token ids (>= 0) to numbers from -100 to 100, got "
                                    f"{key!r}: {json.dumps(value)[:40]}", param="logit_bias", code="invalid_value")
            parsed[token] = float(value)
        if parsed:
            out["logit_bias"] = parsed
    return out


def _opt_bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _logprob_count(body: Mapping[str, Any], name: str) -> int | None:
    count = _opt_int(body, name, minimum=0)
    if count is not None and count > MAX_LOGPROBS:
        raise APIError(400, f"'{name}' must be at most {MAX_LOGPROBS}, got {count}", param=name,
                       code="invalid_value")
    return count


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat: `logprobs` (a boolean) turns them on, `top_logprobs` (0-20) asks for alternatives;
    `top_logprobs` > 0 without `logprobs: true` is a 400, as at OpenAI."""
    wanted = _opt_bool(body, "logprobs")
    top = _logprob_count(body, "top_logprobs")
    if top and not wanted:  # 0 alongside logprobs false asks for nothing
        raise APIError(400, "'top_logprobs' needs 'logprobs' set to true", param="top_logprobs",
                       code="invalid_value")
    return (top or 0) if wanted else None


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """Completions: `logprobs` is the number of alternatives (0-20; null or false: none)."""
    if body.get("top_logprobs") not in (None, 0):
        raise APIError(400, "/v1/completions takes the number of alternatives as 'logprobs'; 'top_logprobs' "
                            "is chat's", param="top_logprobs", code="unsupported_parameter")
    if body.get("logprobs") is False:
        return None
    return _logprob_count(body, "logprobs")


def _model(body: Mapping[str, Any], served_model: str, unknown_model: str = UNKNOWN_MODEL) -> str:
    """The request's model: the served one, also when it names none (absent, null or "")."""
    model = body.get("model")
    if model is None or model == "":
        model = served_model
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    if model != served_model:
        raise APIError(404, unknown_model.format(model=model, served=served_model), param="model",
                       code="model_not_found")
    return model


def prompt_error(exc: Exception, param: str) -> APIError:
    """The 400 for a prompt that could not be encoded (`prompts.encode_prompt`'s error), worded for an
    HTTP client."""
    if isinstance(exc, NoChatTemplate):
        return APIError(400, "this model's tokenizer has no chat template: send the text to /v1/completions "
                             "instead", param=param, code="invalid_value")
    return APIError(400, str(exc), param=param, code="invalid_value")


def _refuse_set(body: Mapping[str, Any], neutrals: Mapping[str, tuple[Any, ...]], why: str) -> None:
    """A 400 (unsupported_parameter) for the first field of `neutrals` given away from its no-op values;
    `why` (with `{name}`) says why it is refused."""
    for name, neutral in neutrals.items():
        if name in body and body[name] not in neutral:
            raise APIError(400, why.format(name=name), param=name, code="unsupported_parameter")


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    """An APIError for a parameter of `_UNSUPPORTED` set away from its no-op value."""
    _refuse_set(body, _UNSUPPORTED, "'{name}' is not supported by this server; remove it from the request")


def parse_tokenize(body: Mapping[str, Any], served_model: str) -> tuple[Any, bool]:
    """vLLM's /tokenize: what to encode and whether raw: `prompt` (text or ids, raw, as
    /v1/completions encodes it) or `messages` (through the chat template, as /v1/chat/completions)."""
    _model(body, served_model)
    _refuse_unsupported(body)
    _default_only(body, "add_special_tokens", _ADD_SPECIAL_TOKENS["chat" if "messages" in body else "completions"])
    _default_only(body, "return_token_strs", False)
    if ("prompt" in body) == ("messages" in body):
        raise APIError(400, "give either 'prompt' (encoded as /v1/completions does) or 'messages' (as "
                            "/v1/chat/completions does)", param="prompt", code="invalid_value")
    if "messages" in body:
        return list(_messages(body)), False
    prompts = _prompts(body)
    if len(prompts) != 1:
        raise APIError(400, f"/tokenize takes one prompt, got {len(prompts)}", param="prompt", code="invalid_value")
    return (list(prompts[0]) if isinstance(prompts[0], tuple) else prompts[0]), True


def parse_tokenize_tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...] | None:
    """/tokenize's `tools` (None: none): rendered with `messages` as /v1/chat/completions renders them, as
    vLLM's /tokenize takes them."""
    try:
        tools = parse_tools(body)
    except ToolError as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
    if tools and "messages" not in body:
        raise APIError(400, "'tools' are rendered by the chat template: give them with 'messages', not 'prompt'",
                       param="tools", code="invalid_value")
    return tools or None


def parse_tokenize_template(body: Mapping[str, Any]) -> dict[str, bool]:
    """/tokenize's chat template options (`add_generation_prompt`, `continue_final_message`), with `messages`
    as /v1/chat/completions takes them (vLLM's /tokenize takes them too); a `prompt` takes none."""
    if "messages" not in body:
        _no_template_options(body)
        return {}
    return _template_options(body)


def _default_only(body: Mapping[str, Any], name: str, default: Any) -> None:
    """Refuse a vLLM extra set away from the one value this server gives it (not silently ignored)."""
    if body.get(name) not in (None, default):
        raise APIError(400, f"'{name}' is only supported at {json.dumps(default)} by this server; remove it from "
                       "the request", param=name, code="unsupported_parameter")


def parse_detokenize(body: Mapping[str, Any], served_model: str, vocab: int) -> list[int]:
    """vLLM's /detokenize: the token ids to decode (each inside the model's vocabulary)."""
    _model(body, served_model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
        raise _type_error("tokens", "a list of token ids", tokens)
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token id {bad[0]} is outside the model's vocabulary of {vocab}", param="tokens",
                       code="invalid_value")
    return tokens


def _constraint(body: Mapping[str, Any]) -> tuple[Constraint | None, str | None]:
    """The request's constraint and the field it came from: OpenAI's response_format (text,
    json_object or json_schema), or vLLM's guided_json / guided_regex / guided_choice /
    guided_grammar, or its structured_outputs ({"json" | "regex" | "choice" | "grammar" |
    "json_object": ...}); at most one of them. Compiled here: what the grammar library cannot compile
    is a 400 with the library's reason."""
    given: list[tuple[str, Any]] = []  # (param, constraint)
    try:
        param = "response_format"
        constraint = Constraint.from_response_format(body.get(param))
        if constraint is not None:
            given.append((param, constraint))
        for param, kind in _GUIDED.items():
            if body.get(param) is not None:
                given.append((param, _guided(kind, body[param])))
        param = "structured_outputs"
        outputs = body.get(param)
        if outputs is not None:
            if not isinstance(outputs, dict):
                raise _type_error(param, "an object", outputs)
            for key, value in outputs.items():
                if key in _GUIDED.values() and value is not None:
                    given.append((f"{param}.{key}", _guided(key, value)))
                elif key == "json_object" and value:
                    given.append((f"{param}.{key}", Constraint.json()))
                elif key not in (*_GUIDED.values(), "json_object") and value not in (None, False):
                    raise APIError(400, f"'{param}.{key}' is not supported by this server; give json, regex, "
                                   "choice, grammar or json_object", param=param, code="unsupported_parameter")
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise APIError(400, f"give one constraint, not several ({names})", param=given[1][0],
                           code="invalid_value")
        if not given:
            return None, None
        param, constraint = given[0]
        constraint.grammar_text()
    except ConstraintError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_value") from None
    return constraint, param


def _guided(kind: str, value: Any) -> Constraint:
    """A vLLM guided-decoding value as a constraint: a JSON schema (object or JSON text), a regex,
    a list of choices or a grammar (ConstraintError when it is not one)."""
    if kind == "json":
        if not isinstance(value, (dict, str)):
            raise ConstraintError(f"a JSON schema must be an object or JSON text, got {json.dumps(value)[:80]}")
        return Constraint.json_schema(value)
    if kind == "choice":
        if not isinstance(value, list):
            raise ConstraintError(f"choices must be a list of strings, got {json.dumps(value)[:80]}")
        return Constraint.choice(value)
    if not isinstance(value, str):
        raise ConstraintError(f"a {kind} must be text, got {json.dumps(value)[:80]}")
    return Constraint.regex(value) if kind == "regex" else Constraint.grammar(value)


def _type_error(param: str, expected: str, value: Any) -> APIError:
    return APIError(400, f"'{param}' must be {expected}, got {json.dumps(value)[:80]}", param=param,
                    code="invalid_type")


def _opt_int(body: Mapping[str, Any], name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer", value)
    if minimum is not None and value < minimum:
        raise APIError(400, f"'{name}' must be >= {minimum}, got {value}", param=name, code="invalid_value")
    return value


def _opt_number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _type_error(name, "a number", value)
    return float(value)


def _prompts(body: Mapping[str, Any]) -> tuple[str | tuple[int, ...], ...]:
    """Completions' `prompt`: a string, token ids, or a list of either (a batch: one choice each)."""
    if "prompt" not in body or body["prompt"] is None:
        raise APIError(400, "you must provide a prompt", param="prompt", code="missing_required_parameter")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return tuple(_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt))
    return (_one_prompt(prompt, "prompt"),)


def _one_prompt(prompt: Any, where: str) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, f"{where} is empty: give at least one character of text", param="prompt",
                           code="invalid_value")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, f"{where} is empty: give text or at least one token id", param="prompt",
                           code="invalid_value")
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            return tuple(prompt)
    raise _type_error("prompt", "a string, a list of token ids, or a list of either", prompt)


def _messages(body: Mapping[str, Any]) -> tuple[dict[str, str], ...]:
    messages = body.get("messages")
    if messages is None:
        raise APIError(400, "you must provide messages", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise _type_error("messages", "a list of {'role', 'content'} objects", messages)
    if not messages:
        raise APIError(400, "'messages' is empty: give at least one message", param="messages",
                       code="invalid_value")
    try:
        checked = [chat_message(message, i) for i, message in enumerate(messages)]
        return tuple(template_message(m, i) for i, m in enumerate(checked))
    except (MessageError, ToolError) as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from None


def _tool_use(body: Mapping[str, Any], tool_parser: str | None) -> ToolUse | None:
    """Chat's tools and tool_choice (`tools.parse_tool_use`): tool_choice "none" renders the tools and
    leaves the output as text; "auto" parses it with `tool_parser`; "required" and a named tool constrain
    it (`_with_tool_constraint`)."""
    try:
        return parse_tool_use(body, tool_parser)
    except ToolError as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from None


def _with_tool_constraint(tool_use: ToolUse | None, constraint: Constraint | None,
                          param: str | None) -> tuple[Constraint | None, str | None]:
    """The request's constraint: tool_choice required's or a named tool's JSON schema (vLLM's), which no
    other constraint may join (as in vLLM), else the one `_constraint` found."""
    try:
        tool_constraint = tool_use.constraint() if tool_use is not None else None
    except ToolError as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
    if tool_constraint is None:
        return constraint, param
    if constraint is not None:
        raise APIError(400, f"tool_choice {tool_use.label} constrains the output to tool calls; it cannot be combined "
                            f"with {param}: drop one of them", param="tool_choice", code="invalid_value")
    return tool_constraint, "tool_choice"


def _template_options(body: Mapping[str, Any]) -> dict[str, bool]:
    """Chat's `add_generation_prompt` (default true) and `continue_final_message` (default false), vLLM's
    chat template options; both true is vLLM's 400 (so is continue_final_message alone, add_generation_prompt
    being true by default: vLLM refuses it through transformers)."""
    options = {"add_generation_prompt": _opt_bool(body, "add_generation_prompt", default=True),
               "continue_final_message": _opt_bool(body, "continue_final_message")}
    try:
        check_template_options(**options)
    except ConfigError as exc:
        raise APIError(400, str(exc), param="continue_final_message", code="invalid_value") from None
    return options


def _no_template_options(body: Mapping[str, Any]) -> None:
    """A prompt that is not chat messages takes none of the chat template's options."""
    _refuse_set(body, {"add_generation_prompt": (None, True), "continue_final_message": (None, False)},
                "'{name}' is a chat template option: it takes 'messages' (/v1/chat/completions, /tokenize), not a "
                "prompt")


def _no_tools(body: Mapping[str, Any]) -> None:
    """Completions take no tools (a chat completions parameter)."""
    _refuse_set(body, {"tools": (None, []), "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None,)},
                "'{name}' is a /v1/chat/completions parameter; /v1/completions does not take it")


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _type_error("stop", "a string or a list of strings", stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed",
                       param="stop", code="invalid_value")
    if any(not s for s in stops):
        raise APIError(400, "'stop' strings must not be empty", param="stop", code="invalid_value")
    return tuple(stops)


def _stop_token_ids(body: Mapping[str, Any]) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise _type_error("stop_token_ids", "a list of token ids", ids)
    return tuple(ids)


IGNORED_STREAM_OPTIONS = ("include_obfuscation",)
"""stream_options accepted (each a boolean) and ignored, as vLLM ignores what it does not know: OpenAI's
include_obfuscation adds an `obfuscation` field of random characters to each chunk (hiding the chunk sizes
from a side channel); specula sends no such field, true or false."""


def _stream_flag(options: Mapping[str, Any], name: str) -> bool:
    """stream_options.`name`, a boolean (default false)."""
    value = options.get(name, False)
    if not isinstance(value, bool):
        raise _type_error(f"stream_options.{name}", "a boolean", value)
    return value


def _include_usage(body: Mapping[str, Any], stream: bool) -> bool:
    """stream_options.include_usage; the other options are refused unless false or ignored
    (`IGNORED_STREAM_OPTIONS`)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    if not stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options",
                       code="invalid_value")
    include = _stream_flag(options, "include_usage")
    for name in IGNORED_STREAM_OPTIONS:
        _stream_flag(options, name)
    known = ("include_usage", *IGNORED_STREAM_OPTIONS)
    other = sorted(k for k, v in options.items() if k not in known and v not in (None, False))
    if other:  # e.g. vLLM's continuous_usage_stats (usage on every chunk): not honoured here
        raise APIError(400, f"'stream_options.{other[0]}' is not supported by this server; remove it",
                       param=f"stream_options.{other[0]}", code="unsupported_parameter")
    return include


# --------------------------------------------------------------------------- responses


def new_id(endpoint: Endpoint) -> str:
    return ("cmpl-" if endpoint == "completions" else "chatcmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def speculation(stats: GenerationStats) -> dict[str, Any]:
    """The `speculative_decoding` object of a response."""
    return {
        "method": stats.method,
        "steps": stats.steps,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "mean_accepted_tokens": round(stats.mean_accepted_tokens, 4),
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "tokens_per_s": round(stats.tokens_per_s, 3),
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens read from the prefix cache (`prefix_cache`)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(frozen=True)
class ResponseIds:
    """What every object of one response shares."""

    id: str
    created: int
    model: str
    endpoint: Endpoint

    @classmethod
    def new(cls, request: GenerationRequest) -> "ResponseIds":
        return cls(new_id(request.endpoint), now(), request.model, request.endpoint)

    def _base(self, object_type: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_type, "created": self.created, "model": self.model,
                "system_fingerprint": None}


LOGPROB_FLOOR = -9999.0
"""A logprob below this (an impossible token: -inf, which JSON cannot carry) is reported as it,
as OpenAI reports one."""


def _logprob(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


def chat_logprobs(entries: Sequence[TokenLogprob], token_bytes: TokenBytes) -> dict[str, Any]:
    """Chat's `logprobs` object for generated tokens."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        return {"token": token_bytes.text(token), "logprob": _logprob(logprob), "bytes": list(token_bytes(token))}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


class CompletionLogprobs:
    """Completions' `logprobs` objects of one response, chunk after chunk: each token's text, its
    logprob (null for the prompt's first), its alternatives by text (with the chosen token's, so up
    to logprobs + 1, as at OpenAI) and its offset in the text so far (characters of the tokens'
    own bytes; a character split over tokens counts at the token that completes it; a special
    token, which the text skips, adds none). A token that is part of a character is labelled by
    its bytes, as at OpenAI ("bytes:\\xe6\\x97"), so its alternatives do not collapse into one
    U+FFFD."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self.token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = 0

    def add(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict[str, Any]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(token_ids, entries):
            text = self.token_bytes.label(token)
            out["tokens"].append(text)
            out["text_offset"].append(self._offset)
            if not self.token_bytes.special(token):  # the text skips special tokens
                self._offset += len(self._decoder.decode(self.token_bytes(token)))
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_logprob(entry.logprob))
            top: dict[str, float | None] = {}
            for t, lp in entry.top:  # best first: two tokens of one label keep the likelier
                top.setdefault(self.token_bytes.label(t), _logprob(lp))
            top.setdefault(text, _logprob(entry.logprob))
            out["top_logprobs"].append(top)
        return out


@dataclass(frozen=True)
class ChoiceResult:
    """One finished choice of a (non-streamed) response."""

    index: int
    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None
    """The choice's logprobs object (`chat_logprobs`, `CompletionLogprobs`), when asked."""
    tool_calls: list[dict[str, Any]] | None = None
    """Chat: the tool calls parsed out of the output (`tool_calls.join_tool_calls`); None or []: none (the
    message has no `tool_calls`)."""
    echo: str | None = None
    """Chat: what the message's content starts with under `echo` (`GenerationRequest.chat_echo`; None: no
    echo)."""
    role: str = "assistant"
    """Chat: the message's role (`GenerationRequest.role`)."""


def join_logprobs(objects: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """One logprobs object from a choice's successive ones (chunk by chunk): their lists joined."""
    if not objects:
        return None
    joined: dict[str, Any] = {}
    for obj in objects:
        for key, value in obj.items():
            joined[key] = joined.get(key, []) + value if isinstance(value, list) else value
    return joined


def completion_body(ids: ResponseIds, choices: Sequence[ChoiceResult], prompt_tokens: int,
                    completion_tokens: int, stats: GenerationStats, cached_tokens: int = 0) -> dict[str, Any]:
    """The whole (non-streamed) response: `choices` in index order, `stats` summed over them (`cached_tokens`:
    `usage`'s)."""
    if ids.endpoint == "completions":
        body = ids._base("text_completion")
        body["choices"] = [{"text": c.text, "index": c.index, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                           for c in choices]
    else:
        body = ids._base("chat.completion")
        body["choices"] = [{"index": c.index, "message": _message(c), "logprobs": c.logprobs,
                            "finish_reason": c.finish_reason} for c in choices]
    body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
    body["speculative_decoding"] = speculation(stats)
    return body


def _message(choice: ChoiceResult) -> dict[str, Any]:
    """Chat's message of a finished choice: its text, or its tool calls and the text beside them (null when
    there is none, as at OpenAI); under echo, the echoed content first (text, as vLLM writes it)."""
    message: dict[str, Any] = {"role": choice.role, "content": choice.text, "refusal": None}
    if choice.tool_calls:
        message["content"] = choice.text or None
        message["tool_calls"] = choice.tool_calls
    if choice.echo is not None:
        message["content"] = choice.echo + (message["content"] or "")
    return message


def chunk_body(ids: ResponseIds, text: str | None, finish_reason: str | None = None, *, index: int = 0,
               first: bool = False, stats: GenerationStats | None = None,
               logprobs: dict[str, Any] | None = None,
               tool_calls: list[dict[str, Any]] | None = None, role: str = "assistant") -> dict[str, Any]:
    """One streamed chunk of choice `index`. Chat: a choice's first carries the `role`, its last an
    empty delta and the finish reason. `stats` adds `speculative_decoding` (a finishing chunk:
    that choice's); `logprobs` is the logprobs object of the chunk's tokens; `tool_calls` the tool call
    deltas it sends (`specula.serve.tool_calls`)."""
    if ids.endpoint == "completions":
        body = ids._base("text_completion")
        body["choices"] = [{"text": text or "", "index": index, "logprobs": logprobs, "finish_reason": finish_reason}]
    else:
        body = ids._base("chat.completion.chunk")
        delta: dict[str, Any] = {"role": role, "content": text or ""} if first else {}
        if not first and text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        body["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    if stats is not None:
        body["speculative_decoding"] = speculation(stats)
    return body


def usage_chunk_body(ids: ResponseIds, prompt_tokens: int, completion_tokens: int,
                     stats: GenerationStats, cached_tokens: int = 0) -> dict[str, Any]:
    """stream_options.include_usage: the last chunk, with no choices."""
    body = ids._base("text_completion" if ids.endpoint == "completions" else "chat.completion.chunk")
    body["choices"] = []
    body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
    body["speculative_decoding"] = speculation(stats)
    return body


def models_body(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "specula"}]}
