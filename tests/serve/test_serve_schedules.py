"""The worker under random schedules: requests arriving while others decode or prefill, `n` choices, prompts that
share openings (prefix-cache hits, a running request's prompt copied), chunked prefill of several sizes, batches of
several sizes, clients gone before their request starts, part-way through its prefill or its stream, a third of the
requests stopping at strings. Whatever the order, every answer is what the request gets alone (one that stops at
strings: plain decoding's tokens and text), a stream cut short holds the start of it, and every session the
worker started is freed (none left running in a prefix cache). With drafters that fail on some text and deadlines
that pass while a request waits, starts or streams: those requests, and only those, end in a 500 or a 504, and
still nothing is left behind."""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass, field, replace

import pytest

from serve_helpers import METHODS, MODEL, TestDrafter, method_spec, native_spec
from tiny import random_stop

from specula.drafters.base import FeatureDrafter
from specula.models.native import kernels
from specula.serve.metrics import ServerMetrics
from specula.serve.protocol import APIError, GenerationRequest, choice_seed
from specula.serve.worker import ChoiceChunk, Started, Worker

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels do not run here")


@dataclass
class Client:
    """One request, when its client goes, and what came back for it (read in the worker's thread, as each event is
    sent: `Job.notify`)."""

    request: GenerationRequest
    cut: int | str | None
    """When the client goes: "queued" (before the worker reaches it), "start" (as soon as its first choice starts:
    part-way through its prompt where chunks cut it), "chunk" (after a later chunk of a prompt of its, or at its
    start where it has none), k (right after its k-th stream chunk is sent, before the worker looks again), None
    (it reads to the end)."""
    expire: int | str | None = None
    """When its deadline passes (the worker then answers 504): "queued", "start" or after its k-th stream chunk, as
    `cut`; None: never."""
    job: object = None
    tokens: dict[int, list[int]] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    chunks: int = 0
    error: APIError | None = None
    gone: bool = False
    late_work: int = 0
    """Choices started and prompt chunks run once it was `over`."""

    @property
    def done(self) -> bool:
        return self.gone or self.error is not None or len(self.finished) == self.request.n

    @property
    def over(self) -> bool:
        """Whether the worker must do no more for it: its client went or its deadline passed, in the worker's
        thread (not "queued": that races the worker)."""
        if self.job is None:
            return False
        return (self.gone and self.cut != "queued") or (self.job.deadline == 0.0 and self.expire != "queued")

    def go(self) -> None:
        if not self.gone:
            self.job.cancel()
            self.gone = True

    def read(self) -> None:
        while True:
            try:
                event = self.job.events.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, APIError):
                self.error = event
            elif isinstance(event, ChoiceChunk):
                self.chunks += 1
                self.tokens.setdefault(event.index, []).extend(event.chunk.token_ids)
                self.texts[event.index] = self.texts.get(event.index, "") + event.chunk.text
                if event.chunk.finished:
                    self.finished.add(event.index)
                if self.cut == self.chunks:
                    self.go()
                if self.expire == self.chunks:
                    self.job.deadline = 0.0  # before the worker looks again
            else:
                assert isinstance(event, Started)


def schedule(rng: random.Random, count: int, sampled: bool, boom: bool = False, expiring: bool = False,
             tokenizer=None) -> list[Client]:
    """`count` requests over prompts that may open alike (a random part of one of three openings of 40 tokens, then up
    to 30 tokens of its own; no two prompts alike, so a session's prompt names its request); greedy, or where
    `sampled` a third of them seeded samples; with a `tokenizer`, a third stop at strings (`tiny.random_stop`);
    every fourth client reads to the end; where `boom`, every third prompt ends in `BOOM`, its client reading to
    the end; where `expiring`, every third other one's deadline passes at some point (its client reading to the
    end, one greedy choice of 40 tokens past any end of text)."""
    openings = [[rng.randrange(2, 96) for _ in range(40)] for _ in range(3)]
    clients, seen = [], set()
    while len(clients) < count:
        opening = rng.choice(openings)[: rng.randrange(0, 41)]
        prompt = tuple(opening + [rng.randrange(2, 96) for _ in range(rng.randint(1, 30))])
        bomb = boom and len(clients) % 3 == 1
        prompt += (BOOM,) * bomb
        if prompt in seen:
            continue
        seen.add(prompt)
        sampling = {"temperature": 0.8, "seed": rng.randrange(1000)} if sampled and rng.random() < 1 / 3 else {}
        if tokenizer is not None and rng.random() < 1 / 3:
            sampling["stop"] = tuple(random_stop(rng, tokenizer, 96) for _ in range(rng.choice((1, 2))))
        request = GenerationRequest(endpoint="completions", model=MODEL, prompts=(prompt,), n=rng.choice((1, 1, 2, 3)),
                                    max_tokens=rng.randint(1, 14), **{"temperature": 0.0, **sampling})
        cuts = (None,) if len(clients) % 4 == 0 or bomb else (None, None, "queued", "start", "chunk", "chunk", 1, 2, 5)
        late = expiring and not bomb and len(clients) % 3 == 2
        if late:  # one greedy choice of 40 tokens, however many end-of-text tokens: more than two chunks
            request = replace(request, n=1, max_tokens=40, ignore_eos=True, temperature=0.0, seed=None)
        clients.append(Client(request, None if late else rng.choice(cuts),
                              rng.choice(("queued", "start", 1, 2)) if late else None))
    return clients


class Schedule:
    """Submits the clients one by one: from the worker's thread at random points between its calls (so where a
    request arrives follows from the seed, not from two threads' timing), and from the test's thread whenever
    everything submitted is done. Hooks on `spec` record the sessions started and the ids of those freed (through
    the engine, which frees a failed prefill itself)."""

    def __init__(self, spec, clients: list[Client], rng: random.Random) -> None:
        self.clients, self.rng = clients, rng
        self.waiting, self.worker = list(clients), None
        self.lock = threading.Lock()
        self.started, self.freed = [], set()
        by_prompt = {client.request.prompts[0]: client for client in clients}
        start, prefill, step, finish = spec.start, spec.prefill, spec.step, spec.decoder.finish

        def on_start(prompt, **kw):
            client = by_prompt[tuple(prompt)]
            client.late_work += client.over
            session = start(prompt, **kw)
            self.started.append(session)
            if client.cut == "start" or (client.cut == "chunk" and session.prefilled):
                client.go()
            if client.expire == "start":
                client.job.deadline = 0.0
            self.arrivals()
            return session

        def on_prefill(session, max_tokens=None):
            client = by_prompt[tuple(session.prompt)]
            client.late_work += client.over
            done = prefill(session, max_tokens)
            if client.cut == "chunk":
                client.go()
            self.arrivals()
            return done

        def on_step(sessions):
            chunks = step(sessions)
            self.arrivals()
            return chunks

        def on_finish(session):
            self.freed.add(id(session))
            return finish(session)

        spec.start, spec.prefill, spec.step, spec.decoder.finish = on_start, on_prefill, on_step, on_finish

    def submit(self) -> None:
        with self.lock:
            if not self.waiting:
                return
            client = self.waiting.pop(0)
        client.job = self.worker.submit(client.request, notify=client.read)
        if client.cut == "queued":
            client.go()
        if client.expire == "queued":
            client.job.deadline = 0.0  # racing the worker's thread, which may have taken it: 504 sooner or later

    def arrivals(self) -> None:
        """None, one or two requests arrive now."""
        for _ in range(self.rng.choice((0, 0, 0, 1, 1, 2))):
            self.submit()

    def run(self, worker: Worker, timeout: float = 60.0) -> None:
        self.worker = worker
        end = time.monotonic() + timeout
        while self.waiting or not all(client.done for client in self.clients):
            assert time.monotonic() < end, "the worker stopped answering"
            if all(client.done for client in self.clients if client.job is not None):
                self.submit()
            time.sleep(0.001)


BOOM = 95
"""The token whose presence in a request's text makes a wrapped drafter raise (`serve_helpers.TestDrafter`)."""


def specs(method: str, planner: bool, prefix_cache_mib: int, target_model, draft_model, tokenizer):
    """(the worker's `Specula`, one for requests alone) of `method`."""
    return (method_spec(method, target_model, draft_model, tokenizer, planner=planner,
                        prefix_cache_mib=prefix_cache_mib),
            method_spec(method, target_model, draft_model, tokenizer))


def answers(client: Client, reference, alone) -> list[list[int]]:
    """Each choice's answer alone: greedy (past end of text where it ignores it), or seeded (choice j seeded seed +
    j)."""
    request = client.request
    prompt = request.prompts[0]
    if request.ignore_eos:
        return [alone.generate(list(prompt), max_new_tokens=request.max_tokens, ignore_eos=True).token_ids]
    if request.temperature == 0:
        return [list(reference.tokens(prompt, request.max_tokens))] * request.n
    return [alone.generate(list(prompt), max_new_tokens=request.max_tokens, temperature=request.temperature,
                           seed=choice_seed(request.seed, j)).token_ids for j in range(request.n)]


def outputs_alone(client: Client, plain) -> list:
    """Each choice's `GenerationOutput` from plain decoding alone (its tokens, and its text where it stops at
    strings)."""
    request = client.request
    return [plain.generate(list(request.prompts[0]), max_new_tokens=request.max_tokens, temperature=request.temperature,
                           seed=None if request.seed is None else choice_seed(request.seed, j), stop=request.stop,
                           ignore_eos=request.ignore_eos)
            for j in range(request.n)]


def assert_texts(client: Client, outputs: list, where: str) -> None:
    """Each choice streamed the text of its `outputs_alone`, or (cut short) the start of it."""
    for j, out in enumerate(outputs):
        got = client.texts.get(j, "")
        assert got == out.text if not client.gone else out.text.startswith(got), (where, client.request.stop)


def assert_cleaned_up(run: Schedule, spec, worker: Worker, where: str) -> None:
    """No prompt ran after its client went, every session started was freed, none is still shared."""
    assert not any(client.late_work for client in run.clients), f"{where}: a prompt ran for a request given up"
    assert run.started and {id(s) for s in run.started} <= run.freed, f"{where}: a session was never freed"
    drafters = [getattr(d, "inner", d) for d in spec.decoder.drafters]
    caches = [spec.decoder.prefix_cache] + [getattr(d, "prefix_cache", None) for d in drafters]
    assert all(not cache._running for cache in caches if cache is not None), f"{where}: a session is still shared"
    assert worker._prefilling is None


@needs_kernels
@pytest.mark.parametrize("seed", range(15))
def test_random_schedules_answer_every_request_as_alone_and_free_every_session(seed, target_model, draft_model,
                                                                              tokenizer, reference):
    rng = random.Random(seed)
    method, planner = METHODS[seed % len(METHODS)], seed % 2 == 1
    spec, alone = specs(method, planner, rng.choice((0, 1, 1)), target_model, draft_model, tokenizer)
    clients = schedule(rng, 14, sampled=True, tokenizer=tokenizer)  # a seeded sample is plain decoding's whatever the
    # planner drafts (README, "How it works")
    run = Schedule(spec, clients, rng)
    size, chunk = rng.choice((1, 2, 4)), rng.choice((0, 1, 3, 8))
    worker = Worker(spec, ServerMetrics(), max_batch_size=size, chunked_prefill_size=chunk)
    try:
        run.run(worker)
    finally:
        worker.close()
    where = f"seed {seed}: {method}, batch {size}, chunks of {chunk}"
    plain = native_spec(target_model, tokenizer, "none")
    for client in clients:
        stopping = outputs_alone(client, plain) if client.request.stop else None  # plain decoding's, text and all
        wants = [out.token_ids for out in stopping] if stopping else answers(client, reference, alone)
        assert client.error is None, f"{where}: {client.error}"
        if not client.gone:
            assert client.tokens == dict(enumerate(wants)), where
        for j, got in client.tokens.items():  # a stream cut short holds the start of the answer
            assert got == wants[j][: len(got)], where
        if stopping:
            assert_texts(client, stopping, where)
    assert sum(not client.gone for client in clients) > 0 and any(client.gone for client in clients)
    assert_cleaned_up(run, spec, worker, where)


@needs_kernels
@pytest.mark.parametrize("seed", range(8))
def test_random_schedules_with_failing_drafters_and_deadlines_fail_only_those_and_free_every_session(
        seed, target_model, draft_model, tokenizer, reference):
    """The same schedules where the drafters (but a head) raise on text holding `BOOM` and some requests' deadlines
    pass while queued, at their start or part-way through their stream: such a request ends in a 500, one past its
    deadline in a 504 (unless it had just finished), its stream so far the start of its answer; every other one as
    alone; every session is freed."""
    rng = random.Random(1000 + seed)
    method, planner = ("prompt-lookup", "draft-model", "fusion")[seed % 3], seed % 2 == 1
    spec, alone = specs(method, planner, rng.choice((0, 1)), target_model, draft_model, tokenizer)
    spec.decoder.drafters = [d if isinstance(d, FeatureDrafter) else TestDrafter(d, boom_token=BOOM)
                             for d in spec.decoder.drafters]  # a head's features go to it alone: it is left as it is
    clients = schedule(rng, 14, sampled=True, boom=True, expiring=True)
    run = Schedule(spec, clients, rng)
    size, chunk = rng.choice((1, 2, 4)), rng.choice((0, 1, 3, 8))
    worker = Worker(spec, ServerMetrics(), max_batch_size=size, chunked_prefill_size=chunk, request_timeout=600.0)
    try:
        run.run(worker)
    finally:
        worker.close()
    where = f"seed {seed}: {method}, batch {size}, chunks of {chunk}"
    codes = []
    for client in clients:
        wants = answers(client, reference, alone)
        if client.error is not None:
            codes.append(client.error.status)
            boom = any(BOOM in client.request.prompts[0] + tuple(want) for want in wants)
            assert {500: boom, 504: client.expire is not None}.get(client.error.status), f"{where}: {client.error}"
        else:
            assert client.expire is None, f"{where}: a request went on past its deadline"
            assert client.gone or client.tokens == dict(enumerate(wants)), where
        for j, got in client.tokens.items():
            assert got == wants[j][: len(got)], where
    assert 500 in codes and any(client.expire is not None for client in clients), where  # each ended in an error
    assert_cleaned_up(run, spec, worker, where)
