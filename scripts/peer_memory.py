"""Memory of what the bench holds with Hugging Face peers: the target and its draft as a method loads them,
then the Hugging Face models of the same weights (`reference_model()`: what `--compare hf:greedy` and
`hf:assisted` run), with resident anonymous and file-backed memory and the peak after each stage. Linux
only (reads /proc/self/status).

    python scripts/peer_memory.py --target qwen2.5-coder-1.5b --method fusion
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path


def resident(stage: str) -> str:
    """One line: resident anonymous, file-backed and total memory and the peak so far, in GiB."""
    status = Path("/proc/self/status").read_text()

    def gib(key: str) -> float:
        return int(re.search(rf"{key}:\s+(\d+)", status).group(1)) / 2 ** 20

    return (f"{stage:24s} resident {gib('VmRSS'):6.2f} GiB (anonymous {gib('RssAnon'):5.2f}, file-backed "
            f"{gib('RssFile'):5.2f}), peak {gib('VmHWM'):6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--method", default="fusion")
    args = parser.parse_args()

    import specula  # noqa: F401  (before torch)
    from specula.api import load

    print(resident("start"), flush=True)
    decoder = load(args.target, method=args.method)
    print(resident(f"{args.method} loaded"), flush=True)
    decoder.target.reference_model()
    print(resident("Hugging Face target"), flush=True)
    if decoder.draft is not None:
        decoder.draft.reference_model()
        print(resident("Hugging Face draft"), flush=True)


if __name__ == "__main__":
    main()
