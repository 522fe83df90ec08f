"""Bringing a memory-mapped file into the page cache (`specula.models.page_cache`): the pages the
cache lacks are found by mincore and read, a warm file reads nothing, and a prepared model's load
reads its evicted weights (so the first timed generation does not)."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from specula.models import page_cache

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore residency is read on Linux only")


@pytest.mark.parametrize("resident, runs", [
    ([True, False, False, True, False], [(1, 2), (4, 1)]),
    ([False, False, False], [(0, 3)]),
    ([True, True], []),
    ([], []),
])
def test_missing_runs_are_the_maximal_runs_of_absent_pages(resident, runs):
    assert page_cache._missing_runs(np.array(resident, dtype=bool)) == runs


def _evicted_file(path: Path, pages: int) -> Path:
    path.write_bytes(os.urandom(pages * mmap.PAGESIZE + 100))  # a last page only partly used
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path


@linux_only
def test_prefetch_reads_exactly_the_absent_pages_and_leaves_the_file_resident(tmp_path):
    path = _evicted_file(tmp_path / "weights.bin", 64)
    size = path.stat().st_size
    before = page_cache.resident_pages(path)
    assert before is not None and before.shape == (65,)  # one flag per page, the partial last one included
    absent = int((~before).sum())
    read = page_cache.prefetch(path)
    # every absent page read in full, except the file's partial last page (its bytes only)
    tail = size % mmap.PAGESIZE if not before[-1] else 0
    assert read == absent * mmap.PAGESIZE - (mmap.PAGESIZE - tail if tail else 0)
    assert page_cache.resident_pages(path).all()
    assert page_cache.prefetch(path) == 0  # warm: nothing more to read


@linux_only
def test_a_file_larger_than_available_memory_is_left_alone(tmp_path, monkeypatch):
    path = _evicted_file(tmp_path / "weights.bin", 8)
    if page_cache.resident_pages(path).all():
        pytest.skip("this filesystem keeps every page resident (nothing to leave alone)")
    monkeypatch.setattr(page_cache, "_available_bytes", lambda: path.stat().st_size - 1)
    assert page_cache.prefetch(path) is None
    assert not page_cache.resident_pages(path).all()


def test_without_residency_information_nothing_is_read(tmp_path, monkeypatch):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x" * 10)
    monkeypatch.setattr(page_cache, "resident_pages", lambda p: None)
    assert page_cache.prefetch(path) is None


def test_an_empty_file_is_resident(tmp_path):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    assert page_cache.prefetch(path) in (0, None)
