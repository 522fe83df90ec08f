"""Chunked prefill in the server (`ServerConfig.chunked_prefill_size`, `serve --chunked-prefill-size`): a prompt that
arrives while another request decodes is prefilled a chunk at a time between that request's steps, so the running
stream goes on; both answers are what each gets alone."""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
import time

import pytest

from serve_helpers import MODEL, chat_ids, native_spec, running, wait_for
from tiny import output_text, reference_greedy

from specula.api import Specula
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.models.native import kernels
from specula.serve import ServerConfig
from specula.serve.worker import DEFAULT_CHUNKED_PREFILL_SIZE, resolve_chunked_prefill

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels do not run here")

SHORT = [{"role": "user", "content": "w05 w06 w07"}]
LONG = [{"role": "user", "content": " ".join(f"w{10 + i % 80:02d}" for i in range(37))}]


def recorded(spec: Specula, step_seconds: float = 0.0) -> list[tuple]:
    """What the worker runs, in order: ("start", prompt length, max_prefill_tokens, tokens run), ("prefill", session's
    prompt length, max_tokens, tokens run), ("step", sessions); each step made to last at least `step_seconds`."""
    events: list[tuple] = []
    start, prefill, step = spec.start, spec.prefill, spec.step

    def on_start(prompt, **kw):
        session = start(prompt, **kw)
        ran = len(session.seq.tokens) - session.stats.cached_tokens
        events.append(("start", len(prompt), kw.get("max_prefill_tokens"), ran))
        return session

    def on_prefill(session, max_tokens=None):
        before = len(session.seq.tokens)
        done = prefill(session, max_tokens)
        events.append(("prefill", len(session.prompt), max_tokens, len(session.seq.tokens) - before))
        return done

    def on_step(sessions):
        events.append(("step", len(sessions)))
        time.sleep(step_seconds)
        return step(sessions)

    spec.start, spec.prefill, spec.step = on_start, on_prefill, on_step
    return events


@needs_kernels
def test_a_prompt_arriving_mid_stream_is_prefilled_between_the_streams_steps(target_model, tokenizer, reference):
    from openai import OpenAI

    spec = native_spec(target_model, tokenizer, "none")  # one token a step: the first request runs long
    events = recorded(spec, step_seconds=0.01)  # 60 steps: 0.6 s at least, where the second's 10 chunks need 10
    with running(spec, max_batch_size=4, chunked_prefill_size=4) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        answers = {}

        def first():
            stream = client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=60, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True})
            answers["short"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        thread = threading.Thread(target=first)
        thread.start()
        wait_for(lambda: sum(e[0] == "step" for e in events) >= 3)  # it decodes
        answers["long"] = client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=8,
                                                         temperature=0).choices[0].message.content
        thread.join(60)
    short_ids, long_ids = chat_ids(tokenizer, SHORT), chat_ids(tokenizer, LONG)
    assert answers["long"] == reference(long_ids, 8)
    assert answers["short"] == output_text(tokenizer, short_ids, reference_greedy(target_model, list(short_ids), 60))
    mine = [i for i, e in enumerate(events) if e[0] in ("start", "prefill") and e[1] == len(long_ids)]
    assert events[mine[0]][:3] == ("start", len(long_ids), 4)  # its first chunk as it joins
    passes = -(-(len(long_ids) - 1) // 4)
    assert [events[i][:3] for i in mine[1:]] == [("prefill", len(long_ids), 4)] * (passes - 1)
    assert sum(events[i][3] for i in mine) == len(long_ids) - 1
    for a, b in zip(mine, mine[1:]):  # the running stream stepped between every two chunks
        assert ("step", 1) in events[a + 1: b]


@needs_kernels
def test_n_choices_prefill_one_after_another_so_the_others_copy_the_first(target_model, tokenizer, reference):
    """Chunks go to one prompt at a time: a request's `n` choices, arriving while another decodes, start one after
    another, so the second and third copy the first's whole prompt from the prefix cache."""
    from openai import OpenAI

    spec = native_spec(target_model, tokenizer, "none", prefix_cache_mib=16)
    cached = []
    start = spec.start
    spec.start = lambda prompt, **kw: (lambda s: (cached.append(s.stats.cached_tokens), s)[1])(start(prompt, **kw))
    steps = recorded(spec, step_seconds=0.01)
    with running(spec, max_batch_size=4, chunked_prefill_size=4) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        thread = threading.Thread(target=lambda: client.chat.completions.create(
            model=MODEL, messages=SHORT, max_tokens=60, temperature=0, extra_body={"ignore_eos": True}))
        thread.start()
        wait_for(lambda: sum(e[0] == "step" for e in steps) >= 3)
        three = client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=6, temperature=0, n=3)
        thread.join(60)
    ids = chat_ids(tokenizer, LONG)
    assert cached[1:] == [0, len(ids) - 1, len(ids) - 1]  # the first of the three prefilled it, in chunks
    assert [c.message.content for c in three.choices] == [reference(ids, 6)] * 3


@needs_kernels
def test_a_client_gone_half_way_through_its_prefill_frees_it_and_the_stream_goes_on(target_model, tokenizer):
    import openai
    from openai import OpenAI

    spec = native_spec(target_model, tokenizer, "none")
    events = recorded(spec)
    prefill, finished = spec.prefill, []
    spec.prefill = lambda session, max_tokens=None: (time.sleep(0.3), prefill(session, max_tokens))[1]
    finish = spec.finish
    spec.finish = lambda session: (finished.append(len(session.prompt)), finish(session))[1]
    with running(spec, max_batch_size=4, chunked_prefill_size=4) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        answers = []
        thread = threading.Thread(target=lambda: answers.append(client.chat.completions.create(
            model=MODEL, messages=SHORT, max_tokens=60, temperature=0, extra_body={"ignore_eos": True})))
        thread.start()
        wait_for(lambda: sum(e[0] == "step" for e in events) >= 1)
        with pytest.raises(openai.APITimeoutError):  # the client hangs up after 1 s: about 3 of 10 chunks
            client.with_options(timeout=1.0).chat.completions.create(model=MODEL, messages=LONG, max_tokens=6,
                                                                     temperature=0)
        thread.join(60)
    ids = chat_ids(tokenizer, LONG)
    prefills = [e for e in events if e[0] == "prefill" and e[1] == len(ids)]
    assert 0 < len(prefills) < -(-(len(ids) - 1) // 4) - 1  # stopped part-way
    assert finished.count(len(ids)) == 1  # its session freed, once
    assert answers[0].usage.completion_tokens == 60  # the stream went on to its end


@needs_kernels
def test_prompts_run_between_two_steps_stay_within_the_budget(target_model, tokenizer, reference):
    """Several prompts arriving while a stream decodes: short ones share a round's budget, a long one takes its
    chunks over the rounds after, and between two steps no more than `chunked_prefill_size` prompt tokens run."""
    from openai import OpenAI

    spec = native_spec(target_model, tokenizer, "none")
    events = recorded(spec, step_seconds=0.01)
    prompts = [LONG, SHORT, [{"role": "user", "content": "w30 w31 w32 w33 w34 w35 w36 w37 w38"}], SHORT]
    with running(spec, max_batch_size=6, chunked_prefill_size=12) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        thread = threading.Thread(target=lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "w60"}], max_tokens=80, temperature=0,
            extra_body={"ignore_eos": True}))
        thread.start()
        wait_for(lambda: sum(e[0] == "step" for e in events) >= 3)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda m: client.chat.completions.create(
                model=MODEL, messages=m, max_tokens=6, temperature=0).choices[0].message.content, prompts))
        thread.join(60)
    assert answers == [reference(chat_ids(tokenizer, m), 6) for m in prompts]
    rounds, ran = [], 0
    for event in events[[e[0] for e in events].index("step"):]:
        if event[0] == "step":
            rounds.append(ran)
            ran = 0
        else:
            ran += event[3]
    assert max(rounds) == 12 and sum(rounds) == sum(len(chat_ids(tokenizer, m)) - 1 for m in prompts)


def test_chunked_prefill_is_on_by_default_only_where_it_changes_nothing(target_model):
    exact = native_spec(target_model, None, "none").target
    hf = HFCausalLM(copy.deepcopy(target_model))
    assert exact.greedy_guarantee == "bitwise" and hf.greedy_guarantee != "bitwise"
    assert resolve_chunked_prefill(None, exact) == DEFAULT_CHUNKED_PREFILL_SIZE
    assert resolve_chunked_prefill(None, hf) == 0
    assert resolve_chunked_prefill(32, hf) == 32 and resolve_chunked_prefill(0, exact) == 0
    with pytest.raises(ConfigError, match="chunked_prefill_size must be >= 0"):
        resolve_chunked_prefill(-1, exact)
    assert ServerConfig(model_name="m").chunked_prefill_size is None


@needs_kernels
def test_an_echoed_prompts_logprobs_come_out_alike_in_chunks(target_model, tokenizer):
    """max_tokens 0 with echo and logprobs (an evaluation harness's loglikelihood request) arriving mid-stream: its
    prompt runs in chunks and ends at its prefill, with the logprobs it gets alone."""
    from openai import OpenAI

    spec = native_spec(target_model, tokenizer, "none")
    events = recorded(spec, step_seconds=0.01)
    ids = list(chat_ids(tokenizer, LONG))
    with running(spec, max_batch_size=4, chunked_prefill_size=4) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        alone = client.completions.create(model=MODEL, prompt=[ids], max_tokens=0, echo=True, logprobs=1)
        thread = threading.Thread(target=lambda: client.chat.completions.create(
            model=MODEL, messages=SHORT, max_tokens=60, temperature=0, extra_body={"ignore_eos": True}))
        thread.start()
        wait_for(lambda: sum(e[0] == "step" for e in events) >= 3)
        chunked = client.completions.create(model=MODEL, prompt=[ids], max_tokens=0, echo=True, logprobs=1)
        thread.join(60)
    passes = [e for e in events if e[0] in ("start", "prefill") and e[1] == len(ids)]
    assert passes[0][2] is None and [e[2] for e in passes[1:]] == [4] * (len(passes) - 1) and len(passes) > 5
    scored = alone.choices[0].logprobs.token_logprobs
    assert len(scored) == len(ids) and scored[0] is None and all(lp < 0 for lp in scored[1:])
    assert chunked.choices[0].logprobs.token_logprobs == scored
    assert chunked.choices[0].logprobs.tokens == alone.choices[0].logprobs.tokens
    assert chunked.choices[0].text == alone.choices[0].text and chunked.choices[0].finish_reason == "length"
