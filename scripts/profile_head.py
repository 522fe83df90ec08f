"""Time one EAGLE head pass (its decoder layer, then the draft-vocabulary logits) in float32 and
bfloat16 for frontiers of 1, 8 and 32 rows, at a SmolLM2-135M shape (576 wide, 9 heads of 64,
MLP 1536, 8192-token draft vocabulary), 300 committed rows in the head's KV cache, 2 threads.

    python3 scripts/profile_head.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specula.drafters.heads.config import HeadConfig  # noqa: E402
from specula.drafters.heads.eagle import EagleHead, KVBuffer  # noqa: E402

CFG = HeadConfig(kind="eagle", hidden_size=576, target_vocab=49152, draft_vocab=8192, num_heads=9, num_kv_heads=9,
                 head_dim=64, intermediate_size=1536, num_offsets=4)


def time_pass(dtype: torch.dtype, rows: int, ctx: int = 300, reps: int = 200) -> tuple[float, float]:
    """(layer ms, logits ms) of one head pass over `rows` frontier rows."""
    module = EagleHead(CFG).eval().to(dtype)
    lm_rows = torch.randn(CFG.draft_vocab, CFG.hidden_size).to(dtype)  # [V_draft, E]
    cache = KVBuffer(CFG.num_kv_heads, CFG.head_dim, dtype, "cpu", 1024)
    emb = torch.randn(1, rows, CFG.hidden_size, dtype=dtype)
    feat = torch.randn(1, rows, CFG.hidden_size, dtype=dtype)
    pos = torch.arange(ctx, ctx + rows)[None]
    mask = torch.ones(1, rows, ctx + rows, dtype=torch.bool)
    with torch.inference_mode():
        for _ in range(20):
            out, _ = module(emb, feat, pos, mask=mask, cache=cache, at=ctx)
            (out[0] @ lm_rows.t()).float()
        t0 = time.perf_counter()
        for _ in range(reps):
            out, _ = module(emb, feat, pos, mask=mask, cache=cache, at=ctx)
        t1 = time.perf_counter()
        for _ in range(reps):
            (out[0] @ lm_rows.t()).float()
        t2 = time.perf_counter()
    return (t1 - t0) / reps * 1e3, (t2 - t1) / reps * 1e3


def main() -> None:
    torch.set_num_threads(2)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 8, 32):
            layer, logits = time_pass(dtype, rows)
            print(f"{str(dtype):15s} rows={rows:3d} layer {layer:.3f} ms  logits {logits:.3f} ms")


if __name__ == "__main__":
    main()
