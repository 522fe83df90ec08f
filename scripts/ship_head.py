"""Copy a trained head into the package and print its sha256 for `SHIPPED`.

    python scripts/ship_head.py runs/heads/smollm2-eagle/eagle.safetensors smollm2-135m

Writes specula/data/heads/ALIAS-KIND.safetensors (atomic) as float16, or with int8 matrices
(per-row float16 scales, head file format 2) where float16 would exceed `MAX_SHIPPED_BYTES`,
and prints the `ShippedHead(...)` line for specula/drafters/heads/shipped.py.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

from specula.drafters.heads.file import read_head, save_head
from specula.drafters.heads.shipped import MAX_SHIPPED_BYTES, PACKAGE_DIR


def main() -> None:
    src, alias = Path(sys.argv[1]), sys.argv[2]
    head = read_head(src)
    dest = PACKAGE_DIR / f"{alias}-{head.config.kind}.safetensors"
    save_head(dest, head, dtype=torch.float16)
    if dest.stat().st_size > MAX_SHIPPED_BYTES:
        save_head(dest, head, dtype=torch.int8)
    size = dest.stat().st_size
    if size > MAX_SHIPPED_BYTES:
        dest.unlink()
        sys.exit(f"error: {src} takes {size} bytes even with int8 matrices, over {MAX_SHIPPED_BYTES}: train a "
                 "narrower head (--intermediate-size, --num-kv-heads)")
    digest = hashlib.sha256(dest.read_bytes()).hexdigest()
    print(f'ShippedHead("{alias}", "{head.config.kind}", "{dest.name}", "{digest}")  # {dest.stat().st_size} bytes')


if __name__ == "__main__":
    main()
