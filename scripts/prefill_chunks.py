"""A prompt's prefill in one pass, in the backend's passes (`NativeCausalLM.prefill_pass`) and in chunks (chunked
prefill), side by side in one process: the time of each, and whether each leaves the same hidden states and next
logits, bit for bit, as one pass.

    python scripts/prefill_chunks.py --target qwen2.5-coder-1.5b --tokens 800 --chunks 512,256,128,64 --repeats 2

The prompt is the everyday prompts' text, joined (repeated as needed) and cut to `--tokens` tokens. Each way runs
`--repeats` times, the ways in turn; prints each way's best and median seconds, its tokens/s and whether its hidden
states and the next token's logits equal one pass's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import specula  # noqa: F401 (before torch: the OpenMP spin setting)
import specula.api as api
import torch

from specula.prefill import PromptPrefill

PROMPTS = Path(__file__).resolve().parents[1] / "specula" / "data" / "everyday" / "prompts.jsonl"


def prompt_ids(spec, tokens: int) -> list[int]:
    text = "\n\n".join(json.loads(line)["turns"][0] for line in PROMPTS.read_text().splitlines() if line.strip())
    ids = spec.tokenizer.encode(text)
    return (ids * (tokens // len(ids) + 1))[: tokens + 1]  # repeated where the prompts hold fewer


def run(target, ids: list[int], way: int | str) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(seconds, hidden states [len(ids) - 1, E], the last token's logits) of one prefill: in one pass ("one
    pass"), as the backend runs a prompt ("default": passes of at most its `prefill_pass`), or in `way`-token
    chunks (chunked prefill)."""
    seq = target.new_sequence()
    pending = PromptPrefill(ids, hidden=True)
    default = target.prefill_pass
    target.prefill_pass = None if way == "one pass" else default
    t0 = time.perf_counter()
    while not pending.finished:
        pending.run(seq, way if isinstance(way, int) else None)
    seconds = time.perf_counter() - t0
    target.prefill_pass = default
    logits = seq.prefill(ids[-1:], logits="last")
    seq.release()
    return seconds, pending.features(), logits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=800)
    ap.add_argument("--chunks", default="512,256,128,64")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    spec = api.load(args.target, method="none")
    ids = prompt_ids(spec, args.tokens)
    ways: list[int | str] = ["one pass", "default", *(int(c) for c in args.chunks.split(","))]
    times: dict[int | str, list[float]] = {w: [] for w in ways}
    reference = None
    equal = {w: True for w in ways}
    for _ in range(args.repeats):
        for way in ways:
            seconds, hidden, logits = run(spec.target, ids, way)
            times[way].append(seconds)
            if reference is None:
                reference = (hidden, logits)
            equal[way] &= torch.equal(hidden, reference[0]) and torch.equal(logits, reference[1])
    print(f"{args.target}, a {args.tokens}-token prompt, {args.repeats} repeats; the backend's passes: at most "
          f"{spec.target.prefill_pass or 'all'} tokens")
    print("| prefill | best / median (s) | tokens/s (best) | equal to one pass |")
    print("|---|---|---|---|")
    for way in ways:
        best, median = min(times[way]), statistics.median(times[way])
        print(f"| {way if isinstance(way, str) else f'chunks of {way}'} | {best:.2f} / {median:.2f} | "
              f"{args.tokens / best:.0f} | {'yes' if equal[way] else 'NO'} |")
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
