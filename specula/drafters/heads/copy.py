"""The copy hint a head may read beside each token: what the text before it says comes next.

A head's attention sees a window of committed pairs (`TrainedHead.window`, 256 for the shipped
heads): it cannot copy a phrase from further back, and a third of a summary is such a copy
(docs/training.md, "Copying from far back in a long document"). Prompt lookup finds those copies at
any distance; a head with `HeadConfig.copy_ngram` = N > 0 is handed the same finding as an input.
For the pair whose token ends at position p (pair p - 1: feature f_{p-1}, token x_p, predicting
x_{p+1}), the hint is x_{j+1} for the latest j < p at which the n tokens ending at j equal the n
ending at p, n the longest such from N down to 1, and the hint's length is that n (0 and token 0:
no earlier match). The head learns how far to trust it (the length is an input too).

One definition serves training (`sequence_hints` over a whole prompt and answer, so a chunk's
hints reach before the chunk, as drafting's do) and drafting (`CopyIndex`: the committed tokens
indexed once, a drafted node's hint over them and its own path); tests hold the two equal.
"""

from __future__ import annotations

from typing import Sequence

MAX_COPY_NGRAM = 8
"""Longest match a copy hint may look for (`HeadConfig.copy_ngram`)."""


class CopyIndex:
    """The committed tokens of one sequence with, per n-gram (n = 1 .. N), the latest position it
    ends at; a position enters once the token after it is committed, so every indexed match has a
    hint."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> latest end position j (x_{j+1} committed)
        self.indexed = 0  # positions 0 .. indexed - 1 are in `latest`

    def extend(self, tokens: Sequence[int]) -> None:
        """Commit more tokens (the sequence so far is `self.tokens` + `tokens`)."""
        self.tokens.extend(int(t) for t in tokens)

    def _index_to(self, end: int) -> None:
        """Index the n-grams ending at positions < end (each needs its next token committed)."""
        toks, latest = self.tokens, self.latest
        for j in range(self.indexed, min(end, len(toks) - 1)):
            for n in range(1, min(self.n, j + 1) + 1):
                latest[tuple(toks[j - n + 1: j + 1])] = j
        self.indexed = max(self.indexed, min(end, len(toks) - 1))

    def committed_hints(self, start: int, stop: int) -> tuple[list[int], list[int]]:
        """(hint tokens, match lengths) of committed positions p = start .. stop - 1 (each over the
        positions before it)."""
        hints, lengths = [], []
        for p in range(start, stop):
            self._index_to(p)
            hint, n = self._lookup(self.tokens, 0, p, p)
            hints.append(hint)
            lengths.append(n)
        return hints, lengths

    def path_hint(self, path: Sequence[int]) -> tuple[int, int]:
        """(hint token, match length) of the last token of `path`, tokens drafted after every committed
        one: matched against the committed tokens and the path before it."""
        end = len(self.tokens)
        self._index_to(end - 1)  # committed positions whose next token is committed
        off = max(0, end - self.n - 1)  # the committed tail a match ending in the path can read
        return self._lookup(self.tokens[off:] + list(path), off, end + len(path) - 1, end - 1)

    def _lookup(self, toks: Sequence[int], off: int, p: int, indexed: int) -> tuple[int, int]:
        """The latest j < p whose n tokens end like position p's, n longest first: positions
        indexed .. p - 1 by scanning `toks` (position q at toks[q - off]), those before through the
        index."""
        for n in range(min(self.n, p + 1), 0, -1):
            gram = toks[p - n + 1 - off: p + 1 - off]
            for j in range(p - 1, max(indexed, n - 1) - 1, -1):
                if toks[j - n + 1 - off: j + 1 - off] == gram:
                    return toks[j + 1 - off], n
            j = self.latest.get(tuple(gram))
            if j is not None and j < indexed:
                return self.tokens[j + 1], n
        return 0, 0


def sequence_hints(tokens: Sequence[int], n: int) -> tuple[list[int], list[int]]:
    """(hint tokens, match lengths) of every position of `tokens` (position 0: none)."""
    index = CopyIndex(n)
    index.extend(tokens)
    return index.committed_hints(0, len(tokens))
