"""The HTTP server: OpenAI-compatible routes on FastAPI, served by uvicorn (as vLLM and SGLang do).

    server = create_server(spec, ServerConfig(model_name="smollm2-135m", port=8000))
    server.serve_forever()          # SIGTERM / Ctrl-C: graceful shutdown, then returns
    server.start(); ...; server.close()   # or in a background thread (tests, notebooks)

Generations go through the one `Worker` thread (continuous batching); an HTTP handler submits a
`Job` and awaits its events, woken from the worker thread. Streaming answers are server-sent
events ending with `data: [DONE]`. A client that hangs up cancels its generation (queued or
running), and only its own. Graceful shutdown: stop accepting, let in-flight requests finish
within `shutdown_timeout` seconds, cancel what is left, stop the worker, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import json
import logging
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from specula.api import Specula
from specula.errors import ConfigError, SpeculaError
from specula.prompts import encode_prompt
from specula.serve import protocol
from specula.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from specula.serve.metrics import ServerMetrics
from specula.serve.protocol import APIError, GenerationRequest, ResponseIds
from specula.serve.choices import ChoiceState, CollectedResponse, cached_prompt_tokens, summed
from specula.serve.tools import auto_tool_parser
from specula.serve.worker import ChoiceChunk, Job, Started, Worker, check_chunked_prefill
from specula.token_bytes import TokenBytes

log = logging.getLogger("specula.serve")

CLIENT_GONE = 499
"""Status recorded in metrics for a request whose client hung up (nginx's convention)."""

ROUTES = {
    "/v1/completions": "POST",
    "/v1/chat/completions": "POST",
    "/v1/models": "GET",
    "/v1/models/{model:path}": "GET",
    "/tokenize": "POST",
    "/detokenize": "POST",
    "/health": "GET",
    "/metrics": "GET",
}
"""Every route and its method (also the `endpoint` label of the request counter)."""


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
    """When set, /v1/*, /tokenize and /detokenize requests need `Authorization: Bearer <api_key>` (/health and
    /metrics do not)."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted (413 above)."""
    chat_max_tokens: int = 512
    """Chat requests without max_tokens generate up to this many tokens (or the remaining context)."""
    max_queue: int = 256
    """Most generation requests waiting for the model (503 with Retry-After above)."""
    max_batch_size: int = 8
    """Most requests decoded at once (continuous batching: one packed target pass per step on
    backends that batch); 1 = one request at a time."""
    chunked_prefill_size: int | None = None
    """Prompt tokens prefilled between two decode steps while other requests decode (chunked prefill, as
    SGLang's `--chunked-prefill-size`): a long prompt no longer stops every running stream for its whole
    prefill. None: `worker.DEFAULT_CHUNKED_PREFILL_SIZE` where the target computes every row alone (greedy
    guarantee "bitwise": outputs unchanged), else 0; 0: prompts prefill whole."""
    request_timeout: float | None = 600.0
    """Seconds a generation request may take from arrival to its last token, queueing included
    (504 after that; None or 0 = no limit, as `serve --request-timeout 0`)."""
    shutdown_timeout: float = 30.0
    """On SIGTERM / Ctrl-C: seconds in-flight requests get to finish before they are cancelled (inf: no
    limit, until a second signal forces the exit)."""
    poll_seconds: float = 0.05
    """How often a waiting non-streamed request checks that its client is still connected."""
    keep_alive_seconds: float = 5.0
    """Seconds an idle keep-alive connection stays open."""
    retry_after_seconds: int = 1
    """`Retry-After` of a 503 answered because the queue is full or the server is stopping."""
    allowed_origins: tuple[str, ...] = ("*",)
    """Origins a browser page may call the API from (CORS, vLLM's `--allowed-origins`; "*" = any, as
    vLLM and llama.cpp's server answer; () = no CORS headers, so browsers refuse other origins)."""
    allowed_methods: tuple[str, ...] = ("*",)
    """HTTP methods a cross-origin request may use (vLLM's `--allowed-methods`)."""
    allowed_headers: tuple[str, ...] = ("*",)
    """Request headers a cross-origin request may send (vLLM's `--allowed-headers`; Authorization is
    among "*" for a page that sends the API key)."""
    allow_credentials: bool = False
    """Whether cross-origin requests may carry cookies or HTTP authentication (vLLM's
    `--allow-credentials`)."""
    enable_auto_tool_choice: bool = False
    """tool_choice "auto" (the default when a request gives tools): the output is parsed for tool calls with
    `tool_call_parser` (vLLM's `--enable-auto-tool-choice`); off, such a request is a 400, as in vLLM."""
    tool_call_parser: str | None = None
    """The format tool_choice auto's output is parsed in (vLLM's `--tool-call-parser`): "hermes", "llama3_json",
    "llama4_pythonic", "mistral" or "pythonic"."""

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ConfigError("the served model needs a name")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} is not a TCP port: it must be in 0..65535")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be at least 1, got {self.max_batch_size}")
        check_chunked_prefill(self.chunked_prefill_size)
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be at least 1, got {self.max_queue}")
        if self.chat_max_tokens < 1:
            raise ConfigError(f"chat_max_tokens must be positive, got {self.chat_max_tokens}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key is empty; give a key or leave the option out")
        if self.request_timeout is not None and not self.request_timeout >= 0:  # nan: never timed out
            raise ConfigError(f"request_timeout must be >= 0 seconds (0: no limit), got {self.request_timeout}")
        if self.request_timeout == 0:
            object.__setattr__(self, "request_timeout", None)
        if not self.shutdown_timeout >= 0:
            raise ConfigError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        # checked here (a bad --tool-call-parser is refused at start-up) and kept: every request reads it
        object.__setattr__(self, "_auto_tool_parser", auto_tool_parser(self.enable_auto_tool_choice,
                                                                        self.tool_call_parser))
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
                raise ConfigError(f"{name} must be a list of non-empty strings, e.g. ('*',) or "
                                  f"('http://localhost:3000',), got {value!r}")

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser of tool_choice auto's output (None: auto is not enabled), derived once at start-up."""
        return self._auto_tool_parser


class _ClientGone(Exception):
    """The client closed its connection."""


class _Uvicorn(uvicorn.Server):
    """uvicorn's server with signals handled by specula (graceful shutdown, exit status 0)."""

    @contextlib.contextmanager
    def capture_signals(self):  # uvicorn would re-raise SIGTERM after shutdown (exit 143)
        yield


class SpeculaServer:
    """The FastAPI app, the uvicorn server on a bound socket, the worker, metrics and config."""

    def __init__(self, spec: Specula, config: ServerConfig) -> None:
        self.spec = spec
        self.config = config
        self.metrics = ServerMetrics()
        self.created = protocol.now()
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((config.host, config.port))
            self._socket.listen(2048)  # connections wait in the backlog until uvicorn runs
        except OSError as exc:
            self._socket.close()
            raise ConfigError(f"cannot listen on {config.host}:{config.port} ({exc.strerror}); "
                              "choose another port= or host=") from exc
        self._http_tokenizer = None
        self._token_bytes: TokenBytes | None = None
        self.worker = Worker(spec, self.metrics, chat_max_tokens=config.chat_max_tokens, max_queue=config.max_queue,
                             max_batch_size=config.max_batch_size, request_timeout=config.request_timeout,
                             chunked_prefill_size=config.chunked_prefill_size)
        self.app = build_app(self)
        self._uvicorn = _Uvicorn(uvicorn.Config(
            self.app, log_config=None, access_log=False, lifespan="off", http="h11",
            timeout_keep_alive=int(max(1, config.keep_alive_seconds)),
            timeout_graceful_shutdown=config.shutdown_timeout))
        self._thread: threading.Thread | None = None

    @property
    def http_tokenizer(self):
        """The HTTP thread's own copy of the tokenizer (/tokenize, /detokenize, echoed prompts,
        logprobs' tokens), made on first use: the worker's is touched by the worker thread only."""
        if self._http_tokenizer is None:
            self._http_tokenizer = copy.deepcopy(self.spec.tokenizer)
        return self._http_tokenizer

    @property
    def token_bytes(self) -> TokenBytes:
        """Each token's bytes and text, for the responses' logprobs (on the HTTP thread's tokenizer)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.http_tokenizer)
        return self._token_bytes

    @property
    def port(self) -> int:
        return self._socket.getsockname()[1]

    @property
    def url(self) -> str:
        host = self.config.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def serve_forever(self) -> None:
        """Serve in this (main) thread until SIGTERM or SIGINT, then shut down gracefully: stop
        accepting, give in-flight requests `shutdown_timeout` seconds, cancel the rest, stop the
        worker. A second signal forces the exit."""
        def on_signal(signum, frame) -> None:
            if self._uvicorn.should_exit:
                self._uvicorn.force_exit = True
            log.info("%s: shutting down (in-flight requests get %gs)", signal.Signals(signum).name,
                     self.config.shutdown_timeout)
            self.worker.stop_accepting()
            self._uvicorn.should_exit = True

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._uvicorn.run(sockets=[self._socket])
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._release()

    def start(self) -> "SpeculaServer":
        """Serve from a background thread (tests, notebooks); `close()` stops it."""
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._socket]},
                                        name="specula-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        """Graceful shutdown of a background server (as on SIGTERM)."""
        self.worker.stop_accepting()
        if self._thread is not None:
            self._uvicorn.should_exit = True
            self._thread.join()
            self._thread = None
        self._release()

    def _release(self) -> None:
        self.worker.close()
        self._socket.close()


def create_server(spec: Specula, config: ServerConfig) -> SpeculaServer:
    """An OpenAI-compatible server for a loaded `Specula` (bound, not yet serving)."""
    return SpeculaServer(spec, config)


# --------------------------------------------------------------------------- the app


class UTF8JSONResponse(JSONResponse):
    """Starlette's JSON response, written by `protocol.json_text`: a lone surrogate that a request gave
    (a model name, a tool's name), echoed, goes out as its escape, where Starlette's UTF-8 encoding raised
    (a bare 500 with no error object, even for the 404 naming that model)."""

    def render(self, content: Any) -> bytes:
        return protocol.json_text(content, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _route_label(request: Request) -> str:
    """The `endpoint` label of a request (unknown paths share one label)."""
    route = request.scope.get("route")
    path = getattr(route, "path", None)
    return path if path in ROUTES else "other"


def _error_response(exc: APIError, request: Request) -> JSONResponse:
    headers: dict[str, str] = {}
    if exc.status == 405:
        headers["Allow"] = ROUTES.get(_route_label(request), "GET")
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if exc.status == 503:
        headers["Retry-After"] = str(request.app.state.server.config.retry_after_seconds)
    return UTF8JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _record(request: Request, status: int) -> None:
    request.app.state.server.metrics.record_request(_route_label(request), status)


def build_app(server: SpeculaServer) -> FastAPI:
    """The FastAPI application of a server (routes, errors as OpenAI error objects)."""
    app = FastAPI(title="specula", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    config = server.config
    if config.allowed_origins:  # browsers' preflight OPTIONS answered, Access-Control-* on every reply
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                           allow_credentials=config.allow_credentials)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = request.url.path.rstrip("/") or "/"
        if exc.status_code == 405:
            error = APIError(405, f"{request.method} is not allowed on {path}; use {ROUTES[_route_label(request)]}",
                             code="method_not_allowed")
        elif exc.status_code == 404:
            error = APIError(404, f"Unknown route {request.method} {path}; routes: POST /v1/completions, "
                                  "POST /v1/chat/completions, GET /v1/models, POST /tokenize, POST /detokenize, "
                                  "GET /health, GET /metrics",
                             code="unknown_url")
        else:
            error = APIError(exc.status_code, str(exc.detail), code="invalid_request")
        _record(request, error.status)
        return _error_response(error, request)

    def guarded(handler: Callable[[Request], Awaitable[Response]], authorize: bool) -> Callable:
        """A route: API key, errors as OpenAI error objects, every request counted once."""
        async def route(request: Request) -> Response:
            try:
                if authorize:
                    _authorize(server.config.api_key, request)
                response = await handler(request)
            except APIError as exc:
                response = _error_response(exc, request)
            except _ClientGone:
                _record(request, CLIENT_GONE)
                return Response(status_code=CLIENT_GONE)  # nobody reads it
            except Exception as exc:  # a bug must cost one request, never the server
                log.exception("request %s %s failed", request.method, request.url.path)
                response = _error_response(APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                                                    type="server_error", code="internal_error"), request)
            if not isinstance(response, StreamingResponse):  # a stream counts itself at its end
                _record(request, response.status_code)
            return response
        return route

    async def health(request: Request) -> Response:
        return UTF8JSONResponse({"status": "ok", "model": server.config.model_name, "method": server.spec.method,
                             "queue_depth": int(server.worker.queue_depth), "max_context": server.worker.max_context,
                             "max_batch_size": server.config.max_batch_size})

    async def metrics(request: Request) -> Response:
        return Response(server.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def models(request: Request) -> Response:
        return UTF8JSONResponse(protocol.models_body(server.config.model_name, server.created))

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        listed = protocol.models_body(server.config.model_name, server.created)["data"][0]
        if name != listed["id"]:
            raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return UTF8JSONResponse(listed)

    async def tokenize(request: Request) -> Response:
        body = await _read_json(request, server.config.max_body_bytes)
        source, raw = protocol.parse_tokenize(body, server.config.model_name)
        tools = protocol.parse_tokenize_tools(body)
        options = protocol.parse_tokenize_template(body)
        try:
            ids = encode_prompt(server.http_tokenizer, source, raw=raw, tools=tools, **options)
        except SpeculaError as exc:
            raise protocol.prompt_error(exc, "prompt" if raw else "messages") from exc
        return UTF8JSONResponse({"count": len(ids), "max_model_len": server.worker.max_context, "tokens": ids,
                             "token_strs": None})

    async def detokenize(request: Request) -> Response:
        ids = protocol.parse_detokenize(await _read_json(request, server.config.max_body_bytes),
                                        server.config.model_name, server.spec.target.vocab_size)
        return UTF8JSONResponse({"prompt": server.http_tokenizer.decode(ids, skip_special_tokens=False)})

    def generation(endpoint: protocol.Endpoint) -> Callable[[Request], Awaitable[Response]]:
        async def generate(request: Request) -> Response:
            return await _generate(server, request, endpoint)
        return generate

    handlers = {
        "/v1/completions": generation("completions"),
        "/v1/chat/completions": generation("chat"),
        "/v1/models": models,
        "/v1/models/{model:path}": model,
        "/tokenize": tokenize,
        "/detokenize": detokenize,
        "/health": health,
        "/metrics": metrics,
    }
    for path, method in ROUTES.items():
        app.add_api_route(path, guarded(handlers[path], authorize=path.startswith(("/v1/", "/tokenize", "/detokenize"))),
                          methods=[method],
                          include_in_schema=False)
    return app


def _authorize(key: str | None, request: Request) -> None:
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if not header:
        raise APIError(401, "You didn't provide an API key; send it as 'Authorization: Bearer <key>'",
                       code="missing_api_key")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "Incorrect API key provided", code="invalid_api_key")


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 above `limit`: refused before the body is read when its
    Content-Length says so (a client sending `Expect: 100-continue` never sends it), else (a chunked
    body, as vLLM takes them) as soon as what has arrived passes the limit."""
    raw = request.headers.get("content-length")
    if raw is not None:
        try:
            length = int(raw)
        except ValueError:
            length = -1
        if length < 0:
            raise APIError(400, f"invalid Content-Length {raw!r}", code="invalid_request")
        if length > limit:
            raise APIError(413, f"the request body has {length} bytes; this server accepts at most {limit} "
                                "(--max-body-bytes)", code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"the request body has more than {limit} bytes; this server accepts at most {limit} "
                                "(--max-body-bytes)", code="request_too_large")
    return protocol.parse_json_body(bytes(body))


class _Wakeup:
    """Wakes an asyncio task from the worker thread (the job's `notify`)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.flag = asyncio.Event()

    def notify(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone (server stopped): nobody waits
            self.loop.call_soon_threadsafe(self.flag.set)

    async def next_event(self, job: Job, request: Request | None, poll: float):
        """The job's next event; raises the job's APIError, or _ClientGone (cancelling the job) when
        `request`'s client is gone (checked every `poll` seconds)."""
        while True:
            try:
                event = job.events.get_nowait()
            except queue.Empty:
                if request is not None and await request.is_disconnected():
                    job.cancel()
                    raise _ClientGone() from None
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.flag.wait(), poll)
                self.flag.clear()
                continue
            if isinstance(event, APIError):
                raise event
            return event


async def _generate(server: SpeculaServer, request: Request, endpoint: protocol.Endpoint) -> Response:
    body = await _read_json(request, server.config.max_body_bytes)
    gen = protocol.parse_request(endpoint, body, server.config.model_name, tool_parser=server.config.auto_tool_parser)
    ids = ResponseIds.new(gen)  # `created`: when the request came, as vLLM stamps it
    wake = _Wakeup()
    job = server.worker.submit(gen, notify=wake.notify)
    t0 = time.perf_counter()
    poll = server.config.poll_seconds
    try:
        started = await wake.next_event(job, request, poll)
        assert isinstance(started, Started)
        if not gen.stream:
            response = CollectedResponse(gen, started, *_readers(server, gen))
            while not response.done:
                response.add(await wake.next_event(job, request, poll))
            server.metrics.request_seconds.observe(time.perf_counter() - t0)
            return UTF8JSONResponse(response.body(ids))
    except BaseException:  # an error, the client gone, or the task cancelled (shutdown)
        job.cancel()
        raise
    return StreamingResponse(_stream(server, request, job, gen, ids, started, wake, t0), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _readers(server: SpeculaServer, gen: GenerationRequest) -> tuple[Any, TokenBytes | None]:
    """The tokenizer (for an echoed prompt of token ids) and token bytes (for logprobs) a response
    reads, on the HTTP thread's copy; None where the request needs none (no copy made)."""
    return (server.http_tokenizer if gen.echoes_prompt else None,
            server.token_bytes if gen.logprobs is not None else None)


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return b"data: " + data.encode() + b"\n\n"


async def _stream(server: SpeculaServer, request: Request, job: Job, gen: GenerationRequest, ids: ResponseIds,
                  started: Started, wake: _Wakeup, t0: float) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed generation, choice by choice as their steps come.
    Starlette cancels this generator when the client disconnects; the `finally` then cancels the
    job. Counted in metrics before `[DONE]`."""
    status: int | None = None  # set once counted
    readers = _readers(server, gen)
    choices = [ChoiceState(gen, started, i, *readers) for i in range(started.choices)]
    try:
        if gen.endpoint == "chat":
            for c in choices:
                yield _sse(protocol.chunk_body(ids, "", index=c.index, first=True, role=gen.role))
            if gen.chat_echo:  # vLLM's echo: the last message's content, one chunk a choice, before the output
                for c in choices:
                    yield _sse(protocol.chunk_body(ids, gen.chat_echo, index=c.index))
        try:
            while not all(c.done for c in choices):
                event: ChoiceChunk = await wake.next_event(job, None, server.config.poll_seconds)
                choice = choices[event.index]
                for text, calls, lp in choice.deltas(event.chunk):
                    yield _sse(protocol.chunk_body(ids, text, index=choice.index, logprobs=lp, tool_calls=calls))
                if choice.done:
                    yield _sse(protocol.chunk_body(ids, None, choice.finish_reason, index=choice.index,
                                                   stats=choice.stats))
        except APIError as exc:  # failed after the headers went out: OpenAI's in-stream error event
            status = exc.status
            _record(request, status)
            yield _sse(exc.body())
        else:
            if gen.include_usage:
                each = [c.stats for c in choices]
                stats = summed(each)
                yield _sse(protocol.usage_chunk_body(ids, started.prompt_tokens, stats.new_tokens, stats,
                                                     cached_prompt_tokens(each, len(started.prompts))))
            status = 200
            server.metrics.request_seconds.observe(time.perf_counter() - t0)
            _record(request, status)
        yield _sse("[DONE]")
    finally:
        job.cancel()  # no-op for a finished job; stops a running one whose client left
        if status is None:
            _record(request, CLIENT_GONE)
