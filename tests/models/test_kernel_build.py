"""Building the kernels' library (`kernels/build.py`): sources compiled apart and linked into one
library whose functions all work; a failing source named in a `ConfigError`, with nothing left
behind that a later load could take for a library."""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest

from specula.errors import ConfigError
from specula.models.native.kernels.build import build_jobs, compile_shared

CC = os.environ.get("CC", "cc")
pytestmark = pytest.mark.skipif(shutil.which(CC) is None, reason="no C compiler")
FLAGS = ("-O2", "-shared", "-fPIC")


def _sources(tmp_path, broken: bool = False):
    a = tmp_path / "a.c"
    a.write_text("int twice(int x) { return 2 * x; }\n")
    b = tmp_path / "b.c"
    b.write_text("int twice(int x);\nint four_times(int x) { return twice(twice(x)); }\n"
                 + ("int oops( {\n" if broken else ""))
    return [a, b]


@pytest.mark.parametrize("jobs", [1, 2])
def test_sources_compiled_apart_link_into_one_library(tmp_path, jobs):
    target = tmp_path / "out" / "libtwo.so"
    compile_shared(_sources(tmp_path), target, cc=CC, flags=FLAGS, libraries=(), jobs=jobs)
    lib = ctypes.CDLL(str(target))
    assert lib.twice(21) == 42
    assert lib.four_times(5) == 20  # b.c's function calls a.c's across the objects
    assert sorted(p.name for p in target.parent.iterdir()) == ["libtwo.so"]  # objects and temporaries gone


def test_a_failing_source_is_named_and_leaves_no_library(tmp_path):
    target = tmp_path / "out" / "libtwo.so"
    with pytest.raises(ConfigError, match=r"(?s)failed at b\.c .*--linear-kernel onednn"):
        compile_shared(_sources(tmp_path, broken=True), target, cc=CC, flags=FLAGS, libraries=(), jobs=2)
    assert list(target.parent.iterdir()) == []


def test_a_failed_rebuild_keeps_the_library_already_there(tmp_path):
    target = tmp_path / "out" / "libtwo.so"
    compile_shared(_sources(tmp_path), target, cc=CC, flags=FLAGS, libraries=(), jobs=2)
    before = target.read_bytes()
    with pytest.raises(ConfigError):
        compile_shared(_sources(tmp_path, broken=True), target, cc=CC, flags=FLAGS, libraries=(), jobs=2)
    assert target.read_bytes() == before


def test_build_jobs_is_the_cores_this_process_may_use():
    assert build_jobs() == len(os.sched_getaffinity(0))
