"""The linear kernels' AVX2 and AVX-512 variants side by side, in one process: median ms of one call
per row count over a stack of layers holding as many weights as SmolLM2-135M (150 x [1536, 576]),
each variant timed in turn for every row count, and the ratio; on a CPU with AMX-INT8, the i8 and i4
kinds on AMX tiles too (calls of 10 rows or more). The variants compute the same bits
(tests/models/test_kernel_isa.py); this says what each costs.

    python scripts/kernel_isa.py --kinds f32,w8,i8,i4 --rows 1,2,4,6,8,12,16,24,32
"""

from __future__ import annotations

import argparse
import statistics
import time

import specula  # noqa: F401  (before torch: its OpenMP spin setting)
import torch
from torch import nn

from specula.models.native import kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="f32,w8,i8", help="kernel kinds, comma-separated")
    p.add_argument("--rows", default="1,2,4,6,8,12,16,24,32", help="rows per call, comma-separated")
    p.add_argument("--layers", type=int, default=150)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    amx = kernels.set_isa("amx") == "amx"
    if kernels.set_isa("avx512") != "avx512":
        raise SystemExit("this CPU has no AVX-512 F/BW/VNNI: only the AVX2 variant runs here")
    for kind in args.kinds.split(","):
        variants = ("avx2", "avx512", "amx") if amx and kind in ("i8", "i4") else ("avx2", "avx512")
        layers = [kernels.KernelLinear(nn.Linear(576, 1536, bias=False), kind) for _ in range(args.layers)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, 576)  # [rows, in]
            ms = {}
            for isa in variants:
                kernels.set_isa(isa)
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    for layer in layers:
                        layer(x)
                    times.append(time.perf_counter() - t0)
                ms[isa] = statistics.median(times) * 1e3
            with_amx = f"  amx {ms['amx']:7.2f} ms  avx512/amx {ms['avx512'] / ms['amx']:.2f}" if "amx" in ms else ""
            print(f"{kind} rows={rows:3d}: avx2 {ms['avx2']:7.2f} ms  avx512 {ms['avx512']:7.2f} ms  "
                  f"avx2/avx512 {ms['avx2'] / ms['avx512']:.2f}{with_amx}")


if __name__ == "__main__":
    main()
