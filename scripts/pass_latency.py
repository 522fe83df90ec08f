"""Median latency of one target pass of n tokens (the root + a chain of n - 1 nodes) after a
200-token context, per n: the kernels' cost curve in a few seconds, for A/B runs of kernel changes
(run it from two checkouts in turn). Nothing is cached: the model is prepared in memory
(`--prepared-cache off`), so checkouts with different kernel code do not rebuild each other's
prepared entries. Unlike `specula profile` (the planner's cost curve), it keeps every pass: the
profile discards rounds timed while other processes work, and a busy machine is one of the cases
this script compares.

    python scripts/pass_latency.py --target smollm2-135m --sizes 1,4,8,16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import specula  # noqa: F401  (before torch: its OpenMP spin setting)
import torch

from specula.models.loading import LoadConfig, load_backend
from specula.tree import TokenTree


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--sizes", default="1,4,8,16", help="tokens per pass, comma-separated")
    p.add_argument("--passes", type=int, default=20, help="timed passes per size")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_backend(args.target, LoadConfig(prepared_cache="off"), "target")
    medians = []
    for n in (int(s) for s in args.sizes.split(",")):
        seq = target.new_sequence()
        seq.prefill(list(range(100, 300)), logits="last")
        tree, times = TokenTree.chain([7] * (n - 1), source="chain"), []
        for _ in range(args.passes):
            t0 = time.perf_counter()
            seq.forward_tree(5, tree)
            times.append(time.perf_counter() - t0)
            seq.commit([])
        medians.append(f"n={n}: {statistics.median(times) * 1e3:.1f} ms")
    print(" ".join(medians))


if __name__ == "__main__":
    main()
