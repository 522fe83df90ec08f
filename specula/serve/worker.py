"""One worker thread owns the model: requests queue up and run one at a time.

The model, its KV cache and the tokenizer are touched by this thread only (the engine
resets the target's cache on every generation, so requests never share state). An HTTP
thread submits a `Job` and reads its `events` queue:

    Started(prompt_tokens)  ->  StreamChunk ... StreamChunk(finished=True, stats)
    or an APIError at any point (bad prompt, context exceeded, internal error).

Setting `job.cancelled` (the client went away) stops the generation at its next step;
a job cancelled while queued never starts.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from specula.api import Specula
from specula.engine import StreamChunk
from specula.errors import SpeculaError
from specula.models.loading import encode_prompt
from specula.sampling import SamplingParams
from specula.serve.metrics import ServerMetrics
from specula.serve.protocol import APIError, GenerationRequest

log = logging.getLogger("specula.serve")


@dataclass(frozen=True)
class Started:
    """The prompt was accepted; generation begins."""

    prompt_tokens: int
    """Tokens of the (templated) prompt."""
    max_tokens: int
    """The generation limit in force (the request's, or the default)."""


Event = Started | StreamChunk | APIError


@dataclass
class Job:
    """One request's trip through the worker."""

    request: GenerationRequest
    events: "queue.Queue[Event]" = field(default_factory=queue.Queue)
    """Filled by the worker, read by the HTTP thread."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    """Set by the HTTP thread when the client is gone."""
    generated_tokens: int = 0
    """Tokens generated so far (for metrics and tests)."""

    def cancel(self) -> None:
        self.cancelled.set()


class Worker:
    """The single thread that runs generations for every client."""

    def __init__(self, spec: Specula, metrics: ServerMetrics, *, chat_max_tokens: int = 512,
                 max_queue: int = 256) -> None:
        self.spec = spec
        self.metrics = metrics
        self.chat_max_tokens = chat_max_tokens
        self._queue: "queue.Queue[Job | None]" = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._loop, name="specula-worker", daemon=True)
        self._closed = False
        self._thread.start()

    @property
    def max_context(self) -> int:
        return self.spec.target.max_context

    def submit(self, request: GenerationRequest) -> Job:
        """Queue a request (503 when the queue is full or the server is stopping)."""
        if self._closed:
            raise APIError(503, "the server is shutting down; retry on another server", type="server_error",
                           code="server_shutting_down")
        job = Job(request)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise APIError(503, f"the server has {self._queue.maxsize} requests waiting; retry later",
                           type="server_error", code="server_overloaded") from None
        self.metrics.queue_depth.add(1)
        return job

    def close(self, timeout: float = 10.0) -> None:
        """Finish the current job, drop the queued ones, stop the thread."""
        self._closed = True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self.metrics.queue_depth.add(-1)
                job.events.put(APIError(503, "the server is shutting down", type="server_error",
                                        code="server_shutting_down"))
        self._queue.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.metrics.queue_depth.add(-1)
            if job.cancelled.is_set():
                continue
            self.metrics.in_progress.set(1)
            try:
                self._run(job)
            except APIError as exc:
                job.events.put(exc)
            except SpeculaError as exc:
                job.events.put(APIError(400, str(exc), code="invalid_value"))
            except Exception as exc:  # one request's failure must not stop the worker
                log.exception("generation failed")
                job.events.put(APIError(500, f"internal error while generating: {type(exc).__name__}: {exc}",
                                        type="server_error", code="internal_error"))
            finally:
                self.metrics.in_progress.set(0)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        """Token ids: chat messages through the chat template, completion text as is."""
        param = "messages" if request.endpoint == "chat" else "prompt"
        source = list(request.messages) if request.messages is not None else request.prompt
        try:
            ids = encode_prompt(self.spec.tokenizer, source, raw=request.messages is None)
        except SpeculaError as exc:
            raise APIError(400, str(exc), param=param, code="invalid_value") from exc
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization: give some text", param=param,
                           code="invalid_value")
        vocab = self.spec.target.vocab_size
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the model's vocabulary of {vocab}",
                           param="prompt", code="invalid_value")
        return ids

    def _limit(self, request: GenerationRequest, prompt_tokens: int) -> int:
        """max_new_tokens for this request, or a 400 when it cannot fit the context window."""
        room = self.max_context - prompt_tokens
        param = "messages" if request.endpoint == "chat" else "prompt"
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {self.max_context} tokens, and the "
                                f"prompt has {prompt_tokens} tokens; shorten the prompt",
                           param=param, code="context_length_exceeded")
        if request.max_tokens is None:
            return min(room, self.chat_max_tokens)
        if request.max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {self.max_context} tokens. However, you "
                                f"requested {prompt_tokens + request.max_tokens} tokens ({prompt_tokens} in the "
                                f"prompt, {request.max_tokens} in the completion); reduce max_tokens to at most "
                                f"{room} or shorten the prompt", param="max_tokens", code="context_length_exceeded")
        return request.max_tokens

    def _run(self, job: Job) -> None:
        request = job.request
        ids = self._prompt_ids(request)
        max_tokens = self._limit(request, len(ids))
        params = SamplingParams(max_new_tokens=max_tokens, **request.sampling())
        self.metrics.prompt_tokens.inc(len(ids))
        job.events.put(Started(len(ids), max_tokens))
        t0 = time.perf_counter()
        with contextlib.closing(self.spec.decoder.stream(ids, params)) as stream:
            for chunk in stream:
                job.generated_tokens += len(chunk.token_ids)
                self.metrics.generated_tokens.inc(len(chunk.token_ids))
                if chunk.finished:
                    self.metrics.record_generation(chunk.stats)
                job.events.put(chunk)
                if job.cancelled.is_set():
                    log.info("client gone: generation stopped after %d tokens (%.2fs)",
                             job.generated_tokens, time.perf_counter() - t0)
                    return
