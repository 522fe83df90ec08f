"""One truncated sampled row's cost through the output screen against the float32 row, on a target's real states.

    python scripts/screen_row_cost.py --target qwen2.5-coder-1.5b --top-k 40 --top-p 0.95 --min-p 0.05
    python scripts/screen_row_cost.py --target qwen2.5-coder-1.5b --top-k 0 --top-p 0.95   # top-p over every id

The states are the final states of a short answer's verification passes (plain decoding, screened); per row the
median of a few timings of each way, then the median, min and max over the rows: the screen's int8 pass of the
row, its candidates and the race over them (`OutputScreen.edited_top`, `sampling.truncated_race`); the float32
row and the same race over it; the float32 row and the race over `probabilities` (the way before session 129).
Where the screen cannot say (top-p over every id: bounds that leave the nucleus open) the first way goes on to the
whole row, as verification does. The first two must pick the same token (checked on every row the screen decides);
the candidates a row took are counted, and the rows left to the whole row.
"""

from __future__ import annotations

import argparse
import statistics
import time

import specula  # noqa: F401 (before torch: the OpenMP spin setting)
import specula.api as api
import torch

from specula.models.native import screen
from specula.sampling import SamplingParams, position_noise, probabilities, race_token, truncated_race
from specula.tree_rows import RowEdit


def median_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--prompt", default="Explain how a hash map works, with an example in Python.")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    if not params.truncates:
        raise SystemExit("give a truncation: --top-k, --top-p or --min-p (--top-k 0 --top-p P: top-p over every id)")
    passes = []
    real_init = screen.ScreenedPass.__init__

    def keep(self, states, output_screen):
        real_init(self, states, output_screen)
        passes.append((self.states, output_screen))
    screen.ScreenedPass.__init__ = keep
    spec = api.load(args.target, method="none")
    spec.generate(args.prompt, max_new_tokens=args.rows + 8)
    screen.ScreenedPass.__init__ = real_init
    rows = [(states[i], layer) for states, layer in passes for i in range(states.shape[0])][-args.rows:]
    if not rows:
        raise SystemExit(f"{args.target}'s passes were not screened (an output layer under "
                         f"{screen.SCREEN_MIN_WEIGHTS} weights, or not the native backend)")
    times: dict[str, list[float]] = {"screen": [], "row": [], "before": []}
    candidates = []
    for i, (x, layer) in enumerate(rows):
        noise = position_noise(1, i, layer.head.out_features)
        xs = x.view(1, -1).contiguous()

        def raced(kept) -> int | None:  # the screen's kept ids raced; None where it cannot say
            if kept is None:
                return None
            ids, values, rest = kept
            return truncated_race(ids, values, noise[ids], params, rest)

        def screen_token() -> int | None:
            return raced(layer.edited_top(x, layer.approx_logits(xs)[0], RowEdit(), params.top_k, params.kept_within,
                                          params.ranks_every_id))

        def whole_row() -> int:
            return truncated_race(None, layer.head(xs)[0], noise, params)

        def through_screen() -> int:  # as `verify_raced_logits` takes it: the whole row where the screen cannot say
            token = screen_token()
            return whole_row() if token is None else token

        def before() -> int:
            return race_token(probabilities(layer.head(xs)[0][None], params)[0], noise)
        kept = layer.edited_top(x, layer.approx_logits(xs)[0], RowEdit(), params.top_k, params.kept_within,
                                params.ranks_every_id)
        token = raced(kept)
        candidates.append(-1 if token is None else len(kept[0]))
        if token is not None and token != whole_row():
            raise SystemExit(f"row {i}: the screen's token {token} is not the whole row's {whole_row()}")
        for name, fn in (("screen", through_screen), ("row", whole_row), ("before", before)):
            times[name].append(median_ms(fn))
    print(f"{args.target}, {len(rows)} rows, {params.top_k=} {params.top_p=} {params.min_p=} T={params.temperature}")
    for name, label in (("screen", "through the screen"), ("row", "the float32 row, then the race"),
                        ("before", "the float32 row, probabilities, race_token")):
        v = times[name]
        print(f"  {label}: median {statistics.median(v):.2f} ms (min {min(v):.2f}, max {max(v):.2f})")
    screened = [c for c in candidates if c >= 0]
    print(f"  candidates a row: median {statistics.median(screened) if screened else 0} (min {min(screened or [0])}, "
          f"max {max(screened or [0])}); {len(candidates) - len(screened)} rows the screen left to the whole row")


if __name__ == "__main__":
    main()
