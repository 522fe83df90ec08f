"""`specula profile`: the target's cost curve (forward latency against tokens verified per pass)."""

from __future__ import annotations

import argparse
import math

from specula.commands.common import add_load_args, flags_in_errors, load_config
from specula.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser(
        "profile", help="measure the target's verification cost curve",
        description="Median latency of one target pass verifying n tokens (the root + n-1 draft nodes) after a "
                    "context of C tokens, for each n; writes DIR/cost_curve.json and DIR/cost_curve.png.")
    p.add_argument("--target", required=True, help="target model (alias, local directory, .gguf file or cached hub id)")
    add_load_args(p)
    p.add_argument("--context", type=int, default=512, help="tokens in the KV cache before each pass (default 512)")
    p.add_argument("--sizes", default="1,2,4,8,16,32,64", help="tokens per pass, comma-separated (default 1,2,4,...,64)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per size after one warm-up (default 5)")
    p.add_argument("--batch-sizes", default=None,
                   help="also time packed passes of b sequences (continuous batching), e.g. 1,2,4,8,16: "
                        "latency against batch size and tokens per sequence, as the serving planner uses it")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(handler=run)


def parse_sizes(value: str, option: str = "--sizes") -> list[int]:
    try:
        sizes = [int(v) for v in value.split(",") if v.strip()]
    except ValueError as exc:
        raise ConfigError(f"{option} must be comma-separated integers, got {value!r}") from exc
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"{option} must be integers >= 1, got {value!r}")
    return sizes


def run(args: argparse.Namespace) -> int:
    from specula.api import load_backend
    from specula.bench.machine import machine_info
    from specula.bench.plots import COST_CURVE_PNG, plot_cost_curve
    from specula.planner.cost import TimingConfig, measure_cost_curve
    from specula.paths import atomic_write_json, check_output

    sizes = parse_sizes(args.sizes)
    if max(sizes) < 2:
        raise ConfigError(f"--sizes needs a pass size above 1, got {args.sizes!r}: a curve of plain steps alone "
                          "says nothing about what drafted tokens cost to verify (e.g. --sizes 1,2,4,8,16)")
    batch_sizes = parse_sizes(args.batch_sizes, "--batch-sizes") if args.batch_sizes else None
    if args.repeats < 1 or args.context < 1:
        raise ConfigError("--repeats and --context must be >= 1")
    load_config(args)  # --device / --dtype checked before anything loads
    out = check_output(args.out, "--out", "dir")
    with flags_in_errors(args):  # the library names LoadConfig's fields (backend="native")
        target, _ = load_backend(args.target, load_config(args), "target")
    # every size asked for is timed: the planner's start-up rule (sizes past the first costing over
    # TimingConfig.max_ratio plain steps left out) dropped them from the table without a word
    every_size = TimingConfig(max_ratio=math.inf)
    with flags_in_errors(args, ["context", "sizes"]):  # the library names its keywords (context=)
        curve = measure_cost_curve(target, sizes, args.context, args.repeats, config=every_size)
    key = target.cost_key()
    payload = {**curve.to_dict(), "target": args.target, "dtype": key.get("dtype"), "attn": key.get("attention"),
               "quantize": key.get("quantize", args.quantize), "linear_kernel": key.get("linear_kernel"),
               "backend": key.get("backend"), "machine": machine_info(target.device)}
    if batch_sizes is not None:
        from specula.planner.batch_cost import DEFAULT_BATCH_TOKENS, measure_batch_curve

        tokens = [n for n in DEFAULT_BATCH_TOKENS if n <= max(sizes)]
        payload["batch"] = measure_batch_curve(target, batch_sizes, tokens, min(args.context, 128),
                                               args.repeats, config=every_size).to_dict()
    json_path = atomic_write_json(out / "cost_curve.json", payload)
    png = plot_cost_curve(payload, out / COST_CURVE_PNG, f"Cost curve: {args.target} (context {args.context})")
    print(f"{'tokens':>8} {'ms':>10} {'ratio':>7}")
    for n, s, r in zip(payload["sizes"], payload["seconds"], payload["ratio"]):
        print(f"{n:>8} {1000 * s:>10.2f} {r:>7.2f}")
    if batch_sizes is not None:
        batch = payload["batch"]
        per_seq = batch["totals"][0]  # the b = 1 row: tokens per sequence
        print(f"\npacked passes (ms) of b sequences x n tokens each (context {batch['context']}):")
        print(f"{'b':>4} " + " ".join(f"{'n=' + str(n):>9}" for n in per_seq) + f" {'ms/token at n=1':>16}")
        for b, secs in zip(batch["batch_sizes"], batch["seconds"]):
            print(f"{b:>4} " + " ".join(f"{1000 * s:>9.2f}" for s in secs) + f" {1000 * secs[0] / b:>16.2f}")
    print(f"wrote {json_path}, {png}")
    return 0
