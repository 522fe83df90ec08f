"""Median latency of one target pass of n tokens (the root + a chain of n - 1 nodes) after a
200-token context, per n: the kernels' cost curve in a few seconds, for A/B runs of kernel changes
(run it from two checkouts in turn). Nothing is cached: the model is prepared in memory
(`--prepared-cache off`), so checkouts with different kernel code do not rebuild each other's
prepared entries. Unlike `specula profile` (the planner's cost curve), it keeps every pass: the
profile discards rounds timed while other processes work, and a busy machine is one of the cases
this script compares.

    python scripts/pass_latency.py --target smollm2-135m --sizes 1,4,8,16 --threads 2

`--breakdown` adds, per size, the mean ms per pass inside each C kernel called from Python (linear,
attention, norms, RoPE, SiLU; the rest is Python and torch glue), timed by wrapping the library's
functions; passes of up to 64 tokens run their layers in one C call (`decoder_pass`,
`models/native/fused.py`), so `--python-layers` runs them from Python to see each kernel;
`--context N` sets the tokens before the pass (attention grows with it); `--quantize int8` times the
int8 model; `--isa avx512,amx` times each size under each kernel variant in turn, in one process
(`SPECULA_KERNEL_ISA`'s values; the variants compute the same bits).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import specula  # noqa: F401  (before torch: its OpenMP spin setting)
import torch

from specula.models.loading import LoadConfig, load_backend
from specula.models.native import kernels
from specula.tree import TokenTree

KERNEL_CALLS = ("specula_decoder_pass", "specula_linear_f32", "specula_linear_w8", "specula_linear_i8",
                "specula_attention", "specula_add_rms_norm", "specula_rope_write", "specula_silu_mul")


def time_kernels() -> collections.Counter:
    """Wrap the kernel library's functions so each call adds its seconds to the returned counter."""
    lib, spent = kernels.library(), collections.Counter()
    for name in KERNEL_CALLS:
        def timed(*args, fn=getattr(lib, name), name=name):
            t0 = time.perf_counter()
            result = fn(*args)
            spent[name.removeprefix("specula_")] += time.perf_counter() - t0
            return result
        setattr(lib, name, timed)
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--sizes", default="1,4,8,16", help="tokens per pass, comma-separated")
    p.add_argument("--passes", type=int, default=20, help="timed passes per size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=200, help="tokens in the cache before each pass")
    p.add_argument("--breakdown", action="store_true", help="also the ms per pass inside each C kernel")
    p.add_argument("--quantize", default="none", choices=("none", "int8"), help="the target's weights")
    p.add_argument("--python-layers", action="store_true",
                   help="run the layers from Python, one kernel call per op (the path before the C loop)")
    p.add_argument("--isa", default="", help="kernel variants to time in turn per size (e.g. avx512,amx); "
                                              "default: the one in force")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_backend(args.target, LoadConfig(prepared_cache="off", quantize=args.quantize), "target")
    if args.python_layers:
        from specula.models.native.fused import FusedLayers

        FusedLayers.of = staticmethod(lambda decoder: None)
    spent = time_kernels() if args.breakdown else None
    medians = []
    variants = [v for v in args.isa.split(",") if v] or [kernels.isa()]
    for n, isa in ((int(s), v) for s in args.sizes.split(",") for v in variants):
        if kernels.set_isa(isa) != isa:
            raise SystemExit(f"error: this machine cannot run the {isa} kernels; drop it from --isa")
        seq = target.new_sequence()
        seq.prefill([100 + i % 1000 for i in range(args.context)], logits="last")
        tree, times = TokenTree.chain([7] * (n - 1), source="chain"), []
        if spent is not None:
            spent.clear()
        for _ in range(args.passes):
            t0 = time.perf_counter()
            seq.forward_tree(5, tree)
            times.append(time.perf_counter() - t0)
            seq.commit([])
        label = f"n={n}" + (f" {isa}" if len(variants) > 1 else "")
        medians.append(f"{label}: {statistics.median(times) * 1e3:.1f} ms")
        seq.release()
        if spent is not None:
            inside = " ".join(f"{name} {sec / args.passes * 1e3:.2f}" for name, sec in spent.most_common())
            other = (sum(times) - sum(spent.values())) / args.passes * 1e3
            print(f"{label}: {statistics.mean(times) * 1e3:.1f} ms mean; {inside}; other {other:.2f}")
    print(" ".join(medians))


if __name__ == "__main__":
    main()
