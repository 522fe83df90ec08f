"""What speculation costs under load, in process (no HTTP): B sessions stepped together through
`decoder.step(sessions)` (one packed pass per step, as the server's worker does), plain decoding
(`none`) against a method on the same target, repeats interleaved. Prints each repeat's tokens/s
ratio and min / median / max, and, with --profile, where the method's step time goes. Each repeat
alternates which of the two runs first (run second, plain decoding read 0.97-1.08x itself, median
1.03x, at batch 6); --decode-only times the steps alone (at batch 6 the prefill of the prompts is
about two thirds of a run, and its noise swamps the steps'). The batch is closed: plain decoding's
sessions all finish on the same step, while a method's finish apart (each accepts its own drafts),
and its last steps run at smaller batches, whose packed passes yield fewer tokens a second. A
server refills its batch: `scripts/serve_load.py` measures that (SmolLM2, 6 sessions, session 118:
this script read `fusion` 0.88-0.94x, the server under a steady load of 6 requests 0.99-1.07x).

    python scripts/batch_overhead.py --target smollm2-135m --batch 8 --max-new-tokens 48 --repeats 3
    python scripts/batch_overhead.py --target smollm2-135m --batch 6 --max-batch-size 8   # a row read between
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time


def run_batch(decoder, prompts, params, decode_only: bool = False) -> tuple[int, float, int]:
    """(new tokens, seconds, drafted tokens) of one batch run to completion (`decode_only`: the
    seconds of the decode steps alone, the prompts' prefill left out)."""
    t0 = time.perf_counter()
    sessions = [decoder.start(p, params) for p in prompts]
    if decode_only:
        t0 = time.perf_counter()
    while not all(s.finished for s in sessions):
        decoder.step(sessions)
    seconds = time.perf_counter() - t0
    for s in sessions:
        decoder.finish(s)
    return sum(len(s.generated) for s in sessions), seconds, sum(s.stats.drafted_tokens for s in sessions)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--method", default="fusion")
    p.add_argument("--draft", default="none")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="the packed-pass table's largest row, as a server's --max-batch-size (default --batch); "
                        "a larger one reads --batch between its timed rows")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-only", action="store_true", help="time the decode steps alone (no prefill)")
    p.add_argument("--profile", action="store_true", help="cProfile one batch run of the method")
    args = p.parse_args()

    from specula.api import EngineConfig, build_decoder, load
    from specula.bench.datasets import load_prompts, select_prompts
    from specula.sampling import SamplingParams

    off = EngineConfig(prefix_cache_mib=0)  # prompts repeat: measure without the prefix cache
    spec = load(args.target, draft=args.draft, method=args.method, engine=off)
    plain = build_decoder("none", spec.target, spec.tokenizer, engine=off)
    chosen = select_prompts(load_prompts("spec-bench"), None, None, 0)
    step = max(1, len(chosen) // args.batch)
    prompts = [spec.encode(q.turns[0]) for q in chosen[::step][: args.batch]]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    spec.prepare_batch(max(args.batch, args.max_batch_size or args.batch))
    run_batch(plain, prompts[:2], SamplingParams(max_new_tokens=4))  # warm-up
    ratios = []
    for r in range(args.repeats):
        runs = {}
        for name in (("none", "method") if r % 2 == 0 else ("method", "none")):
            runs[name] = run_batch(plain if name == "none" else spec.decoder, prompts, params, args.decode_only)
        (n0, s0, _), (n1, s1, drafted) = runs["none"], runs["method"]
        ratios.append((n1 / s1) / (n0 / s0))
        print(f"repeat {r + 1}: none {n0 / s0:.1f} tok/s, {args.method} {n1 / s1:.1f} tok/s "
              f"({drafted} drafted): {ratios[-1]:.2f}x", flush=True)
    print(f"{args.method} / none at batch {args.batch}: min {min(ratios):.2f}x, median "
          f"{statistics.median(ratios):.2f}x, max {max(ratios):.2f}x")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run_batch(spec.decoder, prompts, params)
        prof.disable()
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
