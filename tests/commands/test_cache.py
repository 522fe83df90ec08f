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
    assert not (tmp_path / "cost").exists()
    assert (tmp_path / "kernels" / "k" / "lib.so").exists() and (tmp_path / "models" / "m" / "model.safetensors").exists()
    assert main(["cache", "clear", "--all"]) == 0
    assert not (tmp_path / "kernels").exists() and (tmp_path / "models" / "m" / "model.safetensors").exists()


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
    assert main(["cache", "clear"]) == 0 and not (tmp_path / "cost").exists()  # the actions still run
