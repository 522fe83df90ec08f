"""How often a sampled request's target token is a draft model's fixed candidate, per position, offline: the
draft's argmax (what the draft-model chain proposed before coupling), its top 4, and its coupled candidate (its q
raced with the target's noise at that position, `DraftContext.coupled_candidate`); 1 - TV (speculative sampling's
chain acceptance, for draws from q) for reference.

    python scripts/coupled_candidates.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --temperature 1.0

Each everyday prompt's answer is sampled by the target (seed 1, 48 tokens); both models' logits at every answer
position are read in one prefill each, and each position's acceptance is the exact p(argmax q) or p(top 4 of q),
and for the coupled candidate the share of `--draws` noise draws on which both races pick the same token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import specula  # noqa: F401 (before torch: the OpenMP spin setting)
import specula.api as api
import torch

from specula.sampling import SamplingParams, probabilities

PROMPTS = Path(__file__).resolve().parents[1] / "specula" / "data" / "everyday" / "prompts.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--draws", type=int, default=64)
    args = ap.parse_args()
    params = SamplingParams(max_new_tokens=48, temperature=args.temperature, seed=1, ignore_eos=True)
    target = api.load(args.target, method="none", draft=None)
    draft = api.load(args.draft, method="none", draft=None)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()][: args.prompts]
    gen = torch.Generator().manual_seed(0)
    found = {"argmax": [], "top 4": [], "coupled": [], "1 - TV": []}
    for row in rows:
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": row["turns"][0]}],
                                                   add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        full = ids + list(target.decoder.generate(ids, params).token_ids)
        rows_pq = []
        for model in (target, draft):
            seq = model.target.new_sequence()
            rows_pq.append(seq.prefill(full[:-1], logits="all")[len(ids) - 1:])  # [answer, vocab]: its positions
            seq.release()
        vocab = min(rows_pq[0].shape[-1], rows_pq[1].shape[-1])
        p, q = (probabilities(r[:, :vocab], params) for r in rows_pq)  # [answer, vocab] each
        for pi, qi in zip(p, q):
            top = qi.topk(4).indices
            noise = torch.empty(args.draws, vocab).exponential_(generator=gen)  # [draws, vocab]
            same = (pi[None] / noise).argmax(-1) == (qi[None] / noise).argmax(-1)
            found["argmax"].append(float(pi[top[0]]))
            found["top 4"].append(float(pi[top].sum()))
            found["coupled"].append(float(same.float().mean()))
            found["1 - TV"].append(float(1 - 0.5 * (pi - qi).abs().sum()))
    print(f"{args.target} <- {args.draft}, temperature {args.temperature}, {len(found['argmax'])} positions")
    for name, values in found.items():
        print(f"  {name:8s} {sum(values) / len(values):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
