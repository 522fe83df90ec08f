"""Bounded load test on loopback: 50 requests, 8 at a time, streaming and not, completions and
chat; every greedy answer must equal offline decoding and none may be lost."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from serve_helpers import MODEL, chat_ids, scrape, text_ids

REQUESTS = 50
CONCURRENCY = 8


def _request(i: int) -> dict:
    words = " ".join(f"w{(7 * i + 3 * k) % 90 + 2:02d}" for k in range(2 + i % 5))
    return {"i": i, "chat": i % 3 == 0, "stream": i % 2 == 1, "words": words, "max_tokens": 8 + (i * 5) % 25}


def _call(client, r: dict) -> tuple[str, int, float]:
    """(text, completion tokens, seconds) of one request through the openai client."""
    t0 = time.perf_counter()
    common = dict(model=MODEL, max_tokens=r["max_tokens"], temperature=0)
    if r["chat"]:
        messages = [{"role": "user", "content": r["words"]}]
        if r["stream"]:
            chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                         stream_options={"include_usage": True}, **common))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return text, chunks[-1].usage.completion_tokens, time.perf_counter() - t0
        out = client.chat.completions.create(messages=messages, **common)
        return out.choices[0].message.content, out.usage.completion_tokens, time.perf_counter() - t0
    if r["stream"]:
        chunks = list(client.completions.create(prompt=r["words"], stream=True,
                                                stream_options={"include_usage": True}, **common))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        return text, chunks[-1].usage.completion_tokens, time.perf_counter() - t0
    out = client.completions.create(prompt=r["words"], **common)
    return out.choices[0].text, out.usage.completion_tokens, time.perf_counter() - t0


def test_load(server, client, tokenizer, reference, capsys):
    requests = [_request(i) for i in range(REQUESTS)]
    before = scrape(server)
    t0 = time.perf_counter()
    errors: list[str] = []
    results: dict[int, tuple[str, int, float]] = {}

    def run(r: dict) -> None:
        try:
            results[r["i"]] = _call(client, r)
        except Exception as exc:  # counted and reported, then asserted to be none
            errors.append(f"request {r['i']}: {type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(run, requests))
    wall = time.perf_counter() - t0
    after = scrape(server)

    mismatches = []
    for r in requests:
        if r["i"] not in results:
            continue
        ids = chat_ids(tokenizer, [{"role": "user", "content": r["words"]}]) if r["chat"] else text_ids(tokenizer, r["words"])
        if results[r["i"]][0] != reference(ids, r["max_tokens"]):
            mismatches.append(r["i"])
    tokens = sum(n for _, n, _ in results.values())
    latencies = sorted(s for _, _, s in results.values())
    served = sum(after.get(("specula_requests_total", (("endpoint", ep), ("status", "200"))), 0)
                 - before.get(("specula_requests_total", (("endpoint", ep), ("status", "200"))), 0)
                 for ep in ("/v1/completions", "/v1/chat/completions"))
    with capsys.disabled():
        print(f"\nload: {REQUESTS} requests ({sum(r['stream'] for r in requests)} streamed, "
              f"{sum(r['chat'] for r in requests)} chat), concurrency {CONCURRENCY}, errors {len(errors)}, "
              f"mismatches {len(mismatches)}, {tokens} tokens in {wall:.2f}s = {tokens / wall:.1f} tokens/s, "
              f"{REQUESTS / wall:.1f} requests/s, latency p50 {latencies[len(latencies) // 2]:.3f}s "
              f"max {latencies[-1]:.3f}s")
    assert not errors, errors[:3]
    assert len(results) == REQUESTS and served == REQUESTS
    assert not mismatches, mismatches
    assert after[("specula_generated_tokens_total", ())] - before[("specula_generated_tokens_total", ())] == tokens
    assert after[("specula_queue_depth", ())] == 0
