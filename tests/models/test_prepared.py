"""The prepared-model cache (`specula.models.prepared`): a model prepared for specula's kernels is
written once and memory-mapped by later loads (no second quantization, identical logits), a
damaged entry is rebuilt without a crash, the key follows what changes the weights; and loading
a draft loads nothing it does not need (no Hugging Face reference model, no second tokenizer,
no draft for a method without one)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tiny import tiny_model
import specula.api as specula
from specula.errors import ConfigError
from specula.models import prepared
from specula.models.loading import LoadConfig, load_backend, load_draft, resolve, same_tokenizer_files
from specula.models.native import NativeCausalLM, kernels

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"specula's CPU kernels cannot run here: {kernels.unavailable_reason()}")

PROMPT = [5, 17, 33, 2, 5, 17, 40, 41]


def _save(path: Path, tokenizer, seed: int) -> Path:
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(path)
    tiny_model("qwen2").save_pretrained(path)  # the config decides the tokenizer class loading picks
    vocab = max(AutoTokenizer.from_pretrained(path).get_vocab().values()) + 1
    tiny_model("qwen2", seed=seed, vocab=vocab).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_tokenizer) -> tuple[Path, Path]:
    """Two tiny random Qwen2 directories (target, draft) with the same tokenizer files."""
    root = tmp_path_factory.mktemp("prepared-models")
    return _save(root / "target", tiny_tokenizer, 3), _save(root / "draft", tiny_tokenizer, 4)


def _logits(backend) -> torch.Tensor:
    return backend.new_sequence().prefill(PROMPT, logits="all")  # [n, vocab]


def _load(path: Path, quantize: str = "int8", **config):
    report: dict = {}
    backend, tokenizer = load_backend(str(path), LoadConfig(quantize=quantize, **config), "draft", report=report)
    return backend, tokenizer, report


def _entry(path: Path, quantize: str = "int8") -> Path:
    return prepared.entry_dir(resolve(str(path)), quantize=quantize, kernel="specula")


def _no_preparing(monkeypatch) -> None:
    """Make any quantization or packing fail loudly."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was prepared again")

    monkeypatch.setattr(kernels.KernelLinear, "__init__", refuse)
    monkeypatch.setattr("specula.models.native.configure", refuse)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_prepared_model_is_written_once_and_reused(model_dirs, cache, monkeypatch, quantize):
    path = model_dirs[1]
    off, _, off_report = _load(path, quantize, prepared_cache="off")
    assert off_report["prepared"] == "off" and not prepared.prepared_root().exists()
    first, _, report = _load(path, quantize)
    assert report["prepared"] == "built" and report["seconds"] > 0
    entry = _entry(path, quantize)
    assert (entry / prepared.WEIGHTS).is_file() and (entry / prepared.MARKER).is_file()
    assert prepared.read_marker(entry)["key"]["quantize"] == quantize
    _no_preparing(monkeypatch)
    second, _, report = _load(path, quantize)
    assert report["prepared"] == "hit"
    assert isinstance(second, NativeCausalLM)
    # the same model, bit for bit: weights, every module's kind, and the logits
    assert torch.equal(_logits(second), _logits(first)) and torch.equal(_logits(second), _logits(off))
    for (name, a), (_, b) in zip(first.decoder.state_dict().items(), second.decoder.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    originals = {n: m for n, m in first.decoder.named_modules() if isinstance(m, kernels.KernelLinear)}
    for name, module in second.decoder.named_modules():
        if isinstance(module, kernels.KernelLinear):
            assert set(vars(module)) == set(vars(originals.pop(name))), name  # no attribute forgotten
    assert not originals
    assert (second.eos_token_ids, second.num_parameters, second.greedy_guarantee, second.cost_key()) == \
        (first.eos_token_ids, first.num_parameters, first.greedy_guarantee, first.cost_key())
    assert second.weight_bytes == first.weight_bytes
    # greedy decoding with the cached model equals the uncached one's
    params = specula.SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs = [specula.build_decoder("none", b, planner=False).generate(PROMPT, params).token_ids for b in (first, second)]
    assert outs[0] == outs[1]


def test_float32_target_is_cached_too(model_dirs, cache, monkeypatch):
    path = model_dirs[0]
    first, _, report = _load(path, quantize="none")
    assert report["prepared"] == "built"
    _no_preparing(monkeypatch)
    second, _, report = _load(path, quantize="none")
    assert report["prepared"] == "hit" and torch.equal(_logits(first), _logits(second))
    assert second.decoder.layers[0].wqkv.kind == "f32"


@pytest.mark.parametrize("damage", ["garbage weights", "same size and mtime", "truncated weights", "bad marker",
                                    "no marker", "other key", "no parameter count"])
def test_a_damaged_entry_is_rebuilt(model_dirs, cache, damage, capsys):
    path = model_dirs[1]
    reference, _, _ = _load(path, prepared_cache="off")
    _load(path)
    entry = _entry(path)
    weights, marker = entry / prepared.WEIGHTS, entry / prepared.MARKER
    if damage == "garbage weights":
        weights.write_bytes(b"not a torch file")
    elif damage == "same size and mtime":  # undetectable by its stat: torch refuses the file
        st = weights.stat()
        weights.write_bytes(b"\0" * st.st_size)
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "bad marker":
        marker.write_text("{ half")
    elif damage == "no marker":
        marker.unlink()
    elif damage == "no parameter count":  # read after the weights: it crashed every load
        data = json.loads(marker.read_text())
        del data["num_parameters"]
        marker.write_text(json.dumps(data))
    else:
        data = json.loads(marker.read_text())
        data["key"]["code"] = "something else"
        marker.write_text(json.dumps(data))
    capsys.readouterr()
    backend, _, report = _load(path)
    assert report["prepared"] == "rebuilt"
    assert "preparing it again" in capsys.readouterr().err
    assert torch.equal(_logits(backend), _logits(reference))
    _, _, report = _load(path)  # and the rebuilt entry is used
    assert report["prepared"] == "hit"


def test_the_key_follows_what_changes_the_weights(model_dirs, tmp_path, cache, tiny_tokenizer):
    resolved = resolve(str(model_dirs[1]))
    key = prepared.prepared_key(resolved, dtype="torch.float32", quantize="int8", kernel="specula")
    assert key == prepared.prepared_key(resolved, dtype="float32", quantize="int8", kernel="specula")
    assert key != prepared.prepared_key(resolved, dtype="float32", quantize="none", kernel="specula")
    assert prepared.entry_dir(resolved, quantize="int8", kernel="specula") != \
        prepared.entry_dir(resolved, quantize="none", kernel="specula")
    # another model, or the same directory with its weights rewritten
    copy = _save(tmp_path / "copy", tiny_tokenizer, 4)
    assert prepared.prepared_key(resolve(str(copy)), dtype="float32", quantize="int8", kernel="specula") != key
    assert prepared.entry_dir(resolve(str(copy)), quantize="int8", kernel="specula") != \
        prepared.entry_dir(resolved, quantize="int8", kernel="specula")
    before = prepared.prepared_key(resolve(str(copy)), dtype="float32", quantize="int8", kernel="specula")
    weights = copy / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    assert prepared.prepared_key(resolve(str(copy)), dtype="float32", quantize="int8", kernel="specula") != before


def test_a_changed_model_is_prepared_again(tmp_path, cache, tiny_tokenizer):
    path = _save(tmp_path / "m", tiny_tokenizer, 4)
    _, _, report = _load(path)
    assert report["prepared"] == "built"
    _save(path, tiny_tokenizer, 5)  # other weights in the same place
    backend, _, report = _load(path)
    assert report["prepared"] == "rebuilt"
    reference, _, _ = _load(path, prepared_cache="off")
    assert torch.equal(_logits(backend), _logits(reference))
    assert len(list(prepared.prepared_root().iterdir())) == 1  # replaced in place, not piled up


def test_entries_of_models_that_are_gone_are_removed_when_another_is_prepared(tmp_path, model_dirs, cache,
                                                                             tiny_tokenizer, capsys):
    import shutil

    gone = _save(tmp_path / "gone", tiny_tokenizer, 6)
    _load(gone)
    _load(model_dirs[0])  # an entry whose model stays
    orphan = _entry(gone)
    shutil.rmtree(gone)  # the user deletes the model directory
    assert prepared.orphans() == [orphan]
    capsys.readouterr()
    _, _, report = _load(model_dirs[1])  # a new entry: the cache grows, the orphan goes
    assert report["prepared"] == "built"
    assert "removed 1 prepared model(s) whose model files are gone" in capsys.readouterr().err
    assert sorted(prepared.prepared_root().iterdir()) == sorted([_entry(model_dirs[0]), _entry(model_dirs[1])])
    assert (cache / "locks" / f"prepared-{orphan.name}.lock").exists()  # kept: a waiter may hold it
    _, _, report = _load(model_dirs[0])  # the kept entries are untouched
    assert report["prepared"] == "hit"


def test_a_model_that_comes_back_keeps_its_entry(tmp_path, cache, tiny_tokenizer):
    path = _save(tmp_path / "m", tiny_tokenizer, 6)
    _load(path)
    entry = _entry(path)
    aside = path.rename(tmp_path / "aside")
    assert prepared.orphans() == [entry]
    aside.rename(path)  # back before anything was prepared
    assert prepared.orphans() == [] and prepared.remove_orphans() == []
    assert _load(path)[2]["prepared"] == "hit"


def test_a_hit_imports_no_transformers_model_code_and_no_dynamo(model_dirs, cache):
    """A prepared native model loads without transformers' modeling code (5.3 s of imports) or
    torch._dynamo (1.5 s, pulled in by a random init on the meta device): only the tokenizer's part
    of transformers."""
    import subprocess

    _load(model_dirs[0], quantize="none")  # the entry, written
    code = ("import sys, specula\n"
            "from specula.models.loading import LoadConfig, load_backend\n"
            f"report = {{}}\nload_backend({str(model_dirs[0])!r}, LoadConfig(), 'target', report=report)\n"
            "heavy = [m for m in ('transformers.modeling_utils', 'torch._dynamo', 'specula.models.hf') "
            "if m in sys.modules]\n"
            "print(report['prepared'], heavy)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "SPECULA_CACHE": str(cache)})
    assert done.stdout.strip().splitlines()[-1] == "hit []"


def test_a_cache_whose_locks_cannot_be_written_leaves_the_load_working(model_dirs, cache, capsys):
    """A lock file that cannot be created (a read-only cache) crashed the load with a traceback, where
    an entry that cannot be written is a note and the model prepared in memory."""
    from specula.paths import cache_dir

    reference, _, _ = _load(model_dirs[1], prepared_cache="off")
    lock = cache_dir("locks", f"prepared-{_entry(model_dirs[1]).name}.lock")
    lock.mkdir(parents=True)  # cannot be opened as a file: as unwritable as a read-only folder is to a user
    capsys.readouterr()
    backend, _, report = _load(model_dirs[1])
    assert report["prepared"] == "unsaved" and "could not write the prepared" in capsys.readouterr().err
    assert torch.equal(_logits(backend), _logits(reference))


@pytest.mark.parametrize("where", ["preallocating a packed weight", "copying the other tensors in",
                                   "creating the entry"])
def test_an_entry_that_cannot_be_written_leaves_the_load_working(model_dirs, cache, monkeypatch, capsys, where):
    from specula.models import tensor_file

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    reference, _, _ = _load(model_dirs[1], prepared_cache="off")
    if where == "preallocating a packed weight":
        monkeypatch.setattr(tensor_file.os, "posix_fallocate", full_disk)
    elif where == "copying the other tensors in":
        monkeypatch.setattr(tensor_file.TensorFileWriter, "_copy_in", full_disk)
    else:
        monkeypatch.setattr(prepared, "atomic_dir", full_disk)
    capsys.readouterr()
    backend, _, report = _load(model_dirs[1])
    assert report["prepared"] == "unsaved" and "No space left on device" in capsys.readouterr().err
    assert torch.equal(_logits(backend), _logits(reference))
    root = prepared.prepared_root()
    assert not root.exists() or not any(root.iterdir())  # no half-written entry


def test_packed_weights_are_made_in_the_entry_file_not_in_memory(model_dirs, cache, monkeypatch):
    from specula.models import tensor_file

    made = []
    real = tensor_file.TensorFileWriter.empty

    def recording(self, shape, dtype):
        tensor = real(self, shape, dtype)
        made.append(self._region_offset(tensor) is not None)
        return tensor

    monkeypatch.setattr(tensor_file.TensorFileWriter, "empty", recording)
    backend, _, report = _load(model_dirs[0], quantize="none")
    assert report["prepared"] == "built"
    linears = [m for m in backend.decoder.modules() if isinstance(m, kernels.KernelLinear)]
    assert len(made) == len(linears) and all(made)  # every packed weight, each inside the file


def test_prepared_cache_option_is_checked():
    with pytest.raises(ConfigError, match="choose one of: on, off"):
        LoadConfig(prepared_cache="sometimes")


def test_draft_shares_the_tokenizer_and_loads_no_reference_model(model_dirs, cache, monkeypatch):
    target_dir, draft_dir = model_dirs
    assert same_tokenizer_files(resolve(str(target_dir)), resolve(str(draft_dir)))
    target, tokenizer = load_backend(str(target_dir), LoadConfig(), "target")

    def no_reference(self):
        raise AssertionError("a Hugging Face reference model was loaded")

    monkeypatch.setattr(NativeCausalLM, "reference_model", no_reference)
    report: dict = {}
    draft = load_draft(str(draft_dir), tokenizer, target, LoadConfig(), target_name=str(target_dir), quantize="int8",
                       report=report)
    assert report["prepared"] == "built" and draft.vocab_size == target.vocab_size


def test_different_tokenizer_files_are_loaded_and_compared(tmp_path, model_dirs, cache, tiny_tokenizer,
                                                           monkeypatch):
    import shutil

    from specula.models import loading

    other = tmp_path / "other"
    shutil.copytree(model_dirs[1], other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["model_max_length"] = 17
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert not same_tokenizer_files(resolve(str(model_dirs[0])), resolve(str(other)))
    target, tokenizer = load_backend(str(model_dirs[0]), LoadConfig(), "target")
    loaded = []
    original = loading.load_tokenizer
    monkeypatch.setattr(loading, "load_tokenizer", lambda spec: loaded.append(spec) or original(spec))
    load_draft(str(other), tokenizer, target, LoadConfig(), target_name=str(model_dirs[0]), quantize="int8")
    assert len(loaded) == 1  # the draft's own tokenizer, checked against the target's


def test_load_reports_times_and_skips_an_unused_draft(model_dirs, cache, monkeypatch):
    target_dir, draft_dir = model_dirs

    original = specula.load_draft
    drafts = []
    monkeypatch.setattr(specula, "load_draft", lambda *args, **kwargs: drafts.append(args) or original(*args, **kwargs))
    spec = specula.load(str(target_dir), draft=str(draft_dir), method="prompt-lookup")
    assert spec.draft is None and not drafts
    report = spec.load_report
    assert report.target_seconds > 0 and report.draft_seconds == 0 and report.draft_prepared is None
    assert report.total_seconds >= report.target_seconds + report.other_seconds - 1e-6
    assert report.target_prepared == "built" and report.peak_rss_bytes > 10 * 2**20
    assert report.process_seconds is None or report.process_seconds > report.total_seconds
    assert "loaded in" in report.summary() and "peak RSS" in report.summary()
    assert set(report.to_dict()) >= {"target_s", "draft_s", "other_s", "total_s", "peak_rss_bytes"}
    spec = specula.load(str(target_dir), draft=str(draft_dir), draft_quantize="int8", method="draft-model")
    assert spec.draft is not None and len(drafts) == 1 and spec.load_report.draft_seconds > 0
    assert (spec.load_report.target_prepared, spec.load_report.draft_prepared) == ("hit", "built")


def test_a_load_that_waited_for_another_writer_uses_its_entry(model_dirs, cache, monkeypatch):
    """Two first loads at once: the second waits for the first's lock, then finds the entry written."""
    path = model_dirs[1]
    _load(path)
    real, calls = prepared.load_entry, []

    def absent_at_first(*args):
        calls.append(args)
        if len(calls) == 1:  # as seen before the other process finished writing
            raise prepared.StaleEntry("absent")
        return real(*args)

    monkeypatch.setattr(prepared, "load_entry", absent_at_first)
    _no_preparing(monkeypatch)
    _, _, report = _load(path)
    assert report["prepared"] == "hit" and len(calls) == 2
    assert (prepared.cache_dir("locks") / f"prepared-{_entry(path).name}.lock").is_file()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page residency is read on Linux only")
def test_a_hit_reads_evicted_weights_while_loading(model_dirs, cache, monkeypatch, capsys):
    from specula.models import page_cache

    path = model_dirs[1]
    _load(path)
    weights = _entry(path) / prepared.WEIGHTS
    fd = os.open(weights, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # as after a reboot or a large job in between
    finally:
        os.close(fd)
    evicted = not page_cache.resident_pages(weights).all()
    monkeypatch.setattr(prepared, "_NOTE_BYTES", 1)
    _, _, report = _load(path)
    assert report["prepared"] == "hit"
    assert page_cache.resident_pages(weights).all()  # in memory before any forward pass
    if evicted:
        assert "from storage" in capsys.readouterr().err


def test_the_key_hashes_the_packing_code_and_not_the_kernels():
    base = Path(prepared.__file__).resolve().parent
    assert all((base / rel).is_file() for rel in prepared._CODE_FILES)  # a renamed file would hash as "<missing>"
    assert "native/kernels/pack.c" in prepared._CODE_FILES and "native/kernels/layout.h" in prepared._CODE_FILES
    assert "native/kernels/packing.py" in prepared._CODE_FILES
    assert not any(rel.endswith(("linear.c", "ops.c", "pool.c", "kernels/__init__.py")) for rel in prepared._CODE_FILES)


@pytest.mark.parametrize("config", [{"backend": "hf"}, {"linear_kernel": "aten"}])
def test_int4_is_refused_where_specula_kernels_do_not_run(model_dirs, cache, config):
    """4-bit weights exist only in specula's CPU kernels: the transformers backend and the PyTorch-op
    kernels refuse int4 with the fix named, before any weights are read."""
    with pytest.raises(ConfigError, match='^quantize="int4" runs on specula\'s CPU kernels only.*use quantize="int8"$'):
        _load(model_dirs[1], "int4", **config)
    assert not prepared.prepared_root().exists()


def test_an_int4_models_hugging_face_reference_is_its_int8_self(model_dirs, cache):
    """The bench's Hugging Face peers (`--compare hf`) run a draft's reference model on transformers,
    which has no 4-bit linears: an int4 draft's reference loads in int8 instead of failing."""
    from specula.models.quantize import RowInt8Linear

    backend, _, _ = _load(model_dirs[1], "int4")
    assert backend.decoder.layers[0].wqkv.kind == "i4"
    reference = backend.reference_model()
    assert any(isinstance(m, RowInt8Linear) for m in reference.modules())
