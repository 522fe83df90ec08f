"""Many clients, one model: disconnects cancel generations, one request's failure leaves the
others intact. The drafter is slowed (10 ms a step) and EOS is off, so a generation outlives the client."""

from __future__ import annotations

import http.client
import json
import time

import openai
import pytest

from tiny import output_text, reference_greedy

from serve_helpers import MODEL, TestDrafter, http_call, make_spec, running, scrape, text_ids, wait_for

BOOM = 95  # a prompt holding this token makes the drafter raise
LONG = 200  # tokens a cancelled request asked for (about 2 s of decoding)


@pytest.fixture(scope="module")
def slow_server(target_model, tokenizer):
    spec = make_spec(target_model, tokenizer, "none")
    spec.decoder.drafters = [TestDrafter(d, delay=0.01, boom_token=BOOM) for d in spec.decoder.drafters]
    spec.decoder.eos_token_ids = frozenset()  # never stops by itself: only max_tokens or a cancel ends it
    with running(spec) as srv:
        yield srv


@pytest.fixture(scope="module")
def one_at_a_time_server(target_model, tokenizer):
    """The same slow server with --max-batch-size 1: a second request waits in the queue."""
    spec = make_spec(target_model, tokenizer, "none")
    spec.decoder.drafters = [TestDrafter(d, delay=0.01, boom_token=BOOM) for d in spec.decoder.drafters]
    spec.decoder.eos_token_ids = frozenset()
    with running(spec, max_batch_size=1) as srv:
        yield srv


def _open(server, body: dict) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def _metric(server, name: str, **labels) -> float:
    return scrape(server).get((name, tuple(sorted(labels.items()))), 0.0)


def _idle(server) -> bool:
    m = scrape(server)
    return m[("specula_requests_in_progress", ())] == 0 and m[("specula_queue_depth", ())] == 0


def _body(stream: bool, max_tokens: int = LONG) -> dict:
    return {"model": MODEL, "prompt": "w60 w61 w62", "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def test_streaming_client_disconnect_stops_generation(slow_server):
    before = scrape(slow_server)
    conn = _open(slow_server, _body(stream=True))
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.fp.readline()  # the first chunk arrived: the generation runs
    conn.sock.close()
    conn.close()
    wait_for(lambda: _metric(slow_server, "specula_requests_total", endpoint="/v1/completions", status="499")
             > before.get(("specula_requests_total", (("endpoint", "/v1/completions"), ("status", "499"))), 0))
    wait_for(lambda: _idle(slow_server))
    generated = _metric(slow_server, "specula_generated_tokens_total") - before[("specula_generated_tokens_total", ())]
    assert generated < LONG / 2, generated  # stopped early: counted in tokens, not seconds


def test_non_streaming_client_disconnect_stops_generation(slow_server):
    before = scrape(slow_server)
    conn = _open(slow_server, _body(stream=False))
    wait_for(lambda: _metric(slow_server, "specula_generated_tokens_total")
             > before[("specula_generated_tokens_total", ())])  # it has generated: the disconnect cuts it short
    conn.sock.close()
    conn.close()
    wait_for(lambda: _idle(slow_server))
    after = scrape(slow_server)
    generated = after[("specula_generated_tokens_total", ())] - before[("specula_generated_tokens_total", ())]
    assert 0 < generated < LONG / 2
    key = ("specula_requests_total", (("endpoint", "/v1/completions"), ("status", "499")))
    assert after[key] == before.get(key, 0) + 1
    assert after[("specula_drafted_tokens_total", ())] == before[("specula_drafted_tokens_total", ())]


def test_queued_request_whose_client_left_never_runs(one_at_a_time_server):
    server = one_at_a_time_server
    before = scrape(server)
    running_conn = _open(server, _body(stream=True, max_tokens=60))
    wait_for(lambda: scrape(server)[("specula_requests_in_progress", ())] == 1)
    queued = _open(server, _body(stream=False))
    wait_for(lambda: scrape(server)[("specula_queue_depth", ())] == 1)
    queued.sock.close()
    queued.close()
    resp = running_conn.getresponse()
    assert resp.status == 200 and resp.read().decode().endswith("data: [DONE]\n\n")
    wait_for(lambda: _idle(server))
    generated = scrape(server)[("specula_generated_tokens_total", ())] - before[("specula_generated_tokens_total", ())]
    assert generated == 60  # the first request only


def test_concurrent_requests_share_the_batch_and_a_cancel_leaves_the_others(slow_server, tokenizer, reference):
    """Continuous batching: a second request joins the running one (both in progress at once), the
    first client leaves, the second still gets exactly its offline output."""
    before = scrape(slow_server)
    leaving = _open(slow_server, _body(stream=True, max_tokens=LONG))
    wait_for(lambda: scrape(slow_server)[("specula_requests_in_progress", ())] == 1)
    staying = _open(slow_server, {"model": MODEL, "prompt": "w05 w06 w07", "max_tokens": 8, "temperature": 0})
    wait_for(lambda: scrape(slow_server)[("specula_requests_in_progress", ())] == 2)
    leaving.sock.close()
    leaving.close()
    resp = staying.getresponse()
    text = json.loads(resp.read())["choices"][0]["text"]
    assert resp.status == 200 and text == reference(text_ids(tokenizer, "w05 w06 w07"), 8)
    wait_for(lambda: _idle(slow_server))
    after = scrape(slow_server)
    assert after[("specula_batch_size_count", ())] > before.get(("specula_batch_size_count", ()), 0)


def test_internal_error_is_isolated(slow_server, tokenizer, reference):
    from openai import OpenAI

    client = OpenAI(base_url=slow_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    status, _, body = http_call(slow_server, "POST", "/v1/completions",
                                {"model": MODEL, "prompt": f"w05 w{BOOM}", "max_tokens": 4})
    assert status == 500 and body["error"]["type"] == "server_error" and "boom" in body["error"]["message"]
    with pytest.raises(openai.APIError, match="boom"):  # after the 200 headers: an in-stream error event
        for _ in client.completions.create(model=MODEL, prompt=f"w05 w{BOOM}", max_tokens=4, stream=True):
            pass
    out = client.completions.create(model=MODEL, prompt="w05 w06 w07", max_tokens=8, temperature=0)
    assert out.choices[0].text == reference(text_ids(tokenizer, "w05 w06 w07"), 8)
    wait_for(lambda: _metric(slow_server, "specula_requests_total", endpoint="/v1/completions", status="500") == 2)


def test_an_exception_in_one_session_fails_only_that_request_while_the_batch_goes_on(slow_server, tokenizer,
                                                                                     target_model):
    """A request whose drafter raises joins a running batch: it gets a 500, the other request in the
    same batch still gets exactly its offline output."""
    expected = reference_greedy(target_model, list(text_ids(tokenizer, "w60 w61 w62")), 60)  # EOS is off here
    assert BOOM not in expected  # only the other request raises
    staying = _open(slow_server, {"model": MODEL, "prompt": "w60 w61 w62", "max_tokens": 60, "temperature": 0})
    wait_for(lambda: scrape(slow_server)[("specula_requests_in_progress", ())] == 1)
    status, _, body = http_call(slow_server, "POST", "/v1/completions",
                                {"model": MODEL, "prompt": f"w09 w{BOOM}", "max_tokens": 4})
    assert status == 500 and "boom" in body["error"]["message"]
    # the failed one leaves the batch (the gauge moves just after its answer), the other still runs
    wait_for(lambda: scrape(slow_server)[("specula_requests_in_progress", ())] == 1)
    resp = staying.getresponse()
    assert resp.status == 200
    assert json.loads(resp.read())["choices"][0]["text"] == output_text(tokenizer, text_ids(tokenizer, "w60 w61 w62"),
                                                                        expected)


def test_a_full_queue_answers_503_with_retry_after(target_model, tokenizer):
    spec = make_spec(target_model, tokenizer, "none")
    spec.decoder.drafters = [TestDrafter(d, delay=0.01) for d in spec.decoder.drafters]
    spec.decoder.eos_token_ids = frozenset()
    with running(spec, max_batch_size=1, max_queue=1) as server:
        first = _open(server, _body(stream=True, max_tokens=60))
        wait_for(lambda: scrape(server)[("specula_requests_in_progress", ())] == 1)
        second = _open(server, _body(stream=False, max_tokens=4))
        wait_for(lambda: scrape(server)[("specula_queue_depth", ())] == 1)
        status, headers, body = http_call(server, "POST", "/v1/completions", _body(stream=False, max_tokens=4))
        assert status == 503 and headers["Retry-After"] == "1" and body["error"]["code"] == "server_overloaded"
        assert first.getresponse().status == 200 and second.getresponse().status == 200  # the others are served


def test_a_request_past_its_timeout_gets_504_and_leaves_the_batch(target_model, tokenizer):
    spec = make_spec(target_model, tokenizer, "none")
    spec.decoder.drafters = [TestDrafter(d, delay=0.01) for d in spec.decoder.drafters]
    spec.decoder.eos_token_ids = frozenset()
    with running(spec, request_timeout=0.5) as server:
        status, _, body = http_call(server, "POST", "/v1/completions", _body(stream=False, max_tokens=LONG))
        assert status == 504 and body["error"]["code"] == "timeout" and "--request-timeout" in body["error"]["message"]
        wait_for(lambda: _idle(server))
        assert _metric(server, "specula_generated_tokens_total") < LONG  # cut at the timeout, not run to the end
        status, _, body = http_call(server, "POST", "/v1/completions", _body(stream=False, max_tokens=4))
        assert status == 200 and body["usage"]["completion_tokens"] == 4  # short requests still fit


def test_a_drafter_whose_clean_up_raises_stops_neither_the_request_nor_the_server(target_model, tokenizer):
    """A drafter's finish() that raised (a state file it could not write) killed the worker thread:
    /health said ok and every later request hung, past --request-timeout. It is logged instead."""

    class FailingCleanUp(TestDrafter):
        __test__ = False

        def finish(self, state=None):
            raise RuntimeError("could not save the drafter's state")

    spec = make_spec(target_model, tokenizer, "prompt-lookup")
    spec.decoder.drafters = [FailingCleanUp(d) for d in spec.decoder.drafters]
    with running(spec, request_timeout=20) as server:
        for max_tokens in (4, 6):
            status, _, body = http_call(server, "POST", "/v1/completions", _body(stream=False, max_tokens=max_tokens))
            assert status == 200 and body["usage"]["completion_tokens"] >= 1
        assert server.worker._thread.is_alive()


def test_requests_whose_clients_left_the_queue_hold_no_place_in_it(target_model, tokenizer):
    """Clients that hung up while queued kept their places until the worker reached them: a busy
    server answered 503 "N requests waiting" with nothing live waiting, and counted them."""
    spec = make_spec(target_model, tokenizer, "none")
    spec.decoder.drafters = [TestDrafter(d, delay=0.02) for d in spec.decoder.drafters]
    spec.decoder.eos_token_ids = frozenset()
    with running(spec, max_batch_size=1, max_queue=2) as server:
        first = _open(server, _body(stream=True, max_tokens=240))  # about 5 s: the queue is not reached
        wait_for(lambda: scrape(server)[("specula_requests_in_progress", ())] == 1)
        gone = [_open(server, _body(stream=False, max_tokens=4)) for _ in range(2)]
        wait_for(lambda: server.worker.queue_depth == 2)
        for conn in gone:
            conn.sock.close()
            conn.close()
        wait_for(lambda: server.worker.queue_depth == 0, timeout=2.0)  # they are no longer counted ...
        status, _, body = http_call(server, "POST", "/v1/completions", _body(stream=False, max_tokens=4))
        assert status == 200 and body["usage"]["completion_tokens"] == 4  # ... nor refuse a live request
        assert first.getresponse().status == 200


def test_created_is_when_the_request_came(target_model, tokenizer):
    """`created` stamps the request's arrival (as vLLM does), streamed or not; a non-streamed
    response stamped it when the generation had finished."""
    spec = make_spec(target_model, tokenizer, "none")
    spec.decoder.drafters = [TestDrafter(d, delay=0.05) for d in spec.decoder.drafters]
    spec.decoder.eos_token_ids = frozenset()
    with running(spec) as server:
        sent = time.time()
        status, _, body = http_call(server, "POST", "/v1/completions", _body(stream=False, max_tokens=30))
        done = time.time()
        assert status == 200 and done - sent > 1.2
        assert body["created"] <= sent + 0.5  # whole seconds, rounded down


def test_serving_metrics_latency_goodput_and_batch(slow_server):
    before = scrape(slow_server)
    conns = [_open(slow_server, {"model": MODEL, "prompt": f"w{10 + i} w20", "max_tokens": 12, "temperature": 0})
             for i in range(3)]
    assert all(c.getresponse().status == 200 for c in conns)
    wait_for(lambda: _idle(slow_server))
    after = scrape(slow_server)

    def delta(name):
        return after.get((name, ()), 0.0) - before.get((name, ()), 0.0)

    assert delta("specula_time_to_first_token_seconds_count") == 3
    assert delta("specula_inter_token_latency_seconds_count") > 0
    assert delta("specula_request_drafted_tokens_count") == 3 and delta("specula_request_accepted_tokens_count") == 3
    assert after[("specula_goodput_tokens_per_second", ())] > 0
    assert ("specula_speculation_off_by_load_total", ()) in after
    assert delta("specula_batch_size_sum") > delta("specula_batch_size_count")  # some steps held > 1 request


def test_a_client_leaving_stops_every_choice_of_its_request(slow_server):
    before = scrape(slow_server)
    conn = _open(slow_server, {**_body(stream=True), "n": 3})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.fp.readline()
    conn.sock.close()
    conn.close()
    wait_for(lambda: _idle(slow_server))
    generated = _metric(slow_server, "specula_generated_tokens_total") - before[("specula_generated_tokens_total", ())]
    assert generated < 3 * LONG / 2, generated  # none of the three ran on


def test_one_failing_prompt_of_a_batch_fails_the_request_and_stops_the_others(slow_server):
    """A batch whose second prompt makes the drafter raise: one 500 for the request, and its other
    choices leave the batch (nothing runs on for a request that has failed)."""
    before = scrape(slow_server)
    status, _, body = http_call(slow_server, "POST", "/v1/completions",
                                {"model": MODEL, "prompt": ["w60 w61 w62", f"w09 w{BOOM}"], "max_tokens": LONG,
                                 "temperature": 0})
    assert status == 500 and "boom" in body["error"]["message"]
    wait_for(lambda: _idle(slow_server))
    generated = _metric(slow_server, "specula_generated_tokens_total") - before[("specula_generated_tokens_total", ())]
    assert generated < LONG / 2, generated


def test_the_worker_itself_stops_a_failed_requests_other_choices(slow_server):
    """Without the HTTP side cancelling anything: the worker drops the choices of a request it has
    answered with an error."""
    from specula.serve.protocol import APIError, parse_request

    request = parse_request("completions", {"model": MODEL, "prompt": ["w60 w61 w62", f"w09 w{BOOM}"],
                                            "max_tokens": LONG, "temperature": 0}, MODEL)
    job = slow_server.worker.submit(request)
    events = []
    while not events or not isinstance(events[-1], APIError):
        events.append(job.events.get(timeout=30))
    wait_for(lambda: _idle(slow_server))
    assert not job.cancelled.is_set() and job.generated_tokens < LONG / 2
    assert [e for e in events if isinstance(e, APIError)] == [events[-1]]  # one error, sent once
