"""JSON text read piece by piece, as it is generated, and written again as far as it is settled (pure, no I/O).

`JsonRewriter` reads JSON text as `json.loads` reads it and writes the value again as `json.dumps(value,
ensure_ascii=False)` writes it (", " and ": " between items, strings escaped as json.dumps escapes them,
numbers as Python writes the number read), one piece at a time: after each piece, `text` holds what no
later piece can change (a number waits for the character after it, an escape for its last character, a
high surrogate for the low one that may follow it). So a tool call's arguments can be streamed as they
are generated and still add up to the text a whole response writes. One difference from `json.dumps(
json.loads(...))`: an object that gives a key twice is written with both (json.loads keeps the last
value, at the first key's place; a reader of the text written here does the same). Another: a lone
surrogate (an unpaired `\\ud800`-`\\udfff` escape, which json.loads keeps as it is) is written as its
escape (`\\ud83d`, as ensure_ascii=True writes it), not as the character, which UTF-8 cannot encode: the
text stays encodable (a response holding it), and json.loads reads the same value from it.

A listener hears where each value starts and ends in `text` (`on_value(event, path, offset, kind)`), by
its path: () for the root, then object keys and list indices.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from typing import Callable, Literal

Path = tuple[str | int, ...]
Listener = Callable[[Literal["start", "end"], Path, int, str], None]
"""on_value(event, path, offset in `text`, kind): kind is the value's first character ("{", "[", '"'), or
"s" for a number, true, false, null, NaN or Infinity (each written whole: its start and end come together)."""

WHITESPACE = " \t\n\r"
"""JSON's whitespace (json.loads takes no other)."""
_DELIMITERS = WHITESPACE + ',:[]{}"'
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|true|false|null|NaN|-?Infinity")
"""The literals json.loads reads (its C scanner's: ASCII digits only; NaN and Infinity are Python's)."""
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


@dataclass
class _Container:
    kind: str
    """"{" or "["."""
    path: Path
    count: int = 0
    """Members or elements begun."""
    key: str = ""
    """The member being read (an object's)."""


@dataclass
class _String:
    path: Path | None
    """None: an object's key."""
    escape: str | None = None
    """The escape being read, after its backslash (None: none)."""
    high: int | None = None
    """A high surrogate read (`\\uD8xx`), waiting for the low one that may follow."""
    chars: list[str] = field(default_factory=list)
    """A key's characters so far."""


class JsonRewriter:
    """One JSON text, fed piece by piece (see the module docstring). `failed` once the text is not JSON (then
    nothing more is read or written); `done` once the root value is whole."""

    def __init__(self, on_value: Listener | None = None) -> None:
        self.failed = False
        self._on_value = on_value
        self._text = ""
        self._pieces: list[str] = []
        self._length = 0
        self._containers: list[_Container] = []
        self._expect = "value"
        """What comes next: value, first_value (or "]"), first_key (or "}"), key, colon, next ("," or the
        container's close), end (whitespace only: the root is whole)."""
        self._string: _String | None = None
        self._scalar: str | None = None

    @property
    def text(self) -> str:
        """The value as json.dumps writes it, as far as it is settled."""
        if self._pieces:
            self._text += "".join(self._pieces)
            self._pieces = []
        return self._text

    @property
    def done(self) -> bool:
        return self._expect == "end" and not self.failed and self._scalar is None

    def feed(self, text: str) -> None:
        """Read `text`; text after the root value other than whitespace fails the JSON (as json.loads)."""
        rest = text[self.read(text):]
        if rest.strip(WHITESPACE) and not self.failed:
            self.failed = True

    def read(self, text: str) -> int:
        """Read `text` up to the root value's end: how many of its characters were read (all of them
        unless the root value ended, or the JSON failed, within it; the rest is not this JSON's)."""
        for i, c in enumerate(text):
            if self.failed or self.done:
                return i
            self._char(c)
        return len(text)

    def close(self) -> None:
        """The text has ended: a number (or literal) at its end is whole."""
        if self._scalar is not None and not self.failed:
            self._end_scalar()

    # ------------------------------------------------------------------ reading
    def _char(self, c: str) -> None:
        if self._string is not None:
            self._string_char(c)
            return
        if self._scalar is not None:
            if c not in _DELIMITERS:
                self._scalar += c
                return
            self._end_scalar()
            if self.failed:
                return
        if c in WHITESPACE:
            return
        expect = self._expect
        container = self._containers[-1] if self._containers else None
        if expect in ("value", "first_value"):
            if c == "]" and expect == "first_value":
                self._close()
            elif c in "{[":
                path = self._begin(c)
                self._write(c)
                self._containers.append(_Container(c, path))
                self._expect = "first_key" if c == "{" else "first_value"
            elif c == '"':
                path = self._begin('"')
                self._write('"')
                self._string = _String(path)
            elif c in ",:]}":
                self.failed = True
            else:
                self._scalar = c
        elif expect in ("first_key", "key"):
            if c == "}" and expect == "first_key":
                self._close()
            elif c == '"':
                if container.count:
                    self._write(", ")
                container.count += 1
                self._write('"')
                self._string = _String(None)
            else:
                self.failed = True
        elif expect == "colon":
            if c == ":":
                self._expect = "value"
            else:
                self.failed = True
        elif expect == "next":
            if c == ",":
                self._expect = "key" if container.kind == "{" else "value"
            elif c == ("}" if container.kind == "{" else "]"):
                self._close()
            else:
                self.failed = True
        else:  # text after the root value
            self.failed = True

    def _string_char(self, c: str) -> None:
        s = self._string
        if s.escape is not None:
            s.escape += c
            if len(s.escape) == 1:
                if c == "u":
                    return
                if c not in _ESCAPES:
                    self.failed = True
                    return
                s.escape = None
                self._put(_ESCAPES[c])
            elif c not in _HEX:
                self.failed = True
            elif len(s.escape) == 5:
                code, s.escape = int(s.escape[1:], 16), None
                self._code(code)
        elif c == "\\":
            s.escape = ""
        elif c == '"':
            self._flush_high()
            self._write('"')
            self._string = None
            if s.path is None:
                self._containers[-1].key = "".join(s.chars)
                self._expect = "colon"
            else:
                self._end(s.path)
        elif c < " ":  # json.loads (strict) takes no control character in a string
            self.failed = True
        else:
            self._put(c)

    def _code(self, code: int) -> None:
        """A `\\uXXXX` escape read: a surrogate pair joined as json.loads joins it (a lone one kept, written as
        its escape)."""
        s = self._string
        if s.high is not None:
            if 0xDC00 <= code <= 0xDFFF:
                high, s.high = s.high, None
                self._char_out(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
                return
            self._flush_high()
        if 0xD800 <= code <= 0xDBFF:
            s.high = code
        else:
            self._char_out(chr(code))

    def _put(self, ch: str) -> None:
        self._flush_high()
        self._char_out(ch)

    def _flush_high(self) -> None:
        s = self._string
        if s.high is not None:
            high, s.high = s.high, None
            self._char_out(chr(high))

    def _char_out(self, ch: str) -> None:
        self._write(f"\\u{ord(ch):04x}" if "\ud800" <= ch <= "\udfff" else encode_basestring(ch)[1:-1])
        if self._string.path is None:
            self._string.chars.append(ch)

    def _end_scalar(self) -> None:
        token, self._scalar = self._scalar, None
        if not _SCALAR.fullmatch(token):
            self.failed = True
            return
        try:
            value = json.loads(token)
        except ValueError:  # an integer of more digits than Python converts
            self.failed = True
            return
        path = self._begin("s")
        self._write(json.dumps(value))
        self._end(path)

    # ------------------------------------------------------------------ writing
    def _write(self, s: str) -> None:
        self._pieces.append(s)
        self._length += len(s)

    def _begin(self, kind: str) -> Path:
        """A value starts: the separator before it written, its path."""
        container = self._containers[-1] if self._containers else None
        if container is None:
            path: Path = ()
        elif container.kind == "{":
            self._write(": ")
            path = (*container.path, container.key)
        else:
            if container.count:
                self._write(", ")
            path = (*container.path, container.count)
            container.count += 1
        if self._on_value is not None:
            self._on_value("start", path, self._length, kind)
        return path

    def _end(self, path: Path) -> None:
        if self._on_value is not None:
            self._on_value("end", path, self._length, "")
        self._expect = "next" if self._containers else "end"

    def _close(self) -> None:
        container = self._containers.pop()
        self._write("}" if container.kind == "{" else "]")
        self._end(container.path)
