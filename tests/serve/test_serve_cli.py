"""`specula serve --target DIR` end to end: a tiny model saved to disk, the CLI in a subprocess
on a free port, called with the openai client; plus the CLI's one-line errors (in process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import openai
import pytest
import torch

from serve_helpers import EOS, chat_ids, text_ids
from tiny import output_text, reference_greedy, tiny_model


@pytest.fixture(scope="module")
def llama():
    # Llama: transformers maps its tokenizer to the saved tokenizer.json (Qwen2 would force its BPE class).
    return tiny_model("llama", seed=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, llama, tokenizer):
    path = tmp_path_factory.mktemp("tiny-chat-model")
    llama.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _reference(model, tokenizer, ids, max_tokens: int) -> str:
    with torch.inference_mode():
        return output_text(tokenizer, ids, reference_greedy(model, list(ids), max_tokens, eos=EOS))


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _wait_refused(port: int, timeout: float = 30.0) -> None:
    """Wait until the server at `port` refuses new connections (it stopped accepting)."""
    import http.client

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=5).request("GET", "/health")
        except OSError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server on port {port} still accepts connections after {timeout:g} s")


def _wait_listening(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The server's URL from its 'listening on' line (it binds before printing)."""
    end = time.monotonic() + timeout
    seen = []
    while time.monotonic() < end:
        line = proc.stderr.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            return match.group(1)
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(seen))


def test_cli_serves_a_model_directory(model_dir, llama, tokenizer):
    cmd = [sys.executable, "-m", "specula.cli", "serve", "--target", str(model_dir), "--method", "prompt-lookup",
           "--port", "0", "--api-key", "k3y", "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_env())
    try:
        url = _wait_listening(proc)
        assert url.startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "w10 w11 w12 w10 w11"}]
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                     temperature=0, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == _reference(llama, tokenizer, chat_ids(tokenizer, messages), 12)
        assert chunks[-1].speculative_decoding["method"] == "prompt-lookup"
        out = client.completions.create(model="tiny", prompt="w05 w06 w07", max_tokens=10, temperature=0)
        assert out.choices[0].text == _reference(llama, tokenizer, text_ids(tokenizer, "w05 w06 w07"), 10)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="bad", max_retries=0).models.list()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("args,message", [
    (["--port", "70000"], "--port 70000 is not a TCP port: it must be in 0..65535"),
    (["--max-body-bytes", "10"], "--max-body-bytes must be at least 1024"),
    (["--method", "nope"], "unknown method 'nope'"),
    (["--api-key", ""], "--api-key is empty"),
    (["--request-timeout", "-1"], "--request-timeout must be >= 0 seconds (0: no limit)"),  # 0 is taken
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
    (["--chunked-prefill-size", "-1"], "--chunked-prefill-size must be >= 0 tokens (0: prefill whole prompts)"),
    (["--request-timeout", "nan"], "--request-timeout must be >= 0 seconds"),  # nan: requests never timed out
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be >= 0"),
    (["--allowed-origins", "*"], "--allowed-origins takes a JSON list of strings"),
    (["--allowed-headers", '["x", 3]'], "--allowed-headers takes a JSON list of strings"),
])
def test_cli_bad_arguments_fail_in_one_line(model_dir, capsys, args, message):
    from specula.cli import main

    assert main(["serve", "--target", str(model_dir), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("fields, message", [
    ({"port": 70000}, "port=70000 is not a TCP port: it must be in 0..65535"),
    ({"max_body_bytes": 10}, "max_body_bytes must be at least 1024, got 10"),
    ({"max_batch_size": 0}, "max_batch_size must be at least 1, got 0"),
    ({"max_queue": 0}, "max_queue must be at least 1, got 0"),
    ({"chat_max_tokens": 0}, "chat_max_tokens must be positive, got 0"),
    ({"api_key": ""}, "api_key is empty; give a key or leave the option out"),
    ({"request_timeout": -1}, "request_timeout must be >= 0 seconds (0: no limit), got -1"),
    ({"shutdown_timeout": -1}, "shutdown_timeout must be >= 0 seconds, got -1"),
    ({"chunked_prefill_size": -4}, "chunked_prefill_size must be >= 0 tokens (0: prefill whole prompts), got -4"),
    ({"tool_call_parser": "granite"},
     "tool_call_parser 'granite' is not one this server has; choose hermes, llama3_json, llama4_pythonic, mistral, "
     "pythonic"),
    ({"enable_auto_tool_choice": True}, "enable_auto_tool_choice needs tool_call_parser, one of hermes, llama3_json, "
                                        "llama4_pythonic, mistral, pythonic: the format the model writes its tool "
                                        'calls in (e.g. tool_call_parser="hermes")'),
])
def test_a_server_config_error_names_its_field(fields, message):
    """ServerConfig (specula.serve's Python API) named `specula serve`'s flags (--max-queue) to a Python caller, who had
    written max_queue=0; it names its fields now, and the command shows the flags (test_cli_bad_arguments_...)."""
    from specula.errors import ConfigError
    from specula.serve import ServerConfig

    with pytest.raises(ConfigError) as caught:
        ServerConfig(model_name="m", **fields)
    assert str(caught.value) == message


def test_a_port_in_use_names_the_fields_in_python_and_the_flags_on_the_command_line(model_dir, capsys):
    """create_server on a port another socket holds said "choose another --port or --host" to a Python caller."""
    import socket

    from specula.cli import main
    from specula.errors import ConfigError
    from specula.serve import ServerConfig, create_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=r"^cannot listen on 127\.0\.0\.1:\d+ \(.*\); choose another port= or "
                                              r"host=$"):
            create_server(None, ServerConfig(model_name="m", port=port))  # it binds before it reads the model
        assert main(["serve", "--target", str(model_dir), "--method", "none", "--port", str(port)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: cannot listen on ") and last.endswith("; choose another --port or --host"), last


def test_a_request_timeout_of_0_means_no_limit_on_the_command_line_and_in_the_config():
    """`--request-timeout 0` (its help: "0 = none") was taken while the message for -1 said "must be
    positive", and ServerConfig(request_timeout=0) refused what the command line takes."""
    from specula.serve import ServerConfig

    assert ServerConfig(model_name="m", request_timeout=0).request_timeout is None
    assert ServerConfig(model_name="m", request_timeout=0.0).request_timeout is None
    assert ServerConfig(model_name="m", request_timeout=2.5).request_timeout == 2.5


SLOW_SERVER = """
import sys
sys.path[:0] = {paths!r}
from serve_helpers import MODEL, TestDrafter, make_spec, make_tokenizer
from tiny import tiny_model
from specula.serve import ServerConfig, create_server
spec = make_spec(tiny_model("qwen2", seed=3), make_tokenizer(), "none")
spec.decoder.drafters = [TestDrafter(d, delay=0.02) for d in spec.decoder.drafters]
spec.decoder.eos_token_ids = frozenset()
server = create_server(spec, ServerConfig(model_name=MODEL, port=0, shutdown_timeout={deadline}))
print("listening on " + server.url, file=sys.stderr, flush=True)
server.serve_forever()
print("exited cleanly", file=sys.stderr, flush=True)
"""


def _slow_server_process(deadline: float) -> tuple[subprocess.Popen, str]:
    here = os.path.dirname(os.path.abspath(__file__))
    code = SLOW_SERVER.format(paths=[here, os.path.dirname(here)], deadline=deadline)
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=_env())
    return proc, _wait_listening(proc)


@pytest.mark.parametrize("deadline,finishes", [(30.0, True), (0.5, False)])
def test_sigterm_shuts_down_gracefully(deadline, finishes):
    """SIGTERM with a streamed generation in flight (about 2 s left): the server stops accepting at
    once, the stream finishes within the deadline (or is cut at it), and the process exits 0."""
    import http.client
    import json
    import signal

    proc, url = _slow_server_process(deadline)
    try:
        port = int(url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny-qwen2", "prompt": "w60 w61", "max_tokens": 100,
                                                            "temperature": 0, "stream": True,
                                                            "stream_options": {"include_usage": True}}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline()  # generating
        proc.send_signal(signal.SIGTERM)
        _wait_refused(port)  # no longer accepting, while the stream goes on
        try:
            body = resp.read().decode()
        except http.client.IncompleteRead as exc:  # cut at the deadline
            body = exc.partial.decode()
        events = [line for line in body.splitlines() if line.startswith("data: {")]
        assert body.endswith("data: [DONE]\n\n") == finishes
        if finishes:  # every token arrived
            assert json.loads(events[-1][len("data: "):])["usage"]["completion_tokens"] == 100
        assert proc.wait(timeout=deadline + 60) == 0  # exits once the stream is done or cut at the deadline
        assert "exited cleanly" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_run_batch_answers_a_file_from_the_command_line(model_dir, llama, tokenizer, tmp_path, monkeypatch, capsys):
    import json

    from specula.cli import main

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    messages = [{"role": "user", "content": "w05 w06"}]
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "1", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"messages": messages, "max_tokens": 6, "temperature": 0}}) + "\n")
    code = main(["run-batch", "--target", str(model_dir), "-i", str(source), "-o", str(tmp_path / "out.jsonl"),
                 "--method", "prompt-lookup", "--no-progress"])
    assert code == 0 and "1 requests, 1 answered, 0 failed (method prompt-lookup)" in capsys.readouterr().err
    (answer,) = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    content = answer["response"]["body"]["choices"][0]["message"]["content"]
    assert content == _reference(llama, tokenizer, chat_ids(tokenizer, messages), 6)
