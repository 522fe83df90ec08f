"""The GGUF -> safetensors conversion on tiny random models (no real weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from modelkit import FakeIndex, ModelFactory, write_tiny_gguf
from safetensors import safe_open

from specula.models import install as inst


def _tiny_llama(tie: bool):  # noqa: ANN202
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tie", [True, False])
def test_safetensors_round_trip_gives_identical_logits(tmp_path: Path, tie: bool) -> None:
    from transformers import AutoModelForCausalLM

    model = _tiny_llama(tie)
    files = inst.save_checkpoint(model, None, tmp_path)
    assert {"model.safetensors", "config.json", "generation_config.json"} <= set(files)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert ("lm_head.weight" in keys) is not tie  # tied copy dropped, re-tied from the config
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) is tie
    ids = torch.tensor([[1, 5, 7, 42, 3]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


def test_aliased_tensors_not_declared_tied_are_cloned() -> None:
    model = _tiny_llama(tie=False)
    model.lm_head.weight = model.model.embed_tokens.weight  # shared, but the config says untied
    state = inst.checkpoint_state_dict(model)
    assert "lm_head.weight" in state
    assert state["lm_head.weight"].data_ptr() != state["model.embed_tokens.weight"].data_ptr()
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])


@pytest.mark.parametrize("tie", [True, False])
def test_convert_gguf_matches_gguf_model(tmp_path: Path, tie: bool) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tie=tie, seed=3)
    out = tmp_path / "out"
    facts = inst.convert_gguf(gguf, out, progress=False)
    assert facts["max_abs_logit_diff"] == 0.0 and facts["check_tokens"] > 5
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is tie
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(facts["files"])


def test_full_install_of_a_split_tiny_gguf_then_load(make_model: ModelFactory, fake_index: FakeIndex,
                                                     tmp_path: Path, cache: Path) -> None:
    """End to end with the real converter: 3 parts in 2 fake packages -> cache -> load_model(alias)."""
    from specula.models.loading import load_model

    blob = write_tiny_gguf(tmp_path / "whole.gguf", seed=7).read_bytes()
    cut1, cut2 = len(blob) // 3, 2 * len(blob) // 3
    make_model("tiny-split", [blob[:cut1], blob[cut1:cut2], blob[cut2:]], packages=["tiny-a", "tiny-a", "tiny-b"])
    result = inst.install("tiny-split", progress=False)
    assert result.converted and inst.state("tiny-split").status == "converted"
    marker = inst.read_marker(result.model_dir)
    assert marker is not None and marker["max_abs_logit_diff"] == 0.0
    assert marker["source_packages"] == ["tiny-a==1.0", "tiny-b==1.0"]
    assert all(not p.name.startswith(".") for p in (cache / "models").iterdir())

    model, tokenizer = load_model("tiny-split")
    reference, _ = load_model(str(tmp_path / "whole.gguf"))
    ids = torch.tensor([tokenizer.encode(" the a the", add_special_tokens=False)])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_the_gguf_is_parsed_once_and_loads_as_transformers_alone_loads_it(tmp_path: Path, monkeypatch) -> None:
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_tiny_gguf(tmp_path / "tiny.gguf", tie=False, seed=5)
    made: list[str] = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, *args, **kwargs) -> None:
            made.append(str(args[0]))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    model, tokenizer = inst._load_gguf(path)
    assert made == [str(path)]  # config, weights and tokenizer read one parse
    assert gguf.GGUFReader is CountingReader  # the module's class is back after the load

    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=str(path), dtype=torch.float32)
    assert len(made) > 1  # outside the block every read parses again
    expected = reference.state_dict()
    assert model.state_dict().keys() == expected.keys()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in model.state_dict().items())
    plain_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=str(path))
    assert tokenizer.get_vocab() == plain_tokenizer.get_vocab()


def test_the_reader_over_a_plain_array_reads_what_the_memmap_reader_reads(tmp_path: Path) -> None:
    import gguf
    import numpy as np
    from gguf import gguf_reader

    path = write_tiny_gguf(tmp_path / "tiny.gguf", tie=True, seed=3)
    plain, reference = inst._plain_gguf_reader(gguf.GGUFReader, path), gguf.GGUFReader(path)
    assert type(plain.data) is np.ndarray and isinstance(reference.data, np.memmap)
    assert gguf_reader.np is np  # swapped back
    assert list(plain.fields) == list(reference.fields)
    for name, field in reference.fields.items():
        other = plain.fields[name]
        assert other.types == field.types and other.data == field.data, name
        assert all(np.array_equal(a, b) for a, b in zip(other.parts, field.parts, strict=True)), name
    assert [t.name for t in plain.tensors] == [t.name for t in reference.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(plain.tensors, reference.tensors, strict=True))


def test_a_quantized_gguf_dequantised_in_c_loads_as_transformers_alone_loads_it(tmp_path: Path, monkeypatch) -> None:
    """Every block type of the embedded models' GGUFs (`modelkit.QUANTIZED_GGUF_TYPES`) goes through
    `gguf.c` during the load and gives the state dict transformers gives with gguf-py's numpy; the
    name map is made once per architecture, and both of gguf's functions are back afterwards."""
    import gguf
    from modelkit import QUANTIZED_GGUF_TYPES
    from transformers import AutoModelForCausalLM

    from specula.models.native import kernels
    from specula.models.native.kernels import dequant

    if not kernels.available():
        pytest.skip("specula's CPU kernels cannot run here")
    path = write_tiny_gguf(tmp_path / "q.gguf", tie=False, seed=7, hidden=256, quantized=True)
    in_c: set[str] = set()
    real = dequant.dequantize

    def counting(data, qtype):  # noqa: ANN001, ANN202
        if dequant.known(qtype):
            in_c.add(gguf.GGMLQuantizationType(qtype).name)
        return real(data, qtype)

    name_maps: list[tuple] = []
    real_map = gguf.get_tensor_name_map

    def counting_map(*args):  # noqa: ANN002, ANN202
        name_maps.append(args)
        return real_map(*args)

    monkeypatch.setattr(dequant, "dequantize", counting)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_map)
    model, _ = inst._load_gguf(path)
    assert in_c == set(QUANTIZED_GGUF_TYPES)
    assert len(name_maps) == 1  # transformers asks once per submodule; made once
    assert gguf.dequantize is gguf.quants.dequantize and gguf.get_tensor_name_map is counting_map
    import numpy
    from transformers import modeling_gguf_pytorch_utils as loader

    assert loader.np is numpy  # the loader's numpy is back too

    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=str(path), dtype=torch.float32)
    assert len(name_maps) > 1  # outside the block: once per submodule again
    expected = reference.state_dict()
    assert model.state_dict().keys() == expected.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor.view(torch.int32), expected[name].view(torch.int32)), name


def test_numpy_asks_for_no_huge_pages_during_the_load_only() -> None:
    setter = inst._numpy_hugepage_setter()
    if setter is None:
        pytest.skip("this numpy has no _set_madvise_hugepage")
    before = setter(True)
    try:
        with inst._numpy_without_hugepages():
            assert setter(False) is False  # it was off inside
        assert setter(True) is True  # and on again after
    finally:
        setter(before)


def test_metadata_parsed_with_strings_decoded_whole_is_what_transformers_parses(tmp_path: Path) -> None:
    import gguf
    from transformers.integrations.ggml import _gguf_parse_value

    fast = inst._gguf_parse_value_decoding_whole(_gguf_parse_value)
    reader = gguf.GGUFReader(write_tiny_gguf(tmp_path / "tiny.gguf"))
    kinds = set()
    for name, field in reader.fields.items():
        kinds.add(tuple(field.types))
        ours = [fast(field.parts[i], field.types) for i in field.data]
        theirs = [_gguf_parse_value(field.parts[i], field.types) for i in field.data]
        assert ours == theirs and [type(v) for v in ours] == [type(v) for v in theirs], name
    assert {(8,), (9, 8), (9, 5), (4,), (6,)} <= kinds  # strings, string arrays, int arrays, ints, floats


def test_a_replaced_attribute_is_back_after_an_error_and_a_missing_one_stays_missing() -> None:
    import types

    owner = types.SimpleNamespace(f=abs)
    with pytest.raises(RuntimeError), inst._replaced(owner, "f", lambda original: lambda x: -original(x)):
        assert owner.f(-3) == -3
        raise RuntimeError
    assert owner.f is abs
    with inst._replaced(owner, "g", lambda original: 1 / 0):  # never made: nothing to replace
        assert not hasattr(owner, "g")
    assert not hasattr(owner, "g")


def test_the_loader_keeps_the_array_dequantize_just_made_and_copies_every_other(monkeypatch) -> None:
    """`_NumpyKeepingFresh.copy` hands back the array its `dequantize` has just made (new, owning its
    memory) once; a view of the file's bytes, any other array, or a copy asked with arguments is copied."""
    import numpy as np

    from specula.models.native.kernels import dequant

    made = np.arange(8, dtype=np.float32)
    file_bytes = np.arange(16, dtype=np.float32)
    results = iter([made, file_bytes[4:12]])
    monkeypatch.setattr(dequant, "dequantize", lambda data, qtype: next(results))
    fresh = inst._NumpyKeepingFresh()
    assert fresh.float32 is np.float32 and fresh.ndarray is np.ndarray  # numpy otherwise
    out = fresh.dequantize(b"", 2)
    assert out is made and fresh.copy(made) is made
    again = fresh.copy(made)  # once only: the loader may copy it again for another owner
    assert again is not made and np.array_equal(again, made) and not np.shares_memory(again, made)
    other = np.ones(3)
    assert fresh.copy(other) is not other
    view = fresh.dequantize(b"", 2)
    assert view.base is file_bytes and fresh.fresh is None
    copied = fresh.copy(view)
    assert not np.shares_memory(copied, file_bytes) and np.array_equal(copied, view)
    fresh.fresh = made
    assert fresh.copy(made, order="F") is not made
