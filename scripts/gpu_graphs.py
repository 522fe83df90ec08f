"""Measurements for docs/gpu.md (issue 29): the native backend's CUDA-graph path against its eager
path, the bfloat16 slowdown, specula's plain decoding on both backends, and Hugging Face `generate`
peers (dynamic cache; static cache + torch.compile; prompt lookup), on random weights of real
model shapes (nothing downloaded: timings do not depend on the weights' values).

    python scripts/gpu_graphs.py --out DIR [--sections bf16,buckets,decode,exact,peers]
        [--shapes smollm2-135m:float32,smollm2-135m:bfloat16,qwen2.5-1.5b:bfloat16,qwen2.5-7b:bfloat16]

Each section appends its records to DIR/results.jsonl as it goes (a failing section is logged and
the next one runs); a summary table is printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch

SHAPES = {
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                                   max_position_embeddings=8192, rope_parameters={"rope_theta": 100000.0,
                                                                                   "rope_type": "default"})),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                                   num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                                   max_position_embeddings=32768, rope_parameters={"rope_theta": 1e6,
                                                                                    "rope_type": "default"})),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                                 max_position_embeddings=32768, rope_parameters={"rope_theta": 1e6,
                                                                                  "rope_type": "default"})),
}
SHAPES["tiny"] = ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
                                 max_position_embeddings=2048))
DEVICE = torch.device("cuda:0")
OUT: Path = Path(".")
RESULTS: list[dict] = []
T0 = time.perf_counter()


def record(**row) -> None:
    row["t"] = round(time.perf_counter() - T0, 1)
    RESULTS.append(row)
    with (OUT / "results.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def random_model(shape: str, dtype: torch.dtype, init: float = 0.02):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    arch, kwargs = SHAPES[shape]
    cls, cfg_cls = (LlamaForCausalLM, LlamaConfig) if arch == "llama" else (Qwen2ForCausalLM, Qwen2Config)
    config = cfg_cls(**kwargs, attn_implementation="sdpa", initializer_range=init, bos_token_id=0, eos_token_id=1,
                     pad_token_id=0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with torch.device(DEVICE):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def native(model, graphs: bool, compile_ops: bool = False, attention: str = "matmul"):
    from specula.models.native import NativeCausalLM, NativeDecoder, configure

    backend = NativeCausalLM(configure(NativeDecoder.from_hf(model), "aten", "none", "sdpa"), "native",
                             eos_token_ids=[], cuda_graphs=False)
    if graphs:
        backend.set_cuda_graphs(True, compile_ops=compile_ops, capture=DEVICE.type == "cuda", attention=attention)
    return backend


def late(args) -> bool:
    """Past the --deadline: remaining shapes and sections are skipped (recorded)."""
    return time.perf_counter() - T0 > args.deadline


def sdpa_context(name: str | None):
    if not name:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, b) for b in name.split("+")])


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


# ---------------------------------------------------------------------------- sections
def one_token_steps(backend, steps: int = 64, context: int = 256, sdpa: str | None = None, grow: bool = True) -> float:
    """Seconds per one-token step (argmax read back each step, as the engine does)."""
    from specula.tree import TokenTree

    seq = backend.new_sequence()
    gen = torch.Generator().manual_seed(0)
    seq.prefill(torch.randint(0, backend.vocab_size, (context,), generator=gen).tolist(), logits="none")
    empty, tok = TokenTree.empty(), 5
    with sdpa_context(sdpa):
        for i in range(steps + 8):
            if i == 8:
                sync()
                t0 = time.perf_counter()
            logits = backend_tree(seq, tok, empty)
            tok = int(logits[0].argmax())
            seq.commit(())
            if not grow:
                seq.crop(context)
        sync()
    seq.release()
    return (time.perf_counter() - t0) / steps


def backend_tree(seq, root, tree):
    return seq.forward_tree(root, tree)


def section_bf16(args) -> None:
    """Why bfloat16 decodes slower than float32 on SmolLM2 (eager native backend)."""
    from torch.profiler import ProfilerActivity, profile

    if args.bf16_quick:  # the fix checked: default SDPA choice inside the decoder, context growing
        for dtype in (torch.float32, torch.bfloat16):
            model = random_model("smollm2-135m" if DEVICE.type == "cuda" else "tiny", dtype)
            ms = 1000 * one_token_steps(native(model, graphs=False))
            record(section="bf16", dtype=str(dtype), sdpa="decoder default (no cuDNN)", context="grows",
                   ms_per_step=round(ms, 3))
            del model
        return
    for dtype in (torch.float32, torch.bfloat16):
        model = random_model("smollm2-135m" if DEVICE.type == "cuda" else "tiny", dtype)
        eager = native(model, graphs=False)
        for sdpa in (None, "FLASH_ATTENTION+EFFICIENT_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
            if dtype == torch.float32 and sdpa not in (None, "EFFICIENT_ATTENTION"):
                continue
            for grow in (True, False):
                try:
                    ms = 1000 * one_token_steps(eager, sdpa=sdpa, grow=grow)
                    record(section="bf16", dtype=str(dtype), sdpa=sdpa or "default", context="grows" if grow else "fixed",
                           ms_per_step=round(ms, 3))
                except Exception as exc:  # a backend refusing the shape
                    record(section="bf16", dtype=str(dtype), sdpa=sdpa or "default", error=str(exc).splitlines()[0][:160])
        cuda = DEVICE.type == "cuda"
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            one_token_steps(eager, steps=8)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
        table_cuda = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12) if cuda else ""
        (OUT / f"profile_eager_{str(dtype).split('.')[-1]}.txt").write_text(table + "\n\n" + table_cuda)
        print(table_cuda[:3000], flush=True)
        del eager, model
        torch.cuda.empty_cache()


def pass_times(backend, sizes, context: int, repeats: int) -> dict[int, float]:
    """Median seconds of a pass verifying n tokens (root + chain of n - 1) after `context` tokens."""
    from specula.tree import TokenTree

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, backend.vocab_size, (context + max(sizes),), generator=gen).tolist()
    prefix, root, chain = ids[:context], ids[context], ids[context + 1:]
    seq = backend.new_sequence()
    seq.prefill(prefix, logits="none")
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeats + 2):
        for n in sizes:
            tree = TokenTree.chain(chain[: n - 1])
            sync()
            t0 = time.perf_counter()
            logits = seq.forward_tree(root, tree)
            logits[:, 0].max().item()
            sync()
            if r >= 2:
                times[n].append(time.perf_counter() - t0)
            seq.commit(())
            seq.crop(context)
    seq.release()
    return {n: statistics.median(t) for n, t in times.items()}


def section_buckets(args) -> None:
    sizes = [1, 2, 4, 8, 16, 32, 64]
    for spec in args.shapes.split(","):
        shape, dtype_name = spec.split(":")
        dtype = getattr(torch, dtype_name)
        model = random_model(shape, dtype)
        variants = [("eager", dict(graphs=False)), ("graph", dict(graphs=True))]
        if shape in args.sdpa_shapes.split(","):
            variants.append(("graph-sdpa", dict(graphs=True, attention="sdpa")))
        if shape in args.compile_shapes.split(","):
            variants.append(("graph+compile", dict(graphs=True, compile_ops=True)))
        if late(args):
            record(section="buckets", shape=shape, dtype=dtype_name, error="skipped: past the deadline")
            continue
        for name, options in variants:
            try:
                t0 = time.perf_counter()
                backend = native(model, **options)
                times = pass_times(backend, sizes, args.context, args.repeats)
                base = times[1]
                record(section="buckets", shape=shape, dtype=dtype_name, path=name, context=args.context,
                       ms={n: round(1000 * t, 3) for n, t in times.items()},
                       ratio={n: round(t / base, 3) for n, t in times.items()},
                       seconds=round(time.perf_counter() - t0, 1),
                       captures=backend.graphs.stats["captures"] if backend.graphs else 0)
                del backend
            except Exception:
                record(section="buckets", shape=shape, dtype=dtype_name, path=name, error=traceback.format_exc()[-1500:])
        del model
        torch.cuda.empty_cache()


def plain_decode(decoder, prompt, n):
    from specula.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    out = decoder.generate(prompt, params)
    sync()
    return out.token_ids, time.perf_counter() - t0


def section_decode(args) -> None:
    from specula.api import build_decoder
    from specula.models.hf import HFCausalLM

    n = args.new_tokens
    for spec in args.shapes.split(","):
        shape, dtype_name = spec.split(":")
        if late(args):
            record(section="decode", shape=shape, dtype=dtype_name, error="skipped: past the deadline")
            continue
        dtype = getattr(torch, dtype_name)
        model = random_model(shape, dtype)
        gen = torch.Generator().manual_seed(2)
        prompt = torch.randint(2, model.config.vocab_size, (64,), generator=gen).tolist()
        backends = [("native-eager", lambda: native(model, graphs=False)), ("native-graph", lambda: native(model, True))]
        if shape in args.compile_shapes.split(","):
            backends.append(("native-graph+compile", lambda: native(model, True, compile_ops=True)))
        backends.append(("hf", lambda: HFCausalLM(model, "hf", eos_token_ids=[])))
        backends = [(name, make) for name, make in backends if name in args.decode_backends.split(",")]
        outputs = {}
        for name, make in backends:
            try:
                backend = make()
                dec = build_decoder("none", backend)
                _, warm = plain_decode(dec, prompt, min(n, 32) if name == "hf" else n)  # captures / warm-up
                ids, seconds = plain_decode(dec, prompt, n)
                outputs[name] = ids
                same = None
                if "native-eager" in outputs and name != "native-eager":
                    ref = outputs["native-eager"]
                    same = next((i for i, (a, b) in enumerate(zip(ref, ids)) if a != b), len(ids))
                record(section="decode", shape=shape, dtype=dtype_name, backend=name, new_tokens=n,
                       tok_per_s=round(n / seconds, 1), ms_per_token=round(1000 * seconds / n, 3),
                       warmup_s=round(warm, 2), identical_prefix_vs_eager=same)
                del backend, dec
            except Exception:
                record(section="decode", shape=shape, dtype=dtype_name, backend=name, error=traceback.format_exc()[-1500:])
        if "peers" in args.sections:
            hf_peers(model, shape, dtype_name, prompt, n, outputs.get("native-graph"))
        del model
        torch.cuda.empty_cache()


def hf_peers(model, shape, dtype_name, prompt, n, reference=None) -> None:
    """Hugging Face generate: dynamic cache; static cache (auto-compiled: torch.compile
    reduce-overhead); prompt lookup (dynamic and static)."""
    ids = torch.tensor([prompt], device=DEVICE)
    peers = [("hf:generate", {}), ("hf:static+compile", {"cache_implementation": "static"}),
             ("hf:prompt-lookup", {"prompt_lookup_num_tokens": 10})]
    # prompt lookup with the static cache is left out: its candidates write past the static cache
    # (sized for max_new_tokens): an IndexError on CPU, a device-side assert on CUDA that breaks the
    # process (measured with transformers 5.24 on an H100)
    for name, extra in peers:
        try:
            kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **extra)
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, **kwargs)  # warm-up (compilation for the static cache)
                sync()
                warm = time.perf_counter() - t0
                t0 = time.perf_counter()
                out = model.generate(ids, **kwargs)
                sync()
            seconds = time.perf_counter() - t0
            new = out.shape[1] - ids.shape[1]
            tokens = out[0, ids.shape[1]:].tolist()
            same = None if reference is None else next(
                (i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), min(len(tokens), len(reference)))
            record(section="peers", shape=shape, dtype=dtype_name, backend=name, new_tokens=int(new),
                   tok_per_s=round(new / seconds, 1), ms_per_token=round(1000 * seconds / new, 3),
                   warmup_s=round(warm, 1), identical_prefix_vs_native_graph=same)
        except Exception:
            record(section="peers", shape=shape, dtype=dtype_name, backend=name, error=traceback.format_exc()[-1200:])
        torch._dynamo.reset() if hasattr(torch, "_dynamo") else None


def section_exact(args) -> None:
    """float32: graph-path logits vs eager logits on real shapes; greedy agreement over 128 tokens."""
    from specula.api import build_decoder

    cases = [("smollm2-135m", 0.02), ("qwen2.5-1.5b", 0.02)]
    if DEVICE.type == "cpu":
        cases = [("tiny", 0.02), ("tiny", 0.3)]
    for shape, init in cases:
        model = random_model(shape, torch.float32, init)
        gen = torch.Generator().manual_seed(3)
        prompt = torch.randint(2, model.config.vocab_size, (40,), generator=gen).tolist()
        eager, fixed = native(model, False), native(model, True)
        a = build_decoder("none", eager).generate
        from specula.sampling import SamplingParams

        params = SamplingParams(max_new_tokens=128, ignore_eos=True)
        ids_e, ids_f = a(prompt, params).token_ids, build_decoder("none", fixed).generate(prompt, params).token_ids
        first = next((i for i, (x, y) in enumerate(zip(ids_e, ids_f)) if x != y), len(ids_e))
        # logits of one tree pass of 23 nodes after the prompt
        from specula.tree import TokenTree

        tree = TokenTree.chain(ids_e[:23])
        rel = []
        for backend in (eager, fixed):
            seq = backend.new_sequence()
            seq.prefill(prompt[:-1], logits="none")
            rel.append(seq.forward_tree(prompt[-1], tree))
            seq.release()
        diff = float((rel[0] - rel[1]).abs().max() / rel[0].abs().max())
        record(section="exact", shape=shape, init=init, dtype="float32", greedy_identical_prefix=first,
               of=len(ids_e), tree_logits_max_rel_diff=diff)
        del model, eager, fixed
        torch.cuda.empty_cache()


def summary() -> None:
    print("\n==== summary ====")
    for r in RESULTS:
        if "error" in r:
            print(f"{r['section']:8} {r.get('shape', '')} {r.get('dtype', '')} {r.get('backend', r.get('path', r.get('sdpa')))}: "
                  f"ERROR {r['error'].strip().splitlines()[-1][:150]}")
        elif r["section"] == "buckets":
            print(f"buckets  {r['shape']} {r['dtype']} {r['path']}: 1 tok {r['ms']['1'] if '1' in r['ms'] else r['ms'][1]} ms; "
                  f"ratios " + " ".join(f"{k}:{v}" for k, v in r["ratio"].items()))
        elif r["section"] in ("decode", "peers"):
            same = r.get("identical_prefix_vs_eager", r.get("identical_prefix_vs_native_graph"))
            print(f"{r['section']:8} {r['shape']} {r['dtype']} {r['backend']}: {r['tok_per_s']} tok/s "
                  f"({r['ms_per_token']} ms) warm {r['warmup_s']}s same={same}")
        else:
            print(json.dumps(r))


def main() -> None:
    global OUT, DEVICE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="bf16,buckets,decode,exact")
    ap.add_argument("--shapes", default="smollm2-135m:float32,smollm2-135m:bfloat16,qwen2.5-1.5b:bfloat16,"
                                        "qwen2.5-7b:bfloat16")
    ap.add_argument("--compile-shapes", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--sdpa-shapes", default="", help="shapes whose graph path is also timed with SDPA attention")
    ap.add_argument("--decode-backends", default="native-eager,native-graph,native-graph+compile,hf")
    ap.add_argument("--bf16-quick", action="store_true", help="bf16 section: only the decoder's default, growing context")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds after which remaining shapes are skipped")
    ap.add_argument("--cpu-smoke", action="store_true", help="run the script's code on the CPU (uncaptured passes)")
    args = ap.parse_args()
    if args.cpu_smoke:
        DEVICE = torch.device("cpu")
    elif not torch.cuda.is_available():
        sys.exit("error: no CUDA device; this script measures a GPU")
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    import transformers

    record(section="env", torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
           gpu=torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu")
    funcs = {"bf16": section_bf16, "buckets": section_buckets, "decode": section_decode, "exact": section_exact}
    for name in args.sections.split(","):
        if name not in funcs:
            continue
        try:
            funcs[name](args)
        except Exception:
            record(section=name, error=traceback.format_exc()[-2000:])
    summary()


if __name__ == "__main__":
    main()
