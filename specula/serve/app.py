"""The HTTP server: OpenAI-compatible routes on the standard library's threading HTTP server.

    server = create_server(spec, ServerConfig(model_name="smollm2-135m", port=8000))
    server.serve_forever()          # or server.start() for a background thread; server.close()

Each connection gets a thread (HTTP/1.1 keep-alive); generations go through the one
`Worker`. Streaming answers are server-sent events over chunked transfer encoding, ending
with `data: [DONE]`. While a request waits for its tokens, its thread watches the socket:
a client that hangs up cancels its generation (queued or running).
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import select
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from specula.api import Specula
from specula.engine import StreamChunk
from specula.errors import ConfigError
from specula.serve import protocol
from specula.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from specula.serve.metrics import ServerMetrics
from specula.serve.protocol import APIError, GenerationRequest, ResponseIds
from specula.serve.worker import Job, Started, Worker

log = logging.getLogger("specula.serve")
access_log = logging.getLogger("specula.serve.access")

CLIENT_GONE = 499
"""Status recorded in metrics for a request whose client hung up (nginx's convention)."""


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens and what it accepts."""

    model_name: str
    """The model id clients must send (and /v1/models lists)."""
    host: str = "127.0.0.1"
    """Address to bind: loopback unless told otherwise."""
    port: int = 8000
    """TCP port (0 = any free port; see `SpeculaServer.port`)."""
    api_key: str | None = None
    """When set, /v1/* requests need `Authorization: Bearer <api_key>` (/health and /metrics do not)."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted (413 above)."""
    chat_max_tokens: int = 512
    """Chat requests without max_tokens generate up to this many tokens (or the remaining context)."""
    max_queue: int = 256
    """Most generation requests waiting for the model (503 above)."""
    max_batch_size: int = 8
    """Most requests decoded at once (continuous batching: one packed target pass per step on
    backends that batch); 1 = one request at a time."""
    poll_seconds: float = 0.05
    """How often a waiting request checks that its client is still connected."""
    socket_timeout: float = 120.0
    """Seconds a connection may stay silent while a request is being read (and idle keep-alive)."""

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ConfigError("the served model needs a name")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_batch_size < 1:
            raise ConfigError(f"--max-batch-size must be at least 1, got {self.max_batch_size}")
        if self.max_queue < 1:
            raise ConfigError(f"--max-queue must be at least 1, got {self.max_queue}")
        if self.chat_max_tokens < 1:
            raise ConfigError(f"--chat-max-tokens must be positive, got {self.chat_max_tokens}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key is empty; give a key or leave the option out")


class _ClientGone(Exception):
    """The client closed its connection."""


def _client_gone(sock: socket.socket) -> bool:
    """True when the peer closed the connection (readable with nothing to read, or reset)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class SpeculaServer(ThreadingHTTPServer):
    """The threading HTTP server plus the worker, metrics and config the handlers share."""

    daemon_threads = True

    def __init__(self, spec: Specula, config: ServerConfig) -> None:
        self.spec = spec
        self.config = config
        self.metrics = ServerMetrics()
        self.created = protocol.now()
        self.worker = Worker(spec, self.metrics, chat_max_tokens=config.chat_max_tokens,
                             max_queue=config.max_queue, max_batch_size=config.max_batch_size)
        if ":" in config.host:
            self.address_family = socket.AF_INET6
        self._thread: threading.Thread | None = None
        try:
            super().__init__((config.host, config.port), _Handler)
        except OSError as exc:
            self.worker.close()
            raise ConfigError(f"cannot listen on {config.host}:{config.port} ({exc.strerror}); "
                              "choose another --port or --host") from exc

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        host = self.config.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def start(self) -> "SpeculaServer":
        """Serve from a background thread (tests, notebooks); `close()` stops it."""
        self._thread = threading.Thread(target=self.serve_forever, name="specula-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
        self.server_close()
        self.worker.close()


def create_server(spec: Specula, config: ServerConfig) -> SpeculaServer:
    """An OpenAI-compatible server for a loaded `Specula` (bound, not yet serving)."""
    return SpeculaServer(spec, config)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "specula"
    server: SpeculaServer

    # ------------------------------------------------------------------ plumbing
    def setup(self) -> None:
        self.timeout = self.server.config.socket_timeout
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (BaseHTTPRequestHandler's name)
        access_log.info("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def handle_expect_100(self) -> bool:
        """Refuse an oversized body before the client sends it."""
        self._begin()
        try:
            self._check_length()
        except APIError as exc:
            self.close_connection = True
            self._send_error(exc)
            return False
        return super().handle_expect_100()

    def _path(self) -> str:
        path = self.path.split("?", 1)[0]
        return path.rstrip("/") or "/"

    def _route(self, path: str) -> tuple[str, Callable[[], None]] | None:
        """(allowed method, handler) of a path, or None."""
        if path.startswith("/v1/models/"):
            return "GET", self._model
        return {
            "/v1/completions": ("POST", lambda: self._generate("completions")),
            "/v1/chat/completions": ("POST", lambda: self._generate("chat")),
            "/v1/models": ("GET", self._models),
            "/health": ("GET", self._health),
            "/metrics": ("GET", self._metrics),
        }.get(path)

    def _begin(self) -> None:
        """Per-request state (a connection's handler serves many requests)."""
        self._status, self._label, self._recorded, self._t0 = 0, _route_label(self._path()), False, None

    def _dispatch(self, method: str) -> None:
        path = self._path()
        self._begin()
        try:
            route = self._route(path)
            if route is None:
                raise APIError(404, f"Unknown route {method} {path}; routes: POST /v1/completions, "
                                    "POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics",
                               code="unknown_url")
            allowed, handler = route
            if method != allowed:
                raise APIError(405, f"{method} is not allowed on {path}; use {allowed}", code="method_not_allowed")
            if path.startswith("/v1/"):
                self._authorize()
            handler()
        except APIError as exc:
            self._send_error(exc)
        except _ClientGone:
            self.close_connection = True
            self._status = CLIENT_GONE
        except (BrokenPipeError, ConnectionResetError):  # a write failed: the client is gone
            self.close_connection = True
            self._status = CLIENT_GONE
        except Exception as exc:  # a bug must cost one request, never the connection thread's silence
            log.exception("request %s %s failed", method, path)
            self.close_connection = True
            if not self._status:  # nothing sent yet: answer with OpenAI's error object
                self._send_error(APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                                          type="server_error", code="internal_error"))
        finally:
            if self._status:
                self._record(self._status)

    def _record(self, status: int) -> None:
        """Count the request once, before its last bytes go out (a client that reads the answer
        and then scrapes /metrics sees it counted)."""
        if self._recorded:
            return
        self._recorded, self._status = True, status
        self.server.metrics.record_request(self._label, status)
        if self._t0 is not None:
            self.server.metrics.request_seconds.observe_many([time.perf_counter() - self._t0])

    def _authorize(self) -> None:
        key = self.server.config.api_key
        if key is None:
            return
        header = self.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if not header:
            raise APIError(401, "You didn't provide an API key; send it as 'Authorization: Bearer <key>'",
                           code="missing_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")

    # ------------------------------------------------------------------ responses
    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self._record(status)
        self.wfile.write(body)

    def _send_json(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json", headers)

    def _send_error(self, exc: APIError) -> None:
        headers = {}
        if exc.status == 405:
            route = self._route(self._path())
            headers["Allow"] = route[0] if route else "GET"
        if exc.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        self._send_json(exc.status, exc.body(), headers)

    # ------------------------------------------------------------------ simple routes
    def _health(self) -> None:
        worker = self.server.worker
        self._send_json(200, {"status": "ok", "model": self.server.config.model_name,
                              "method": self.server.spec.method,
                              "queue_depth": int(self.server.metrics.queue_depth.value()),
                              "max_context": worker.max_context})

    def _metrics(self) -> None:
        self._send(200, self.server.metrics.render().encode(), METRICS_CONTENT_TYPE)

    def _models(self) -> None:
        self._send_json(200, protocol.models_body(self.server.config.model_name, self.server.created))

    def _model(self) -> None:
        name = self.path.split("?", 1)[0][len("/v1/models/"):]
        listed = protocol.models_body(self.server.config.model_name, self.server.created)["data"][0]
        if name != listed["id"]:
            raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        self._send_json(200, listed)

    # ------------------------------------------------------------------ generation
    def _check_length(self) -> int:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise APIError(411, "chunked request bodies are not supported; send Content-Length",
                           code="length_required")
        raw = self.headers.get("Content-Length")
        if raw is None:
            return 0
        try:
            length = int(raw)
        except ValueError:
            length = -1
        if length < 0:
            raise APIError(400, f"invalid Content-Length {raw!r}", code="invalid_request")
        limit = self.server.config.max_body_bytes
        if length > limit:
            raise APIError(413, f"the request body has {length} bytes; this server accepts at most {limit} "
                                "(--max-body-bytes)", code="request_too_large")
        return length

    def _read_json(self) -> dict[str, Any]:
        try:
            length = self._check_length()
        except APIError:
            self.close_connection = True  # the body is left unread
            raise
        return protocol.parse_json_body(self.rfile.read(length) if length else b"")

    def _next_event(self, job: Job):
        """The job's next event; raises the job's APIError, or _ClientGone (cancelling the job)."""
        poll = self.server.config.poll_seconds
        while True:
            try:
                event = job.events.get(timeout=poll)
            except queue.Empty:
                event = None
            now = time.perf_counter()
            if event is None or now - self._checked >= poll:  # look at the socket every `poll` seconds
                self._checked = now
                if _client_gone(self.connection):
                    job.cancel()
                    raise _ClientGone()
            if event is None:
                continue
            if isinstance(event, APIError):
                raise event
            return event

    def _generate(self, endpoint: protocol.Endpoint) -> None:
        body = self._read_json()
        request = protocol.parse_request(endpoint, body, self.server.config.model_name)
        job = self.server.worker.submit(request)
        self._t0 = self._checked = time.perf_counter()
        try:
            started = self._next_event(job)
            assert isinstance(started, Started)
            if request.stream:
                self._stream(job, request, started)
            else:
                self._complete(job, request, started)
        except (_ClientGone, BrokenPipeError, ConnectionResetError):
            job.cancel()
            raise

    def _complete(self, job: Job, request: GenerationRequest, started: Started) -> None:
        parts: list[str] = []
        while True:
            chunk: StreamChunk = self._next_event(job)
            parts.append(chunk.text)
            if chunk.finished:
                break
        stats = chunk.stats
        finish = stats.finish_reason or "length"
        self._send_json(200, protocol.completion_body(ResponseIds.new(request), "".join(parts), finish,
                                                      started.prompt_tokens, stats.new_tokens, stats))

    def _stream(self, job: Job, request: GenerationRequest, started: Started) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._status = 200
        ids = ResponseIds.new(request)
        if request.endpoint == "chat":
            self._event(protocol.chunk_body(ids, "", first=True))
        try:
            while True:
                chunk: StreamChunk = self._next_event(job)
                if chunk.text:  # stop strings are already cut by the engine
                    self._event(protocol.chunk_body(ids, chunk.text))
                if chunk.finished:
                    break
        except APIError as exc:  # failed after the headers went out: OpenAI's in-stream error event
            self._status = exc.status
            try:
                self._event(exc.body())
                self._end_stream()
            except (BrokenPipeError, ConnectionResetError):  # the client stopped reading at the error
                self.close_connection = True
            return
        stats = chunk.stats
        finish = stats.finish_reason or "length"
        self._event(protocol.chunk_body(ids, None, finish, stats=stats))
        if request.include_usage:
            self._event(protocol.usage_chunk_body(ids, started.prompt_tokens, stats.new_tokens, stats))
        self._end_stream()

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _event(self, payload: dict[str, Any]) -> None:
        self._write_chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _end_stream(self) -> None:
        self._record(self._status)
        self._write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _route_label(path: str) -> str:
    """The `endpoint` label of a path (unknown paths share one label)."""
    if path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"):
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"
