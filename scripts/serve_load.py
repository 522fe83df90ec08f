"""Load generator for `specula serve` (loopback only, bounded, stops by itself).

Starts the server as a subprocess for each configuration, drives it with the official `openai`
client at the given concurrencies over Spec-Bench prompts (first turns, streamed chat
completions), and reports throughput, time to first token and inter-token latency percentiles,
errors, and whether every greedy answer equals plain decoding's (the first configuration,
`none:1` by default: plain decoding one request at a time, is the reference), plus from the
server's /metrics the mean batch size and the request-steps on which speculation was switched off
by load. Writes a JSON file and prints a Markdown table.

    python scripts/serve_load.py --target smollm2-135m --requests 32 --concurrency 1,4,8 \
        --configs "none:1,none:8,fusion:1,fusion:8" --max-tokens 64 --out runs/serve-load.json

A configuration is METHOD:MAX_BATCH_SIZE[:PREFIX_CACHE_MIB[:CHUNKED_PREFILL_SIZE]]. The servers run without their
prefix cache unless the configuration or `--prefix-cache-mib` says otherwise, and with the server's chunked prefill
unless the configuration or `--chunked-prefill-size` says otherwise. The inter-token latency (ITL) percentiles are
over every gap between two streamed pieces of text; a stream's longest gap (percentiles over the requests, and the
longest of all) is what a prompt prefilled whole in the middle of other streams shows. The servers draft with no draft model unless
`--draft` names one (`auto`: what `serve` picks by default). `--turns 2` sends MT-bench's two-turn
questions as conversations (the second turn after the first's answer) and times the second turns: what the
prefix cache saves a chat server.

    python scripts/serve_load.py --target qwen2.5-coder-1.5b --turns 2 --requests 12 --concurrency 1,4 \
        --configs "fusion:4:0,fusion:4:1024" --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(count: int, turns: int) -> list[tuple[str, ...]]:
    """`count` Spec-Bench prompts spread over its groups (their first turns), or with `turns` 2 MT-bench's
    two-turn questions."""
    from specula.bench.datasets import load_prompts, select_prompts

    chosen = select_prompts(load_prompts("spec-bench"), None, None, 0)
    if turns == 2:
        chosen = [p for p in chosen if len(p.turns) >= 2]
    step = max(1, len(chosen) // count)
    return [tuple(p.turns[:turns]) for p in chosen[::step]][:count]


def start_server(args, method: str, batch: int, cache_mib: int, chunk: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "specula", "serve", "--target", args.target, "--method", method,
           "--port", str(port), "--max-batch-size", str(batch), "--max-queue", "1024", "--draft", args.draft,
           "--prefix-cache-mib", str(cache_mib), *(["--chunked-prefill-size", str(chunk)] if chunk is not None else [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    import urllib.request

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit("server did not come up in 600 s")


def conversation(client, model: str, turns: tuple[str, ...], max_tokens: int, temperature: float) -> dict:
    """Each turn asked after the answers to the ones before (the whole conversation sent again, as a chat
    client does); the last turn's measurements, with every turn's text and tokens."""
    messages: list[dict] = []
    texts, tokens = [], 0
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        r = one(client, model, messages, max_tokens, temperature)
        messages.append({"role": "assistant", "content": r["text"]})
        texts.append(r["text"])
        tokens += r["tokens"]
    return {**r, "text": "\n".join(texts), "tokens": tokens}


def one(client, model: str, messages: list[dict], max_tokens: int, temperature: float) -> dict:
    t0 = time.perf_counter()
    first, stamps, text, tokens = None, [], [], 0
    stream = client.chat.completions.create(model=model, messages=messages,
                                            max_tokens=max_tokens, temperature=temperature, seed=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = now - t0
            stamps.append(now)
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    total = time.perf_counter() - t0
    per_token = (stamps[-1] - stamps[0]) / max(1, tokens - 1) if len(stamps) > 1 else None
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"text": "".join(text), "tokens": tokens, "ttft": first, "seconds": total, "per_token": per_token,
            "gaps": gaps}


def pct(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def scrape(url: str) -> dict[str, float]:
    """Unlabelled samples of the server's /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def drive(url: str, model: str, items: list[tuple[str, ...]], concurrency: int, max_tokens: int,
          temperature: float) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    results: dict[int, dict] = {}
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            results[i] = conversation(client, model, items[i], max_tokens, temperature)
        except Exception as exc:  # counted and reported
            errors.append(f"{i}: {type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(run, range(len(items))))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results.values())
    return {
        "concurrency": concurrency, "requests": len(items), "errors": errors, "wall_seconds": wall,
        "tokens": tokens, "tokens_per_s": tokens / wall,
        "ttft_p50": pct([r["ttft"] for r in results.values()], 0.5),
        "ttft_p99": pct([r["ttft"] for r in results.values()], 0.99),
        "per_token_p50": pct([r["per_token"] for r in results.values()], 0.5),
        "per_token_p99": pct([r["per_token"] for r in results.values()], 0.99),
        "itl_p50": pct([g for r in results.values() for g in r["gaps"]], 0.5),
        "itl_p99": pct([g for r in results.values() for g in r["gaps"]], 0.99),
        "longest_gap": max((g for r in results.values() for g in r["gaps"]), default=None),
        "stall_p50": pct([max(r["gaps"], default=None) for r in results.values()], 0.5),
        "stall_p99": pct([max(r["gaps"], default=None) for r in results.values()], 0.99),
        "texts": {i: r["text"] for i, r in results.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--configs", default="none:1,none:8,fusion:8",
                    help="METHOD:MAX_BATCH_SIZE[:PREFIX_CACHE_MIB[:CHUNKED_PREFILL_SIZE]], comma-separated (defaults: "
                         "--prefix-cache-mib, --chunked-prefill-size); the first is the reference for the equality "
                         "check")
    ap.add_argument("--turns", type=int, choices=(1, 2), default=1,
                    help="2: MT-bench's two-turn questions, the second asked after the answer to the first; the "
                         "latencies are the second turns' (tokens/s counts both)")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--draft", default="none",
                    help="the servers' --draft (default none: no draft model; auto: what `serve` picks, the 0.5B "
                         "for the 1.5B)")
    ap.add_argument("--out", default="runs/serve-load.json")
    ap.add_argument("--prefix-cache-mib", type=int, default=0,
                    help="the server's prefix cache (default 0, off: every concurrency sends the same prompts, so a "
                         "cache would serve the later ones whole; this measures decoding)")
    ap.add_argument("--chunked-prefill-size", type=int, default=None,
                    help="the server's chunked prefill (default: the server's own, 128 tokens on its CPU kernels)")
    args = ap.parse_args()
    configs = [(method, int(batch), int(rest[0]) if rest else args.prefix_cache_mib,
                int(rest[1]) if len(rest) > 1 else args.chunked_prefill_size)
               for method, batch, *rest in (config.split(":") for config in args.configs.split(","))]
    levels = [int(x) for x in args.concurrency.split(",")]
    # with a prefix cache, each concurrency gets prompts of its own: a server that kept the earlier level's
    # conversations would serve them whole
    distinct = any(cache_mib for _, _, cache_mib, _ in configs)
    pool = prompts(args.requests * (len(levels) if distinct else 1), args.turns)
    items = [pool[k * args.requests:(k + 1) * args.requests] if distinct else pool for k in range(len(levels))]
    rows, reference = [], {}
    for method, batch, cache_mib, chunk in configs:
        proc, url = start_server(args, method, batch, cache_mib, chunk)
        try:
            for k, c in enumerate(levels):
                print(f"{method} batch {batch} concurrency {c} ...", file=sys.stderr, flush=True)
                before = scrape(url)
                r = drive(url, args.target, items[k], c, args.max_tokens, args.temperature)
                after = scrape(url)
                delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                r["mean_batch_size"] = delta["specula_batch_size_sum"] / max(1.0, delta["specula_batch_size_count"])
                r["speculation_off_by_load"] = delta.get("specula_speculation_off_by_load_total", 0.0)
                r["drafted_tokens"] = delta.get("specula_drafted_tokens_total", 0.0)
                r["accepted_tokens"] = delta.get("specula_accepted_tokens_total", 0.0)
                same = reference.setdefault(k if distinct else 0, r["texts"])
                r["identical_to_reference"] = (sum(r["texts"].get(i) == t for i, t in same.items())
                                               / len(same)) if args.temperature == 0 else None
                rows.append({"method": method, "max_batch_size": batch, "prefix_cache_mib": cache_mib,
                             "chunked_prefill_size": chunk, **r})
        finally:
            proc.terminate()
            proc.wait(30)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": [{k: v for k, v in r.items() if k != "texts"}
                                                                        for r in rows]}, indent=1))
    print("| server | concurrency | tokens/s | TTFT p50 / p99 (s) | per-token p50 / p99 (ms) | ITL p50 / p99 (ms) | "
          "a stream's longest gap p50 / p99 / max (s) | mean batch | accepted / drafted | off by load | errors | "
          "identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    f = lambda v, k=1.0: "-" if v is None else f"{v * k:.2f}"  # noqa: E731
    for r in rows:
        same = "-" if r["identical_to_reference"] is None else f"{r['identical_to_reference']:.0%}"
        cached = f", cache {r['prefix_cache_mib']} MiB" if r["prefix_cache_mib"] else ""
        if r["chunked_prefill_size"] is not None:
            cached += f", chunks {r['chunked_prefill_size']}"
        print(f"| `{r['method']}` batch {r['max_batch_size']}{cached} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
              f"{f(r['ttft_p50'])} / {f(r['ttft_p99'])} | "
              f"{f(r['per_token_p50'], 1e3)} / {f(r['per_token_p99'], 1e3)} | "
              f"{f(r['itl_p50'], 1e3)} / {f(r['itl_p99'], 1e3)} | "
              f"{f(r['stall_p50'])} / {f(r['stall_p99'])} / {f(r['longest_gap'])} | "
              f"{r['mean_batch_size']:.1f} | {r['accepted_tokens']:.0f} / {r['drafted_tokens']:.0f} | "
              f"{r['speculation_off_by_load']:.0f} | {len(r['errors'])} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
