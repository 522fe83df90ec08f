"""GPU measurements for docs/gpu.md: cost curves of random-weight model shapes, and which fused
attention kernels accept a tree mask.

    python scripts/gpu_measure.py curves --shapes qwen2.5-1.5b,qwen2.5-7b --out DIR
    python scripts/gpu_measure.py attention --out DIR

Random weights of a real architecture have the real cost (shapes, kernels, launches); nothing is
downloaded. Each curve is `specula.planner.measure_cost_curve` on the backend the CLI would use
(`--backend hf` and `native`), in bfloat16 on the first CUDA device, written as
DIR/cost_curve_<shape>_<backend>.json (the format `--cost-curve` reads).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    # Qwen2.5 configs (hidden, intermediate, layers, heads, kv heads, vocabulary, tied embeddings)
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}


def random_model(shape: str, dtype: torch.dtype, device: torch.device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_parameters={"rope_theta": 1e6,
                         "rope_type": "default"}, attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def curves(args) -> None:
    from specula.bench.machine import machine_info
    from specula.models.hf import HFCausalLM
    from specula.models.native import NativeCausalLM, NativeDecoder, configure
    from specula.planner.cost import measure_cost_curve

    device = torch.device("cuda:0")
    sizes = [int(s) for s in args.sizes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes.split(","):
        t0 = time.perf_counter()
        model = random_model(shape, torch.bfloat16, device)
        print(f"{shape}: random bf16 weights on {torch.cuda.get_device_name(device)} in {time.perf_counter() - t0:.1f}s",
              flush=True)
        backends = {"hf": lambda: HFCausalLM(model, shape),
                    "native": lambda: NativeCausalLM(configure(NativeDecoder.from_hf(model), "aten", "none", "sdpa"),
                                                     shape)}
        for name in args.backends.split(","):
            backend = backends[name]()
            t0 = time.perf_counter()
            curve = measure_cost_curve(backend, sizes, context=args.context, repeats=args.repeats)
            payload = {**curve.to_dict(), "target": f"random {shape}", "dtype": "bfloat16", "backend": name,
                       "machine": machine_info(device), "seconds_to_measure": round(time.perf_counter() - t0, 1)}
            (out / f"cost_curve_{shape}_{name}.json").write_text(json.dumps(payload, indent=1))
            ratios = " ".join(f"{n}:{r:.2f}" for n, r in zip(payload["sizes"], payload["ratio"]))
            print(f"{shape} {name}: 1 token {1000 * curve.seconds[0]:.2f} ms; ratios {ratios}", flush=True)
            del backend
        del model
        torch.cuda.empty_cache()


def attention(args) -> None:
    """Which SDPA kernels run a tree pass (an arbitrary boolean / additive 4D mask) on this GPU."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device("cuda:0")
    q = torch.randn(1, 28, 64, 128, device=device, dtype=torch.bfloat16)  # [batch, heads, rows, dim]
    k = torch.randn(1, 28, 1088, 128, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tree = torch.rand(64, 1088, device=device) < 0.9
    tree[:, :1024] = True
    masks = {"none": None, "causal-offset bool": tree, "additive float": torch.zeros(64, 1088, device=device,
                                                                                  dtype=torch.bfloat16).masked_fill(~tree, -1e4)}
    report = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        for name, mask in masks.items():
            try:
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(50):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    torch.cuda.synchronize()
                report[f"{backend.name} / {name}"] = f"ok, {1e6 * (time.perf_counter() - t0) / 50:.1f} us"
            except RuntimeError as exc:
                report[f"{backend.name} / {name}"] = f"refused: {str(exc).splitlines()[0][:120]}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sdpa_backends.json").write_text(json.dumps(report, indent=1))
    for key, value in report.items():
        print(f"{key}: {value}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("curves")
    c.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-7b")
    c.add_argument("--backends", default="hf,native")
    c.add_argument("--sizes", default="1,2,4,8,16,32,64,128,256")
    c.add_argument("--context", type=int, default=512)
    c.add_argument("--repeats", type=int, default=5)
    c.add_argument("--out", required=True)
    a = sub.add_parser("attention")
    a.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device; this script measures a GPU")
    {"curves": curves, "attention": attention}[args.what](args)


if __name__ == "__main__":
    main()
