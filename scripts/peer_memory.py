"""Memory of what the bench holds with Hugging Face peers: the target and its draft as a method loads them,
then the Hugging Face models of the same weights (`reference_model()`: what `--compare hf:greedy` and
`hf:assisted` run), with resident anonymous and file-backed memory and the peak after each stage. Linux
only (reads /proc/self/status).

    python scripts/peer_memory.py --target qwen2.5-coder-1.5b --method fusion
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_memory import resident  # noqa: E402


def stage(name: str) -> str:
    """One line: resident anonymous and file-backed memory now and the process's peak so far, in GiB."""
    from specula.models.loading import peak_rss_bytes

    now = resident()
    return (f"{name:24s} resident {now['anon'] + now['file']:6.2f} GiB (anonymous {now['anon']:5.2f}, file-backed "
            f"{now['file']:5.2f}), peak {(peak_rss_bytes() or 0) / 2 ** 30:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--method", default="fusion")
    args = parser.parse_args()

    import specula  # noqa: F401  (before torch)
    from specula.api import load

    print(stage("start"), flush=True)
    decoder = load(args.target, method=args.method)
    print(stage(f"{args.method} loaded"), flush=True)
    decoder.target.reference_model()
    print(stage("Hugging Face target"), flush=True)
    if decoder.draft is not None:
        decoder.draft.reference_model()
        print(stage("Hugging Face draft"), flush=True)


if __name__ == "__main__":
    main()
