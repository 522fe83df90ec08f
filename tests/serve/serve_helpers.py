"""Helpers for the server tests: a tiny word-level tokenizer with a chat template, servers on
free loopback ports, raw HTTP and /metrics scraping."""

from __future__ import annotations

import copy
import http.client
import json
import time
from contextlib import contextmanager
from typing import Iterator

from tiny import VOCAB, word_tokenizer

from specula.api import Specula
from specula.drafters.base import DraftContext, Proposal, StepResult
from specula.models.hf import HFCausalLM
from specula.serve import ServerConfig, SpeculaServer, create_server

MODEL = "tiny-qwen2"
CHAT_TEMPLATE = (
    "{% for m in messages %}w02 {{ m['content'] }} w03 {% endfor %}{% if add_generation_prompt %}w04{% endif %}"
)
EOS = 1


def make_tokenizer():
    """Word-level tokenizer over w00..w95 (w01 = EOS) with a chat template. Two-digit names:
    no token is a prefix of another, so saved special tokens cannot split words."""
    return word_tokenizer([f"w{i:02d}" for i in range(VOCAB)], decoder=True, chat_template=CHAT_TEMPLATE,
                          unk_token="w00", eos_token="w01")


class TestDrafter:
    """Wraps a drafter: sleeps `delay` seconds per proposal (so a generation lasts long enough
    to be cancelled) and raises when the context holds `boom_token` (an internal error)."""

    __test__ = False

    def __init__(self, inner, delay: float = 0.0, boom_token: int | None = None) -> None:
        self.inner, self.delay, self.boom_token = inner, delay, boom_token
        self.name = inner.name

    def start(self):
        return self.inner.start()

    def propose(self, ctx: DraftContext, state=None) -> Proposal:
        if self.boom_token is not None and self.boom_token in ctx.tokens:
            raise RuntimeError("boom")
        time.sleep(self.delay)
        return self.inner.propose(ctx, state)

    def observe(self, step: StepResult, state=None) -> None:
        self.inner.observe(step, state)

    def finish(self, state=None) -> None:
        self.inner.finish(state)


def make_spec(target_model, tokenizer, method: str = "draft-model", draft_model=None) -> Specula:
    """A `Specula` over private copies of the models (each server owns its weights). No planner:
    the trees are what the drafter proposes, whatever the timing, so seeded sampled outputs are
    the same online and offline."""
    draft = HFCausalLM(copy.deepcopy(draft_model)) if draft_model is not None else None
    return Specula(HFCausalLM(copy.deepcopy(target_model)), tokenizer, method, draft, planner=False)


def native_spec(target_model, tokenizer, method: str = "prompt-lookup", draft_model=None, *, planner: bool = False,
                prefix_cache_mib: int = 0, head: str | None = None) -> Specula:
    """A `Specula` on specula's C kernels (rows computed alone: greedy guarantee "bitwise") over private copies of
    the models; the hardware planner where `planner`, else the drafters' trees as proposed; no prefix cache unless
    asked; `head`: a freshly initialised head of that kind over the whole vocabulary (seed 1)."""
    import torch

    from specula.drafters.heads.runtime import new_head
    from specula.engine import EngineConfig
    from specula.models.native import NativeCausalLM, NativeDecoder, configure

    def native(model):
        decoder = configure(NativeDecoder.from_hf(copy.deepcopy(model)), "specula", "none", "sdpa")
        return NativeCausalLM(decoder, "native", eos_token_ids=[EOS])

    target = native(target_model)
    draft = native(draft_model) if draft_model is not None else None
    options = {} if head is None else {"head": new_head(head, target, torch.arange(target.vocab_size), seed=1)}
    return Specula(target, tokenizer, method, draft, planner="hardware" if planner else False,
                   engine=EngineConfig(prefix_cache_mib=prefix_cache_mib), **options)


METHODS = ("none", "prompt-lookup", "draft-model", "eagle3", "fusion")
"""Drafters of each kind: none, copying, a draft model's cache, a head's features (fusion: all of them at once)."""


def method_spec(method: str, target_model, draft_model, tokenizer, *, planner: bool = False,
                prefix_cache_mib: int = 0) -> Specula:
    """`native_spec` of one of `METHODS` with what it drafts from: the draft model (draft-model, fusion), a fresh
    head (eagle3; fusion: an eagle head)."""
    draft = draft_model if method in ("draft-model", "fusion") else None
    return native_spec(target_model, tokenizer, method, draft, planner=planner, prefix_cache_mib=prefix_cache_mib,
                       head={"eagle3": "eagle3", "fusion": "eagle"}.get(method))


@contextmanager
def running(spec: Specula, **config) -> Iterator[SpeculaServer]:
    server = create_server(spec, ServerConfig(**{"model_name": MODEL, "port": 0, **config})).start()
    try:
        yield server
    finally:
        server.close()


def chat_ids(tokenizer, messages) -> tuple[int, ...]:
    from specula.models.loading import apply_chat_template

    return tuple(apply_chat_template(tokenizer, messages))


def text_ids(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text))


def http_call(server: SpeculaServer, method: str, path: str, body=None, headers: dict | None = None,
         raw: bytes | None = None) -> tuple[int, "http.client.HTTPMessage", dict | str]:
    """One raw HTTP request; returns (status, headers, parsed JSON or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    payload = resp.read().decode()
    conn.close()
    ctype = resp.getheader("Content-Type", "")
    return resp.status, resp.headers, json.loads(payload) if "json" in ctype else payload  # headers: case-insensitive


def scrape(server: SpeculaServer) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus_client: {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, text = http_call(server, "GET", "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_for(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


