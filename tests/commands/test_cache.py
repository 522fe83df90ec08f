"""`specula cache info | clear`: what is kept, and clearing the measured state only."""

from __future__ import annotations

import json

from specula.cli import main


def test_clear_removes_measured_state_and_keeps_models(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    for folder, name in (("models", "m/model.safetensors"), ("cost", "abc.json"), ("kernels", "k/lib.so")):
        path = tmp_path / folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x" * 10)
    assert main(["cache", "info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    sizes = {e["folder"].rsplit("/", 1)[-1]: e["bytes"] for e in info["entries"]}
    assert sizes["cost"] == 10 and sizes["models"] == 10 and sizes["prepared"] == 0
    assert main(["cache", "clear"]) == 0  # default: the measured state
    assert list((tmp_path / "cost").iterdir()) == []  # its entries go; the folder stays
    assert (tmp_path / "kernels" / "k" / "lib.so").exists() and (tmp_path / "models" / "m" / "model.safetensors").exists()
    assert main(["cache", "clear", "--all"]) == 0
    assert list((tmp_path / "kernels").iterdir()) == [] and (tmp_path / "models" / "m" / "model.safetensors").exists()


def test_orphaned_prepared_entries_are_shown_and_cleared_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    model = tmp_path / "elsewhere" / "model"
    model.mkdir(parents=True)
    (tmp_path / "cost").mkdir()
    (tmp_path / "cost" / "curve.json").write_text("{}")
    for name, source in (("kept-1.none-specula", model), ("gone-2.none-specula", tmp_path / "deleted")):
        entry = tmp_path / "prepared" / name
        entry.mkdir(parents=True)
        (entry / "weights.bin").write_bytes(b"w" * 100)
        (entry / "prepared.json").write_text(json.dumps({"key": {"source": {"path": str(source)}}}))
    assert main(["cache", "info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [g["entry"] for g in info["prepared_orphans"]] == ["gone-2.none-specula"]
    assert info["prepared_orphans"][0]["bytes"] > 100
    assert main(["cache", "info"]) == 0
    assert "1 prepared model(s) whose model files are gone" in capsys.readouterr().out
    assert main(["cache", "clear", "--orphans"]) == 0
    assert "removed 1 prepared model(s)" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "prepared").iterdir()) == ["kept-1.none-specula"]
    assert (tmp_path / "cost" / "curve.json").read_text() == "{}"  # --orphans alone touches nothing else


def test_cache_alone_shows_what_cache_info_shows(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    (tmp_path / "cost").mkdir()
    (tmp_path / "cost" / "curve.json").write_text("{}")
    assert main(["cache", "info"]) == 0
    shown = capsys.readouterr().out
    assert main(["cache"]) == 0
    assert capsys.readouterr().out == shown and "cost" in shown
    assert main(["cache", "clear"]) == 0 and list((tmp_path / "cost").iterdir()) == []  # the actions still run


def test_clear_takes_each_entrys_lock_so_an_entry_being_written_goes_once_whole(tmp_path, monkeypatch, capsys):
    """A writer holds `prepared-<entry>` while it builds the entry in a temporary and renames it in:
    clear waits for it, then removes the whole entry, never the writer's temporary under it."""
    import threading
    import time

    from specula.paths import atomic_dir, file_lock

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    entry = tmp_path / "prepared" / "m-x.int8-specula"
    entry.parent.mkdir(parents=True)
    held, wrote = threading.Event(), []

    def writer():
        with file_lock(f"prepared-{entry.name}"):
            with atomic_dir(entry) as tmp:
                held.set()
                time.sleep(0.5)
                (tmp / "weights.bin").write_bytes(b"w" * 100)  # the temporary is still there
            wrote.append(entry.exists())

    thread = threading.Thread(target=writer)
    thread.start()
    held.wait()
    assert main(["cache", "clear", "--prepared"]) == 0
    thread.join()
    assert wrote == [True] and list(entry.parent.iterdir()) == []
    assert "removed" in capsys.readouterr().out


def test_clear_empties_a_symlinked_folder_and_info_survives_a_writer(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    elsewhere = tmp_path / "other-disk"
    (elsewhere / "m-y.none-specula").mkdir(parents=True)
    (elsewhere / "m-y.none-specula" / "weights.bin").write_bytes(b"w" * 64)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "prepared").symlink_to(elsewhere)
    assert main(["cache", "info", "--json"]) == 0
    sizes = {e["folder"].rsplit("/", 1)[-1]: e["bytes"] for e in json.loads(capsys.readouterr().out)["entries"]}
    assert sizes["prepared"] == 64
    assert main(["cache", "clear", "--prepared"]) == 0
    assert list(elsewhere.iterdir()) == [] and (tmp_path / "cache" / "prepared").is_symlink()


def test_a_cache_root_that_is_a_file_is_a_one_line_error(tmp_path, monkeypatch):
    import pytest

    from specula.errors import ConfigError
    from specula.paths import file_lock

    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "afile"))
    with pytest.raises(ConfigError, match="is a file, not a folder; point \\$SPECULA_CACHE at a directory"):
        with file_lock("anything"):
            pass


def test_clear_leaves_a_fresh_temporary_of_a_lockless_writer_and_removes_an_old_one(tmp_path, monkeypatch, capsys):
    import os
    import time

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path))
    cost = tmp_path / "cost"
    cost.mkdir()
    fresh, old = cost / ".a.json.tmp-live", cost / ".b.json.tmp-killed"
    fresh.write_text("{")
    old.write_text("{")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    (cost / "c.json").write_text("{}")
    assert main(["cache", "clear", "--measured"]) == 0
    assert sorted(p.name for p in cost.iterdir()) == [fresh.name]  # its writer may still rename it in
