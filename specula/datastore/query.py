"""REST retrieval over a suffix array: pure numpy functions, no Python loop over the data.

    longest_match(tokens, index, context)       the longest context suffix (16 .. 2 tokens) that
                                                occurs in the datastore, and its suffix-array range
    continuation_prefixes(tokens, index, ...)   every prefix of the (up to 10-token) continuations
                                                of up to 5000 of its matches, with counts
    top_prefixes(prefixes, n)                   the n most frequent prefixes: a prefix-closed tree

All suffix-array searches of one query run together as one vectorised binary search (about
log2(n) rounds of a few numpy calls), so a query costs microseconds to a few milliseconds
whatever the datastore size. Arrays: `tokens` [n] unsigned ids ending with the separator,
`index` [n] its suffix array (see `specula.datastore.format`); contexts hold ids below the
separator only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Match:
    """Where the longest matching context suffix occurs."""

    length: int
    """Tokens of the context suffix that matched."""
    lo: int
    """First suffix-array row whose suffix starts with the pattern."""
    hi: int
    """One past the last such row (hi - lo = number of occurrences)."""

    @property
    def count(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Prefixes:
    """Continuation prefixes as a trie, nodes in topological (depth-major) order."""

    tokens: np.ndarray
    """[m] int64 last token of each prefix."""
    parents: np.ndarray
    """[m] int64 node index of the prefix one token shorter; -1 for single-token prefixes."""
    depths: np.ndarray
    """[m] int64 prefix length."""
    counts: np.ndarray
    """[m] int64 how many sampled continuations start with the prefix."""
    n_matches: int
    """Continuations sampled (the denominator of a node's frequency)."""


def _compare(tokens: np.ndarray, starts: np.ndarray, patterns: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """Sign of suffix(start)[:len] against pattern[:len] per row: -1 less, 0 equal, +1 greater.

    starts [b] int64; patterns [b, w] int64; columns [b, w] bool, True for the first `len`
    columns of each row. Positions past the end read the final separator (see the module
    docstring), which is exact because patterns never contain it."""
    width = patterns.shape[1]
    window = tokens[np.minimum(starts[:, None] + np.arange(width), len(tokens) - 1)].astype(np.int64)  # [b, w]
    differ = (window != patterns) & columns  # [b, w]
    first = differ.argmax(axis=1)  # [b]
    rows = np.arange(len(starts))
    return np.sign(window[rows, first] - patterns[rows, first]) * differ[rows, first]


def suffix_ranges(tokens: np.ndarray, index: np.ndarray, patterns: np.ndarray,
                  lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi) suffix-array rows whose suffix starts with each pattern, all patterns at once.

    patterns [b, w] int64; lengths [b]. Returns lo [b], hi [b] int64. Lower and upper bounds are
    2b simultaneous binary searches."""
    b = len(lengths)
    pats = np.concatenate([patterns, patterns])  # [2b, w]
    columns = np.arange(patterns.shape[1]) < np.concatenate([lengths, lengths])[:, None]  # [2b, w]
    upper = np.arange(2 * b) >= b  # rows b.. search the first suffix greater than the pattern
    lo = np.zeros(2 * b, dtype=np.int64)
    hi = np.full(2 * b, len(index), dtype=np.int64)
    while True:
        active = np.flatnonzero(lo < hi)
        if len(active) == 0:
            break
        mid = (lo[active] + hi[active]) // 2
        cmp = _compare(tokens, index[mid].astype(np.int64), pats[active], columns[active])
        right = (cmp < 0) | ((cmp == 0) & upper[active])
        lo[active] = np.where(right, mid + 1, lo[active])
        hi[active] = np.where(right, hi[active], mid)
    return lo[:b], lo[b:]


def longest_match(tokens: np.ndarray, index: np.ndarray, context: np.ndarray,
                  max_len: int = 16, min_len: int = 2) -> Match | None:
    """The longest suffix of `context` ([L] ids, max_len down to min_len tokens) found in the
    datastore, or None."""
    longest = min(max_len, len(context))
    if longest < min_len or len(index) == 0:
        return None
    context = np.asarray(context[-longest:], dtype=np.int64)
    lengths = np.arange(longest, min_len - 1, -1, dtype=np.int64)  # [b], longest first
    patterns = np.full((len(lengths), longest), -2, dtype=np.int64)  # [b, longest]; padding is masked
    for row, length in enumerate(lengths):
        patterns[row, :length] = context[longest - length :]
    lo, hi = suffix_ranges(tokens, index, patterns, lengths)
    found = np.flatnonzero(hi > lo)
    if len(found) == 0:
        return None
    row = int(found[0])
    return Match(int(lengths[row]), int(lo[row]), int(hi[row]))


def sample_rows(match: Match, max_matches: int) -> np.ndarray:
    """Suffix-array rows of the matches used: all of them, or `max_matches` evenly spaced ones.

    Rows are sorted by what follows the match, so an evenly spaced pick keeps each continuation
    prefix's share to within one pick per run of rows (a stratified sample), deterministically."""
    if match.count <= max_matches:
        return np.arange(match.lo, match.hi, dtype=np.int64)
    return match.lo + (np.arange(max_matches, dtype=np.int64) * match.count) // max_matches


def continuation_prefixes(tokens: np.ndarray, index: np.ndarray, match: Match, *, depth: int = 10,
                          max_matches: int = 5000, separator: int) -> Prefixes:
    """Count every prefix (1..depth tokens) of the continuations after the sampled matches.

    A continuation stops at the datastore's end or at a document separator."""
    rows = sample_rows(match, max_matches)
    pos = index[rows].astype(np.int64)[:, None] + match.length + np.arange(depth)  # [m, depth]
    cont = tokens[np.minimum(pos, len(tokens) - 1)].astype(np.int64)  # [m, depth]; past the end: separator
    cont[cont == separator] = -1
    valid = np.cumprod(cont >= 0, axis=1).astype(bool)  # [m, depth]: cut at the first stop
    base = separator + 1
    node_tokens, node_parents, node_depths, node_counts = [], [], [], []
    parent = np.full(len(rows), -1, dtype=np.int64)  # [m] node of each continuation's prefix so far
    offset = 0
    for d in range(depth):
        alive = valid[:, d]
        if not alive.any():
            break
        keys = (parent[alive] + 1) * base + cont[alive, d]
        uniq, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
        node_tokens.append(uniq % base)
        node_parents.append(uniq // base - 1)
        node_depths.append(np.full(len(uniq), d + 1, dtype=np.int64))
        node_counts.append(counts)
        parent = np.full(len(rows), -1, dtype=np.int64)
        parent[alive] = offset + inverse.reshape(-1)
        offset += len(uniq)
    arrays = [np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
              for parts in (node_tokens, node_parents, node_depths, node_counts)]
    return Prefixes(*arrays, n_matches=len(rows))


def top_prefixes(prefixes: Prefixes, n: int) -> np.ndarray:
    """Indices (ascending, hence topological) of the `n` most frequent prefixes.

    Ties go to the shorter prefix, then to the lower node index; since a prefix is at least as
    frequent as any extension of it, the chosen set is prefix-closed."""
    if n >= len(prefixes.counts):
        return np.arange(len(prefixes.counts))
    order = np.lexsort((np.arange(len(prefixes.counts)), prefixes.depths, -prefixes.counts))
    return np.sort(order[:n])
