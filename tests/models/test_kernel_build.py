"""Building the kernels' library (`kernels/build.py`): sources compiled apart and linked into one
library whose functions all work; a failing source named in a `ConfigError`, with nothing left
behind that a later load could take for a library."""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil

import pytest

from specula.errors import ConfigError
from specula.models.native.kernels.build import build_jobs, compile_shared

CC = shlex.split(os.environ.get("CC") or "cc")
pytestmark = pytest.mark.skipif(shutil.which(CC[0]) is None, reason="no C compiler")
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
    with pytest.raises(ConfigError, match=r'failed at b\.c .*; use linear_kernel="onednn"$') as err:
        compile_shared(_sources(tmp_path, broken=True), target, cc=CC, flags=FLAGS, libraries=(), jobs=2)
    assert "\n" not in str(err.value)  # the compiler's lines on one: the CLI prints errors on one line
    assert list(target.parent.iterdir()) == []


def test_cc_is_a_command_line_and_a_missing_one_is_named(monkeypatch):
    from specula.models.native import kernels

    monkeypatch.setenv("CC", f"{CC[0]} -O1")  # a compiler with an argument, as make reads $CC
    assert kernels.c_compiler() == [CC[0], "-O1"]
    if kernels.unavailable_reason() is not None:
        pytest.skip(kernels.unavailable_reason())  # not an x86-64 Linux CPU with AVX2: no compiler asked for
    monkeypatch.setenv("CC", "no-such-cc --flag")
    assert "no C compiler ($CC='no-such-cc --flag')" in kernels.unavailable_reason()


def test_a_kernel_isa_typo_is_refused_before_any_build(monkeypatch, tmp_path):
    from specula.models.native import kernels

    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    monkeypatch.setenv(kernels.ISA_ENV, "avx-512")
    monkeypatch.setattr(kernels, "_build", lambda target: pytest.fail("built before checking the ISA"))
    with pytest.raises(ConfigError, match="is not a kernel ISA; use auto, avx2, avx512 or amx"):
        kernels.library.__wrapped__()


def test_a_failed_build_is_not_retried_and_auto_falls_back(monkeypatch, tmp_path, capsys):
    from specula.models import prepack
    from specula.models.native import kernels

    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))  # no library cached here
    calls = []

    def failing(target):
        calls.append(target)
        raise ConfigError("compiling specula's CPU kernels failed at a.c (cc ...): error: boom; "
                          'use linear_kernel="onednn"')

    monkeypatch.setattr(kernels, "_build", failing)
    monkeypatch.setattr(kernels, "_BUILD_FAILURE", None)
    monkeypatch.setattr(kernels, "library", kernels.library.__wrapped__)  # no process-wide cache of a good build
    assert not kernels.usable() and not kernels.usable()
    assert len(calls) == 1  # the failure is remembered, not rebuilt on every call
    assert "warning: compiling specula's CPU kernels failed" in capsys.readouterr().err
    import torch

    assert prepack.resolve_linear_kernel("auto", dtype=torch.float32, device="cpu", quantize="none",
                                         native=True) in ("onednn", "aten")


def test_a_failed_rebuild_keeps_the_library_already_there(tmp_path):
    target = tmp_path / "out" / "libtwo.so"
    compile_shared(_sources(tmp_path), target, cc=CC, flags=FLAGS, libraries=(), jobs=2)
    before = target.read_bytes()
    with pytest.raises(ConfigError):
        compile_shared(_sources(tmp_path, broken=True), target, cc=CC, flags=FLAGS, libraries=(), jobs=2)
    assert target.read_bytes() == before


def test_build_jobs_is_the_cores_this_process_may_use():
    assert build_jobs() == len(os.sched_getaffinity(0))


def test_a_sources_own_flags_come_after_the_common_ones(tmp_path):
    only_unoptimised = tmp_path / "c.c"
    only_unoptimised.write_text("#ifdef __OPTIMIZE__\n#error built with optimisation\n#endif\nint one(void) { return 1; }\n")
    target = tmp_path / "out" / "libone.so"
    with pytest.raises(ConfigError, match="built with optimisation"):
        compile_shared([only_unoptimised], target, cc=CC, flags=FLAGS, libraries=())
    compile_shared([only_unoptimised], target, cc=CC, flags=FLAGS, libraries=(),
                   source_flags={only_unoptimised: ("-O0",)})
    assert ctypes.CDLL(str(target)).one() == 1


def test_a_cpu_without_avx512_compiles_the_avx512_variants_unoptimised(monkeypatch):
    from specula.models.native import kernels

    plans, keys = {}, {}
    for name, flags in (("avx2", {"avx2", "fma"}), ("avx512", {"avx2", "fma", *kernels.AVX512_FLAGS}),
                        ("unreadable", set())):
        monkeypatch.setattr(kernels, "_cpu_flags", lambda flags=flags: set(flags))
        kernels.build_key.cache_clear()
        plans[name], keys[name] = kernels.compile_plan(), kernels.build_key()
    kernels.build_key.cache_clear()
    monkeypatch.undo()
    unoptimised = {path.name for path, extra in plans["avx2"].items() if extra == ("-O0",)}
    assert unoptimised == {"linear_avx512.c", "linear_i4_vnni.c", "linear_amx.c", "attention_avx512.c"}
    assert not any(plans["avx512"].values()) and not any(plans["unreadable"].values())
    assert set(plans["avx2"]) == set(kernels.SOURCES)
    assert keys["avx2"] != keys["avx512"] == keys["unreadable"]  # another plan, another library


def test_another_cc_builds_its_own_library(monkeypatch):
    """A library built by one $CC was loaded whatever $CC said later: a sanitizer build then aborted
    every ordinary process on that cache. Without $CC the key is unchanged (no rebuild)."""
    from specula.models.native import kernels

    keys = {}
    for name, cc in (("unset", None), ("cc", "cc"), ("asan", "gcc -fsanitize=address -g")):
        if cc is None:
            monkeypatch.delenv("CC", raising=False)
        else:
            monkeypatch.setenv("CC", cc)
        kernels.build_key.cache_clear()
        keys[name] = kernels.build_key()
    kernels.build_key.cache_clear()
    monkeypatch.undo()
    assert len(set(keys.values())) == 3


def test_a_killed_builds_objects_are_swept_by_the_next_build(tmp_path, monkeypatch):
    from specula.models.native import kernels
    from specula.models.native.kernels import build

    folder = tmp_path / "kernels" / "key"
    leftover = folder / f"{build.BUILD_PREFIX}abc"
    leftover.mkdir(parents=True)
    (leftover / "0-linear.o").write_bytes(b"x")
    built = []
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "compile_shared", lambda sources, target, **kw: built.append(target) or target.touch())
    kernels._build(folder / "lib.so")
    assert not leftover.exists() and built == [folder / "lib.so"]
    kernels._build(folder / "lib.so")  # built already (another process, or this one): nothing compiled
    assert built == [folder / "lib.so"]
