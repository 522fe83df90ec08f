"""Tests never change the user's specula cache (`$SPECULA_CACHE` or `~/.cache/specula`): a pytest plugin,
active for every test run through `tests/conftest.py` (`-p cache_sandbox` elsewhere).

- The run's `$SPECULA_CACHE` is a sandbox in a temporary directory (its subprocesses inherit it), removed at the
  end. What a test writes there (cost curves, training corpora, locks, anything new) is removed after the test,
  so no test sees another's.
- The installed models stay readable (the `slow` tests load them): the sandbox's `models`, `gguf` and `heads`
  mirror the real cache's, folders made anew and each file a symbolic link to the real one, so a writer that
  replaces or adds a file changes the sandbox only; a test that changed the mirror gets it back afterwards.
  The compiled kernels are linked the same way (a build takes a minute; one of other sources lands in the
  sandbox and serves the run's later tests and subprocesses). Prepared models are not: their entries are keyed
  by the model's path, the sandbox's here, and are prepared once per run into the sandbox, shared by its tests
  like the kernels.
- A guard (an audit hook) refuses, in the test process, every write into the real cache -- a test that points
  `$SPECULA_CACHE` back at it, or writes through one of the links -- with `RealCacheWrite`, and fails the test
  that tried even if the code swallowed the error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from specula.paths import CACHE_ENV, cache_root

REAL = os.path.realpath(cache_root())
"""The user's cache, as this process found it when the plugin was imported (before the sandbox is set)."""
INSTALLED = ("models", "gguf", "heads")
"""Folders of the real cache the sandbox mirrors and restores after a test that changed them."""
MIRRORED = (*INSTALLED, "kernels")
"""Folders of the real cache the sandbox mirrors (read through links)."""
SHARED = (*MIRRORED, "prepared")
"""Folders of the sandbox kept from test to test (kernels and prepared models built by one test serve the
next); everything else is removed after each test."""

_state: dict = {"sandbox": None, "mirror": None, "writes": [], "saved": None, "hooked": False}
_busy = threading.local()
"""`active` while the guard resolves a path (in this thread): its own file system calls are not checked."""


class RealCacheWrite(PermissionError):
    """A test wrote (or tried to) into the real specula cache."""


def _mirror(real: Path, into: Path) -> None:
    """Make `into` a copy of the folder `real` in which every file is a link to the real one."""
    for root, dirs, files in os.walk(real):
        target = into / os.path.relpath(root, real)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            if not name.startswith("."):  # an atomic writer's leftovers (`.<name>.tmp-...`) stay out
                (target / name).symlink_to(Path(root, name))
        dirs[:] = [d for d in dirs if not d.startswith(".")]


def _snapshot(sandbox: Path) -> list[tuple[str, str]]:
    """(relative path, link target or "") of every entry of the installed folders' mirrors."""
    entries = []
    for folder in INSTALLED:
        for root, dirs, files in os.walk(sandbox / folder):
            for name in dirs + files:
                path = Path(root, name)
                entries.append((str(path.relative_to(sandbox)), os.readlink(path) if path.is_symlink() else ""))
    return sorted(entries)


def _build_mirror(sandbox: Path, folders: tuple[str, ...] = MIRRORED) -> None:
    for folder in folders:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(sandbox / folder)
        if os.path.isdir(os.path.join(REAL, folder)):
            _mirror(Path(REAL, folder), sandbox / folder)
    _state["mirror"] = _snapshot(sandbox)


def _where(path, dir_fd, follow: bool) -> str | None:
    """The real location that `path` (relative to `dir_fd` when given) names: the file a link leads to when
    the operation follows links (`follow`), else the link itself (its folder resolved)."""
    if isinstance(path, int):
        return None
    path = os.fsdecode(path)
    if dir_fd is not None and not os.path.isabs(path):
        try:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        except OSError:
            return None
    path = os.path.abspath(path)
    if follow:
        return os.path.realpath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


_EVENTS = {  # audit event -> (argument index of a path, of its dir_fd or None, whether links are followed)
    "os.mkdir": ((0, 2, False),), "os.remove": ((0, 1, False),), "os.rmdir": ((0, 1, False),),
    "os.rename": ((0, 2, False), (1, 3, False)), "os.symlink": ((1, 2, False),), "os.link": ((1, 3, False),),
    "os.chmod": ((0, 2, True),), "os.chown": ((0, 3, True),), "os.utime": ((0, 3, True),),
    "os.truncate": ((0, None, True),), "shutil.rmtree": ((0, 1, False),),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _in_real_cache(where: str | None) -> bool:
    sandbox = _state["sandbox"]
    if where is None or not (where == REAL or where.startswith(REAL + os.sep)):
        return False
    return sandbox is None or not (where == str(sandbox) or where.startswith(str(sandbox) + os.sep))


def _guard(event: str, args: tuple) -> None:
    if _state["sandbox"] is None or getattr(_busy, "active", False):
        return
    if event == "open":
        if not (isinstance(args[2], int) and args[2] & _WRITE_FLAGS):
            return
        checks = ((0, None, True),)
    elif event in _EVENTS:
        checks = _EVENTS[event]
    else:
        return
    _busy.active = True
    try:
        for index, fd_index, follow in checks:
            where = _where(args[index], None if fd_index is None else args[fd_index], follow)
            if _in_real_cache(where):
                _state["writes"].append(f"{event} {where}")
                raise RealCacheWrite(f"a test wrote into the real specula cache ({event} {where}); tests use the "
                                     f"sandbox ${CACHE_ENV} that tests/cache_sandbox.py sets")
    finally:
        _busy.active = False


def pytest_configure(config: pytest.Config) -> None:
    sandbox = Path(tempfile.mkdtemp(prefix="specula-test-cache-"))
    _state["saved"] = os.environ.get(CACHE_ENV)
    _build_mirror(sandbox)
    os.environ[CACHE_ENV] = str(sandbox)
    _state["sandbox"] = sandbox
    if not _state["hooked"]:  # an audit hook cannot be removed: one per process, idle without a sandbox
        sys.addaudithook(_guard)
        _state["hooked"] = True


def pytest_unconfigure(config: pytest.Config) -> None:
    sandbox = _state["sandbox"]
    if sandbox is None:
        return
    _state["sandbox"] = None
    if _state["saved"] is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = _state["saved"]
    shutil.rmtree(sandbox, ignore_errors=True)


def _reset(sandbox: Path) -> None:
    """Remove what the last test wrote into the sandbox; restore the mirror if it changed."""
    if not sandbox.is_dir():  # removed, or replaced by a file
        sandbox.unlink(missing_ok=True)
        sandbox.mkdir()
    for entry in sandbox.iterdir():
        if entry.name not in SHARED:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    if _snapshot(sandbox) != _state["mirror"]:
        _build_mirror(sandbox, INSTALLED)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Fail the phase (setup, call, teardown) during which something wrote into the real cache."""
    outcome = yield
    report = outcome.get_result()
    if _state["writes"]:
        writes, _state["writes"] = _state["writes"], []
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} wrote into the real specula cache {REAL} ({len(writes)} time(s)), "
                           "refused: " + "; ".join(writes[:5]))
    if report.when == "teardown" and _state["sandbox"] is not None:
        _reset(_state["sandbox"])
