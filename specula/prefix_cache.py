"""The engine's prefix cache: finished requests' target caches, kept for the requests that begin alike.

A chat's next turn sends the whole conversation again (its prompt begins with the last turn's prompt and
answer), and a server's requests often share a system prompt. On a CPU the prefill of those tokens is
most of the wait for the first token (a 1.5B model prefills about 80 tokens/s on 2 cores). When a
request finishes, the engine hands its target sequence here instead of freeing it; a new request copies
(`PrefixCopyingSequence.copy_prefix`) the longest run of its prompt's tokens one of the kept sequences
(or a running request's) holds, and prefills only the rest. The hidden states the trained drafters read
for those tokens are kept beside them (`RowLog`), so a head sees the same prompt features as after a
prefill.

Where the backend's rows are row invariant (`greedy_guarantee == "bitwise"`: specula's native CPU
kernels) the copied keys and values are bit for bit what a prefill writes, so outputs do not change
(tested). The cache holds at most `max_bytes` (keys, values and features); the least recently used
sequence is freed first, and one whose tokens another kept sequence extends is dropped for it.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from specula.models.base import PrefixCopyingSequence, TargetSequence, common_prefix_length

MIN_REUSE = 16
"""Fewest common tokens worth a copy (fewer: the request prefills its whole prompt)."""


class RowLog:
    """Rows appended over a request's life ([n, width], grown by doubling): the hidden states the
    target returned for each committed token, in order."""

    def __init__(self, rows: torch.Tensor) -> None:
        self._buffer = rows.new_empty((max(64, 2 * rows.shape[0]), rows.shape[1]))  # [capacity, width]
        self._buffer[: rows.shape[0]] = rows
        self.length = rows.shape[0]

    def extend(self, rows: torch.Tensor) -> None:
        """Append `rows` [m, width]."""
        end = self.length + rows.shape[0]
        if end > self._buffer.shape[0]:
            grown = self._buffer.new_empty((max(end, 2 * self._buffer.shape[0]), self._buffer.shape[1]))
            grown[: self.length] = self._buffer[: self.length]
            self._buffer = grown
        self._buffer[self.length: end] = rows
        self.length = end

    def rows(self) -> torch.Tensor:
        """The rows so far [length, width] (a view)."""
        return self._buffer[: self.length]

    def shrink_to_fit(self) -> None:
        """Free the buffer's rows past `length` (a later `extend` grows it again)."""
        if self._buffer.shape[0] > self.length:
            self._buffer = self._buffer[: self.length].clone()

    @property
    def memory_bytes(self) -> int:
        return self._buffer.numel() * self._buffer.element_size()


@dataclass(frozen=True)
class Hit:
    """What a new request took from the cache."""

    length: int
    """Prompt tokens copied into its sequence (not prefilled)."""
    features: torch.Tensor | None
    """The hidden states of those tokens [length, k E] (None: none asked for)."""


@dataclass
class _Entry:
    seq: PrefixCopyingSequence
    features: RowLog | None
    bytes: int


class PrefixCache:
    """Finished requests' sequences, least recently used first out (see the module docstring)."""

    def __init__(self, max_bytes: int, min_tokens: int = MIN_REUSE) -> None:
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._entries: "collections.OrderedDict[int, _Entry]" = collections.OrderedDict()  # oldest first
        self._keys = itertools.count()
        self._running: dict[int, tuple[TargetSequence, RowLog | None]] = {}  # running requests' (`share`), by id
        self.bytes = 0
        """Bytes held now (of the kept sequences; the running ones are their requests')."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_tokens(self) -> int:
        """Tokens the kept sequences hold, in all (what `bytes` pays for)."""
        return sum(len(entry.seq.tokens) for entry in self._entries.values())

    def take(self, prompt: Sequence[int], into: TargetSequence, features: bool = False) -> Hit | None:
        """Copy into `into` (a new, empty sequence) the longest run of `prompt`'s tokens before its last (the
        first step's root) that a kept sequence holds, with their hidden states when `features`; None (and
        `into` left empty) when no sequence holds `min_tokens` of them (or, with `features`, their hidden
        states)."""
        if not isinstance(into, PrefixCopyingSequence):
            return None
        head = prompt[:-1]
        best, best_length = None, 0
        kept = ((key, entry.seq, entry.features) for key, entry in self._entries.items())
        for key, seq, rows in itertools.chain(kept, ((None, seq, rows) for seq, rows in self._running.values())):
            if features and rows is None:
                continue
            length = common_prefix_length(seq.tokens, head)
            if features:
                length = min(length, rows.length)
            if length > best_length:
                best, best_length = (key, seq, rows), length
        if best is None or best_length < self.min_tokens:
            return None
        key, seq, rows = best
        if key is not None:
            self._entries.move_to_end(key)
        into.copy_prefix(seq, best_length)
        return Hit(best_length, rows.rows()[:best_length].clone() if features else None)

    def share(self, seq: TargetSequence, features: RowLog | None) -> None:
        """Let `take` copy from a running request's sequence too (its committed tokens; `features`: the hidden
        states of them, as they grow) until it is `put`: the `n` choices of a prompt, or requests at once with
        one system prompt, prefill it once."""
        self._running[id(seq)] = (seq, features)

    def put(self, seq: TargetSequence, features: RowLog | None) -> None:
        """Keep a finished request's sequence (and the hidden states of its tokens), or free it when it
        cannot be copied from, holds fewer than `min_tokens` tokens or alone exceeds the budget. What is kept
        holds its tokens' rows only (`shrink_to_fit`: the buffers grew by doubling)."""
        self._running.pop(id(seq), None)
        if not isinstance(seq, PrefixCopyingSequence) or len(seq.tokens) < self.min_tokens:
            seq.release()
            return
        seq.shrink_to_fit()
        if features is not None:
            features.shrink_to_fit()
        size = seq.memory_bytes + (features.memory_bytes if features is not None else 0)
        if size > self.max_bytes:
            seq.release()
            return
        for key in [k for k, e in self._entries.items() if _extends(seq, features, e)]:
            self._drop(key)  # the new one holds all it held (a chat's earlier turn)
        self._entries[next(self._keys)] = _Entry(seq, features, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        """Free every kept sequence."""
        while self._entries:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.bytes
        entry.seq.release()


def _extends(seq: TargetSequence, features: RowLog | None, entry: _Entry) -> bool:
    """Whether `seq` (with `features`) holds everything `entry` does: its tokens begin with the entry's,
    with hidden states where the entry has them."""
    held = entry.seq.tokens
    return (len(held) <= len(seq.tokens) and common_prefix_length(held, seq.tokens) == len(held)
            and (entry.features is None or features is not None))
