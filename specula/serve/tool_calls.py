"""Tool calling, the output side (pure, no I/O): a choice's generated text, as it arrives, split into
message content and tool calls in the wire's delta shape, for a streamed response as for a whole one.

Every parser takes the text piece by piece (`feed`, then `finish` once the choice has ended) and gives
back `(content, tool_call_deltas)`: the text to send as content now, and tool call deltas as vLLM streams
them: a call's first delta `{"index", "id", "type": "function", "function": {"name", "arguments"}}` once
its name is known (with the arguments so far, often none), then deltas of `index` and more `arguments`
only, as the arguments are generated. A whole response joins the same deltas (`join_tool_calls`), so a
stream and a response of one output say the same thing. Tool call ids are vLLM's `chatcmpl-tool-<hex>`
(mistral's: 9 letters and digits, as vLLM's mistral parser makes them).

tool_choice auto parses the format the server's `--tool-call-parser` names (`AUTO_PARSERS`, vLLM's names):

- `HermesParser` (`hermes`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks become tool
  calls, each named as soon as its name is whole and its arguments have begun, its arguments then sent as
  they settle (`_CallReader`); the text before the first block is content, streamed as it comes except
  for a tail that could begin `<tool_call>`, which waits for the next text.
- `Llama3JsonParser` (`llama3_json`, Llama 3.1 to 3.3): the output's first `{` (after text, which is content,
  or whitespace and `<|python_tag|>`) opens `{"name": ..., "parameters": {...}}` calls separated by `;`;
  where that first object makes no call, the output is content, all of it.
- `MistralParser` (`mistral`): content, then `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}`
  (Mistral 7B v0.3), or `[TOOL_CALLS]name[ARGS]{...}` for each call (Mistral Small 3 and later; some
  models write `[CALL_ID]` and an id before `[ARGS]`).
- `PythonicParser` (`pythonic`, Llama 3.2 1B and 3B, Llama 4): an output that begins (after whitespace) with
  `[` is read as a Python list of calls, `[name(key=<literal>, ...), ...]` (`ast`, never evaluated); each call
  goes out whole, its arguments as JSON, once its `)` closes it; any other output is content.
- `Llama4PythonicParser` (`llama4_pythonic`, Llama 4): pythonic's, Llama 4's `<|python_start|>` and
  `<|python_end|>` around the list dropped where the text has them.

Where the tokenizer makes a format's tags special tokens (`kept_tags`: hermes's, mistral's), the output's
text keeps them for the parser (`special_tags`, `SamplingParams.kept_special_tokens`; decoding drops
special tokens otherwise), as vLLM's parsers read them.

The other choices:

- `RequiredParser` (tool_choice required): the output is a JSON list of `{"name", "parameters"}`
  (constrained); each element becomes a call the same way, as its parameters begin.
- `NamedParser` (a named tool_choice): the whole output (constrained) is the named tool's arguments,
  streamed as it comes.

The arguments of every auto parser and of required are written as vLLM's whole response writes them
(`json.dumps(arguments, ensure_ascii=False)`; mistral's name form too, where vLLM passes the text on), piece
by piece as the JSON settles (`specula.serve.json_rewrite`: a number goes out once the character after it
shows it is whole, an escape once it is complete; a lone surrogate stays an escape, `\\ud83d`, where vLLM's
response fails to encode it; pythonic's at once for each call, a Python literal being JSON only once whole),
so what was sent is never contradicted by what follows; vLLM streams the model's own text instead, whose
layout its whole response does not keep. A call that has begun going out cannot be
taken back: its JSON breaking off later (cut by max_tokens, malformed) leaves it with the arguments read up to
there, in a whole response too (where max_tokens cut it, finish_reason says "length").
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from specula.serve.json_rewrite import WHITESPACE, JsonRewriter, Path
from specula.serve.tools import ToolUse

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
"""What Llama 3.x may write before its JSON tool call (a special token: decoding drops it, as in vLLM)."""
PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
"""What Llama 4 may write around its pythonic tool calls (special tokens: decoding drops them, as in vLLM)."""
TOOL_CALLS = "[TOOL_CALLS]"
"""Mistral's token before its tool calls."""
ARGS = "[ARGS]"
"""Mistral's token between a call's name and its arguments (the `[TOOL_CALLS]name[ARGS]{...}` form)."""
CALL_ID = "[CALL_ID]"
"""Mistral's token before the id that some models write between a call's name and `[ARGS]`."""

Piece = tuple[str, list[dict[str, Any]]]
"""(content text, tool call deltas) of one stretch of output."""
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_-]*")
"""The characters of a function name in Mistral's `[TOOL_CALLS]name{...}` form (vLLM's)."""
_MISTRAL_ID = string.ascii_letters + string.digits


def special_tags(tokenizer: Any, parser: str = "hermes") -> tuple[int, ...]:
    """The ids of the `parser`'s tags (`kept_tags`: hermes's `<tool_call>` and `</tool_call>`, mistral's
    `[TOOL_CALLS]`, `[ARGS]` and `[CALL_ID]`) where the tokenizer makes each a special token, which decoding with
    skip_special_tokens drops (a model's added special tokens): the output's text must keep them for the
    parser to see the calls. () where the tags are text (Qwen2.5's)."""
    ids = []
    for tag in AUTO_PARSERS[parser].kept_tags:
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) == 1 and (tokenizer.decode(encoded, skip_special_tokens=True)
                                  != tokenizer.decode(encoded, skip_special_tokens=False) == tag):
            ids.append(int(encoded[0]))
    return tuple(ids)


def tool_call_id() -> str:
    """A new tool call id, as vLLM makes them."""
    return "chatcmpl-tool-" + uuid.uuid4().hex


def mistral_tool_call_id() -> str:
    """A new tool call id as vLLM's mistral parser makes them: 9 letters and digits (what Mistral's chat
    templates accept back in a conversation's history)."""
    return "".join(secrets.choice(_MISTRAL_ID) for _ in range(9))


def first_delta(index: int, name: str, arguments: str, call_id: Callable[[], str] = tool_call_id) -> dict[str, Any]:
    """A tool call's first delta: its index, a new id, its type and name, and the arguments so far."""
    return {"index": index, "id": call_id(), "type": "function",
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
    """Where the "name" member being read begins in the text, if a string (None: none, or not a string)."""
    start: int | None = None
    """Where the arguments begin in the text (None: not begun)."""
    end: int | None = None
    """Where they end (None: not yet)."""
    reading: bool = False
    """The arguments that begin at `start` are being read (their end is still to come)."""
    index: int | None = None
    """The tool call's index once its first delta went out."""
    sent: int = 0
    """Characters of the arguments sent."""

    @property
    def fixed(self) -> bool:
        """The name is whole and the arguments have begun: the call goes out as it is, a name or arguments
        given again later being too late (it has been sent)."""
        return self.name is not None and self.start is not None

    def delta(self, text: str, next_index: Callable[[], int], call_id: Callable[[], str]) -> dict[str, Any] | None:
        """The call's next delta from the reader's `text`: its first once its name is whole and its arguments
        have begun, then each time more arguments have settled (None: nothing new)."""
        if not self.fixed:
            return None
        arguments = text[self.start:len(text) if self.end is None else self.end]
        more = arguments[self.sent:]
        self.sent = len(arguments)
        if self.index is None:
            self.index = next_index()
            return first_delta(self.index, self.name, more, call_id)
        return {"index": self.index, "function": {"arguments": more}} if more else None


class _CallReader:
    """The calls of a JSON text as it is generated: objects `{"name": <a string>, <an arguments key>: <any
    value>}` at `depth` (0: the root, a hermes block's; 1: the elements of the root list, tool_choice
    required's). A call goes out (`deltas`) once its name is whole and its arguments have begun: a first
    delta with its index, id, type, name and the arguments so far, then more arguments as they settle,
    written as `JsonRewriter` writes them (json.dumps's layout, what a whole response gives). A call object
    that gives "name" or the arguments twice (under either key) keeps the last, as json.loads does, up to the
    moment the call is fixed (its name whole, its arguments begun); one given after that is too late, the call
    having gone out. A name is text, not JSON: a lone surrogate in it (an unpaired \\ud800-\\udfff escape)
    becomes U+FFFD, as undecodable bytes of the output do, so that the response is Unicode any client reads and
    can send back (the arguments keep it as its escape). The reader reads up to the end of the JSON value
    (`feed` says how far)."""

    def __init__(self, depth: int, arguments_keys: tuple[str, ...], next_index: Callable[[], int],
                 call_id: Callable[[], str] = tool_call_id) -> None:
        self.depth, self.arguments_keys, self.next_index, self.call_id = depth, arguments_keys, next_index, call_id
        self.json = JsonRewriter(self._on_value)
        self.calls: list[_Call] = []

    @property
    def called(self) -> bool:
        """A call has gone out."""
        return any(call.index is not None for call in self.calls)

    @property
    def ended(self) -> bool:
        """The JSON value is whole, or broke off (nothing more is read)."""
        return self.json.done or self.json.failed

    def feed(self, text: str) -> tuple[int, list[dict[str, Any]]]:
        """(how many characters of `text` were read: fewer where the JSON value ended within it, the rest
        not its; the deltas)."""
        read = self.json.read(text)
        return read, self.deltas()

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
        if event == "end" and call.reading:
            call.end, call.reading = offset, False
        elif call.fixed:
            return
        elif key == "name" and event == "start":
            call.name_start = offset if kind == '"' else None
        elif key == "name":
            call.name = None if call.name_start is None else self._name(call.name_start, offset)
        elif key in self.arguments_keys and event == "start":
            call.start, call.end, call.reading = offset, None, True

    def _name(self, start: int, end: int) -> str:
        """The name whose JSON string lies from `start` to `end` in the text, a lone surrogate U+FFFD."""
        return _LONE_SURROGATE.sub("\ufffd", json.loads(self.json.text[start:end]))

    def deltas(self) -> list[dict[str, Any]]:
        text = self.json.text
        deltas = (call.delta(text, self.next_index, self.call_id) for call in self.calls)
        return [delta for delta in deltas if delta is not None]


class _ArgumentsReader:
    """One call whose name is known and whose arguments are a JSON object of their own (Mistral's
    `[TOOL_CALLS]name[ARGS]{...}`): the call goes out as the object begins, its arguments then sent as they
    settle (`JsonRewriter`, json.dumps's layout). Arguments that do not begin with `{` make no call."""

    def __init__(self, name: str, next_index: Callable[[], int], call_id: Callable[[], str]) -> None:
        self.call = _Call(True, name)
        self.next_index, self.call_id = next_index, call_id
        self.json = JsonRewriter(self._on_value)
        self.refused = False
        """The arguments began with something other than `{`."""

    @property
    def called(self) -> bool:
        return self.call.index is not None

    @property
    def ended(self) -> bool:
        return self.refused or self.json.done or self.json.failed

    def feed(self, text: str) -> tuple[int, list[dict[str, Any]]]:
        """As `_CallReader.feed`."""
        if self.call.start is None and text.lstrip(WHITESPACE)[:1] not in ("", "{"):
            self.refused = True
            return 0, []
        return self.json.read(text), self.deltas()

    def close(self) -> list[dict[str, Any]]:
        self.json.close()
        return self.deltas()

    def _on_value(self, event: str, path: Path, offset: int, kind: str) -> None:
        if path == () and event == "start":
            self.call.start = offset
        elif path == () and event == "end":
            self.call.end = offset

    def deltas(self) -> list[dict[str, Any]]:
        delta = self.call.delta(self.json.text, self.next_index, self.call_id)
        return [] if delta is None else [delta]


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held back: the rest of the tag may follow)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _AutoParser:
    """What tool_choice auto's parsers share: the text not yet read, fed piece by piece and read by `_drain`,
    and the calls' indices (`called` once one is given) and ids."""

    kept_tags: tuple[str, ...] = ()
    """The tags that the output's text must keep where the tokenizer makes them special tokens."""

    def __init__(self, call_id: Callable[[], str] = tool_call_id) -> None:
        self.called = False
        self.call_id = call_id
        self._pending = ""
        """Text not yet read."""
        self._index = 0

    def feed(self, text: str) -> Piece:
        self._pending += self._take(text, final=False)
        return self._drain(final=False)

    def finish(self) -> Piece:
        self._pending += self._take("", final=True)
        return self._drain(final=True)

    def _take(self, text: str, final: bool) -> str:
        """The text to read of a piece fed (`final`: the output has ended): all of it, here."""
        return text

    def _next_index(self) -> int:
        self._index += 1
        self.called = True
        return self._index - 1

    def _drain(self, final: bool) -> Piece:
        """Read `_pending` as far as it is known (all of it when `final`)."""
        raise NotImplementedError

    def _feed_reader(self, final: bool) -> tuple[list[dict[str, Any]], bool]:
        """Feed `_pending` to the open call's reader (the subclass's `_reader`, a `_CallReader` or
        `_ArgumentsReader`), what it read added to `_raw` (the text as written) and the rest left in `_pending`:
        (the deltas, whether the reader is done: its JSON whole or broken off, or the output over, and closed)."""
        read, calls = self._reader.feed(self._pending)
        self._raw += self._pending[:read]
        self._pending = self._pending[read:]
        if not (self._reader.ended or final):
            return calls, False
        return calls + self._reader.close(), True


class _TaggedParser(_AutoParser):
    """Tool calls in stretches of the text that a tag (`start_tag`) opens; the text outside them is content.
    Content is streamed as it comes except for a tail that could begin the tag, which waits for the next
    text; whitespace between and after the stretches is dropped; other text after one is content too. What
    a stretch holds, and where it ends, is the subclass's (`_open` and `_read`)."""

    start_tag: str

    def __init__(self, call_id: Callable[[], str] = tool_call_id) -> None:
        super().__init__(call_id)
        self._inside = False
        """A stretch is open (the subclass reads `_pending`)."""
        self._after_block = False
        """The last thing read was a stretch (whitespace waits to see whether more text or a stretch follows)."""

    def _open(self) -> None:
        """A stretch begins, its tag read."""
        raise NotImplementedError

    def _read(self, final: bool) -> tuple[str, list[dict[str, Any]], bool]:
        """Read the open stretch from `_pending`: (content, deltas, whether the stretch has ended)."""
        raise NotImplementedError

    def _drain(self, final: bool) -> Piece:
        content, calls = "", []
        while True:
            if self._inside:
                text, more, ended = self._read(final)
                content, calls = content + text, calls + more
                if not ended:
                    break
                self._inside = False
                continue
            start = self._pending.find(self.start_tag)
            if start >= 0:
                text = self._pending[:start]
                if not (self._after_block and text.isspace()):
                    content += text
                self._pending = self._pending[start + len(self.start_tag):]
                self._inside, self._after_block = True, False
                self._open()
                continue
            held = 0 if final else _partial_tag(self._pending, self.start_tag)
            text = self._pending[:len(self._pending) - held]
            if self._after_block and (text.isspace() or not text):
                if final:
                    self._pending = ""
                break  # whitespace after a stretch: dropped if a stretch or the end follows
            content += text
            self._pending = self._pending[len(text):]
            self._after_block = False
            break
        return content, calls


class HermesParser(_TaggedParser):
    """Hermes-format tool calls (Qwen2.5, Qwen3, Hermes 2 Pro and others), as vLLM's `hermes` parser reads
    them. Content is the text before the first `<tool_call>`; whitespace between and after blocks is
    dropped; other text after a block is content too (vLLM drops it from a whole response and streams
    it). A block is a call once its JSON has given a string "name" and begun its "arguments" (`_CallReader`);
    one that never does (not JSON, no string "name", no "arguments") stays in the content as written.
    A call's JSON that breaks off after that (cut by max_tokens, malformed, text after it in the block)
    keeps the arguments read up to there, as a stream has sent them."""

    start_tag = TOOL_CALL_START
    kept_tags = (TOOL_CALL_START, TOOL_CALL_END)

    def _open(self) -> None:
        self._block = _CallReader(0, ("arguments",), self._next_index, self.call_id)
        self._raw = ""
        """The open block's text as written (its content, should it not be a call)."""

    def _read(self, final: bool) -> tuple[str, list[dict[str, Any]], bool]:
        end = self._pending.find(TOOL_CALL_END)
        cut = end if end >= 0 else len(self._pending) - (0 if final else _partial_tag(self._pending, TOOL_CALL_END))
        body = self._pending[:cut]
        self._pending = self._pending[cut + len(TOOL_CALL_END):] if end >= 0 else self._pending[cut:]
        self._raw += body
        _, calls = self._block.feed(body)
        if end < 0 and not final:
            return "", calls, False
        calls += self._block.close()
        content = "" if self._block.called else TOOL_CALL_START + self._raw + (TOOL_CALL_END if end >= 0 else "")
        self._after_block = True
        return content, calls, True


class MistralParser(_TaggedParser):
    """Mistral-format tool calls, as vLLM's `mistral` parser reads them: content, then `[TOOL_CALLS]` and either a JSON
    list of `{"name": ..., "arguments": {...}}` (Mistral 7B Instruct v0.3 and other models of tokenizer versions
    before 11) or a call's name, optionally `[ARGS]`, and its JSON arguments object
    (`[TOOL_CALLS]name[ARGS]{...}`, Mistral Small 3.x and later, `[CALL_ID]` and an id before `[ARGS]` where a
    model writes them; `[TOOL_CALLS]` again before each further call). Each call goes out once its name is whole
    and its arguments have begun, its arguments then sent as they settle, in json.dumps's layout (for the name
    form too, where vLLM passes the model's text on). A stretch after `[TOOL_CALLS]` that makes no call (not
    JSON, a name of other characters than letters, digits, `_` and `-`, arguments not an object) stays in the
    content as written; text after the calls is content too, the whitespace before it dropped. A call's JSON that
    breaks off keeps the arguments read up to there; the text after it, up to the next `[TOOL_CALLS]`, is
    dropped. Tool call ids are vLLM's mistral ones (9 letters and digits)."""

    start_tag = TOOL_CALLS
    kept_tags = (TOOL_CALLS, ARGS, CALL_ID)

    def __init__(self, call_id: Callable[[], str] = mistral_tool_call_id) -> None:
        super().__init__(call_id)

    def _open(self) -> None:
        self._raw = TOOL_CALLS
        """The stretch's text as written, from its tag (its content, should it make no call)."""
        self._reader: _CallReader | _ArgumentsReader | None = None
        self._name: str | None = None
        """The name form's name so far (None: not known to be that form yet)."""
        self._model_id: str | None = None
        """The id the model wrote after `[CALL_ID]`, so far (None: none yet; the call gets a new id as ever)."""
        self._skipping = False
        """A call broke off: the text up to the next `[TOOL_CALLS]` is dropped."""

    def _read(self, final: bool) -> tuple[str, list[dict[str, Any]], bool]:
        if self._skipping:
            return self._skip(final)
        if self._reader is None:
            form = self._form(final) if self._name is None else "name"
            if form == "name":
                form = self._read_name(final)
            if form == "wait":
                return "", [], False
            if form == "none":
                return self._refuse([])
        return self._read_calls(final)

    def _form(self, final: bool) -> str:
        """The form of the calls, from the first character after the tag and its whitespace: `[` opens the
        JSON list ("ready"), a name character the name form ("name"); "none" for anything else or an end
        before it, "wait" until it is known."""
        text = self._pending.lstrip(WHITESPACE)
        if not text:
            return "none" if final else "wait"
        self._raw += self._pending[:len(self._pending) - len(text)]
        self._pending = text
        if text[0] == "[":
            self._reader = _CallReader(1, ("arguments",), self._next_index, self.call_id)
            return "ready"
        if not _MISTRAL_NAME.match(text).group():
            return "none"
        self._name = ""
        return "name"

    def _read_name(self, final: bool) -> str:
        """Read the name form's name (and `[CALL_ID]` and an id, where the model writes them) up to `[ARGS]` or
        its arguments' `{`, then open its arguments ("ready"); "none" where something else follows the name
        (or the text ends first), "wait" until it is known."""
        chars = _MISTRAL_NAME.match(self._pending).group()
        if self._model_id is None:
            self._name += chars
        else:
            self._model_id += chars
        self._raw += chars
        rest = self._pending = self._pending[len(chars):]
        if self._model_id is None and rest.startswith(CALL_ID):
            self._raw += CALL_ID
            self._pending, self._model_id = rest[len(CALL_ID):], ""
            return self._read_name(final)
        if rest.startswith(ARGS) or rest.startswith("{"):
            separator = ARGS if rest.startswith(ARGS) else ""
            self._raw += separator
            self._pending = rest[len(separator):]
            self._reader = _ArgumentsReader(self._name, self._next_index, self.call_id)
            return "ready"
        could_follow = ARGS.startswith(rest) or (self._model_id is None and CALL_ID.startswith(rest))
        return "wait" if not final and could_follow else "none"

    def _read_calls(self, final: bool) -> tuple[str, list[dict[str, Any]], bool]:
        calls, done = self._feed_reader(final)
        if not done:
            return "", calls, False
        if not self._reader.called:
            return self._refuse(calls)
        if self._reader.json.done:
            self._after_block = True
            return "", calls, True
        self._skipping = True
        content, more, ended = self._skip(final)
        return content, calls + more, ended

    def _skip(self, final: bool) -> tuple[str, list[dict[str, Any]], bool]:
        """Drop the text up to the next `[TOOL_CALLS]` (the stretch ends there, or at the end)."""
        start = self._pending.find(TOOL_CALLS)
        if start >= 0:
            self._pending = self._pending[start:]
            return "", [], True
        held = 0 if final else _partial_tag(self._pending, TOOL_CALLS)
        self._pending = self._pending[len(self._pending) - held:]
        return "", [], final

    def _refuse(self, calls: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], bool]:
        """The stretch made no call: its text as written is content; what follows is read as content again."""
        return self._raw, calls, True


class _StateParser(_AutoParser):
    """An auto parser read as a machine of states (`_state`), each read by its `_read_<state>(final)` method,
    which gives (content, deltas) and may move to another state; `_drain` reads on until the state stays.
    Two states end every such parser: content (all the rest is content) and dropped (all the rest is dropped)."""

    def __init__(self, call_id: Callable[[], str] = tool_call_id) -> None:
        super().__init__(call_id)
        self._state = "start"
        """The state being read: "start" first, then the subclass's, ending in "content" or "dropped"."""

    def _drain(self, final: bool) -> Piece:
        content, calls = "", []
        while True:
            state = self._state
            text, more = getattr(self, f"_read_{state}")(final)
            content, calls = content + text, calls + more
            if self._state == state:
                return content, calls

    def _read_content(self, final: bool) -> Piece:
        text, self._pending = self._pending, ""
        return text, []

    def _read_dropped(self, final: bool) -> Piece:
        self._pending = ""
        return "", []


class Llama3JsonParser(_StateParser):
    """Llama 3.x JSON tool calls, as vLLM's `llama3_json` parser reads them: a call `{"name": ..., "parameters":
    {...}}` ("arguments" is read too: of the two, as of a key given twice, the last given before the call goes
    out), then more calls, each after a `;`. The calls begin at the output's first `{`: the text before it is
    content, streamed as it comes (unless it is whitespace and `<|python_tag|>` only, where the text keeps it:
    dropped), as vLLM's whole response finds the calls after text (which it drops; its stream answers such an
    output as content). Each call goes out once its name is whole and its arguments have begun, its arguments then sent
    as they settle, in json.dumps's layout (`_CallReader`). The first JSON object decides: one that makes no
    call (no string "name", no arguments; not JSON) is content as written, and so is everything after it (vLLM's
    whole response reads that first object only); text after the calls that is not `;` and a call is content
    too (vLLM drops it). A call's JSON that breaks off (cut by max_tokens, malformed) keeps the arguments read
    up to there; the text after it is dropped. The separators and a trailing `;` are not content."""

    kept_tags = ()
    """`<|python_tag|>` stays dropped, as in vLLM, whose text does not keep it either."""

    def __init__(self, call_id: Callable[[], str] = tool_call_id) -> None:
        super().__init__(call_id)  # states: start (nothing but whitespace yet), prose (text before the first
        # object), call (a call's JSON), between (after a call), content and dropped (`_StateParser`)
        self._reader: _CallReader | None = None
        self._raw = ""
        """The open call's text as written, from the end of the previous one (its content should it make none)."""

    def _read_start(self, final: bool) -> Piece:
        text = self._pending.lstrip(WHITESPACE)
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG):].lstrip(WHITESPACE)
        elif PYTHON_TAG.startswith(text) and text and not final:
            return "", []
        return self._open_call(text, final)

    def _read_between(self, final: bool) -> Piece:
        text = self._pending.lstrip(WHITESPACE)
        if not text:
            if final:
                self._pending = ""
            return "", []
        if text[0] != ";":
            self._state = "content"
            return "", []
        return self._open_call(text[1:].lstrip(WHITESPACE), final, separator=True)

    def _read_prose(self, final: bool) -> Piece:
        """Text before the first object: content as it comes, up to the `{` that opens a call."""
        start = self._pending.find("{")
        text = self._pending[:start] if start >= 0 else self._pending
        self._pending = self._pending[len(text):]
        if start >= 0:
            self._open_call(self._pending, final)
        return text, []

    def _open_call(self, text: str, final: bool, separator: bool = False) -> Piece:
        """Open a call where `text` (the end of `_pending`) begins with `{`; where it begins with anything else,
        prose before a call at the start, content after a separator; wait where it is empty."""
        if not text:
            if final:
                self._state = "content" if not separator else "dropped"
            return "", []
        if text[0] != "{":
            self._state = "content" if separator else "prose"
            return "", []
        self._raw = self._pending[:len(self._pending) - len(text)]
        self._pending = text
        self._reader = _CallReader(0, ("parameters", "arguments"), self._next_index, self.call_id)
        self._state = "call"
        return "", []

    def _read_call(self, final: bool) -> Piece:
        calls, done = self._feed_reader(final)
        if not done:
            return "", calls
        if not self._reader.called:
            self._state = "content"
            return self._raw, calls
        self._state = "between" if self._reader.json.done else "dropped"
        return "", calls


class _NotLiteral(Exception):
    """A pythonic call's argument is not a literal that JSON writes."""


def _literal(node: ast.expr) -> Any:
    """The value of a Python literal in a pythonic call's arguments: a str, int, finite float, bool or None
    (a number with a sign too), or a list or dict of them (a dict's keys such constants); `_NotLiteral` for
    anything else (a name, an expression, a tuple, bytes...). Read from the syntax tree, never evaluated."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _NotLiteral
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Constant) and _json_constant(node.value):
        return node.value
    if isinstance(node, ast.List):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and _json_constant(k.value) for k in node.keys):
        return {key.value: _literal(value) for key, value in zip(node.keys, node.values)}
    raise _NotLiteral


def _json_constant(value: Any) -> bool:
    """A constant JSON writes: a str, int, bool, None or finite float (not bytes, complex, inf or nan)."""
    return value is None or isinstance(value, (str, int)) or (isinstance(value, float) and math.isfinite(value))


def pythonic_call(text: str) -> tuple[str, str] | None:
    """(name, arguments) of one call of a pythonic list, `name(key=<literal>, ...)`: the arguments an object of
    the keywords, written as vLLM writes them (`json.dumps(arguments, ensure_ascii=False)`; a lone surrogate in a
    string stays its escape, so that the text is JSON that UTF-8 encodes). None where `text` is not such a call
    (not Python, positional or `**` arguments, a value that is not a literal)."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        if any(keyword.arg is None for keyword in node.keywords):
            return None
        arguments = {keyword.arg: _literal(keyword.value) for keyword in node.keywords}
    except (SyntaxError, ValueError, RecursionError, _NotLiteral):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return node.func.id, _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class PythonicParser(_StateParser):
    """Pythonic tool calls (Llama 3.2 1B and 3B, Llama 4 with their pythonic templates, ToolACE), as vLLM's
    `pythonic` parser reads them: the output (after whitespace) is a Python list of calls,
    `[get_weather(city="Paris"), get_time(zone="CET")]`, each call's keyword arguments Python literals (`ast`
    reads them, nothing is evaluated; `pythonic_call`) that become its JSON arguments. Output that does not begin
    with `[` is content, all of it, as it comes. A Python literal is JSON only once it is whole, so each call goes
    out whole (its first delta, with all its arguments) as soon as its closing `)` is read, as vLLM's stream
    does; until the first call has gone out the text is held back, and where it turns out to be no call list
    (`[1, 2]`, `[link](url)`, a call that is not a literal call, an empty list, the end of the output first,
    cut by max_tokens) all of it is content, as written. Once a call has gone out it stays: whatever breaks
    the list after it (a malformed or cut call, an element that is no call) ends the calls, and the rest of the
    output is dropped, streamed or not (vLLM's whole response answers such an output as content, its stream
    keeps the calls sent). Text after the list's `]` is content (whitespace alone is dropped; vLLM answers it
    as content and no calls). `<|python_start|>` and `<|python_end|>` (Llama 4's special tokens) are dropped by
    decoding, as in vLLM, whose `pythonic` parser does not read them either (`llama4_pythonic` drops them where
    the text has them: `Llama4PythonicParser`).
    Strings are read as Python reads them, in single, double or triple quotes (`'''...'''`, `\"\"\"...\"\"\"`, which
    may hold quotes, brackets and newlines)."""

    def __init__(self, call_id: Callable[[], str] = tool_call_id) -> None:
        super().__init__(call_id)
        self._raw = ""
        """The text read of the list so far, from the output's start (its content, should it make no call)."""
        self._element = ""
        """The list's element read so far: a call's name, then the call's text up to its closing `)`."""
        self._depth = 1
        """Brackets open (1: in the list, between calls; 2 or more: in a call)."""
        self._quote: str | None = None
        """The delimiter of the string being read in a call: `'`, `"`, `'''` or `\"\"\"` (None: not in a string)."""
        self._opening = 0
        """Quotes read at the string's start while it is not yet known whether it is triple-quoted (1 or 2; 0:
        known)."""
        self._quotes = 0
        """Quotes read in a row, unescaped, at the end of the string so far (its delimiter's length closes it)."""
        self._escape = False
        """The last character was a backslash in a string."""
        self._expect = "first"
        """What comes next in the list: first (the first element), element (one after a comma) or separator
        (`,` or `]` after a call)."""

    def _read_start(self, final: bool) -> Piece:
        text = self._pending.lstrip(WHITESPACE)
        if not text:
            if final:
                self._state = "content"
            return "", []
        if text[0] != "[":
            self._state = "content"
            return "", []
        self._raw = self._pending[:len(self._pending) - len(text) + 1]
        self._pending = text[1:]
        self._state = "list"
        return "", []

    def _read_list(self, final: bool) -> Piece:
        calls = []
        for i, char in enumerate(self._pending):
            step = self._step(char)
            if isinstance(step, dict):
                calls.append(step)
            elif step is not None:
                self._raw += self._pending[:i + 1]
                self._pending = self._pending[i + 1:]
                return self._end(step), calls
        self._raw += self._pending
        self._pending = ""
        return (self._end("broken") if final else ""), calls

    def _end(self, how: str) -> str:
        """The list has ended ("closed": its `]`; "broken": anything else): the text after it is read as
        content, unless it broke after a call went out (the rest dropped); the list's text is content where it
        made no call."""
        if self.called:
            self._state = "after" if how == "closed" else "dropped"
            return ""
        self._state = "content"
        return self._raw

    def _step(self, char: str) -> dict[str, Any] | str | None:
        """Read one character of the list: a call's first delta once its `)` closes it, "closed" at the list's
        `]`, "broken" where the text is no call list, None otherwise."""
        if self._depth > 1:
            return self._step_in_call(char)
        if self._expect == "separator":
            if char in " \t\r\n\f":
                return None
            self._expect = "element"
            return None if char == "," else "closed" if char == "]" else "broken"
        if char == "]" and self._expect == "element" and not self._element.strip():
            return "closed"  # after a trailing comma, as Python allows
        if char == "(" and self._element.strip().isidentifier():
            self._depth = 2
            self._element += char
            return None
        self._element += char
        return None if not self._element.strip() or self._element.strip().isidentifier() else "broken"

    def _step_in_call(self, char: str) -> dict[str, Any] | str | None:
        """Read one character of a call, from its `(`: strings and brackets, to the `)` that closes it."""
        self._element += char
        if self._quote is not None and self._in_string(char):
            return None
        if char in "'\"":
            self._quote, self._opening, self._quotes = char, 1, 0
        elif char in "([{":
            self._depth += 1
        elif char in ")]}":
            self._depth -= 1
            if self._depth == 1:
                return self._call()
        return None

    def _in_string(self, char: str) -> bool:
        """Read `char` in the string being read: whether it is the string's (False where `char` follows an empty
        string, `''` not followed by a third quote, and is read outside it). A string opened by three quotes is
        triple-quoted and ends at three unescaped quotes, as Python reads it; its single quotes are text."""
        if self._opening == 2:
            self._opening = 0
            if char != self._quote:
                self._quote = None
                return False
            self._quote *= 3
            return True
        if self._opening == 1 and char == self._quote:
            self._opening = 2
            return True
        self._opening = 0
        if self._escape or char == "\\":
            self._escape, self._quotes = not self._escape, 0
        elif char == self._quote[0]:
            self._quotes += 1
            if self._quotes == len(self._quote):
                self._quote = None
        else:
            self._quotes = 0
        return True

    def _call(self) -> dict[str, Any] | str:
        """The call just closed: its first delta, with all its arguments; "broken" where it is no call."""
        call = pythonic_call(self._element)
        self._element, self._expect = "", "separator"
        if call is None:
            return "broken"
        name, arguments = call
        return first_delta(self._next_index(), name, arguments, self.call_id)

    def _read_after(self, final: bool) -> Piece:
        """After the list's `]`: whitespace waits (dropped at the end); any other text is content."""
        if not self._pending.strip(WHITESPACE):
            if final:
                self._pending = ""
            return "", []
        self._state = "content"
        return "", []


class Llama4PythonicParser(PythonicParser):
    """Llama 4's pythonic tool calls, as vLLM's `llama4_pythonic` parser reads them: `PythonicParser`'s list of
    calls, which Llama 4 may write between `<|python_start|>` and `<|python_end|>`. The tags are dropped wherever
    the text has them (vLLM's whole response drops a leading `<|python_start|>` and every `<|python_end|>`), so
    that an output that makes no call is its text without them; a tail that could begin a tag waits for the next
    text. Where the tokenizer makes them special tokens, as Llama 4's does, decoding has dropped them already (as
    in vLLM, whose parser does not ask to keep them)."""

    _TAGS = (PYTHON_START, PYTHON_END)

    def __init__(self, call_id: Callable[[], str] = tool_call_id) -> None:
        super().__init__(call_id)
        self._held = ""
        """The end of the text fed that could begin a tag."""

    def _take(self, text: str, final: bool) -> str:
        """The text fed, its tags dropped, less a tail that could begin one (held for the next piece)."""
        text = self._held + text
        for tag in self._TAGS:
            text = text.replace(tag, "")
        held = 0 if final else max(_partial_tag(text, tag) for tag in self._TAGS)
        self._held = text[len(text) - held:]
        return text[:len(text) - held]


AUTO_PARSERS: dict[str, type[_AutoParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "llama4_pythonic": Llama4PythonicParser,
    "mistral": MistralParser, "pythonic": PythonicParser}
"""tool_choice auto's parsers by `--tool-call-parser` name (vLLM's names; `tools.TOOL_PARSERS` lists them)."""


class RequiredParser:
    """tool_choice required: the output is constrained to `[{"name": ..., "parameters": {...}}, ...]`; each
    element is a call once its name is whole and its parameters have begun, its parameters streamed as
    they settle (`_CallReader`). An output that ends before any call began (cut by max_tokens or a stop
    string) is content, as written; one cut inside a call keeps the parameters read up to there."""

    def __init__(self) -> None:
        self._text = ""
        self._index = 0
        self._reader = _CallReader(1, ("parameters",), self._next_index)

    @property
    def called(self) -> bool:
        return self._reader.called

    def _next_index(self) -> int:
        self._index += 1
        return self._index - 1

    def feed(self, text: str) -> Piece:
        self._text += text
        return "", self._reader.feed(text)[1]

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
                               RequiredParser() if tool_use.choice == "required" else AUTO_PARSERS[tool_use.parser]())

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
