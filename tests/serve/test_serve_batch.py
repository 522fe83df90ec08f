"""`specula run-batch`: an OpenAI batch file answered offline through the server's own checks and
responses: every answer equals offline decoding, in input order, and bad lines get their error."""

from __future__ import annotations

import json

import pytest

from serve_helpers import MODEL, chat_ids, make_spec, text_ids

from specula.cli import main
from specula.serve.batch import read_batch, run_batch


def line(custom_id, url, body, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


@pytest.fixture(scope="module")
def spec(target_model, tokenizer):
    return make_spec(target_model, tokenizer, "prompt-lookup")


def test_a_batch_file_is_answered_in_order_as_the_server_answers(spec, tokenizer, reference, tmp_path):
    messages = [{"role": "user", "content": "w05 w06 w07"}]
    rows = [
        line("chat", "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}),
        line("text", "/v1/completions", {"prompt": "w10 w11 w12", "max_tokens": 6, "temperature": 0, "logprobs": 1}),
        "",
        line("two", "/v1/completions", {"prompt": ["w40 w41", "w20 w21"], "max_tokens": 4, "temperature": 0}),
        "{not json",
        line("url", "/v1/embeddings", {"input": "w05"}),
        line("get", "/v1/completions", {"prompt": "w05"}, method="GET"),
        line("long", "/v1/completions", {"prompt": "w05", "max_tokens": 100_000}),
        line("model", "/v1/completions", {"model": "gpt-4", "prompt": "w05"}),
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(rows) + "\n")
    summary = run_batch(spec, read_batch(source), tmp_path / "out.jsonl", MODEL, max_batch_size=3)
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert (summary.requests, summary.succeeded, summary.failed) == (8, 3, 5)
    assert [o["custom_id"] for o in out] == ["chat", "text", "two", None, "url", "get", "long", "model"]
    assert [o["response"]["status_code"] for o in out] == [200, 200, 200, 400, 400, 400, 400, 404]
    assert all(o["id"].startswith("batch_req_") and (o["error"] is None) == (o["response"]["status_code"] == 200)
               for o in out)
    chat, text, two = (o["response"]["body"] for o in out[:3])
    assert chat["choices"][0]["message"]["content"] == reference(chat_ids(tokenizer, messages), 8)
    assert text["choices"][0]["text"] == reference(text_ids(tokenizer, "w10 w11 w12"), 6)
    assert len(text["choices"][0]["logprobs"]["token_logprobs"]) == text["usage"]["completion_tokens"]
    assert [c["text"] for c in two["choices"]] == [reference(text_ids(tokenizer, p), 4) for p in ("w40 w41", "w20 w21")]
    assert out[6]["error"]["code"] == "context_length_exceeded" and out[7]["error"]["code"] == "model_not_found"
    # the served name and the flag that sets it (it said "this server serves ... (see GET /v1/models)")
    assert out[7]["error"]["message"] == (f"The model 'gpt-4' does not exist; this batch is answered as '{MODEL}' "
                                          "(--served-model-name, by default the --target value): name "
                                          f"'{MODEL}' in the request (or leave model out), or run with "
                                          "--served-model-name 'gpt-4'")


def test_a_custom_id_holding_a_lone_surrogate_is_written_back(spec, tmp_path):
    """A line's custom_id with an unpaired escape is echoed as that escape: writing the output raised
    UnicodeEncodeError once every request was answered, and the whole batch was lost."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [line("a\ud83d", "/v1/completions", {"prompt": "w05", "max_tokens": 2, "temperature": 0}),
            line("b\udc00", "/v1/completions", {"model": "gpt-\udc00", "prompt": "w05"})]
    source.write_text("\n".join(rows) + "\n")
    summary = run_batch(spec, read_batch(source), out, MODEL)
    assert (summary.succeeded, summary.failed) == (1, 1)
    written = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert [o["custom_id"] for o in written] == ["a\ud83d", "b\udc00"]
    assert written[1]["error"]["message"].startswith("The model 'gpt-\udc00' does not exist")


def test_the_command_refuses_a_missing_file_in_one_line(tmp_path, capsys):
    code = main(["run-batch", "--target", "smollm2-135m", "-i", str(tmp_path / "none.jsonl"), "-o",
                 str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.jsonl").exists()
    code = main(["run-batch", "--target", "smollm2-135m", "-i", str(tmp_path), "-o", str(tmp_path / "out.jsonl")])
    assert code == 2 and "is a directory" in capsys.readouterr().err


def test_a_batch_file_with_a_byte_order_mark_reads_its_first_request(tmp_path):
    """Notepad and PowerShell 5 write UTF-8 with a BOM: line 1 was answered 400, not JSON."""
    from specula.serve.batch import read_batch

    path = tmp_path / "in.jsonl"
    line = '{"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "w5", "max_tokens": 2}}'
    path.write_bytes(b"\xef\xbb\xbf" + line.encode() + b"\n")
    assert read_batch(path) == [(1, "r1", ("completions", {"prompt": "w5", "max_tokens": 2}))]


def test_a_request_holding_a_line_separator_reads_whole(tmp_path):
    """JSON holds U+2028 / U+2029 / U+0085 raw (json.dumps(ensure_ascii=False), pasted text): the
    file was split there too and the request refused as not JSON."""
    from specula.serve.batch import read_batch

    path = tmp_path / "batch.jsonl"
    body = {"prompt": "a\u2028b\u2029c\u0085d", "max_tokens": 2}
    row = {"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": body}
    path.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_batch(path) == [(1, "r1", ("completions", body))]


def test_an_unreadable_file_is_refused_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import specula.commands.run_batch as command

    def no_load(args):
        raise AssertionError("the model was loaded before the batch file was read")

    monkeypatch.setattr(command, "load_spec", no_load)
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\xff\xfe not utf-8\n")
    code = main(["run-batch", "--target", "smollm2-135m", "-i", str(source), "-o", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot read the batch file" in err and len(err.strip().splitlines()) == 1


def test_the_command_exits_1_when_every_request_failed_and_0_when_one_went_through(spec, tmp_path, capsys,
                                                                                   monkeypatch):
    import specula.commands.run_batch as command

    monkeypatch.setattr(command, "load_spec", lambda args: (spec, "prompt-lookup"))
    good = line("ok", "/v1/completions", {"prompt": "w05 w06", "max_tokens": 2, "temperature": 0})
    bad = line("bad", "/v1/completions", {"model": "gpt-4", "prompt": "w05"})
    for rows, code in (([bad, bad], 1), ([bad, good], 0)):
        source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        source.write_text("\n".join(rows) + "\n")
        assert main(["run-batch", "--target", MODEL, "-i", str(source), "-o", str(out), "--no-progress"]) == code
        err = capsys.readouterr().err
        assert len(out.read_text().splitlines()) == 2  # the errors are written either way
        assert ("every request failed; the first: " in err and "gpt-4" in err) == (code == 1)
        assert ("--served-model-name 'gpt-4'" in err) == (code == 1)
