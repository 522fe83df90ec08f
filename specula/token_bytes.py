"""The bytes each token stands for, as OpenAI's logprobs report them (`token`, `bytes`).

A token's own decoding (`tokenizer.decode([id])`) cannot say which bytes a token holds when it is
part of a multi-byte character (it shows U+FFFD). The tokenizer's pieces can:

    byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2)   each piece character stands for one byte
    byte fallback (SentencePiece: Llama 2, Mistral)    "<0x0A>" is one byte; "▁" a space
    anything else (word-level, WordPiece)              the token's own decoding, as UTF-8

Added and special tokens are their text. Looked up per token when first asked (no vocabulary
pass), so a server pays nothing until a request asks for logprobs.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any, Literal

Kind = Literal["byte-level", "byte-fallback", "text"]

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def decoder_kind(tokenizer: Any) -> Kind:
    """How a (fast) tokenizer's pieces map to bytes, read from its backend's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return "text"
    types: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            types.add(str(node.get("type")))
            for child in node.get("decoders") or ():
                walk(child)

    walk(json.loads(decoder.__getstate__()))
    if "ByteLevel" in types:
        return "byte-level"
    if "ByteFallback" in types:
        return "byte-fallback"
    return "text"


class TokenBytes:
    """token id -> the bytes it stands for, and their text for display (`text`)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kind: Kind = decoder_kind(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        self._cache: dict[int, bytes] = {}
        self._special: frozenset[int] | None = None

    def __call__(self, token_id: int) -> bytes:
        token_id = int(token_id)
        out = self._cache.get(token_id)
        if out is None:
            out = self._cache[token_id] = self._bytes(token_id)
        return out

    def text(self, token_id: int) -> str:
        """The token's bytes as text: a byte of an unfinished character shows as U+FFFD (as
        `tokenizer.decode([id])` shows it)."""
        return self(token_id).decode("utf-8", errors="replace")

    def label(self, token_id: int) -> str:
        """The token as completions' logprobs name it: its text, or where its bytes are not whole
        UTF-8 characters "bytes:" and their escapes (OpenAI's form)."""
        data = self(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def special(self, token_id: int) -> bool:
        """Whether decoding with skip_special_tokens drops the token (BOS, EOS, chat markers)."""
        if self._special is None:
            self._special = frozenset(int(i) for i in getattr(self.tokenizer, "all_special_ids", ()) or ())
        return int(token_id) in self._special

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        if self.kind == "text":
            return self.tokenizer.decode([token_id]).encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self.kind == "byte-level":
            alphabet = byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            return piece.encode()
        match = _BYTE_PIECE.fullmatch(piece)
        return bytes([int(match.group(1), 16)]) if match else piece.replace("\u2581", " ").encode()
