#!/usr/bin/env bash
# The test command: set-up, the small embedded model for the slow tests, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
"$PY" -m specula models install smollm2-135m
"$PY" -m pytest -q "$@"
