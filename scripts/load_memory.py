"""Memory over a model's first load for specula's kernels: resident anonymous and file-backed memory
sampled every 0.2 s while `load_backend` prepares the model in a fresh cache (holding only the
converted models and the compiled kernels, so the entry is prepared, written and mapped back), with
marks at each stage (Hugging Face load, fusing, packing into the entry's file, the rest of the
entry, mapping back). Linux only (reads
/proc/self/status).

    python scripts/load_memory.py qwen2.5-coder-1.5b
    python scripts/load_memory.py qwen2.5-coder-0.5b --quantize int4 --json runs/mem.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cold_start import fresh_cache  # noqa: E402

GIB = 2 ** 20  # /proc reports kB


def resident() -> dict[str, float]:
    """{"anon": GiB, "file": GiB} resident now."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:")):
            key, value = line.split(":")
            out[key[3:].lower()] = int(value.split()[0]) / GIB
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b")
    parser.add_argument("--quantize", default="none", help="none, int8 or int4 (as --quantize)")
    parser.add_argument("--json", type=Path, help="write the samples and marks here")
    args = parser.parse_args()

    from specula.paths import cache_dir

    tmp = tempfile.mkdtemp(prefix="specula-mem-")
    fresh_cache(cache_dir(), Path(tmp), keep=("models", "gguf", "heads", "kernels"))
    os.environ["SPECULA_CACHE"] = tmp

    start = time.perf_counter()
    samples, marks = [], []

    def sample() -> None:
        while True:
            samples.append((time.perf_counter() - start, resident()))
            time.sleep(0.2)

    def marked(fn, name):
        def wrapper(*a, **k):
            marks.append((time.perf_counter() - start, f"{name} start", resident()))
            result = fn(*a, **k)
            marks.append((time.perf_counter() - start, f"{name} end", resident()))
            return result
        return wrapper

    threading.Thread(target=sample, daemon=True).start()
    try:
        run(args, marked, marks, start)
    finally:
        shutil.rmtree(tmp)  # the prepared entry written there (the links to the real cache are not followed)
    report(args, samples, marks)


def run(args, marked, marks, start) -> None:
    """Load `args.model` once with the stages marked."""
    import specula.models.loading as loading
    import specula.models.native as native
    import specula.models.prepared as prepared
    import specula.models.tensor_file as tensor_file
    from specula.models.native.model import NativeDecoder

    from_hf = NativeDecoder.from_hf.__func__
    NativeDecoder.from_hf = classmethod(marked(from_hf, "fuse (from_hf)"))
    native.configure = marked(native.configure, "pack (configure)")
    prepared.build_entry = marked(prepared.build_entry, "entry (build_entry)")
    writer = tensor_file.TensorFileWriter
    writer.finish = marked(writer.finish, "write index, fsync (finish)")
    loading.load_model = marked(loading.load_model, "Hugging Face load")
    loading.load_backend(args.model, loading.LoadConfig(quantize=args.quantize))
    marks.append((time.perf_counter() - start, "loaded (entry mapped back)", resident()))
    time.sleep(0.3)


def report(args, samples, marks) -> None:
    """Print the peaks and the marks; write them as JSON with `--json`."""
    peak_t, peak = max(samples, key=lambda s: s[1]["anon"])
    both = max(s[1]["anon"] + s[1]["file"] for s in samples)
    print(f"{args.model} ({args.quantize}): peak anonymous {peak['anon']:.2f} GiB at {peak_t:.1f} s, "
          f"peak anonymous + file-backed {both:.2f} GiB")
    for t, name, r in marks:
        print(f"{t:7.1f} s  {name:28s} anon {r['anon']:5.2f}  file {r['file']:5.2f} GiB")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "quantize": args.quantize, "peak_anon_gib": peak["anon"],
                                         "peak_anon_file_gib": both, "marks": marks, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
