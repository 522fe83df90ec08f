"""Copy a trained head into the package as float16 and print its sha256 for `SHIPPED`.

    python scripts/ship_head.py runs/heads/smollm2-eagle/eagle.safetensors smollm2-135m

Writes specula/data/heads/ALIAS-KIND.safetensors (atomic) and prints the `ShippedHead(...)` line
for specula/drafters/heads/shipped.py.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

from specula.drafters.heads.file import read_head, save_head
from specula.drafters.heads.shipped import PACKAGE_DIR


def main() -> None:
    src, alias = Path(sys.argv[1]), sys.argv[2]
    head = read_head(src)
    dest = PACKAGE_DIR / f"{alias}-{head.config.kind}.safetensors"
    save_head(dest, head, dtype=torch.float16)
    digest = hashlib.sha256(dest.read_bytes()).hexdigest()
    print(f'ShippedHead("{alias}", "{head.config.kind}", "{dest.name}", "{digest}")  # {dest.stat().st_size} bytes')


if __name__ == "__main__":
    main()
