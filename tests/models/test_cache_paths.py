"""specula.paths: the cache root and atomic writers."""

from __future__ import annotations

from pathlib import Path

import pytest

from specula import paths


def test_cache_dir_honours_specula_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "elsewhere"))
    assert paths.cache_dir() == tmp_path / "elsewhere"
    assert paths.cache_dir("models", "x") == tmp_path / "elsewhere" / "models" / "x"
    assert not (tmp_path / "elsewhere").exists()  # nothing created by asking


def test_cache_dir_default_is_home_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECULA_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert paths.cache_dir() == tmp_path / ".cache" / "specula"


def test_atomic_write_bytes_creates_and_replaces(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "file.bin"
    paths.atomic_write_bytes(target, b"one")
    paths.atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    assert paths.stale_temps(target) == []
    assert target.stat().st_mode & 0o777 == 0o666 & ~paths._umask()  # not mkstemp's 0600


def test_atomic_path_gives_a_file_a_library_wrote_privately_the_default_mode(tmp_path: Path) -> None:
    """safetensors' save_file leaves its file 0600 (a trained head no one else could read)."""
    import torch
    from safetensors.torch import save_file

    target = tmp_path / "head.safetensors"
    with paths.atomic_path(target) as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp))
    assert target.stat().st_mode & 0o777 == 0o666 & ~paths._umask()


def test_atomic_write_json_round_trips(tmp_path: Path) -> None:
    import json

    target = paths.atomic_write_json(tmp_path / "x.json", {"b": 1, "a": [1, 2]})
    assert json.loads(target.read_text()) == {"a": [1, 2], "b": 1}


def test_read_json_object_is_the_object_or_none(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    assert paths.read_json_object(path) is None  # missing
    paths.atomic_write_json(path, {"a": [1, 2]})
    assert paths.read_json_object(path) == {"a": [1, 2]}
    for text in ("[1, 2]", '"a"', "{cut"):  # not an object, not JSON
        path.write_text(text, encoding="utf-8")
        assert paths.read_json_object(path) is None, text
    path.write_bytes(b"\xff\xfe{")  # not UTF-8
    assert paths.read_json_object(path) is None


def test_atomic_file_failure_keeps_old_content(tmp_path: Path) -> None:
    target = tmp_path / "file.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with paths.atomic_file(target, "w") as handle:
            handle.write("half of the new")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert paths.stale_temps(target) == []


def test_atomic_dir_replaces_existing_and_cleans_up_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "model"
    with paths.atomic_dir(target) as tmp:
        (tmp / "a").write_text("1")
    assert (target / "a").read_text() == "1"
    with paths.atomic_dir(target) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    with pytest.raises(KeyboardInterrupt):
        with paths.atomic_dir(target) as tmp:
            (tmp / "c").write_text("3")
            raise KeyboardInterrupt
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_remove_stale_temps_only_touches_this_target(tmp_path: Path) -> None:
    target = tmp_path / "x.gguf"
    (tmp_path / ".x.gguf.tmp-abc").write_text("left by a crash")
    (tmp_path / ".x.gguf.tmp-dir").mkdir()
    (tmp_path / ".y.gguf.tmp-abc").write_text("someone else's")
    removed = paths.remove_stale_temps(target)
    assert sorted(p.name for p in removed) == [".x.gguf.tmp-abc", ".x.gguf.tmp-dir"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".y.gguf.tmp-abc"]


def test_remove_dir_renames_first_and_a_cut_short_removal_is_swept(tmp_path: Path, monkeypatch) -> None:
    entry = tmp_path / "entry"
    (entry / "sub").mkdir(parents=True)
    (entry / "sub" / "w.bin").write_bytes(b"x" * 10)
    neighbour = tmp_path / "other"
    neighbour.mkdir()
    paths.remove_dir(entry)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]  # no temporary left either

    entry.mkdir()
    (entry / "w.bin").write_bytes(b"y")
    monkeypatch.setattr(paths, "_remove", lambda path: None)  # killed after the rename, before deleting
    paths.remove_dir(entry)
    assert not entry.exists()  # the entry vanished in one rename
    assert len(paths.stale_temps(entry)) == 1
    monkeypatch.undo()
    paths.remove_stale_temps(entry)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_disk_usage_and_format_bytes(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x" * 1000)
    (tmp_path / "d" / "b").write_bytes(b"x" * 536)
    assert paths.disk_usage(tmp_path / "d") == 1536
    assert paths.disk_usage(tmp_path / "missing") == 0
    assert paths.format_bytes(1536) == "1.5 KiB"
    assert paths.format_bytes(12) == "12 B"
    assert paths.format_bytes(None) == "-"


def test_file_lock_makes_writers_take_turns(cache: Path) -> None:
    import threading

    order: list[str] = []
    trying = threading.Event()

    def second() -> None:
        trying.set()
        with paths.file_lock("entry"):
            order.append("second")

    with paths.file_lock("entry"):
        thread = threading.Thread(target=second)
        thread.start()
        assert trying.wait(5)
        thread.join(0.2)
        assert thread.is_alive()  # blocked on the lock the first writer holds
        order.append("first done")
    thread.join(5)
    assert order == ["first done", "second"]
    assert (cache / "locks" / "entry.lock").is_file()


def test_check_not_input_reads_an_input_given_under_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An input named "~/..." was checked for existence expanded, then compared unexpanded
    (FileNotFoundError instead of the refusal)."""
    from specula.errors import ConfigError

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "in.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="--out would overwrite the input '~/in.jsonl'"):
        paths.check_not_input(tmp_path / "in.jsonl", "--out", [("the input", "~/in.jsonl")])
    paths.check_not_input(tmp_path / "other.jsonl", "--out", [("the input", "~/in.jsonl")])  # nothing to overwrite
