"""Draft choices for the Qwen2.5-Coder-1.5B target, side by side in one process: the 0.5B int8 and the
int8 self-draft as fixed draft-model chains (3, 5, 8 tokens, planner off) and inside fusion, on 4
prompts written here (chat, email, math, code; not Spec-Bench), 64 new tokens, decode phase
(prefill excluded), each against plain decoding of the same run. Needs both models installed.

    python scripts/compare_drafts.py
"""
import argparse

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
from specula.api import build_decoder
from specula.models.loading import load_backend, load_draft, LoadConfig, encode_prompt
from specula.sampling import SamplingParams
import torch
torch.set_num_threads(2)
cfg = LoadConfig()
target, tok = load_backend("qwen2.5-coder-1.5b", cfg, "target")
drafts = {
  "0.5b-int8": load_draft("qwen2.5-coder-0.5b", tok, target, cfg, target_name="qwen2.5-coder-1.5b", quantize="int8"),
  "self-int8": load_draft("self", tok, target, cfg, target_name="qwen2.5-coder-1.5b"),
}
prompts = ["Explain in three sentences why the sky is blue.",
           "Write a short email asking my manager for a day off next Friday.",
           "A train travels 120 km in 1.5 hours. What is its average speed in km/h? Show the steps.",
           "Write a Python function that merges two sorted lists into one sorted list."]
ids = [encode_prompt(tok, p) for p in prompts]
params = SamplingParams(max_new_tokens=64)
def run(dec):
    t = 0.0; n = 0; acc = []; outs = []
    for x in ids:
        out = dec.generate(x, params)
        t += out.stats.seconds - out.stats.prefill_seconds if hasattr(out.stats, "prefill_seconds") else out.stats.seconds
        n += len(out.token_ids); acc.append(out.stats.mean_accepted_tokens); outs.append(out.token_ids)
    return n / t, sum(acc)/len(acc), outs
plain = build_decoder("none", target, tok)
plain.generate(ids[0], SamplingParams(max_new_tokens=8))
configs = [(d, k) for d in drafts for k in (3, 5, 8)]
base = run(plain)
print("plain", f"{base[0]:.2f} tok/s", flush=True)
for d, k in configs:
    dec = build_decoder("draft-model", target, tok, drafts[d], planner=False, num_draft_tokens=k)
    dec.generate(ids[0], SamplingParams(max_new_tokens=8))
    r = run(dec)
    same = all(a == b for a, b in zip(r[2], base[2]))
    print(d, k, f"{r[0]:.2f} tok/s {r[0]/base[0]:.2f}x acc {r[1]:.2f} identical {same}", flush=True)
for d in drafts:
    dec = build_decoder("fusion", target, tok, drafts[d])
    dec.generate(ids[0], SamplingParams(max_new_tokens=8))
    r = run(dec)
    print("fusion", d, f"{r[0]:.2f} tok/s {r[0]/base[0]:.2f}x acc {r[1]:.2f}", flush=True)
base2 = run(plain)
print("plain again", f"{base2[0]:.2f} tok/s", flush=True)
