"""torch.compile vs eager PyTorch ops vs specula's C kernels: one-token step of the native SmolLM2 decoder."""
import argparse, time, statistics
import torch
torch.set_num_threads(2)
from specula.models.loading import load_backend, LoadConfig
from specula.tree import TokenTree

def step_ms(backend, n=40):
    seq = backend.new_sequence()
    seq.prefill(list(range(100, 356)), logits="none")
    times = []
    for i in range(n):
        t = time.perf_counter(); seq.forward_tree(200 + i, TokenTree.empty()); seq.commit([])
        times.append(time.perf_counter() - t)
    return statistics.median(times[5:]) * 1e3
parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("target", nargs="?", default="smollm2-135m", help="model (default smollm2-135m)")
name = parser.parse_args().target
eager, _ = load_backend(name, LoadConfig(linear_kernel="aten"), "t")
print("eager TorchOps (aten)", f"{step_ms(eager):.1f} ms", flush=True)
ck, _ = load_backend(name, LoadConfig(linear_kernel="specula"), "t")
print("C kernels (specula)", f"{step_ms(ck):.1f} ms", flush=True)
t = time.perf_counter()
eager.decoder.forward = torch.compile(eager.decoder.forward)
try:
    seq = eager.new_sequence(); seq.prefill(list(range(100, 356)), logits="none"); seq.forward_tree(5, TokenTree.empty())
    print("compile (first call)", f"{time.perf_counter() - t:.1f} s", flush=True)
    print("torch.compile TorchOps", f"{step_ms(eager):.1f} ms", flush=True)
except Exception as e:  # report what failed
    print("torch.compile failed:", type(e).__name__, str(e)[:300])
