"""Compare CPU execution options of one target side by side in one process (docs/cpu.md).

    python scripts/cpu_options.py --target qwen2.5-coder-1.5b --threads 2 --prompts 6 --tokens 32 --out runs/cpu-options

Measures, for float32 and `--quantize int8` (attention `auto`, i.e. batch-invariant for int8):
  * decoding speed: specula plain decoding and Hugging Face `generate` on each model, interleaved
    per prompt (first question of the first N Spec-Bench categories, chat template, EOS ignored);
  * quality of int8: perplexity and teacher-forced top-1 agreement with float32 on held-out text
    (the docstrings of the stdlib modules argparse, difflib and textwrap), and free-running greedy
    agreement with float32 on the prompts;
  * losslessness of int8: prompt-lookup and token-recycling output == plain decoding of the same
    int8 model, token for token.
Writes OUT/cpu_options.json and prints a summary. Cost curves: `specula profile --quantize ...`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import time

import torch

from specula.api import build_decoder
from specula.bench.datasets import load_prompts
from specula.models.attention import causal_prefill
from specula.models.hf import HFCausalLM
from specula.models.loading import apply_chat_template, load_model
from specula.paths import atomic_write_json
from specula.sampling import SamplingParams


def first_prompts(tokenizer, n: int) -> list[list[int]]:
    seen, out = set(), []
    for prompt in load_prompts("spec-bench"):
        if prompt.source_category not in seen and len(out) < n:
            seen.add(prompt.source_category)
            out.append(apply_chat_template(tokenizer, prompt.turns[0]))
    return out


def held_out_ids(tokenizer, limit: int = 1024) -> torch.Tensor:
    import difflib
    import textwrap

    text = "\n\n".join(inspect.getdoc(m) for m in (argparse, difflib, textwrap))
    return torch.tensor([tokenizer.encode(text)[:limit]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    say = lambda *a: print(*a, flush=True)  # noqa: E731

    float32, tokenizer = load_model(args.target)
    models = {"float32": float32, "int8": load_model(args.target, quantize="int8")[0]}
    prompts = first_prompts(tokenizer, args.prompts)
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    result: dict = {"target": args.target, "threads": args.threads, "tokens": args.tokens, "prompts": len(prompts),
                    "attention": {k: m.config._attn_implementation for k, m in models.items()}}

    with torch.inference_mode():
        # Speed, interleaved per prompt (one untimed warm-up each first).
        plain = {k: build_decoder("none", HFCausalLM(m), tokenizer) for k, m in models.items()}
        timed = {f"specula {k}": [] for k in models} | {f"hf-generate {k}": [] for k in models}
        outputs: dict[str, list[list[int]]] = {k: [] for k in models}

        def hf(model, ids):
            x = torch.tensor([ids])
            t = time.perf_counter()
            with causal_prefill():  # as `specula bench` runs its peers: prefill on sdpa
                model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.tokens,
                               min_new_tokens=args.tokens, do_sample=False)
            return time.perf_counter() - t

        for k, m in models.items():
            plain[k].generate(prompts[0][:16], SamplingParams(max_new_tokens=4, ignore_eos=True))
            hf(m, prompts[0][:16])
        for i, ids in enumerate(prompts):
            for k, m in models.items():
                out = plain[k].generate(ids, params)
                timed[f"specula {k}"].append(out.stats.seconds)
                outputs[k].append(out.token_ids)
                timed[f"hf-generate {k}"].append(hf(m, ids))
            say(f"speed: prompt {i + 1}/{len(prompts)}")
        ms = {k: 1000 * sum(v) / (args.tokens * len(v)) for k, v in timed.items()}
        result["ms_per_token"] = {k: round(v, 1) for k, v in ms.items()}
        result["speedup_vs_hf_float32"] = {k: round(ms["hf-generate float32"] / v, 2) for k, v in ms.items()}
        say("ms/token:", result["ms_per_token"])
        say("speed vs hf-generate float32:", result["speedup_vs_hf_float32"])

        # Quality: held-out perplexity and teacher-forced agreement; free-running agreement.
        ids = held_out_ids(tokenizer)
        logits = {k: m(ids).logits[0, :-1].float() for k, m in models.items()}
        result["held_out_tokens"] = ids.shape[1]
        result["perplexity"] = {k: round(math.exp(torch.nn.functional.cross_entropy(lg, ids[0, 1:])), 3)
                                for k, lg in logits.items()}
        result["teacher_forced_top1_agreement"] = round(
            (logits["int8"].argmax(-1) == logits["float32"].argmax(-1)).float().mean().item(), 4)
        same = sum(a == b for f, q in zip(outputs["float32"], outputs["int8"]) for a, b in zip(f, q))
        prefixes = [next((j for j, (a, b) in enumerate(zip(f, q)) if a != b), len(f))
                    for f, q in zip(outputs["float32"], outputs["int8"])]
        result["free_running_agreement"] = round(same / (args.tokens * len(prompts)), 4)
        result["mean_identical_prefix"] = round(statistics.mean(prefixes), 2)
        say("quality:", {k: result[k] for k in ("perplexity", "teacher_forced_top1_agreement",
                                                 "free_running_agreement", "mean_identical_prefix")})

        # Losslessness of the int8 model: speculative output == its own plain output.
        target = HFCausalLM(models["int8"])
        result["int8_identical_to_plain"] = {}
        for method in ("prompt-lookup", "token-recycling"):
            dec = build_decoder(method, target, tokenizer)
            same = sum(dec.generate(p, params).token_ids == ref for p, ref in zip(prompts, outputs["int8"]))
            result["int8_identical_to_plain"][method] = f"{same}/{len(prompts)}"
        say("int8 speculative == plain int8:", result["int8_identical_to_plain"])
    path = atomic_write_json(f"{args.out}/cpu_options.json", result)
    say(f"wrote {path}")


if __name__ == "__main__":
    main()
