"""The command line (`specula.cli`): building it, and the commands that need no model, import
neither torch nor transformers (they took 7.5 s to do so before `specula --help` printed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "specula.drafters")


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["bench", "--help"], ["cache", "info"],
                                  ["models", "list"]])
def test_commands_without_a_model_import_no_torch(argv, tmp_path):
    code = ("import sys, runpy\n"
            f"sys.argv = ['specula', *{argv!r}]\n"
            "try:\n    runpy.run_module('specula', run_name='__main__')\n"
            "except SystemExit as exit:\n    assert exit.code in (0, None), exit.code\n"
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY[:2]!r} or m == {HEAVY[2]!r})\n"
            "print('HEAVY', heavy)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"SPECULA_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.stdout.strip().splitlines()[-1] == "HEAVY []"
