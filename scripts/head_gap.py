"""Where does a trained head's acceptance go between the training report and the engine?

For prompts of several sources (the head's own training prompts, seen and held out; the everyday
set; Spec-Bench), generate greedily with the head drafting a chain (no planner, so nothing is cut)
and compare, on the same sequences:

- `engine`: mean accepted tokens per step the engine saw (accepted chain + 1);
- `teacher_walk`: the same greedy walk replayed on the teacher-forced predictions (the roots a
  decode really starts steps at); equal to `engine` when the drafting path is the training forward;
- `teacher`: the training report's measure (`training.trainer.acceptance_report`: teacher-forced
  chain acceptance along the same output, the head fed its own features past depth 1), computed
  from one prefill of prompt + output (full context, as the engine has it);
- `teacher@256`: the same with the context cut into 256-pair chunks, as the training loop sees it.

engine == teacher means the drafting path is the training-time forward, and a gap between
sources is the data's. Output: one JSON object on stdout (per source and per prompt).

    python3 scripts/head_gap.py --target smollm2-135m --per-source 8 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specula import api  # noqa: E402
from specula.training.corpus import read_prompts  # noqa: E402
from specula.training.features import FeatureSet  # noqa: E402
from specula.training.trainer import TrainConfig, acceptance_report, split  # noqa: E402

DATA = ROOT / "specula" / "data"


def sources(per: int, seed: int) -> dict[str, list[str]]:
    """Prompt texts by source. The training prompts' held-out split is the trainer's own
    (`split` over the corpus order with the head's seed and 5%)."""
    train = [text for _, text in read_prompts([DATA / "training" / "prompts.jsonl"])]
    # one token per sequence standing for its prompt (equal texts, one token): `split` leaves out of
    # training every sequence whose prompt a held-out one has, so empty prompts all read as one
    first: dict[str, int] = {}
    keys = torch.tensor([first.setdefault(text, len(first)) for text in train], dtype=torch.long)
    fit, held = split(FeatureSet(keys, torch.zeros(0, 1), torch.arange(len(train) + 1),
                                 torch.ones(len(train), dtype=torch.long)), 0.05, seed)
    every = [json.loads(line)["turns"][0] for line in (DATA / "everyday" / "prompts.jsonl").read_text().splitlines()
             if line.strip()]
    bench = [json.loads(line) for line in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines()
             if line.strip()]
    by_cat: dict[str, list[str]] = {}
    for row in bench:
        by_cat.setdefault(row["category"], []).append(row["turns"][0])
    spec = [t for texts in by_cat.values() for t in texts[: max(1, per // len(by_cat) + 1)]][:per]
    step = max(1, len(every) // per)
    return {"train-seen": [train[i] for i in fit[:: max(1, len(fit) // per)][:per]],
            "train-heldout": [train[i] for i in held[:per]],
            "everyday": every[::step][:per], "spec-bench": spec}


def teacher(spec, ids: list[int], prompt_len: int, seq_len: int, depth: int) -> dict:
    target = spec.decoder.target
    drafter = spec.decoder.drafters[0]
    head = drafter.head
    seq = target.new_sequence()
    _, hidden = seq.prefill(ids, logits="none", hidden=True)  # [n, E]
    seq.release()
    fs = FeatureSet(torch.tensor(ids), hidden.to(torch.float16).cpu(), torch.tensor([0, len(ids)]),
                    torch.tensor([prompt_len]))
    return acceptance_report(head, fs, [0], TrainConfig(seq_len=seq_len, eval_depth=depth), head.embed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--method", default="eagle")
    ap.add_argument("--head", default=None, help="head file (default: the installed one)")
    ap.add_argument("--per-source", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="the head's training seed (for the held-out split)")
    args = ap.parse_args()

    options = {} if args.head is None else {"head": args.head}
    spec = api.load(args.target, method=args.method, planner="none", tree_top_k=1, tree_depth=args.depth,
                    tree_nodes=args.depth, **options)
    report: dict = {"target": args.target, "method": args.method, "depth": args.depth,
                    "max_new_tokens": args.max_new_tokens, "sources": {}}
    for name, prompts in sources(args.per_source, args.seed).items():
        rows = []
        for text in prompts:
            ids = spec.encode(text)
            out = spec.generate(ids, raw=True, max_new_tokens=args.max_new_tokens)
            seq = [*ids, *out.token_ids]
            st = out.stats
            full = teacher(spec, seq, len(ids), 4096, args.depth)
            rows.append({"prompt_tokens": len(ids), "new_tokens": st.new_tokens,
                         "engine": round(sum(st.accepted_lengths) / max(1, len(st.accepted_lengths)), 3),
                         "teacher_walk": full["mean_accepted_walk"], "teacher": full["mean_accepted_chain"],
                         "teacher@256": teacher(spec, seq, len(ids), 256, args.depth)["mean_accepted_chain"]})
            print(name, rows[-1], file=sys.stderr, flush=True)
        report["sources"][name] = {
            "prompts": len(rows),
            **{k: round(statistics.mean(r[k] for r in rows), 3) for k in ("engine", "teacher_walk", "teacher", "teacher@256")},
            "rows": rows}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
