"""Tool calling, the output side (pure, no I/O): a choice's generated text, as it arrives, split into
message content and tool calls in the wire's delta shape, for a streamed response as for a whole one.

Every parser takes the text piece by piece (`feed`, then `finish` once the choice has ended) and gives
back `(content, tool_call_deltas)`: the text to send as content now, and tool call deltas as vLLM streams
them: a call's first delta `{"index", "id", "type": "function", "function": {"name", "arguments"}}` once
its name is known (with the arguments so far, often none), then deltas of `index` and more `arguments`
only, as the arguments are generated. A whole response joins the same deltas (`join_tool_calls`), so a
stream and a response of one output say the same thing. Tool call ids are vLLM's `chatcmpl-tool-<hex>`.

- `HermesParser` (tool_choice auto, `--tool-call-parser hermes`): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks become tool calls, each named as soon as its name is whole and its arguments
  have begun, its arguments then sent as they settle (`_CallReader`); the text before the first block is
  content, streamed as it comes except for a tail that could begin `<tool_call>`, which waits for the
  next text. Where the tokenizer makes the tags special tokens, the output's text keeps them for the
  parser (`special_tags`, `SamplingParams.kept_special_tokens`; decoding drops special tokens otherwise).
- `RequiredParser` (tool_choice required): the output is a JSON list of `{"name", "parameters"}`
  (constrained); each element becomes a call the same way, as its parameters begin.
- `NamedParser` (a named tool_choice): the whole output (constrained) is the named tool's arguments,
  streamed as it comes.

The arguments of auto and required are written as vLLM's whole response writes them (`json.dumps(
arguments, ensure_ascii=False)`), piece by piece as the JSON settles (`specula.serve.json_rewrite`: a
number goes out once the character after it shows it is whole, an escape once it is complete; a lone
surrogate stays an escape, `\\ud83d`, where vLLM's response fails to encode it), so what was sent
is never contradicted by what follows; vLLM streams the model's own text instead, whose layout
its whole response does not keep. A call that has begun going out cannot be taken back: its JSON breaking
off later (cut by max_tokens, malformed) leaves it with the arguments read up to there, in a whole
response too (where max_tokens cut it, finish_reason says "length").
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from specula.serve.json_rewrite import JsonRewriter, Path
from specula.serve.tools import ToolUse

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

Piece = tuple[str, list[dict[str, Any]]]
"""(content text, tool call deltas) of one stretch of output."""
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def special_tags(tokenizer: Any) -> tuple[int, ...]:
    """The ids of `<tool_call>` and `</tool_call>` where the tokenizer makes each a special token, which
    decoding with skip_special_tokens drops (a model's added special tokens): the output's text must keep
    them for the hermes parser to see the blocks. () where the tags are text (Qwen2.5's)."""
    ids = []
    for tag in (TOOL_CALL_START, TOOL_CALL_END):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) == 1 and (tokenizer.decode(encoded, skip_special_tokens=True)
                                  != tokenizer.decode(encoded, skip_special_tokens=False) == tag):
            ids.append(int(encoded[0]))
    return tuple(ids)


def tool_call_id() -> str:
    """A new tool call id, as vLLM makes them."""
    return "chatcmpl-tool-" + uuid.uuid4().hex


def first_delta(index: int, name: str, arguments: str) -> dict[str, Any]:
    """A tool call's first delta: its index, a new id, its type and name, and the arguments so far."""
    return {"index": index, "id": tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def join_tool_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's `tool_calls` from its stream of tool call deltas: by index, each call's arguments
    joined."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.get(delta["index"])
        if call is None:
            calls[delta["index"]] = {"id": delta["id"], "type": "function",
                                     "function": {"name": delta["function"]["name"],
                                                  "arguments": delta["function"].get("arguments", "")}}
        else:
            call["function"]["arguments"] += delta["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


class Parser(Protocol):
    """What every parser does (see the module docstring)."""

    called: bool
    """A tool call has been given."""

    def feed(self, text: str) -> Piece: ...

    def finish(self) -> Piece: ...


@dataclass
class _Call:
    """One call object read so far: where its name and arguments lie in the reader's text."""

    is_object: bool
    name: str | None = None
    """The name, once its string is whole (None: not yet, or not a string)."""
    name_start: int | None = None
    """Where the first "name" member's string begins in the text (None: none yet, or not a string)."""
    start: int | None = None
    """Where the arguments begin in the text (None: not begun)."""
    end: int | None = None
    """Where they end (None: not yet)."""
    index: int | None = None
    """The tool call's index once its first delta went out."""
    sent: int = 0
    """Characters of the arguments sent."""


class _CallReader:
    """The calls of a JSON text as it is generated: objects `{"name": <a string>, <arguments_key>: <any
    value>}` at `depth` (0: the root, a hermes block's; 1: the elements of the root list, tool_choice
    required's). A call goes out (`deltas`) once its name is whole and its arguments have begun: a first
    delta with its index, id, type, name and the arguments so far, then more arguments as they settle,
    written as `JsonRewriter` writes them (json.dumps's layout, what a whole response gives). A call object
    that gives "name" or the arguments twice keeps the first. A name is text, not JSON: a lone surrogate in
    it (an unpaired \\ud800-\\udfff escape) becomes U+FFFD, as undecodable bytes of the output do, so that
    the response is Unicode any client reads and can send back (the arguments keep it as its escape)."""

    def __init__(self, depth: int, arguments_key: str, next_index: Callable[[], int]) -> None:
        self.depth, self.arguments_key, self.next_index = depth, arguments_key, next_index
        self.json = JsonRewriter(self._on_value)
        self.calls: list[_Call] = []

    @property
    def called(self) -> bool:
        """A call has gone out."""
        return any(call.index is not None for call in self.calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.json.feed(text)
        return self.deltas()

    def close(self) -> list[dict[str, Any]]:
        """The text has ended (a number at its end is whole)."""
        self.json.close()
        return self.deltas()

    def _on_value(self, event: str, path: Path, offset: int, kind: str) -> None:
        if len(path) == self.depth:
            if event == "start" and (self.depth == 0 or isinstance(path[-1], int)):
                self.calls.append(_Call(kind == "{"))
            return
        if len(path) != self.depth + 1 or not self.calls or not self.calls[-1].is_object:
            return
        call, key = self.calls[-1], path[-1]
        if key == "name" and call.name is None:
            if event == "start":
                call.name_start = offset if kind == '"' and call.name_start is None else -1
            elif call.name_start >= 0:
                call.name = _LONE_SURROGATE.sub("\ufffd", json.loads(self.json.text[call.name_start:offset]))
        elif key == self.arguments_key:
            if event == "start" and call.start is None:
                call.start = offset
            elif event == "end" and call.end is None and call.start is not None:
                call.end = offset

    def deltas(self) -> list[dict[str, Any]]:
        out = []
        text = self.json.text
        for call in self.calls:
            if call.name is None or call.start is None:
                continue
            arguments = text[call.start:len(text) if call.end is None else call.end]
            more = arguments[call.sent:]
            call.sent = len(arguments)
            if call.index is None:
                call.index = self.next_index()
                out.append(first_delta(call.index, call.name, more))
            elif more:
                out.append({"index": call.index, "function": {"arguments": more}})
        return out


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held back: the rest of the tag may follow)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesParser:
    """Hermes-format tool calls (Qwen2.5, Qwen3, Hermes 2 Pro and others), as vLLM's `hermes` parser reads
    them. Content is the text before the first `<tool_call>`; whitespace between and after blocks is
    dropped; other text after a block is content too (vLLM drops it from a whole response and streams
    it). A block is a call once its JSON has given a string "name" and begun its "arguments" (`_CallReader`);
    one that never does (not JSON, no string "name", no "arguments") stays in the content as written.
    A call's JSON that breaks off after that (cut by max_tokens, malformed, text after it in the block)
    keeps the arguments read up to there, as a stream has sent them."""

    def __init__(self) -> None:
        self.called = False
        self._pending = ""
        """Text not yet read: a possible start of `<tool_call>` or `</tool_call>`, or whitespace after a block."""
        self._block: _CallReader | None = None
        """The open block's reader."""
        self._raw = ""
        """The open block's text as written (its content, should it not be a call)."""
        self._after_block = False
        """The last thing read was a block (whitespace waits to see whether more text or a block follows)."""
        self._index = 0

    def feed(self, text: str) -> Piece:
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> Piece:
        return self._drain(final=True)

    def _next_index(self) -> int:
        self._index += 1
        self.called = True
        return self._index - 1

    def _drain(self, final: bool) -> Piece:
        content, calls = "", []
        while True:
            if self._block is not None:
                end = self._pending.find(TOOL_CALL_END)
                cut = end if end >= 0 else len(self._pending) - (0 if final else _partial_tag(self._pending,
                                                                                               TOOL_CALL_END))
                body = self._pending[:cut]
                self._pending = self._pending[cut + len(TOOL_CALL_END):] if end >= 0 else self._pending[cut:]
                self._raw += body
                calls += self._block.feed(body)
                if end < 0 and not final:
                    break
                calls += self._block.close()
                if not self._block.called:
                    content += TOOL_CALL_START + self._raw + (TOOL_CALL_END if end >= 0 else "")
                self._block, self._raw, self._after_block = None, "", True
                continue
            start = self._pending.find(TOOL_CALL_START)
            if start >= 0:
                text = self._pending[:start]
                if not (self._after_block and text.isspace()):
                    content += text
                self._pending = self._pending[start + len(TOOL_CALL_START):]
                self._block = _CallReader(0, "arguments", self._next_index)
                continue
            held = 0 if final else _partial_tag(self._pending, TOOL_CALL_START)
            text = self._pending[:len(self._pending) - held]
            if self._after_block and (text.isspace() or not text):
                if final:
                    self._pending = ""
                break  # whitespace after a block: dropped if a block or the end follows
            content += text
            self._pending = self._pending[len(text):]
            self._after_block = False
            break
        return content, calls


class RequiredParser:
    """tool_choice required: the output is constrained to `[{"name": ..., "parameters": {...}}, ...]`; each
    element is a call once its name is whole and its parameters have begun, its parameters streamed as
    they settle (`_CallReader`). An output that ends before any call began (cut by max_tokens or a stop
    string) is content, as written; one cut inside a call keeps the parameters read up to there."""

    def __init__(self) -> None:
        self._text = ""
        self._index = 0
        self._reader = _CallReader(1, "parameters", self._next_index)

    @property
    def called(self) -> bool:
        return self._reader.called

    def _next_index(self) -> int:
        self._index += 1
        return self._index - 1

    def feed(self, text: str) -> Piece:
        self._text += text
        return "", self._reader.feed(text)

    def finish(self) -> Piece:
        calls = self._reader.close()
        return ("" if self.called else self._text), calls


class NamedParser:
    """A named tool_choice: the output (constrained to the tool's parameters) is that tool's arguments,
    streamed as they come: the first delta names the call, the next ones add arguments. An empty output
    is still the call, with empty arguments (as vLLM gives it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.called = False

    def feed(self, text: str) -> Piece:
        if not text:
            return "", []
        if self.called:
            return "", [{"index": 0, "function": {"arguments": text}}]
        self.called = True
        return "", [first_delta(0, self.name, text)]

    def finish(self) -> Piece:
        if self.called:
            return "", []
        self.called = True
        return "", [first_delta(0, self.name, "")]


class ToolCallOutput:
    """One choice's output under a request's tool_choice: its parser, `parallel_tool_calls` (false: the
    first call only), and the finish reason."""

    def __init__(self, tool_use: ToolUse) -> None:
        self.choice = tool_use.choice
        self.parallel = tool_use.parallel
        self.parser: Parser = (NamedParser(tool_use.name) if tool_use.choice == "named" else
                               RequiredParser() if tool_use.choice == "required" else HermesParser())

    @classmethod
    def for_request(cls, tool_use: ToolUse | None) -> "ToolCallOutput | None":
        """The choice's output parser; None when the output is not parsed (no tools, tool_choice none)."""
        return None if tool_use is None or tool_use.choice == "none" else cls(tool_use)

    @property
    def called(self) -> bool:
        return self.parser.called

    def feed(self, text: str) -> Piece:
        return self._keep(self.parser.feed(text))

    def finish(self) -> Piece:
        return self._keep(self.parser.finish())

    def _keep(self, piece: Piece) -> Piece:
        content, calls = piece
        return content, calls if self.parallel else [c for c in calls if c["index"] == 0]

    def finish_reason(self, reason: str) -> str:
        """The choice's finish reason: "tool_calls" when it called a tool and ended by itself ("stop"), for
        auto and required; a named choice keeps "stop" (OpenAI's and vLLM's rule); an output cut by
        max_tokens stays "length"."""
        return "tool_calls" if self.called and self.choice != "named" and reason == "stop" else reason
