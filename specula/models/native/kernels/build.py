"""Building the kernels' shared library: every C source in its own compiler process, then one link.

Why: `gcc -O3` spends most of a build on the AVX-512 and int4 variants (their row-count switches
unroll into many loop bodies). On the 2-core development machine (gcc 12) one `cc ... *.c` call
took 68-76 s, `linear_avx512.c` alone 42 s and `linear_i4.c` 18 s; the first `generate` on a new
machine waited for it. With a compiler process per source, the slowest started first and as many
at once as the machine has cores, the build takes about as long as its slowest source. A CPU
without AVX-512 compiles the AVX-512-only variants without optimisation (`kernels.compile_plan`):
it never runs them, and they were most of the build (50 s of 65 s on session 94's AVX2-only EPYC).

The objects go to a temporary folder beside the library and are removed (a killed build's folder
is swept by the next build, `remove_stale_builds`); the library is linked to a temporary sibling and
renamed into place (`paths.atomic_path`), so a failed or interrupted build leaves nothing a later
load would take for a library.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specula.errors import ConfigError
from specula.paths import atomic_path

LINK_ONLY = ("-shared",)
"""Flags that belong to the link alone (an object is compiled with the others and `-c`)."""


def build_jobs() -> int:
    """How many compiler processes run at once: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


BUILD_PREFIX = ".build."
"""The object folders' prefix (beside the library; `remove_stale_builds`)."""


def remove_stale_builds(folder: Path) -> list[Path]:
    """Delete the object folders under `folder` that a killed build left (call it only while no
    build of this folder runs: `kernels._build` holds the folder's lock); returns what it removed."""
    import shutil

    stale = sorted(p for p in folder.glob(f"{BUILD_PREFIX}*") if p.is_dir()) if folder.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        reason = " ".join(done.stderr.split())[-400:]  # one line: the CLI prints errors on one
        raise ConfigError(f"compiling specula's CPU kernels failed at {what} ({' '.join(cmd)}): {reason}; "
                          'use linear_kernel="onednn"')


def compile_shared(sources: Sequence[Path], target: Path, *, cc: Sequence[str], flags: Sequence[str],
                   libraries: Sequence[str] = ("-lm",), jobs: int | None = None,
                   source_flags: Mapping[Path, Sequence[str]] | None = None) -> None:
    """Build the shared library `target` from `sources` (compiled in the order given, up to `jobs` at
    once: list the slowest first), with `flags` (`LINK_ONLY` ones at the link only), a source's own
    `source_flags` after them (gcc: the last `-O` wins) and `libraries` at the link. Raises
    `ConfigError` naming the source, the command and the compiler's message when a step fails;
    `target` then does not exist (or is the library that was already there)."""
    compile_flags = [f for f in flags if f not in LINK_ONLY]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=BUILD_PREFIX, dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{i}-{source.stem}.o" for i, source in enumerate(sources)]
        pool = ThreadPoolExecutor(max_workers=jobs or build_jobs())
        try:
            own = source_flags or {}
            done = [pool.submit(_run, [*cc, *compile_flags, *own.get(source, ()), "-c", str(source), "-o", str(obj)],
                                source.name)
                    for source, obj in zip(sources, objects)]
            for future in done:
                future.result()  # the first failure, in source order
        finally:
            pool.shutdown(cancel_futures=True)  # after a failure, start no other source
        with atomic_path(target) as linked:
            _run([*cc, *flags, *(str(o) for o in objects), "-o", str(linked), *libraries], "the link")
            os.chmod(linked, 0o755)
