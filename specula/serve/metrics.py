"""Server metrics through `prometheus_client`, one registry per server (several servers can run in
one process, e.g. in tests). HTTP handlers count requests, the worker thread counts tokens,
steps, batches and latencies; `prometheus_client` is thread-safe."""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specula.stats import GenerationStats

prometheus_client.disable_created_metrics()  # no `_created` samples: counters read as plain totals

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
ACCEPTED_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)
"""Upper bounds of the accepted-length histogram (tokens per step, bonus included)."""
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
TOKEN_COUNT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ServerMetrics:
    """Everything /metrics exposes (names follow vLLM's where one exists, prefixed `specula_`)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("specula_requests", "HTTP requests by endpoint and status (499: the client went "
                                "away before the end)", ("endpoint", "status"), registry=r)
        self.request_seconds = Histogram("specula_request_duration_seconds",
                                         "Wall time of generation requests, queueing included",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("specula_time_to_first_token_seconds",
                                             "Seconds from a generation request's arrival to its first token "
                                             "(queueing and prefill included)", buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("specula_inter_token_latency_seconds",
                                             "Seconds per token after the first (a step's wall time over the tokens "
                                             "it gave the request)", buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specula_prompt_tokens", "Prompt tokens of generation requests", registry=r)
        self.generated_tokens = Counter("specula_generated_tokens",
                                        "Tokens generated (cancelled generations included)", registry=r)
        self.drafted_tokens = Counter("specula_drafted_tokens",
                                      "Draft tokens sent to the target for verification (finished generations)",
                                      registry=r)
        self.accepted_tokens = Counter("specula_accepted_tokens",
                                       "Draft tokens the target accepted (finished generations)", registry=r)
        self.request_drafted = Histogram("specula_request_drafted_tokens", "Draft tokens verified per finished request",
                                         buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.request_accepted = Histogram("specula_request_accepted_tokens",
                                          "Draft tokens accepted per finished request", buckets=TOKEN_COUNT_BUCKETS,
                                          registry=r)
        self.steps = Counter("specula_verify_steps", "Target verification steps (finished generations)", registry=r)
        self.accepted_length = Histogram("specula_accepted_length",
                                         "Tokens emitted per verification step, bonus token included "
                                         "(plain decoding = 1)", buckets=ACCEPTED_LENGTH_BUCKETS, registry=r)
        self.speculation_off_by_load = Counter(
            "specula_speculation_off_by_load",
            "Request steps on which the request had a tree worth verifying alone but the batch's goodput plan "
            "gave it no node (finished generations)", registry=r)
        self.generation_seconds = Counter("specula_generation_seconds",
                                          "Wall time of finished generations, summed over requests (requests "
                                          "decoded together overlap: under batching this runs ahead of the "
                                          "clock)", registry=r)
        self.tokens_per_second = Gauge("specula_tokens_per_second",
                                       "Decoding speed of the last finished generation (tokens/s)", registry=r)
        self.goodput = Gauge("specula_goodput_tokens_per_second",
                             "Tokens the whole batch emitted per second of decode steps (recent steps)", registry=r)
        self.queue_depth = Gauge("specula_queue_depth", "Generation requests waiting for the model", registry=r)
        self.in_progress = Gauge("specula_requests_in_progress", "Generation requests being decoded (the batch)",
                                 registry=r)
        self.batch_size = Histogram("specula_batch_size", "Requests advanced by one decode step (continuous batching)",
                                    buckets=BATCH_SIZE_BUCKETS, registry=r)

    def record_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def record_generation(self, stats: GenerationStats) -> None:
        """Counters of one finished generation (tokens are counted as they stream, see the worker)."""
        self.drafted_tokens.inc(stats.drafted_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        self.request_drafted.observe(stats.drafted_tokens)
        self.request_accepted.observe(stats.accepted_tokens)
        self.steps.inc(stats.steps)
        for n in stats.accepted_lengths:
            self.accepted_length.observe(n)
        self.speculation_off_by_load.inc(stats.speculation_off_by_load)
        self.generation_seconds.inc(stats.seconds)
        self.tokens_per_second.set(stats.tokens_per_s)

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)
