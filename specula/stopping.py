"""Text of a generation as it streams: incremental decoding and stop strings (OpenAI's rule).

As in OpenAI's API (and vLLM's default), a stop string ends the generation and neither it nor
anything after it is returned; while streaming, text that might be the start of a stop string
is held back until it cannot be.
"""

from __future__ import annotations

from typing import Collection, Sequence

from specula.token_bytes import decoder_kind


def cut_at_stop(text: str, stops: Sequence[str], after: int = 0) -> tuple[str, bool]:
    """`text` up to (excluding) the earliest stop string that ends past its first `after`
    characters, and whether one was found."""
    cut = min((i for i in (text.find(s, max(0, after - len(s) + 1)) for s in stops) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


class StopTrimmer:
    """Streams text deltas with stop strings removed: text that might begin a stop string is
    held back until it cannot, and nothing after a stop string is ever released."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""
        self.floor = 0  # characters of `pending` in which no stop string may end (`protect`)
        self.stopped = False

    def feed(self, delta: str, protect: bool = False) -> str:
        """Text safe to send now. `protect`: no stop string may end in the text so far (the output
        is shorter than its `min_new_tokens`); one may still start there and end later."""
        if self.stopped:
            return ""
        self.pending += delta
        if protect:
            self.floor = len(self.pending)
        head, found = cut_at_stop(self.pending, self.stops, self.floor)
        if found:
            self.stopped, self.pending = True, ""
            return head
        hold = max((k for s in self.stops for k in range(min(len(s) - 1, len(head)), 0, -1)
                    if head.endswith(s[:k])), default=0)
        out, self.pending = head[: len(head) - hold], head[len(head) - hold :]
        self.floor = max(0, self.floor - len(out))
        return out

    def flush(self) -> str:
        """The held-back text once the generation is over (it ended without a stop string)."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


CONTEXT_TOKENS = 5
"""Prompt tokens decoded before the output (vLLM's incremental detokenizer reads 5): a tokenizer
that strips the leading space of a text (SentencePiece's) keeps the output's first space."""

SETTLE_TOKENS = 16
"""Tokens kept in the decoded window when its head is settled: each feed decodes at most twice as
many (plus the context), whatever the output's length (`TextStream.feed`)."""


def rust_decoder(tokenizer):
    """The `tokenizers` object whose `decode(ids, skip_special_tokens=...)` is what the tokenizer's own
    `decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)` returns, where its class
    takes transformers' `TokenizersBackend` decoding as it is, else None. A step decodes once or twice
    through transformers' argument handling, 3.6 us a call of its own (20 ids, SmolLM2's tokenizer)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its own decoding
        return None
    kind = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend) or kind.decode is not PreTrainedTokenizerBase.decode
            or kind._decode is not TokenizersBackend._decode):
        return None
    return getattr(tokenizer, "_tokenizer", None)


class TextStream:
    """Decodes a growing list of token ids into text deltas, holding back a trailing incomplete
    multi-byte character, and applies the stop strings (`StopTrimmer`). The output is decoded after
    the prompt's last `CONTEXT_TOKENS` tokens and without them, as vLLM decodes it.

    Each feed decodes only a window of the latest tokens after `CONTEXT_TOKENS` of the settled ones
    before it (vLLM's incremental detokenizer does the same), not the whole output: a 4,000-token
    output cost 1.4 s of decoding token by token, growing with the square of its length. The window's
    head is settled (its text fixed) only where it ends on a whole character and decoding the window
    in two parts gives the text of decoding it whole.

    Special tokens (BOS, EOS, chat markers) decode to nothing (vLLM's default `skip_special_tokens`),
    except those of `keep`: a tool parser's `<tool_call>` tags where the tokenizer makes them special (vLLM's
    hermes parser keeps special tokens for them)."""

    def __init__(self, tokenizer, stops: Sequence[str] = (), prompt: Sequence[int] = (), min_tokens: int = 0,
                 keep: Collection[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.keep = frozenset(int(t) for t in keep)
        self._skipped: dict[int, bool] = {}  # token id -> skip_special_tokens drops it (for `keep`)
        self.min_tokens = min_tokens  # no stop string ends in the first min_tokens tokens' text (vLLM's min_tokens)
        self.context = [int(t) for t in list(prompt)[-CONTEXT_TOKENS:]]  # [<= CONTEXT_TOKENS]
        self.ids: list[int] = []
        self.settled = 0  # ids[:settled] have their text fixed: settled_text
        self.settled_text = ""
        self.next_settle = 2 * SETTLE_TOKENS  # len(ids) at which settling is tried next
        self.shown = ""  # decoded text already passed to the trimmer
        self._context_key: tuple[int, ...] | None = None  # the context `_decoded_context` last decoded, and its text
        self._context_text = ""
        self.trimmer = StopTrimmer(stops) if stops and tokenizer is not None else None
        self._backend = rust_decoder(tokenizer)
        # A byte-level decoder (GPT-2, Qwen, SmolLM2) never rewrites text it decoded once more tokens
        # follow (past a held-back unfinished character), so without stop strings a step's tokens
        # may go in at once, one decode a step; any other decoder gets them one at a time (`take`)
        self.token_by_token = self.trimmer is not None or (tokenizer is not None
                                                           and decoder_kind(tokenizer) != "byte-level")

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        # no clean-up of spaces before punctuation (GPT-2-style tokenizers): it rewrites text already
        # shown once the next token arrives (" '" -> "'"); vLLM's incremental detokenizer does none either
        if self.keep and not self.keep.isdisjoint(ids):  # the special tokens skipped, but for those kept
            ids = [t for t in ids if t in self.keep or not self._skips(t)]
            return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=True)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _skips(self, token: int) -> bool:
        """Whether decoding with skip_special_tokens drops the token."""
        skipped = self._skipped.get(token)
        if skipped is None:
            skipped = self._skipped[token] = (self.tokenizer.decode([token], skip_special_tokens=True)
                                              != self.tokenizer.decode([token], skip_special_tokens=False))
        return skipped

    def decode_after(self, context: Sequence[int], ids: Sequence[int]) -> str:
        """The text of `ids` where they follow `context`: decode(context + ids) less decode(context)
        (the context alone where it ends inside a character)."""
        before = self._decoded_context(context)
        if not before or before.endswith("\ufffd"):
            return self.decode(ids)
        return self.decode([*context, *ids])[len(before):]

    def _decoded_context(self, context: Sequence[int]) -> str:
        """`decode(context)`, kept for the last context asked: each feed decodes the window after the same one
        (it moves when the text settles), and a decode through transformers took 86 us inside SmolLM2's decoding."""
        key = tuple(context)
        if key != self._context_key:
            self._context_key, self._context_text = key, self.decode(context) if context else ""
        return self._context_text

    @property
    def stopped(self) -> bool:
        return self.trimmer is not None and self.trimmer.stopped

    def stop_cut(self, new: Sequence[int]) -> int | None:
        """Fewest of `new` tokens (about to be appended) whose text, after the tokens so far,
        contains a stop string; None when none does."""
        if self.trimmer is None:
            return None
        longest = max(len(s) for s in self.trimmer.stops)
        # Only the output's tail can hold the start of a new match: enough tokens for `longest`
        # characters (tokens that decode to nothing, special ones, widen it).
        start = len(self.ids)
        while start > 0:
            start = max(0, start - longest - 8)
            if len(self.decode(self.ids[start:])) >= longest:
                break
        head = self.ids[start:]
        context = self._context_at(start)
        # Under a minimum length, stops in the text so far were let pass: only one ending in the new
        # tokens' text counts (past an unfinished character, which the new tokens may finish).
        after = len(self.decode_after(context, head).rstrip("\ufffd")) if self.min_tokens else 0
        for k in range(max(1, self.min_tokens + 1 - len(self.ids)), len(new) + 1):
            text = self.decode_after(context, [*head, *new[:k]])
            if cut_at_stop(text, self.trimmer.stops, after)[1]:
                return k
        return None

    def take(self, new: Sequence[int], final: bool = False) -> tuple[list[int], str, bool]:
        """Feed a step's tokens one at a time, as plain decoding (one token a step) feeds them, so
        neither the text nor where a stop string ends the output depends on how many tokens the
        step accepted (byte-fallback decoders rewrite text already decoded; a stop string can show
        in the whole text before `stop_cut`'s window sees it): (the tokens kept, up to the one a
        stop string ended on; their text; whether a stop string ended the output). `final`: the
        output ends with this step's last token (EOS, a stop id, a limit)."""
        tokens = [int(t) for t in new]
        if not self.token_by_token:  # the same text, one decode
            return tokens, self.feed(tokens, final), False
        parts = []
        for i, token in enumerate(tokens):
            cut = self.stop_cut([token]) is not None  # None while the output is under its minimum
            parts.append(self.feed([token], final=cut or (final and i == len(tokens) - 1)))
            if cut or self.stopped:  # the trimmer's whole text may show a stop `stop_cut` did not
                return tokens[: i + 1], "".join(parts), True
        return tokens, "".join(parts), False

    def _context_at(self, start: int) -> list[int]:
        """The `CONTEXT_TOKENS` tokens (prompt, then output) before output position `start`."""
        before = self.ids[max(0, start - CONTEXT_TOKENS):start]
        return [*self.context, *before][-CONTEXT_TOKENS:]

    def _settle(self, window: str) -> None:
        """Fix the text of the window's head (`window`: the text of ids[settled:]) where that leaves
        the text unchanged: all but `SETTLE_TOKENS` tokens, ending on a whole character."""
        n = len(self.ids)
        if n < self.next_settle:
            return
        cut = n - SETTLE_TOKENS
        head = self.decode_after(self._context_at(self.settled), self.ids[self.settled:cut])
        context = self._context_at(cut)
        before = self.decode(context)  # empty (special tokens only) or unfinished: no context, and a decoder
        # that strips a text's first space would strip the window's once more tokens come
        if before and not before.endswith("\ufffd") and not head.endswith("\ufffd") and \
                head + self.decode_after(context, self.ids[cut:]) == window:
            self.settled, self.settled_text = cut, self.settled_text + head
            self.next_settle = n + SETTLE_TOKENS
        else:  # an unfinished character, or a decoder whose text depends on tokens further back
            self.next_settle = n + max(SETTLE_TOKENS, n - self.settled)  # tried again at doubling gaps

    def feed(self, new: Sequence[int], final: bool = False) -> str:
        """Append tokens; the text delta safe to show (all of it when `final`)."""
        self.ids.extend(int(t) for t in new)
        window = self.decode_after(self._context_at(self.settled), self.ids[self.settled:])
        text = self.settled_text + window
        self._settle(window)
        # an unfinished character decodes to one U+FFFD a byte so far (byte-fallback tokenizers): all of
        # them wait for the character's last byte, as in vLLM's incremental detokenizer
        stable = text if final else text.rstrip("\ufffd")
        # Text already shown cannot be taken back: where decoding more tokens rewrote it, what lies past
        # it is shown once the text is as long again (so nothing after a rewrite is lost).
        delta = stable[len(self.shown) :]
        self.shown = stable if len(stable) >= len(self.shown) else self.shown
        if self.trimmer is None:
            return delta
        out = self.trimmer.feed(delta, protect=len(self.ids) <= self.min_tokens)
        return out + self.trimmer.flush() if final else out
