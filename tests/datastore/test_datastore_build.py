import json
import os

import numpy as np
import pytest

from specula.cli import main
from specula.datastore.build import BuildConfig, build_datastore, file_documents, record_texts, suffix_array
from specula.datastore.format import DatastoreError, load_datastore
from specula.datastore.tokenizers import tokenizer_fingerprint
from specula.paths import stale_temps

QUIET = BuildConfig(progress=False)


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def brute_suffix_array(tokens) -> list[int]:
    seq = [int(t) for t in tokens]
    return sorted(range(len(seq)), key=lambda i: seq[i:])


def test_corpus_documents_are_tokenized_and_joined_with_the_separator(tmp_path, corpus, make_tokenizer):
    tok = make_tokenizer(96)
    report = build_datastore(tok, [corpus], tmp_path / "ds.specds", QUIET)
    store = load_datastore(report.path, expected_fingerprint=tokenizer_fingerprint(tok))
    sep = store.separator
    assert sep == 65535 and store.tokens.dtype == np.uint16 and store.vocab_size == 96
    # Walk order: sorted names per directory, hidden and non-matching files skipped.
    docs = [[5, 6, 7, 8, 9, 5, 6, 7, 10, 11], [5, 6, 7, 8, 12, 13, 5, 6, 40],
            [20, 21, 22, 5, 6, 7, 8, 9], [30, 31], [32, 33, 34], [5, 6, 7, 50]]
    expected = [t for doc in docs for t in (*doc, sep)]
    assert store.tokens.tolist() == expected
    assert store.header.n_documents == len(docs) and report.files_read == 3 and report.files_skipped == 0
    assert store.index.tolist() == brute_suffix_array(expected)


@pytest.mark.parametrize("dtype,high", [(np.uint16, 65534), (np.uint32, 300_000)])
def test_suffix_array_matches_sorting_all_suffixes(dtype, high):
    rng = np.random.default_rng(0)
    for alphabet in (2, 7, high):  # repetitive and diverse
        tokens = rng.integers(0, min(alphabet, high), 1500).astype(dtype)
        assert suffix_array(tokens).tolist() == brute_suffix_array(tokens)


def test_large_vocabulary_ids_round_trip(tmp_path, make_tokenizer):
    tok = make_tokenizer(70_000)
    ids = [69_999, 65_535, 65_536, 3, 69_999, 65_535, 12, 66_000]
    (tmp_path / "big.txt").write_text(words(ids))
    report = build_datastore(tok, [tmp_path / "big.txt"], tmp_path / "big.specds", QUIET)
    store = load_datastore(report.path, expected_fingerprint=tokenizer_fingerprint(tok))
    assert store.tokens.dtype == np.uint32 and store.separator == 2**32 - 1
    assert store.tokens.tolist() == [*ids, store.separator]
    assert store.index.tolist() == brute_suffix_array(store.tokens)


def test_max_tokens_truncates(tmp_path, corpus, make_tokenizer):
    report = build_datastore(make_tokenizer(96), [corpus], tmp_path / "ds.specds", BuildConfig(max_tokens=7, progress=False))
    store = load_datastore(report.path)
    assert store.tokens.tolist() == [5, 6, 7, 8, 9, 5, store.separator]  # always ends with a separator
    assert store.index.tolist() == brute_suffix_array(store.tokens)
    assert store.header.n_documents == 1  # the one document cut short, not every document read
    for limit, documents in ((12, 1), (13, 2)):  # the first document is 10 tokens and its separator
        report = build_datastore(make_tokenizer(96), [corpus], tmp_path / "ds.specds",
                                 BuildConfig(max_tokens=limit, progress=False))
        assert report.header.n_documents == documents, limit  # 12: the second cut down to nothing


def test_record_formats():
    assert record_texts("plain") == ["plain"]
    assert record_texts({"text": "t", "messages": [{"content": "x"}]}) == ["t"]
    assert record_texts({"conversations": [{"value": "a"}, {"value": ""}, {"value": "b"}]}) == ["a", "b"]
    assert record_texts({"messages": [{"role": "user", "content": "q"}, "junk"]}) == ["q"]
    assert record_texts({"other": 1}) == [] and record_texts(3) == []


def test_json_array_file_and_bad_inputs(tmp_path):
    good = tmp_path / "list.json"
    good.write_text(json.dumps([{"text": "a b"}, {"messages": [{"content": "c"}]}]))
    assert file_documents(good, explicit=True) == ["a b", "c"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DatastoreError, match=r"bad.jsonl:2: not valid JSON"):
        file_documents(bad, explicit=True)
    assert file_documents(bad, explicit=False) is None  # found by a directory walk: skipped
    binary = tmp_path / "x.txt"
    binary.write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(DatastoreError, match="not UTF-8"):
        file_documents(binary, explicit=True)


def test_files_as_editors_and_scrapers_leave_them(tmp_path):
    """A byte-order mark, a JSON string with a lone surrogate escape, a dangling link."""
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "w7 w8"}).encode() + b"\n")
    assert file_documents(bom, explicit=True) == ["w7 w8"] == file_documents(bom, explicit=False)
    text = tmp_path / "bom.txt"
    text.write_bytes(b"\xef\xbb\xbfw7 w8")
    assert file_documents(text, explicit=True) == ["w7 w8"]
    lone = tmp_path / "lone.jsonl"
    lone.write_text('{"text": "w4 \\ud83d w5"}\n')
    [doc] = file_documents(lone, explicit=True)
    assert doc.encode("utf-8") and doc.startswith("w4 ") and doc.endswith(" w5")  # UTF-8 now: a tokenizer takes it
    separators = tmp_path / "separators.jsonl"  # JSON holds U+2028 / U+2029 / U+0085 raw: one line each
    separators.write_text(json.dumps({"text": "w1\u2028w2\u2029w3\u0085w4"}, ensure_ascii=False) + "\n")
    assert file_documents(separators, explicit=True) == ["w1\u2028w2\u2029w3\u0085w4"]
    dangling = tmp_path / "gone.txt"
    dangling.symlink_to(tmp_path / "missing.txt")
    assert file_documents(dangling, explicit=False) is None  # found by a walk: skipped
    with pytest.raises(DatastoreError, match="cannot read"):
        file_documents(dangling, explicit=True)


def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, corpus, make_tokenizer,
                                                                         monkeypatch):
    import specula.datastore.build as build_mod

    monkeypatch.setattr(build_mod, "tokenize_corpus", lambda *a: pytest.fail("tokenized before the check"))
    (tmp_path / "dir").mkdir()
    with pytest.raises(DatastoreError, match="is a directory"):
        build_datastore(make_tokenizer(96), [corpus], tmp_path / "dir", QUIET)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DatastoreError, match="not a writable directory"):
        build_datastore(make_tokenizer(96), [corpus], tmp_path / "file" / "ds.specds", QUIET)


def test_missing_or_empty_corpus_is_a_clear_error(tmp_path, make_tokenizer):
    tok = make_tokenizer(96)
    with pytest.raises(DatastoreError, match="does not exist"):
        build_datastore(tok, [tmp_path / "nope"], tmp_path / "o.specds", QUIET)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatastoreError, match="no corpus files"):
        build_datastore(tok, [tmp_path / "empty"], tmp_path / "o.specds", QUIET)
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(DatastoreError, match="no text"):
        build_datastore(tok, [tmp_path / "blank.txt"], tmp_path / "o.specds", QUIET)
    assert not (tmp_path / "o.specds").exists()


def test_a_build_that_would_store_no_token_is_refused_and_writes_nothing(tmp_path, corpus, make_tokenizer, capsys):
    """--max-tokens 1 kept the separator alone, and a corpus the tokenizer turns into nothing (blank text to a
    word-level tokenizer) wrote a store of separators: empty stores that REST could never draft from."""
    tok = make_tokenizer(96)
    out = tmp_path / "ds.specds"
    for limit in (1, 0, -3):
        with pytest.raises(DatastoreError, match=f"^max_tokens must be >= 2 .*got {limit}"):  # BuildConfig's field
            build_datastore(tok, [corpus], out, BuildConfig(max_tokens=limit, progress=False))
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "a.txt").write_text("   \n\t ")
    (blank / "b.jsonl").write_text(json.dumps({"text": " "}) + "\n" + json.dumps({"messages": [{"content": "\n"}]}))
    with pytest.raises(DatastoreError, match="no text the tokenizer turns into tokens: nothing to build"):
        build_datastore(tok, [blank], out, QUIET)
    (blank / "c.txt").write_text("w5 w6 w7")  # read after the blank documents: cut off by --max-tokens
    with pytest.raises(DatastoreError, match=r"in its first 3 tokens \(max_tokens\).*or a larger max_tokens$"):
        build_datastore(tok, [blank], out, BuildConfig(max_tokens=3, progress=False))
    assert not out.exists() and stale_temps(out) == [] and sorted(os.listdir(tmp_path)) == ["blank", "corpus"]
    tokdir = tmp_path.parent / f"{tmp_path.name}-tok"
    tok.save_pretrained(tokdir)
    for source, extra, message in (("a.txt", ["--max-tokens", "1"], "error: --max-tokens must be >= 2 "),
                                   ("a.txt", [], "error: the corpus holds no text"),
                                   ("", ["--max-tokens", "3"], "(--max-tokens): nothing to build a datastore from; "
                                                               "give files with text, or a larger --max-tokens\n")):
        code = main(["datastore", "build", "--tokenizer", str(tokdir), "--from", str(blank / source), "--out",
                     str(out), "--quiet", *extra])
        err = capsys.readouterr().err  # the library names BuildConfig's max_tokens; the command, its flag
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists() and stale_temps(out) == []
    assert build_datastore(tok, [blank], out, BuildConfig(max_tokens=5, progress=False)).header.n_tokens == 5


def test_interrupted_build_leaves_no_file_and_keeps_the_old_one(tmp_path, corpus, make_tokenizer, monkeypatch):
    import specula.datastore.build as build_mod

    tok = make_tokenizer(96)
    out = tmp_path / "ds.specds"

    def dying_write(handle, header, tokens, index, progress=None):
        handle.write(b"SPECREST" + b"\x00" * 100)  # part of a file, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(build_mod, "write_datastore", dying_write)
    with pytest.raises(KeyboardInterrupt):
        build_datastore(tok, [corpus], out, QUIET)
    assert not out.exists() and stale_temps(out) == []
    monkeypatch.undo()

    build_datastore(tok, [corpus], out, QUIET)
    before = out.read_bytes()
    monkeypatch.setattr(build_mod, "write_datastore", dying_write)
    with pytest.raises(KeyboardInterrupt):
        build_datastore(tok, [corpus / "a.txt"], out, QUIET)
    assert out.read_bytes() == before and stale_temps(out) == []


def test_cli_build_info_and_errors(tmp_path, corpus, make_tokenizer, capsys):
    tokdir = tmp_path / "tok"
    make_tokenizer(96).save_pretrained(tokdir)
    out = tmp_path / "cli.specds"
    assert main(["datastore", "build", "--tokenizer", str(tokdir), "--from", str(corpus), "--out", str(out),
                 "--ext", ".txt", "--quiet", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n_tokens"] == 11 and report["files_read"] == 1
    assert main(["datastore", "info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["n_tokens"] == 11 and info["checksums"] == "ok" and info["file_bytes"] == os.path.getsize(out)
    assert main(["datastore", "bench", str(out), "--queries", "5"]) == 2  # too small to time: one-line error
    assert "too small" in capsys.readouterr().err
    assert main(["datastore", "info", str(tmp_path)]) == 2
    assert "is a directory, not a datastore file" in capsys.readouterr().err
    (tmp_path / "junk.specds").write_bytes(b"hello world, not a datastore")
    assert main(["datastore", "info", str(tmp_path / "junk.specds")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "bad magic" in err and "\n" not in err


def test_bench_of_a_store_of_one_word_documents_reports_no_datastore_queries(tmp_path, make_tokenizer, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"w{i % 90}"}) + "\n" for i in range(100)))
    out = tmp_path / "short.specds"
    build_datastore(make_tokenizer(96), [docs], out, QUIET)
    assert main(["datastore", "bench", str(out), "--queries", "20", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert results["from datastore"] == {"queries": 0} and results["random ids"]["queries"] == 20


@pytest.mark.parametrize("setting", ["truncation", "padding"])
def test_a_tokenizer_json_with_truncation_or_padding_on_stores_the_whole_documents(tmp_path, make_tokenizer, setting):
    """A tokenizer.json may switch truncation or padding on; transformers turns them off for each
    encode, the Rust tokenizer called directly did not: documents were cut to max_length or padded
    with pad ids stored as text."""
    from specula.models.loading import load_tokenizer

    tok = make_tokenizer(50)
    if setting == "truncation":
        tok.backend_tokenizer.enable_truncation(max_length=8)
    else:
        tok.backend_tokenizer.enable_padding(pad_id=49, pad_token="w49")
    tok.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(str(tmp_path / "tok"))
    long, short = [" ".join(f"w{i}" for i in range(2, 32)), "w3 w4"]
    (tmp_path / "a.txt").write_text(long)
    (tmp_path / "b.txt").write_text(short)
    store = load_datastore(build_datastore(loaded, [tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "s.specds",
                                           BuildConfig(progress=False)).path)
    sep = store.header.separator
    assert store.tokens.tolist() == [*range(2, 32), sep, 3, 4, sep]
    assert loaded.backend_tokenizer.truncation is not None or loaded.backend_tokenizer.padding is not None  # untouched


def test_an_output_that_is_one_of_the_corpus_files_is_refused(tmp_path, make_tokenizer):
    notes = tmp_path / "notes.txt"
    notes.write_text("w3 w4 w5")
    with pytest.raises(DatastoreError, match="^out= would overwrite the corpus file"):  # build_datastore's keyword
        build_datastore(make_tokenizer(10), [tmp_path], notes, BuildConfig(progress=False))
    with pytest.raises(DatastoreError, match=f"^out={str(tmp_path)!r} is a directory; give a file path$"):
        build_datastore(make_tokenizer(10), [notes], tmp_path, BuildConfig(progress=False))
    assert notes.read_text() == "w3 w4 w5"


def test_an_unreadable_datastore_is_a_clear_error(tmp_path, corpus, make_tokenizer, monkeypatch):
    """A file the user may not read (or an I/O error): a DatastoreError naming it, not a traceback."""
    path = build_datastore(make_tokenizer(100), [corpus], tmp_path / "s.specds", BuildConfig(progress=False)).path

    def refused(file, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(file))

    monkeypatch.setattr("specula.datastore.format.open", refused, raising=False)  # as for a user without read access
    with pytest.raises(DatastoreError, match="cannot read datastore .*Permission denied"):
        load_datastore(path)


def test_the_command_refuses_a_bad_corpus_or_output_before_loading_the_tokenizer(tmp_path, corpus, monkeypatch,
                                                                                 capsys):
    import specula.models.loading as loading

    monkeypatch.setattr(loading, "load_tokenizer", lambda *a, **k: pytest.fail("the tokenizer loaded first"))
    (tmp_path / "dir").mkdir()
    cases = [([str(tmp_path / "missing")], str(tmp_path / "ds.specds"), "does not exist"),
             ([str(corpus)], str(tmp_path / "dir"), f"error: --out {str(tmp_path / 'dir')!r} is a directory"),
             ([str(corpus)], str(corpus / "a.txt"), "error: --out would overwrite the corpus file")]
    for sources, out, message in cases:  # the library names build's out=; the command, its flag
        assert main(["datastore", "build", "--tokenizer", "smollm2-135m", "--from", *sources, "--out", out,
                     "--quiet"]) == 2
        assert message in capsys.readouterr().err
