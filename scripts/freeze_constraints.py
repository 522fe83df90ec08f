"""Writes scripts/constraints.txt: the exact versions of every package `pip install -e '.[dev]'` pulls in,
read from this machine's installed metadata. `scripts/setup.sh` installs with `-c scripts/constraints.txt`,
so a fresh machine gets the versions the test suite passed with, not whatever the registry holds that day.

Run after a full `.ci/run` passed with new versions: `python3 scripts/freeze_constraints.py`.
torch is left out: `scripts/setup.sh` pins it (the CPU build) before anything else.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

LEFT_OUT = {"specula", "torch"}
HEADER = """\
# The versions the test suite passed with (written by scripts/freeze_constraints.py; read it before editing).
# scripts/setup.sh installs with `-c` this file; pyproject.toml keeps the ranges a user's own install may take.
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(root: str, extras: tuple[str, ...]) -> dict[str, str]:
    """Every installed distribution `root[extras]` needs, by canonical name -> installed version."""
    found: dict[str, str] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(root, extras)]
    walked: set[tuple[str, tuple[str, ...]]] = set()
    while todo:
        name, want = todo.pop()
        if (canonical(name), want) in walked:
            continue
        walked.add((canonical(name), want))
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            sys.exit(f"error: {name} is needed but not installed; run `bash scripts/setup.sh` first")
        found[canonical(name)] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *want)):
                todo.append((req.name, tuple(sorted(req.extras))))
    return found


def main() -> None:
    pins = closure("specula", ("dev",))
    text = HEADER + "".join(f"{name}=={pins[name]}\n" for name in sorted(pins) if name not in LEFT_OUT)
    out = Path(__file__).with_name("constraints.txt")
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".constraints.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, out)
    print(f"wrote {out} ({len(pins) - len(LEFT_OUT & set(pins))} pins)")


if __name__ == "__main__":
    main()
