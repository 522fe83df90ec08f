"""Retrieval queries against a brute-force reference, and file-format errors."""

import struct
from collections import Counter

import numpy as np
import pytest

from specula.datastore.build import BuildConfig, build_datastore, suffix_array
from specula.datastore.format import DatastoreError, load_datastore
from specula.datastore.query import continuation_prefixes, longest_match, sample_rows, top_prefixes
from specula.datastore.tokenizers import tokenizer_fingerprint

SEP = 65535


def make_store(n_docs=40, seed=0, alphabet=6):
    """Random documents over a small alphabet (many repeats) joined by SEP: tokens, suffix array."""
    rng = np.random.default_rng(seed)
    toks: list[int] = []
    for _ in range(n_docs):
        toks.extend(rng.integers(0, alphabet, rng.integers(1, 30)).tolist())
        toks.append(SEP)
    tokens = np.array(toks, dtype=np.uint16)
    return tokens, suffix_array(tokens)


def brute_longest(tokens, context, max_len=16, min_len=2):
    seq = tokens.tolist()
    for n in range(min(max_len, len(context)), min_len - 1, -1):
        pat = list(context[-n:])
        starts = [i for i in range(len(seq) - n + 1) if seq[i : i + n] == pat]
        if starts:
            return n, starts
    return None


def brute_prefix_counts(tokens, starts, n, depth):
    seq = tokens.tolist()
    counts = Counter()
    for s in starts:
        cont = []
        for t in seq[s + n : s + n + depth]:
            if t == SEP:
                break
            cont.append(t)
            counts[tuple(cont)] += 1
    return counts


def trie_counts(prefixes):
    """{token path: count} of a Prefixes trie."""
    paths = {}
    for i in range(len(prefixes.tokens)):
        par = int(prefixes.parents[i])
        paths[i] = (paths[par] if par >= 0 else ()) + (int(prefixes.tokens[i]),)
    return {paths[i]: int(prefixes.counts[i]) for i in range(len(prefixes.tokens))}, paths


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_query_matches_brute_force(seed):
    tokens, index = make_store(seed=seed)
    rng = np.random.default_rng(100 + seed)
    seq = tokens.tolist()
    contexts = [rng.integers(0, 6, rng.integers(1, 20)).tolist() for _ in range(25)]
    contexts += [seq[s : s + 18] for s in rng.integers(0, len(seq) - 18, 25)]  # long real matches
    contexts = [[t for t in c if t != SEP] for c in contexts]
    for context in contexts:
        match = longest_match(tokens, index, np.array(context))
        expected = brute_longest(tokens, context)
        if expected is None:
            assert match is None, context
            continue
        n, starts = expected
        assert (match.length, match.count) == (n, len(starts)), context
        assert sorted(index[match.lo : match.hi].tolist()) == starts
        prefixes = continuation_prefixes(tokens, index, match, depth=10, separator=SEP)
        counts, paths = trie_counts(prefixes)
        assert counts == dict(brute_prefix_counts(tokens, starts, n, 10))
        assert prefixes.n_matches == len(starts)
        keep = top_prefixes(prefixes, 12).tolist()
        chosen = {paths[i] for i in keep}
        assert len(chosen) == min(12, len(counts))
        assert all(p[:-1] in chosen for p in chosen if len(p) > 1)  # prefix-closed
        if len(chosen) < len(counts):  # a top-N: nothing left out beats anything kept
            assert min(counts[p] for p in chosen) >= max(c for p, c in counts.items() if p not in chosen)


def test_no_match_and_short_context():
    tokens, index = make_store()
    assert longest_match(tokens, index, np.array([7, 8, 9])) is None  # ids absent from the store
    assert longest_match(tokens, index, np.array([3])) is None  # shorter than min_len
    assert longest_match(tokens, index[:0], np.array([1, 2, 3])) is None


def test_many_matches_are_sampled_evenly():
    tokens = np.array([1, 2] * 3000 + [SEP], dtype=np.uint16)
    index = suffix_array(tokens)
    match = longest_match(tokens, index, np.array([1, 2]), max_len=2)
    assert match.count == 3000
    rows = sample_rows(match, 500)
    assert len(rows) == 500 and rows[0] == match.lo and rows[-1] < match.hi
    assert np.all(np.diff(rows) == 6)
    prefixes = continuation_prefixes(tokens, index, match, depth=4, max_matches=500, separator=SEP)
    assert prefixes.n_matches == 500 and prefixes.counts.max() <= 500
    assert prefixes.counts[0] >= 495  # "1" follows nearly every match (not those at the end)


@pytest.mark.perf
def test_query_time_does_not_scan():
    """A 2M-token store answers in well under the cost of a linear scan (budget: 20 ms on a slow CI)."""
    import time

    rng = np.random.default_rng(0)
    tokens = np.append(rng.integers(0, 500, 2_000_000), SEP).astype(np.uint16)
    index = suffix_array(tokens)
    seq_ctx = tokens[1000:1016].astype(np.int64)
    t0 = time.perf_counter()
    for _ in range(20):
        match = longest_match(tokens, index, seq_ctx)
        continuation_prefixes(tokens, index, match, separator=SEP)
    per_query = (time.perf_counter() - t0) / 20
    assert match.length == 16 and match.count >= 1
    assert per_query < 0.02, per_query


# --------------------------------------------------------------------------- file format


@pytest.fixture
def built(tmp_path, make_tokenizer):
    tok = make_tokenizer(96)
    (tmp_path / "c.txt").write_text(" ".join(f"w{i % 17}" for i in range(500)))
    report = build_datastore(tok, [tmp_path / "c.txt"], tmp_path / "ds.specds", BuildConfig(progress=False))
    return report.path, tok


def test_round_trip_and_tokenizer_check(built, make_tokenizer):
    path, tok = built
    store = load_datastore(path, expected_fingerprint=tokenizer_fingerprint(tok))
    assert len(store) == 501 and isinstance(store.tokens, np.ndarray)
    assert store.index.tolist() == suffix_array(np.asarray(store.tokens)).tolist()
    other = make_tokenizer(97)
    with pytest.raises(DatastoreError, match="built with tokenizer .* not with this model's tokenizer"):
        load_datastore(path, expected_fingerprint=tokenizer_fingerprint(other))


def test_truncated_file(built):
    path, _ = built
    data = path.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 40, 10, 0):
        path.write_bytes(data[:cut])
        with pytest.raises(DatastoreError, match="truncated|bad magic"):
            load_datastore(path)


def test_bad_magic_version_and_corruption(built):
    path, _ = built
    data = bytearray(path.read_bytes())
    path.write_bytes(b"NOTREST!" + data[8:])
    with pytest.raises(DatastoreError, match="bad magic"):
        load_datastore(path)
    path.write_bytes(data[:8] + struct.pack("<I", 99) + data[12:])
    with pytest.raises(DatastoreError, match="format version 99"):
        load_datastore(path)
    broken_header = bytearray(data)
    broken_header[20] ^= 0xFF
    path.write_bytes(broken_header)
    with pytest.raises(DatastoreError, match="header checksum"):
        load_datastore(path)
    broken_array = bytearray(data)
    broken_array[-3] ^= 0x01
    path.write_bytes(broken_array)
    with pytest.raises(DatastoreError, match="array checksum"):
        load_datastore(path)
    load_datastore(path, verify=False)  # the caller may skip the checksum pass
    with pytest.raises(DatastoreError, match="does not exist"):
        load_datastore(path.parent / "missing.specds")
