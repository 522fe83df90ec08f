#!/usr/bin/env bash
# Installs specula and everything it needs on a fresh machine (Python >= 3.11, pip).
# torch is pinned to the CPU build first: an unpinned torch would pull CUDA packages. Everything else gets the
# versions the test suite passed with (scripts/constraints.txt, written by scripts/freeze_constraints.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else 1)' 2>/dev/null; then
    "$PY" -m pip install --quiet --disable-pip-version-check torch==2.13.0
fi
"$PY" -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt -e '.[dev]'
