"""`specula run-batch`: OpenAI batch files run offline through the server's own path (vLLM's
`run-batch`).

Each input line is one request, as OpenAI's Batch API writes them:

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Every request is checked as the server checks it (`protocol.parse_request`), then decoded by one
`Worker` (continuous batching: up to `max_batch_size` sequences at once, each the output it would
get alone), and answered as the server answers it. Each output line, in input order:

    {"id": "batch_req_...", "custom_id": "r1", "response": {"status_code": 200, "request_id":
     "...", "body": {...}}, "error": null}

A request that fails (a bad line, a bad body, a prompt past the context) gets its error's status
and body in `response` and `{"code", "message"}` in `error`; the others are answered. The output
file is written whole at the end (atomically).
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from specula.errors import ConfigError
from specula.jsonl import json_lines
from specula.paths import atomic_path
from specula.serve import protocol
from specula.serve.choices import CollectedResponse
from specula.serve.metrics import ServerMetrics
from specula.serve.protocol import APIError, ResponseIds
from specula.serve.worker import Job, Started, Worker
from specula.token_bytes import TokenBytes

ENDPOINTS: dict[str, protocol.Endpoint] = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
"""The URLs a batch line may name, and the endpoint each is."""

UNKNOWN_MODEL = ("The model '{model}' does not exist; this batch is answered as '{served}' (--served-model-name, "
                 "by default the --target value): name '{served}' in the request (or leave model out), or run "
                 "with --served-model-name '{model}'")
"""The error of a request naming another model than the one the batch is answered as (`protocol.UNKNOWN_MODEL`
words it for a server's client): who reads it ran the command, so it names the flag that sets the name."""


@dataclass(frozen=True)
class BatchSummary:
    """What a run did."""

    requests: int
    """Lines read."""
    succeeded: int
    """Requests answered with status 200."""
    failed: int
    """Requests answered with an error."""
    first_error: str = ""
    """The first failed request's error message ("" when none failed)."""


BatchRow = tuple[int, Any, "tuple[protocol.Endpoint, dict] | APIError"]
"""(line number, custom_id, (endpoint, body) or the line's error)."""


def read_batch(path: str | Path) -> list[BatchRow]:
    """The rows of a batch file, one for each non-blank line: read whole before a model loads, so that an
    unreadable file fails at once rather than after the load."""
    return list(_rows(Path(path)))


def _rows(path: Path) -> Iterator[BatchRow]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Notepad, PowerShell 5) is not JSON
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the batch file {path}: {exc}") from None
    for number, line in enumerate(json_lines(text), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            yield number, None, APIError(400, f"line {number} is not JSON ({exc})", code="invalid_json")
            continue
        if not isinstance(row, dict):
            yield number, None, APIError(400, f"line {number} is not a JSON object", code="invalid_json")
            continue
        custom_id = row.get("custom_id")
        url, body = row.get("url"), row.get("body")
        if url not in ENDPOINTS:
            yield number, custom_id, APIError(400, f"line {number}: url {url!r} is not one of "
                                                   f"{', '.join(ENDPOINTS)}", param="url", code="invalid_value")
        elif row.get("method", "POST") != "POST":
            yield number, custom_id, APIError(400, f"line {number}: method must be POST", param="method",
                                              code="invalid_value")
        elif not isinstance(body, dict):
            yield number, custom_id, APIError(400, f"line {number}: body must be a JSON object", param="body",
                                              code="invalid_value")
        else:
            yield number, custom_id, (ENDPOINTS[url], body)


def run_batch(spec, rows: Sequence[BatchRow], output_path: str | Path, model_name: str, *, max_batch_size: int = 8,
              chat_max_tokens: int = 512, progress: bool = False, tool_parser: str | None = None) -> BatchSummary:
    """Answer every request of `rows` (`read_batch`) into `output_path` (see the module docstring);
    `tool_parser` parses tool_choice auto's output, as the server's `--enable-auto-tool-choice
    --tool-call-parser` (None: auto with tools is refused)."""
    from tqdm import tqdm

    tokenizer = copy.deepcopy(spec.tokenizer)  # this thread's own: the worker's is the worker thread's
    token_bytes = TokenBytes(tokenizer)
    worker = Worker(spec, ServerMetrics(), chat_max_tokens=chat_max_tokens, max_queue=len(rows) + 1,
                    max_batch_size=max_batch_size)
    try:
        jobs: list[Job | APIError] = []
        for _, _, item in rows:  # everything is queued first: the worker batches across requests
            if isinstance(item, APIError):
                jobs.append(item)
                continue
            try:
                jobs.append(worker.submit(protocol.parse_request(item[0], item[1], model_name, UNKNOWN_MODEL,
                                                                 tool_parser=tool_parser)))
            except APIError as exc:
                jobs.append(exc)
        lines, succeeded, first_error = [], 0, ""
        for (_, custom_id, _), job in tqdm(list(zip(rows, jobs)), disable=not progress, unit="request",
                                           desc="run-batch"):
            status, body = _answer(job, tokenizer, token_bytes)
            succeeded += status == 200
            first_error = first_error or ("" if status == 200 else body["error"]["message"])
            lines.append(protocol.json_text(_output_line(custom_id, status, body)) + "\n")
    finally:
        worker.close()
    with atomic_path(output_path) as tmp:
        tmp.write_text("".join(lines), encoding="utf-8")
    return BatchSummary(len(rows), succeeded, len(rows) - succeeded, first_error)


def _answer(job: Job | APIError, tokenizer, token_bytes: TokenBytes) -> tuple[int, dict[str, Any]]:
    """(status, response body) of one request, once the worker has finished it."""
    if isinstance(job, APIError):
        return job.status, job.body()
    response: CollectedResponse | None = None
    while response is None or not response.done:
        event = job.events.get()
        if isinstance(event, APIError):
            return event.status, event.body()
        if isinstance(event, Started):
            response = CollectedResponse(job.request, event, tokenizer, token_bytes)
        else:
            response.add(event)
    return 200, response.body(ResponseIds.new(job.request))


def _output_line(custom_id: Any, status: int, body: dict[str, Any]) -> dict[str, Any]:
    error = None if status == 200 else {"code": body["error"].get("code"), "message": body["error"]["message"]}
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id,
            "response": {"status_code": status, "request_id": uuid.uuid4().hex, "body": body}, "error": error}
