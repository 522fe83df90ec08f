"""A test run leaves the user's specula cache as it was (`cache_sandbox.py`): a pytest run, with a made-up
cache standing for the user's, reads its models through the sandbox, writes only into the sandbox, and fails
the test that writes into the real one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

INNER = '''
import json
import os
import subprocess
import sys
from pathlib import Path

from specula.paths import atomic_dir, atomic_write_json, cache_dir, cache_root

REAL = Path(os.environ["REAL_CACHE"])


def test_the_installed_models_read_through_the_sandbox():
    assert cache_root() != REAL and not str(cache_root()).startswith(str(REAL))
    assert json.loads(cache_dir("models", "m", "config.json").read_text()) == {"layers": 2}
    assert cache_dir("heads", "m", "eagle.safetensors").read_bytes() == b"head"


def test_what_a_test_writes_stays_in_the_sandbox():
    atomic_write_json(cache_dir("cost") / "curve.json", {"sizes": [1]})
    cache_dir("training").mkdir()
    cache_dir("training", "corpus.jsonl").write_text("{}")
    with atomic_dir(cache_dir("models", "m")) as tmp:  # a reinstall replaces the sandbox's mirror only
        (tmp / "config.json").write_text(json.dumps({"layers": 9}))
    cache_dir("heads", "m", "eagle.safetensors").unlink()  # removes the link, not the head
    cache_dir("kernels", "k").mkdir(parents=True)
    cache_dir("kernels", "k", "lib.so").write_bytes(b"built")  # kernels built by a test serve the next ones
    child = subprocess.run([sys.executable, "-c", "from specula.paths import cache_root; print(cache_root())"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(cache_root())  # subprocesses get the sandbox too


def test_the_next_test_finds_none_of_it():
    assert not cache_dir("cost").exists() and not cache_dir("training").exists()
    assert json.loads(cache_dir("models", "m", "config.json").read_text()) == {"layers": 2}
    assert cache_dir("heads", "m", "eagle.safetensors").read_bytes() == b"head"
    assert cache_dir("kernels", "k", "lib.so").read_bytes() == b"built"


def test_writing_into_the_real_cache_fails():
    try:
        atomic_write_json(REAL / "cost" / "curve.json", {})
    except PermissionError:
        pass  # swallowed: the test fails all the same


def test_writing_through_a_link_into_the_real_cache_fails():
    with open(cache_dir("models", "m", "config.json"), "w") as handle:
        handle.write("{}")
'''


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with a file's content (None: a folder)."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_a_test_run_leaves_the_real_cache_as_it_was(tmp_path):
    real = tmp_path / "real"
    (real / "models" / "m").mkdir(parents=True)
    (real / "models" / "m" / "config.json").write_text('{"layers": 2}')
    (real / "heads" / "m").mkdir(parents=True)
    (real / "heads" / "m" / "eagle.safetensors").write_bytes(b"head")
    (real / "cost").mkdir()
    before = _tree(real)
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "tmp").mkdir()
    here = Path(__file__).resolve().parent
    env = {**os.environ, "SPECULA_CACHE": str(real), "REAL_CACHE": str(real), "TMPDIR": str(tmp_path / "tmp"),
           "PYTHONPATH": os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "cache_sandbox", "-p", "no:cacheprovider", "-rA",
                           "-q", "test_inner.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = done.stdout.splitlines()
    passed = {line.split("::")[1] for line in lines if line.startswith("PASSED ")}
    failed = {line.split("::")[1].split(" ")[0] for line in lines if line.startswith("FAILED ")}
    assert passed == {"test_the_installed_models_read_through_the_sandbox",
                      "test_what_a_test_writes_stays_in_the_sandbox",
                      "test_the_next_test_finds_none_of_it"}, done.stdout
    assert failed == {"test_writing_into_the_real_cache_fails",
                      "test_writing_through_a_link_into_the_real_cache_fails"}, done.stdout
    assert f"wrote into the real specula cache {real}" in done.stdout
    assert _tree(real) == before  # the refused writes never happened
    assert list((tmp_path / "tmp").iterdir()) == []  # the sandbox is removed at the end


def test_this_run_is_on_a_sandbox_holding_the_installed_models():
    """tests/conftest.py puts every test of this run on the sandbox, the real cache's models linked into it."""
    import cache_sandbox
    from specula.paths import cache_root

    sandbox = cache_root()
    assert os.path.realpath(sandbox) != cache_sandbox.REAL and sandbox.is_dir()
    assert not os.path.realpath(sandbox).startswith(cache_sandbox.REAL + os.sep)
    models = Path(cache_sandbox.REAL, "models")
    for path in (p for p in models.rglob("*") if p.is_file()) if models.is_dir() else ():
        assert (sandbox / "models" / path.relative_to(models)).resolve() == path.resolve()
