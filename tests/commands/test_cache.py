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
