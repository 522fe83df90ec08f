"""Server metrics in the Prometheus text exposition format (version 0.0.4), without dependencies.

Thread-safe: HTTP threads count requests, the worker thread counts tokens and speculation."""

from __future__ import annotations

import math
import threading
from typing import Iterable, Sequence

from specula.stats import GenerationStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ACCEPTED_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Upper bounds of the accepted-length histogram (tokens per step, bonus included)."""
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    value = float(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonically increasing value per label set."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help, labels)
        self._values: dict[tuple[str, ...], float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in items]


class Gauge(_Metric):
    """A value that goes up and down."""

    kind = "gauge"

    def __init__(self, name: str, help: str) -> None:
        super().__init__(name, help)
        self._value = 0.0

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def add(self, amount: float) -> None:
        with self._lock:
            self._value += amount

    def value(self) -> float:
        with self._lock:
            return self._value

    def render(self) -> list[str]:
        return self.header() + [f"{self.name} {_number(self.value())}"]


class Histogram(_Metric):
    """Cumulative buckets, sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help)
        self.bounds = tuple(float(b) for b in sorted(buckets)) + (math.inf,)
        self._counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self._sum = 0.0

    def observe_many(self, values: Iterable[float]) -> None:
        with self._lock:
            for v in values:
                self._counts[next(i for i, b in enumerate(self.bounds) if v <= b)] += 1
                self._sum += v

    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def render(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines, cumulative = self.header(), 0
        for bound, n in zip(self.bounds, counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines += [f"{self.name}_sum {_number(total)}", f"{self.name}_count {cumulative}"]
        return lines


class ServerMetrics:
    """Everything /metrics exposes."""

    def __init__(self) -> None:
        self.requests = Counter("specula_requests_total",
                                "HTTP requests by endpoint and status (499: the client went away before the end)",
                                ("endpoint", "status"))
        self.request_seconds = Histogram("specula_request_duration_seconds",
                                         "Wall time of generation requests, queueing included", LATENCY_BUCKETS)
        self.prompt_tokens = Counter("specula_prompt_tokens_total", "Prompt tokens of generation requests")
        self.generated_tokens = Counter("specula_generated_tokens_total",
                                        "Tokens generated (cancelled generations included)")
        self.drafted_tokens = Counter("specula_drafted_tokens_total",
                                      "Draft tokens sent to the target for verification (finished generations)")
        self.accepted_tokens = Counter("specula_accepted_tokens_total",
                                       "Draft tokens the target accepted (finished generations)")
        self.steps = Counter("specula_verify_steps_total", "Target verification steps (finished generations)")
        self.accepted_length = Histogram("specula_accepted_length",
                                         "Tokens emitted per verification step, bonus token included "
                                         "(plain decoding = 1)", ACCEPTED_LENGTH_BUCKETS)
        self.generation_seconds = Counter("specula_generation_seconds_total",
                                          "Seconds the worker spent generating (finished generations)")
        self.tokens_per_second = Gauge("specula_tokens_per_second",
                                       "Decoding speed of the last finished generation (tokens/s)")
        self.queue_depth = Gauge("specula_queue_depth", "Generation requests waiting for the model")
        self.in_progress = Gauge("specula_requests_in_progress", "Generation requests being decoded (the batch)")
        self.batch_size = Histogram("specula_batch_size", "Requests advanced by one decode step (continuous batching)",
                                    BATCH_SIZE_BUCKETS)

    def record_request(self, endpoint: str, status: int) -> None:
        self.requests.inc(1, endpoint, str(status))

    def record_generation(self, stats: GenerationStats) -> None:
        """Counters of one finished generation (tokens are counted as they stream, see the worker)."""
        self.drafted_tokens.inc(stats.drafted_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        self.steps.inc(stats.steps)
        self.accepted_length.observe_many(stats.accepted_lengths)
        self.generation_seconds.inc(stats.seconds)
        self.tokens_per_second.set(stats.tokens_per_s)

    def render(self) -> str:
        metrics = (self.requests, self.request_seconds, self.prompt_tokens, self.generated_tokens,
                   self.drafted_tokens, self.accepted_tokens, self.steps, self.accepted_length,
                   self.generation_seconds, self.tokens_per_second, self.queue_depth, self.in_progress, self.batch_size)
        return "\n".join(line for m in metrics for line in m.render()) + "\n"
