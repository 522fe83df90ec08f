"""What a head costs and accepts in each drafting precision: one head level (a frontier of 1 and of 4
rows, context 300) and its draft-vocabulary logits, timed; then greedy 5-token chains over the
everyday prompts with no planner (every chain verified whole), tokens per decode step.

    python3 scripts/head_kernels.py --target smollm2-135m --kind eagle3 --threads 2

Needs the head installed (`specula models install smollm2-135m`) or given with --head.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specula.api import Specula, load  # noqa: E402
from specula.drafters.heads.runtime import TrainedHead, load_head  # noqa: E402
from specula.methods import default_head, get_method  # noqa: E402
from specula.bench.datasets import EVERYDAY, load_prompts  # noqa: E402

PRECISIONS = ("float32", "bfloat16", "w8", "i8", "i4")


def head_in(precision: str, base: TrainedHead) -> TrainedHead:
    """The loaded float32 head drafting in `precision` (torch float32 / bfloat16, or a kernel)."""
    module = copy.deepcopy(base.module)
    if precision in ("float32", "bfloat16"):
        return TrainedHead(module.to(getattr(torch, precision)), base.d2t, base.target, base.file)
    return TrainedHead(module, base.d2t, base.target, base.file, kernel=precision)


def level_ms(head: TrainedHead, rows: int, context: int = 300, reps: int = 100) -> tuple[float, float]:
    """(head level ms, root logits ms) with `context` committed pairs in the head's cache."""
    state = head.new_state()
    width = head.config.hidden_size * max(1, len(head.config.feature_layers or ()))
    state.add_features(torch.randn(context + 1, width))
    tokens = list(range(100, 100 + context + 1))
    nodes, parents, kids = list(range(rows)), [-1] * rows, [5 + i for i in range(rows)]

    def timed(feed: bool) -> float:
        for _ in range(10):
            state.finish(())
            state.begin(tokens)
            if feed:
                state.feed(nodes, kids, parents)
        t0 = time.perf_counter()
        for _ in range(reps):
            state.finish(())
            state.begin(tokens)
            if feed:
                state.feed(nodes, kids, parents)
        return (time.perf_counter() - t0) / reps * 1e3

    begin = timed(False)
    return timed(True) - begin, begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--kind", default="eagle3")
    parser.add_argument("--head", default=None, help="head file (default: the installed one)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plain = load(args.target, method="none")
    path = args.head or default_head(get_method(args.kind), args.target)
    base = load_head(path, plain.target, args.target, torch.float32)
    prompts = [p.turns[0] for p in load_prompts(EVERYDAY)]
    print("| drafting in | 1 row: level + logits | 4 rows: level + logits | 5-token chains: tokens per step |")
    print("|---|---|---|---|")
    for precision in PRECISIONS:
        head = head_in(precision, base)
        one, four = level_ms(head, 1), level_ms(head, 4)
        spec = Specula(plain.target, plain.tokenizer, args.kind, None, planner="none", head=head,
                       target_name=args.target, tree_top_k=1, tree_depth=5)
        steps = tokens = 0
        for prompt in prompts:
            out = spec.generate(prompt, max_new_tokens=args.max_new_tokens)
            steps, tokens = steps + out.stats.steps, tokens + len(out.token_ids)
        print(f"| {precision} | {one[0]:.2f} + {one[1]:.2f} ms | {four[0]:.2f} + {four[1]:.2f} ms | {tokens / steps:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
