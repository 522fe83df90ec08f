"""scripts/bench_runs.py: min / median / max over bench runs, with figures some methods lack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_runs.py"


def _entry(speedup, tps, accepted, identical):
    return {"speedup": speedup, "tokens_per_s": tps, "mean_accepted_tokens": accepted,
            "mean_accepted_per_drafting_step": accepted, "paused_step_fraction": None,
            "draft_fraction_of_plain_step_per_token": None, "identical_fraction": identical}


def test_runs_with_a_peer_and_sampled_outputs_are_summarised(tmp_path):
    """A Hugging Face peer has no steps (mean accepted null) and a sampled run no identity check:
    their cells read "-", the others min / median / max."""
    dirs = []
    for i, speed in enumerate((2.0, 2.5, 2.2)):
        d = tmp_path / f"run{i}"
        d.mkdir()
        summary = {"none": _entry(1.0, 10.0, 1.0, None), "fast": _entry(speed, 10.0 * speed, 2.0, None),
                   "hf:greedy": _entry(0.8, 8.0, None, None)}
        (d / "results.json").write_text(json.dumps({"summary": summary}))
        dirs.append(str(d))
    out = subprocess.run([sys.executable, str(SCRIPT), *dirs, "--over", "hf:greedy"], capture_output=True, text=True,
                         check=True).stdout
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert "| 2.00 / 2.20 / 2.50x | 2.00 / 2.00 / 2.00 |" in rows["fast"]
    assert rows["hf:greedy"].startswith("| hf:greedy | 0.80 / 0.80 / 0.80x | - |")
    assert "| 2.50 / 2.75 / 3.12x | - |" in rows["fast"]  # over the peer, then identity unknown
