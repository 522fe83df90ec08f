"""Time one EAGLE head pass (its decoder layer, then the draft-vocabulary logits) in float32 and
bfloat16 for frontiers of 1, 8 and 32 rows, at a SmolLM2-135M shape (576 wide, 9 heads of 64,
MLP 1536, 8192-token draft vocabulary), 300 committed rows in the head's KV cache, 2 threads.

    python3 scripts/profile_head.py
"""
import time, torch, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from specula.drafters.heads.config import HeadConfig
from specula.drafters.heads.eagle import EagleHead, KVBuffer
torch.set_num_threads(2)
cfg = HeadConfig(kind="eagle", hidden_size=576, target_vocab=49152, draft_vocab=8192, num_heads=9, num_kv_heads=9,
                 head_dim=64, intermediate_size=1536, num_offsets=4)
m = EagleHead(cfg).eval()
lm = torch.randn(8192, 576)
def bench(dtype, rows, ctx=300, reps=200):
    mod = EagleHead(cfg).eval().to(dtype); l = lm.to(dtype)
    cache = KVBuffer(9, 64, dtype, "cpu", 1024)
    emb = torch.randn(1, rows, 576, dtype=dtype); feat = torch.randn(1, rows, 576, dtype=dtype)
    pos = torch.arange(ctx, ctx+rows)[None]
    mask = torch.ones(1, rows, ctx+rows, dtype=torch.bool)
    with torch.inference_mode():
        for _ in range(20):
            out, _ = mod(emb, feat, pos, mask=mask, cache=cache, at=ctx); (out[0] @ l.t()).float()
        t = time.perf_counter()
        for _ in range(reps):
            out, _ = mod(emb, feat, pos, mask=mask, cache=cache, at=ctx)
        t1 = time.perf_counter()
        for _ in range(reps):
            (out[0] @ l.t()).float()
        t2 = time.perf_counter()
    return (t1-t)/reps*1e3, (t2-t1)/reps*1e3
for dt in (torch.float32, torch.bfloat16):
    for rows in (1, 8, 32):
        a, b = bench(dt, rows)
        print(f"{str(dt):15s} rows={rows:3d} layer {a:.3f} ms  logits {b:.3f} ms")
