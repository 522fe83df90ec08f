"""What the planner does on two cost curves: the target's measured one and another one (a flat,
GPU-like curve, or one measured elsewhere with `specula profile`: `--cost-curve FILE`).

    python scripts/planner_demo.py --target smollm2-135m --per-category 1 --max-new-tokens 64
    python scripts/planner_demo.py --target smollm2-135m --cost-curve cost_curve_qwen2.5-7b_native.json

For each Spec-Bench prompt (first turn) it runs `fusion` twice on the same target: once planned
on the cost curve measured here, once on the other curve (by default a synthetic flat one:
verifying 64 tokens costs the same as one). The acceptance is this target's, measured here, so
the second run projects what the planner would reach on a machine with that curve (a projection,
not a measurement). Outputs are checked identical to plain greedy. Prints, per curve: mean tree size,
predicted vs realised mean accepted tokens, and the planner's projected speedup over plain
decoding on that curve (the realised speed on this machine only makes sense for the measured one).
On the other curve the planner is told the verify times that curve predicts, not this machine's:
its online cost corrections and its back-off (judged on realised tokens/s) then act as they
would on such a machine instead of learning this CPU's steep curve back.
"""

from __future__ import annotations

import argparse
import json

from specula.api import LoadConfig, build_decoder, load_backend
from specula.bench.datasets import load_prompts, select_prompts
from specula.models.loading import encode_prompt
from specula.planner import CostCurve, HardwarePlanner, load_or_measure_curve
from specula.sampling import SamplingParams


def simulated_verify_times(planner: HardwarePlanner, curve: CostCurve):
    """planner.observe, fed the verify time `curve` predicts for each pass instead of the measured one."""
    observe = planner.observe

    def fake(step, state, draft_seconds, verify_seconds, overhead_seconds=0.0):
        return observe(step, state, draft_seconds, curve.latency(len(step.proposal.tree) + 1), overhead_seconds)

    return fake


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=None, help="use only the first N selected prompts")
    ap.add_argument("--draft", default=None, help="draft model (fusion then includes it)")
    ap.add_argument("--quantize", default="none", choices=("none", "int8"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cost-curve", default=None, help="plan the second run on this curve (cost_curve.json) "
                                                       "instead of a flat one")
    ap.add_argument("--categories", default=None, help="comma-separated Spec-Bench groups (default: all)")
    args = ap.parse_args()

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config = LoadConfig(quantize=args.quantize)
    target, tokenizer = load_backend(args.target, config, "target")
    draft = load_backend(args.draft, config, "draft")[0] if args.draft else None
    measured = load_or_measure_curve(target)
    if args.cost_curve:
        from specula.planner import read_cost_curve

        other, other_name = read_cost_curve(args.cost_curve), args.cost_curve
    else:
        other = CostCurve(measured.sizes, (measured.seconds[0],) * len(measured.sizes), measured.context)
        other_name = "flat"
    categories = args.categories.split(",") if args.categories else None
    prompts = select_prompts(load_prompts(), args.per_category, categories)[: args.limit]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    plain = build_decoder("none", target, tokenizer)
    references = {}
    report = {}
    for name, curve in (("measured", measured), (other_name, other)):
        planner = HardwarePlanner(curve=curve)
        if curve is other:
            planner.observe = simulated_verify_times(planner, curve)
        decoder = build_decoder("fusion", target, tokenizer, draft, planner=planner)
        tokens = steps = drafted = 0
        predicted = realised = 0.0
        identical = 0
        projected_tokens = projected_plain_steps = 0.0
        for prompt in prompts:
            ids = encode_prompt(tokenizer, prompt.turns[0])
            out = decoder.generate(ids, params)
            if prompt.id not in references:
                references[prompt.id] = plain.generate(ids, params).token_ids
            identical += out.token_ids == references[prompt.id]
            steps += out.stats.steps
            tokens += out.stats.new_tokens
            drafted += out.stats.drafted_tokens
            predicted += out.stats.predicted_accepted
            realised += sum(out.stats.accepted_lengths)
            projection = out.stats.planner
            if projection and projection["steps"]:
                expected = projection["steps"] * projection["expected_tokens_per_step"]
                projected_tokens += expected
                projected_plain_steps += expected / projection["projected_speedup"]
        report[name] = {
            "cost_ratio_8_tokens": round(curve.ratio(8), 2),
            "prompts": len(prompts),
            "identical_to_plain": f"{identical}/{len(prompts)}",
            "mean_tree_nodes": round(drafted / steps, 2),
            "predicted_mean_accepted": round(predicted / steps, 3),
            "realised_mean_accepted": round(realised / steps, 3),
            "projected_speedup_on_this_curve": round(projected_tokens / projected_plain_steps, 3),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
