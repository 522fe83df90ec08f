#!/usr/bin/env bash
# The test command: set-up, the small embedded model for the slow tests, then pytest (all but `perf`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
"$PY" -m specula models install smollm2-135m
# timing assertions (`perf` marker) only mean something on a quiet machine: `pytest -m perf` runs them
"$PY" -m pytest -q -m "not perf" "$@"
