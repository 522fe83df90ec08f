"""One worker thread owns the model and decodes up to `max_batch_size` sequences at once.

Continuous batching: every loop admits waiting sequences while the batch has room (prefilling
each), then advances every running one by one decode step in one call,
`Specula.step(sessions)`, which verifies all their trees in one packed target pass
where the backend batches (the native backend does); a sequence that finishes, fails or is
cancelled leaves the batch at once and frees its cache. A request is one or more choices: its
prompts (completions take a list) times `n`, each its own session (KV cache, drafter and planner
state, generator; choice j of a prompt samples with seed + j, as vLLM seeds them), so each output
is what it would get alone. The model and the tokenizer are touched by this thread only. An HTTP
thread submits a `Job` and reads its `events` queue:

    Started(prompt_tokens, prompts, choices)  ->  ChoiceChunk(index, StreamChunk) ... until every
    choice's chunk with finished=True;  or an APIError at any point (bad prompt, context
    exceeded, internal error: the whole request fails).

Setting `job.cancelled` (the client went away) stops every choice at its next step; a job
cancelled while queued never starts; a job past its deadline (`request_timeout`) gets a 504 and
leaves the batch. `max_batch_size=1` is the one-at-a-time server.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from specula.api import Session, Specula, StreamChunk
from specula.ema import Ema
from specula.constraints import ConstraintError
from specula.errors import ConfigError, SpeculaError
from specula.models.base import output_room
from specula.prompts import encode_prompt
from specula.sampling import SamplingParams
from specula.serve.metrics import ServerMetrics
from specula.serve.protocol import APIError, GenerationRequest, choice_seed, prompt_error
from specula.serve.tool_calls import special_tags

log = logging.getLogger("specula.serve")

DEFAULT_CHUNKED_PREFILL_SIZE = 128
"""`chunked_prefill_size` where none is given and chunks change nothing (the target's greedy guarantee is "bitwise":
specula's CPU kernels compute every row alone). On the 2-core test machine a 128-token chunk of Qwen2.5-Coder-1.5B
takes about 0.9 s and of SmolLM2-135M about 0.1 s, where a whole 800-token prompt took 5.5-6.5 s and 0.6 s, about 4-6
of the batch's steps (README, "Chunked prefill")."""


def check_chunked_prefill(size: int | None) -> None:
    """A ConfigError for a `chunked_prefill_size` below 0."""
    if size is not None and size < 0:
        raise ConfigError(f"chunked_prefill_size must be >= 0 tokens (0: prefill whole prompts), got {size}")


def resolve_chunked_prefill(size: int | None, target) -> int:
    """The prompt tokens a server prefills between two decode steps (0: whole prompts): `size`, or where None
    `DEFAULT_CHUNKED_PREFILL_SIZE` on a target whose rows are computed alone (its output cannot change), else 0."""
    check_chunked_prefill(size)
    if size is None:
        return DEFAULT_CHUNKED_PREFILL_SIZE if target.greedy_guarantee == "bitwise" else 0
    return size


@dataclass(frozen=True)
class Started:
    """The request's prompts were accepted and its first choice prefilled; generation begins."""

    prompt_tokens: int
    """Tokens of the (templated) prompts, each counted once."""
    prompts: tuple[tuple[int, ...], ...]
    """Each prompt's token ids (choice i decodes prompt i // n)."""
    choices: int
    """How many choices the response has: prompts times n."""


@dataclass(frozen=True)
class ChoiceChunk:
    """One decode step of one choice. The choice's first chunk carries its prompt's logprobs when
    the request asked (`StreamChunk.prompt_logprobs`)."""

    index: int
    chunk: StreamChunk


Event = Started | ChoiceChunk | APIError


@dataclass
class Job:
    """One request's trip through the worker."""

    request: GenerationRequest
    events: "queue.Queue[Event]" = field(default_factory=queue.Queue)
    """Filled by the worker, read by the HTTP thread."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    """Set by the HTTP thread when the client is gone."""
    generated_tokens: int = 0
    """Tokens generated so far, all choices (for metrics and tests)."""
    t_submit: float = field(default_factory=time.perf_counter)
    """When the request reached the worker's queue."""
    deadline: float | None = None
    """perf_counter time after which the request is answered 504 (None: no limit)."""
    t_first_token: float | None = None
    """When the request's first tokens went out (None before)."""
    prompts: tuple[tuple[int, ...], ...] = ()
    """Its prompts' token ids, once accepted."""
    notify: Callable[[], None] | None = None
    """Called (from the worker thread) after each event: wakes an asyncio reader."""
    failed: bool = False
    """An error was sent: the request's other choices stop and nothing more is sent."""
    started: bool = False
    """`Started` was sent."""

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, event: Event) -> None:
        self.events.put(event)
        if self.notify is not None:
            self.notify()

    @property
    def dropped(self) -> bool:
        """Nothing more is wanted: cancelled by the client, or failed."""
        return self.failed or self.cancelled.is_set()


@dataclass
class _Choice:
    """One choice of an admitted request, waiting for a place in the batch."""

    job: Job
    index: int
    prompt: tuple[int, ...]
    params: SamplingParams
    echo_only: bool = False
    """max_tokens 0 with echo (OpenAI's and vLLM's): the prompt alone, its logprobs from the prefill."""


@dataclass
class _Running:
    """A choice in the batch and its engine session."""

    choice: _Choice
    session: Session
    t0: float
    t_last_token: float | None = None
    """When its latest tokens went out."""

    @property
    def job(self) -> Job:
        return self.choice.job


class Worker:
    """The single thread that runs generations for every client, batched."""

    def __init__(self, spec: Specula, metrics: ServerMetrics, *, chat_max_tokens: int = 512,
                 max_queue: int = 256, max_batch_size: int = 8, request_timeout: float | None = None,
                 chunked_prefill_size: int | None = 0) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.spec = spec
        self.metrics = metrics
        self.chat_max_tokens = chat_max_tokens
        self.max_batch_size = max_batch_size
        self.request_timeout = request_timeout
        self.chunked_prefill_size = resolve_chunked_prefill(chunked_prefill_size, spec.target)
        """Prompt tokens prefilled between two decode steps while other requests decode (0: whole prompts)."""
        self._prefilling: _Running | None = None  # the choice whose prompt is part-way through its prefill
        self._budget: int | None = None  # prompt tokens this round may still run (None: any; a new round)
        self._goodput = Ema(0.2)  # the batch's tokens per step-second
        self._tool_tags: dict[str, tuple[int, ...]] = {}  # `special_tags` of the tokenizer by parser, once needed
        if max_batch_size > 1:
            log.info("timing packed passes of up to %d sequences (cached after the first run)", max_batch_size)
            spec.prepare_batch(max_batch_size)  # the goodput plan's cost table, before the first batch
        self._queue: "queue.Queue[Job | None]" = queue.Queue(maxsize=max_queue)
        metrics.queue_depth.set_function(lambda: self.queue_depth)
        self._thread = threading.Thread(target=self._loop, name="specula-worker", daemon=True)
        self._closed = False
        self._thread.start()

    @property
    def max_context(self) -> int:
        return self.spec.target.max_context

    def submit(self, request: GenerationRequest, notify: Callable[[], None] | None = None) -> Job:
        """Queue a request (503 when the queue is full or the server is stopping)."""
        if self._closed:
            raise APIError(503, "the server is shutting down; retry on another server", type="server_error",
                           code="server_shutting_down")
        job = Job(request, notify=notify)
        if self.request_timeout is not None:
            job.deadline = job.t_submit + self.request_timeout
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._drop_cancelled()  # clients that hung up while queued hold no place
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise APIError(503, f"the server has {self._queue.maxsize} requests waiting; retry later",
                               type="server_error", code="server_overloaded") from None
        return job

    def _drop_cancelled(self) -> None:
        """Remove queued jobs whose clients hung up (the worker would discard each when it reached it)."""
        with self._queue.mutex:
            live = [job for job in self._queue.queue if job is None or not job.cancelled.is_set()]
            self._queue.queue.clear()
            self._queue.queue.extend(live)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for the model whose clients are still there (the stop sentinel of
        `close` aside)."""
        with self._queue.mutex:
            return sum(job is not None and not job.cancelled.is_set() for job in self._queue.queue)

    def stop_accepting(self) -> None:
        """New requests get 503 from now on; queued and running ones go on (graceful shutdown)."""
        self._closed = True

    def close(self, timeout: float = 10.0) -> None:
        """Finish the current job, drop the queued ones, stop the thread."""
        self._closed = True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.put(APIError(503, "the server is shutting down", type="server_error",
                                 code="server_shutting_down"))
        self._queue.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        batch: list[_Running] = []
        waiting: "collections.deque[_Choice]" = collections.deque()  # choices of admitted requests
        stopping = False
        while batch or waiting or self._prefilling or not stopping:
            self._admit(batch, waiting)
            if not stopping and self._room(batch) and not waiting and self._prefilling is None:
                # take queued requests while there is room; wait for one only when nothing runs
                try:
                    job = self._queue.get() if not batch else self._queue.get_nowait()
                except queue.Empty:
                    job = False
                if job is None:
                    stopping = True
                elif job:
                    self._accept(job, waiting)
                    continue
            if batch:
                batch = self._step(batch)
            self._budget = None  # a new round of prefill
            self.metrics.in_progress.set(len({id(r.job) for r in batch + [self._prefilling] if r is not None}))
        self.metrics.in_progress.set(0)

    def _step(self, batch: list[_Running]) -> list[_Running]:
        """One decode step of the batch: each choice's chunk sent; the choices still running."""
        self.metrics.batch_size.observe(len(batch))
        t0 = time.perf_counter()
        try:
            chunks = self.spec.step([r.session for r in batch])
        except Exception as exc:  # a failed pass fails the requests in it, never the worker
            log.exception("decode step failed")
            for r in batch:
                self._fail(r.job, exc)
                self._free(r.session)
            return []
        self._observe_goodput(sum(len(c.token_ids) for c in chunks), time.perf_counter() - t0)
        batch = [r for r, chunk in zip(batch, chunks) if not self._deliver(r, chunk)]
        return [r for r in batch if not self._drop(r)]  # another choice of its request failed

    def _accept(self, job: Job, waiting: "collections.deque[_Choice]") -> None:
        """A request off the queue: its prompts checked and its choices queued for the batch (or
        its error sent)."""
        if job.cancelled.is_set():
            return
        if self._expired(job):
            self._fail(job, self._timeout_error())
            return
        try:
            waiting.extend(self._choices(job))
        except Exception as exc:  # one request's failure must not stop the worker
            self._fail(job, exc)

    def _room(self, batch: list[_Running]) -> bool:
        """Whether another choice fits beside the batch and the choice prefilling."""
        return len(batch) + (self._prefilling is not None) < self.max_batch_size

    def _admit(self, batch: list[_Running], waiting: "collections.deque[_Choice]") -> None:
        """Prefill waiting choices into the batch while it has room. With chunked prefill, while other choices
        decode, the prompts run between two of their steps at most `chunked_prefill_size` tokens in all (the
        prompt part-way through first): a prompt that does not fit waits in `_prefilling` for the next round (one
        at a time, so that the choices after it, a request's `n` among them, can copy its prompt from the prefix
        cache)."""
        if self._budget is None:  # a new round: the batch has stepped
            self._budget = self.chunked_prefill_size if batch and self.chunked_prefill_size else None
        if self._prefilling is not None and self._budget != 0:
            self._prefill_chunk(batch)
        while waiting and self._prefilling is None and self._room(batch) and self._budget != 0:
            choice = waiting.popleft()
            job = choice.job
            if self._gone(job):
                continue
            try:
                session = self.spec.start(choice.prompt, params=choice.params, constraint=job.request.constraint,
                                          max_prefill_tokens=self._budget)
            except Exception as exc:
                self._fail(job, exc)
                continue
            self._spend(len(session.seq.tokens) - session.stats.cached_tokens)
            running = _Running(choice, session, time.perf_counter())
            if session.prefilled:
                self._join(running, batch)
            else:
                self._prefilling = running

    def _spend(self, tokens: int) -> None:
        """Count prompt tokens run against this round's budget."""
        if self._budget is not None:
            self._budget = max(0, self._budget - tokens)

    def _prefill_chunk(self, batch: list[_Running]) -> None:
        """The next chunk of the prompt prefilling (all the rest where the round has no budget: no other choice
        decodes); once prefilled, its choice joins the batch."""
        running, self._prefilling = self._prefilling, None
        job = running.job
        if self._gone(job):
            self._free(running.session)
            return
        before = len(running.session.seq.tokens)
        try:
            done = self.spec.prefill(running.session, self._budget)
        except Exception as exc:  # the session is freed
            self._fail(job, exc)
            return
        self._spend(len(running.session.seq.tokens) - before)
        if done:
            self._join(running, batch)
        else:
            self._prefilling = running

    def _join(self, running: _Running, batch: list[_Running]) -> None:
        """A prefilled choice joins the batch (the request's first sends `Started`), or ends at once where it has
        nothing to decode (echo only)."""
        choice, job = running.choice, running.job
        if not job.started:
            job.started = True
            job.put(Started(sum(len(p) for p in job.prompts), job.prompts, len(job.prompts) * job.request.n))
        if choice.echo_only:  # nothing to decode: it ends at its prefill
            self._deliver(running, StreamChunk([], "", True, replace(running.session.stats, finish_reason="length"),
                                               logprobs=None if choice.params.logprobs is None else [],
                                               prompt_logprobs=running.session.prompt_logprobs))
        else:
            batch.append(running)

    def _free(self, session) -> None:
        """`spec.finish(session)`: an error there (a drafter's clean-up: a state file, online
        distillation) is logged; it must not stop the worker (every request after would hang)."""
        try:
            self.spec.finish(session)
        except Exception:
            log.exception("freeing a finished session failed")

    def _gone(self, job: Job) -> bool:
        """Whether a job waiting for its prefill is no longer to be worked on: dropped, or past its deadline (then
        answered 504)."""
        if job.dropped:
            return True
        if self._expired(job):
            self._fail(job, self._timeout_error())
            return True
        return False

    def _expired(self, job: Job) -> bool:
        return job.deadline is not None and time.perf_counter() > job.deadline

    def _timeout_error(self) -> APIError:
        return APIError(504, f"the request did not finish within the server's --request-timeout of "
                             f"{self.request_timeout:g} s; ask for fewer tokens or retry when the server is less busy",
                        type="server_error", code="timeout")

    def _observe_goodput(self, tokens: int, seconds: float) -> None:
        self.metrics.goodput.set(self._goodput.update(tokens / max(seconds, 1e-9)))

    def _fail(self, job: Job, exc: Exception) -> None:
        """Send the request's error (once: its other choices stop)."""
        if job.failed:
            return
        job.failed = True
        if isinstance(exc, APIError):
            job.put(exc)
        elif isinstance(exc, ConstraintError):  # found against the tokenizer (at the start or on the way):
            # the field the constraint came from is the one to fix
            job.put(APIError(400, str(exc), param=job.request.constraint_param, code="invalid_value"))
        elif isinstance(exc, SpeculaError):
            job.put(APIError(400, str(exc), code="invalid_value"))
        else:
            log.error("generation failed: %s: %s", type(exc).__name__, exc)
            job.put(APIError(500, f"internal error while generating: {type(exc).__name__}: {exc}",
                             type="server_error", code="internal_error"))

    def _choices(self, job: Job) -> list[_Choice]:
        """Tokenize the request's prompts and check the limits: one choice per prompt and n, in
        OpenAI's order (prompt by prompt; choice j of a prompt seeded with seed + j)."""
        request = job.request
        prompts = [self._prompt_ids(request, prompt) for prompt in request.prompt_sources()]
        limits = [self._limit(request, len(ids)) for ids in prompts]
        job.prompts = tuple(tuple(ids) for ids in prompts)
        base = SamplingParams(max_new_tokens=1, **request.sampling(), kept_special_tokens=self._kept_special(request))
        problem = base.vocabulary_problem(self.spec.target.vocab_size)
        if problem:
            raise APIError(400, problem[1], param=problem[0], code="invalid_value")
        short = [limit for limit in limits if limit < request.min_tokens]
        if short:  # max_tokens is checked against min_tokens with the request; the context's room here
            raise APIError(400, f"min_tokens ({request.min_tokens}) asks for more tokens than fit: at most {short[0]} "
                                f"new tokens fit this prompt in the context window ({self.max_context} tokens) or "
                                f"the default {request.max_tokens_param}; lower min_tokens or shorten the prompt",
                           param="min_tokens", code="invalid_value")
        seed = base.seed
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))  # a request refused above counts none
        return [_Choice(job, i * request.n + j, job.prompts[i],
                        replace(base, max_new_tokens=max(1, limit), min_new_tokens=request.min_tokens,
                                seed=None if seed is None else choice_seed(seed, j)), echo_only=limit == 0)
                for i, limit in enumerate(limits) for j in range(request.n)]

    def _kept_special(self, request: GenerationRequest) -> tuple[int, ...]:
        """The special tokens the output's text keeps: the tool call parser's tags (hermes's, mistral's) where
        the tokenizer makes them special and tool_choice auto parses the output (as vLLM's parsers keep
        special tokens)."""
        tool_use = request.tool_use
        if tool_use is None or tool_use.choice != "auto" or self.spec.tokenizer is None:
            return ()
        if tool_use.parser not in self._tool_tags:
            self._tool_tags[tool_use.parser] = special_tags(self.spec.tokenizer, tool_use.parser)
        return self._tool_tags[tool_use.parser]

    def _drop(self, running: _Running) -> bool:
        """Free a running choice whose request is no longer wanted; True when dropped."""
        if not running.job.dropped:
            return False
        self._free(running.session)
        return True

    def _deliver(self, running: _Running, chunk: StreamChunk) -> bool:
        """Send one step's chunk of a choice; True when the choice leaves the batch (finished,
        failed or no longer wanted)."""
        job = running.job
        if job.dropped:
            self._free(running.session)
            return True
        if chunk.error is not None:
            self._free(running.session)
            self._fail(job, chunk.error)
            return True
        n = len(chunk.token_ids)
        job.generated_tokens += n
        self.metrics.generated_tokens.inc(n)
        if n:
            now = time.perf_counter()
            if job.t_first_token is None:
                job.t_first_token = now
                self.metrics.time_to_first_token.observe(now - job.t_submit)
            if running.t_last_token is not None:
                self.metrics.inter_token_latency.observe((now - running.t_last_token) / n)
            running.t_last_token = now
        if chunk.finished:
            self._free(running.session)
            self.metrics.record_generation(chunk.stats)
        job.put(ChoiceChunk(running.choice.index, chunk))
        if chunk.finished:
            return True
        if job.cancelled.is_set():
            self._free(running.session)
            if running.choice.index == 0:
                log.info("client gone: generation stopped after %d tokens (%.2fs)",
                         job.generated_tokens, time.perf_counter() - running.t0)
            return True
        if self._expired(job):
            self._free(running.session)
            self._fail(job, self._timeout_error())
            return True
        return False

    def _prompt_ids(self, request: GenerationRequest, source) -> list[int]:
        """Token ids: chat messages through the chat template, completion text (or ids) as is."""
        param = "messages" if request.endpoint == "chat" else "prompt"
        try:
            ids = encode_prompt(self.spec.tokenizer, source, raw=request.messages is None, tools=request.tools,
                                **request.template_options())
        except SpeculaError as exc:
            raise prompt_error(exc, param) from exc
        vocab = self.spec.target.vocab_size
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the model's vocabulary of {vocab}",
                           param="prompt", code="invalid_value")
        return ids

    def _limit(self, request: GenerationRequest, prompt_tokens: int) -> int:
        """max_new_tokens for this request, or a 400 when it cannot fit the context window."""
        room = output_room(self.max_context, prompt_tokens)
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
                                f"prompt, {request.max_tokens} in the completion); reduce "
                                f"{request.max_tokens_param} to at most {room} or shorten the prompt",
                           param=request.max_tokens_param, code="context_length_exceeded")
        return request.max_tokens
