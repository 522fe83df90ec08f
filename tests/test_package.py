"""Importing specula: the OpenMP spin setting (`specula.GOMP_SPINCOUNT`) is applied only when torch
is not loaded yet and the user chose no OpenMP wait setting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _spincount(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", code + "\nimport os; print(os.environ.get('GOMP_SPINCOUNT'))"],
                          env={**clean, **env}, capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def test_specula_first_sets_the_short_spin():
    import specula

    assert _spincount("import specula") == specula.GOMP_SPINCOUNT


@pytest.mark.parametrize("code, env, expected", [
    ("import torch, specula", {}, "None"),  # too late: torch's OpenMP read its settings already
    ("import specula", {"GOMP_SPINCOUNT": "123"}, "123"),  # the user's choice stands
    ("import specula", {"OMP_WAIT_POLICY": "active"}, "None"),
])
def test_the_users_setting_or_a_loaded_torch_is_left_alone(code, env, expected):
    assert _spincount(code, **env) == expected


def _constraints() -> dict[str, str]:
    from pathlib import Path

    pins = {}
    for line in (Path(__file__).parents[1] / "scripts" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[name] = version
    return pins


def test_the_tested_pins_satisfy_every_declared_range():
    """scripts/setup.sh installs with scripts/constraints.txt: each direct dependency in pyproject.toml (torch
    aside, which setup.sh pins itself) must be pinned there, to a version its declared range allows, or a fresh
    install fails to resolve."""
    import re
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    pins = _constraints()
    for line in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(line)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name == "torch":
            continue
        assert name in pins, f"{name} is declared in pyproject.toml but not pinned in scripts/constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is outside {req}"
