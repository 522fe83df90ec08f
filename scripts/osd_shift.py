"""Online distillation on a shifted domain: the same head file drafting a stream of requests from
a domain its training barely covered, with and without `--online-distill`, side by side in one
process (greedy; outputs must be identical to plain decoding either way).

    python scripts/osd_shift.py --target smollm2-135m --head runs/heads/smollm2-eagle/eagle.safetensors \
        --out runs/osd-shift.json

Prompts: SQL, shell, JavaScript, C and config-file tasks written here (not a benchmark's).
Reports mean accepted tokens per step and tokens/s over the first and the second half of the
stream: the online head starts equal and should pull ahead in the second half.
"""

from __future__ import annotations

import argparse
import json
import time

PROMPTS = [
    "Write a SQL query that lists each department with its average salary, highest first.",
    "Write a bash one-liner that counts the lines of every .log file in a directory.",
    "Write a JavaScript function that debounces another function by 300 milliseconds.",
    "Write a C function that returns the length of a null-terminated string without strlen.",
    "Write a YAML config for a web service with a port, a log level and two database hosts.",
    "Write a SQL query that finds customers who placed no order in 2023.",
    "Write a bash script that retries a command up to five times with a delay.",
    "Write a JavaScript class for a stack with push, pop and peek.",
    "Write a C struct for a 2D point and a function that computes the distance between two points.",
    "Write a Dockerfile for a small Python web application.",
    "Write a SQL statement that creates a table of books with an id, a title, an author and a year.",
    "Write a bash function that prints the ten largest files under the current directory.",
    "Write a JavaScript function that deep-clones a plain object.",
    "Write a C program that reads integers from standard input and prints their sum.",
    "Write a Makefile with build, test and clean targets for a C project.",
    "Write a SQL query that returns the second highest salary in an employees table.",
    "Write a bash script that renames every .jpeg file in a folder to .jpg.",
    "Write a JavaScript function that groups an array of objects by a key.",
    "Write a C function that reverses a singly linked list.",
    "Write a JSON schema for a user with a name, an email and an optional age.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--head", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N prompts")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    from specula.api import build_decoder
    from specula.drafters.heads.runtime import load_head
    from specula.models.loading import LoadConfig, encode_prompt, load_backend
    from specula.sampling import SamplingParams

    torch.set_num_threads(2)
    target, tok = load_backend(args.target, LoadConfig(), "target")
    plain = build_decoder("none", target, tok)
    runs = {name: build_decoder("eagle", target, tok, head=load_head(args.head, target, args.target),
                                online_distill=online, planner=False, tree_nodes=16, tree_depth=4)
            for name, online in (("offline", False), ("online-distill", True))}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows = []
    for i, text in enumerate(PROMPTS[: args.prompts]):
        ids = encode_prompt(tok, text)
        ref = plain.generate(ids, params).token_ids
        row = {"prompt": i}
        for name, dec in runs.items():
            t0 = time.perf_counter()
            out = dec.generate(ids, params)
            row[name] = {"seconds": time.perf_counter() - t0, "tokens": len(out.token_ids),
                         "steps": out.stats.steps, "identical": out.token_ids == ref}
        rows.append(row)
        print(i, {n: round(row[n]["tokens"] / max(1, row[n]["steps"]), 2) for n in runs}, flush=True)
    half = len(rows) // 2
    summary = {}
    for name in runs:
        for part, sel in (("first_half", rows[:half]), ("second_half", rows[half:])):
            tokens = sum(r[name]["tokens"] for r in sel)
            summary[f"{name}/{part}"] = {"mean_accepted": round(tokens / sum(r[name]["steps"] for r in sel), 3),
                                         "tokens_per_s": round(tokens / sum(r[name]["seconds"] for r in sel), 2),
                                         "identical": all(r[name]["identical"] for r in sel)}
    print(json.dumps(summary, indent=2))
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
