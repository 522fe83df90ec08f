"""Tool calling, the output side (pure, no I/O): a choice's generated text, as it arrives, split into
message content and tool calls in the wire's delta shape, for a streamed response as for a whole one.

Every parser takes the text piece by piece (`feed`, then `finish` once the choice has ended) and gives
back `(content, tool_call_deltas)`: the text to send as content now, and tool calls as
`{"index", "id", "type": "function", "function": {"name", "arguments"}}` (a call's later deltas carry
`index` and more `arguments` only). A whole response joins the same pieces (`join_tool_calls`), so a
stream and a response of one output say the same thing. Tool call ids are vLLM's `chatcmpl-tool-<hex>`.

- `HermesParser` (tool_choice auto, `--tool-call-parser hermes`): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks become tool calls, each in one delta when its closing tag arrives (or at
  the end, when the output stops inside an unclosed block whose JSON is whole, as vLLM reads it); the
  text before the first block is content, streamed as it comes except for a tail that could begin
  `<tool_call>`, which waits for the next text.
- `RequiredParser` (tool_choice required): the output is a JSON list of `{"name", "parameters"}`
  (constrained); each element becomes a call as soon as it closes.
- `NamedParser` (a named tool_choice): the whole output (constrained) is the named tool's arguments,
  streamed as it comes.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Protocol

from specula.serve.tools import ToolUse

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

Piece = tuple[str, list[dict[str, Any]]]
"""(content text, tool call deltas) of one stretch of output."""


def tool_call_id() -> str:
    """A new tool call id, as vLLM makes them."""
    return "chatcmpl-tool-" + uuid.uuid4().hex


def whole_call(index: int, name: str, arguments: str) -> dict[str, Any]:
    """One tool call's delta when it is sent whole."""
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


def _call_json(text: str, arguments_key: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call written as `{"name": ..., <arguments_key>: ...}`, or None
    when `text` is not one. The arguments are written again as vLLM writes them (`json.dumps`,
    `ensure_ascii=False`)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or arguments_key not in value:
        return None
    return value["name"], json.dumps(value[arguments_key], ensure_ascii=False)


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
    it). A block that is not a call (not JSON, no string "name", no "arguments") stays in the content as
    written."""

    def __init__(self) -> None:
        self.called = False
        self._pending = ""
        """Text not yet given out: a possible start of `<tool_call>`, an open block, or whitespace after a block."""
        self._in_block = False
        self._after_block = False
        """The last thing read was a block (whitespace waits to see whether more text or a block follows)."""
        self._index = 0

    def feed(self, text: str) -> Piece:
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> Piece:
        return self._drain(final=True)

    def _drain(self, final: bool) -> Piece:
        content, calls = "", []
        while True:
            if self._in_block:
                end = self._pending.find(TOOL_CALL_END)
                if end < 0 and not final:
                    break
                body = self._pending if end < 0 else self._pending[:end]
                self._pending = "" if end < 0 else self._pending[end + len(TOOL_CALL_END):]
                self._in_block, self._after_block = False, True
                call = _call_json(body, "arguments")
                if call is None:
                    content += TOOL_CALL_START + body + ("" if end < 0 else TOOL_CALL_END)
                else:
                    calls.append(whole_call(self._index, *call))
                    self._index += 1
                    self.called = True
                continue
            start = self._pending.find(TOOL_CALL_START)
            if start >= 0:
                text = self._pending[:start]
                if not (self._after_block and text.isspace()):
                    content += text
                self._pending = self._pending[start + len(TOOL_CALL_START):]
                self._in_block = True
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
    element is a call once its closing brace arrives (its parameters written again as vLLM writes them).
    An output that ends with no element complete (cut by max_tokens or a stop string) is content, as
    written."""

    def __init__(self) -> None:
        self.called = False
        self._text = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._element = -1
        """Where the element being read starts in `_text` (-1: between elements)."""
        self._index = 0

    def feed(self, text: str) -> Piece:
        calls = []
        for i, c in enumerate(text, len(self._text)):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "[{":
                if self._depth == 1 and c == "{":
                    self._element = i
                self._depth += 1
            elif c in "]}":
                self._depth -= 1
                if self._depth == 1 and self._element >= 0:
                    element = (self._text + text)[self._element:i + 1]
                    self._element = -1
                    call = _call_json(element, "parameters")
                    if call is not None:
                        calls.append(whole_call(self._index, *call))
                        self._index += 1
                        self.called = True
        self._text += text
        return "", calls

    def finish(self) -> Piece:
        return ("" if self.called else self._text), []


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
        return "", [whole_call(0, self.name, text)]

    def finish(self) -> Piece:
        if self.called:
            return "", []
        self.called = True
        return "", [whole_call(0, self.name, "")]


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
