"""Copy a trained head into the package and print its sha256 for `SHIPPED`.

    python scripts/ship_head.py runs/heads/smollm2-eagle/eagle.safetensors smollm2-135m [--out DIR]

Writes specula/data/heads/ALIAS-KIND.safetensors (or DIR/ALIAS-KIND.safetensors with --out, e.g. a
dry run that must not touch the shipped files) as float16, or with int8 matrices (per-row float16
scales, head file format 2) where float16 would exceed `MAX_SHIPPED_BYTES`, and prints the
`ShippedHead(...)` line for specula/drafters/heads/shipped.py (`shipped.ship_head`).
"""

from __future__ import annotations

import argparse
import sys

import specula  # noqa: F401  (before torch)
from specula.drafters.heads.shipped import ship_head
from specula.errors import HeadFileError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("head", help="a trained head file (specula train's KIND.safetensors)")
    parser.add_argument("alias", help="the embedded model it was trained for")
    parser.add_argument("--out", default=None, help="folder to write into (default: the package's specula/data/heads)")
    args = parser.parse_args()
    try:
        shipped, dest = ship_head(args.head, args.alias, args.out)
    except HeadFileError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f'ShippedHead("{shipped.alias}", "{shipped.kind}", "{shipped.file}", "{shipped.sha256}")  '
          f'# {dest.stat().st_size} bytes')


if __name__ == "__main__":
    main()
