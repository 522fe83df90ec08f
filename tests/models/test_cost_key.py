"""One `cost_key()` schema for every backend (`models/cost_key.py`): the same fields on the Hugging
Face and the native backend, so a field added to the schema reaches both cost caches."""

import dataclasses

import pytest

from tiny import tiny_model
from specula.models.cost_key import CostKey
from specula.models.device import cpu_model
from specula.models.hf import HFCausalLM
from specula.models.native import NativeCausalLM, NativeDecoder, configure, kernels


def test_both_backends_build_their_key_from_the_one_schema():
    fields = {f.name for f in dataclasses.fields(CostKey)}
    hf = HFCausalLM(tiny_model("llama")).cost_key()
    native = NativeCausalLM(configure(NativeDecoder.from_hf(tiny_model("llama")), "aten", "none", "sdpa"),
                            "native").cost_key()
    assert set(hf) == fields - {"cuda_graphs", "gpu"}  # no graph path, no GPU: left out (keys as before)
    assert hf["cpu"] == native["cpu"] == cpu_model()  # a cache taken to another machine is timed there
    assert set(native) == fields - {"gpu"}
    assert {k: v for k, v in hf.items() if k not in ("backend", "arch")} == \
        {k: v for k, v in native.items() if k not in ("backend", "arch", "cuda_graphs", "model")} | {"model": "model"}


def test_another_model_at_the_same_path_gets_its_own_key_and_a_path_is_one_key_however_spelled(tmp_path,
                                                                                              monkeypatch):
    """A model of another vocabulary or MLP width saved where one was timed read that one's curve;
    the same directory given relatively and absolutely got two keys (timed twice)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    def saved(**shape):
        config = LlamaConfig(**{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96, **shape})
        LlamaForCausalLM(config).save_pretrained(tmp_path / "m")
        return HFCausalLM(AutoModelForCausalLM.from_pretrained(tmp_path / "m")).cost_key()

    keys = [saved(), saved(vocab_size=200), saved(intermediate_size=128), saved(num_key_value_heads=4)]
    assert len({str(k) for k in keys}) == 4
    monkeypatch.chdir(tmp_path)
    relative = HFCausalLM(AutoModelForCausalLM.from_pretrained("m")).cost_key()
    assert relative == keys[-1]


def test_optional_fields_are_left_out_only_when_unset():
    key = CostKey(model="m", arch="a", layers=2, hidden=8, backend="hf", dtype="torch.float32", device="cpu",
                  threads=1, torch="2", quantize="none", attention="sdpa", linear_kernel="aten")
    assert "cuda_graphs" not in key.as_dict() and "gpu" not in key.as_dict()
    assert dataclasses.replace(key, cuda_graphs=False).as_dict()["cuda_graphs"] is False


@pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels cannot run here")
def test_a_curve_timed_with_other_kernel_code_or_isa_is_another_key():
    native = NativeCausalLM(configure(NativeDecoder.from_hf(tiny_model("llama")), "specula", "none", "sdpa"), "native")
    before = kernels.isa()
    try:
        keys = {isa: (kernels.set_isa(isa), native.cost_key()["linear_kernel"])[1] for isa in ("avx2", "avx512")}
    finally:
        kernels.set_isa(before)
    assert keys["avx2"] == f"specula-f32-avx2-{kernels.build_key()[:8]}"
    if before == "avx512":  # the CPU has it
        assert keys["avx512"] == f"specula-f32-avx512-{kernels.build_key()[:8]}"
