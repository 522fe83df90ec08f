"""One `cost_key()` schema for every backend (`models/cost_key.py`): the same fields on the Hugging
Face and the native backend, so a field added to the schema reaches both cost caches."""

import dataclasses

import pytest

from tiny import tiny_model
from specula.models.cost_key import CostKey
from specula.models.hf import HFCausalLM
from specula.models.native import NativeCausalLM, NativeDecoder, configure, kernels


def test_both_backends_build_their_key_from_the_one_schema():
    fields = {f.name for f in dataclasses.fields(CostKey)}
    hf = HFCausalLM(tiny_model("llama")).cost_key()
    native = NativeCausalLM(configure(NativeDecoder.from_hf(tiny_model("llama")), "aten", "none", "sdpa"),
                            "native").cost_key()
    assert set(hf) == fields - set(CostKey.OPTIONAL)  # no graph path, no GPU: left out (keys as before)
    assert set(native) == fields - {"gpu"}
    assert {k: v for k, v in hf.items() if k not in ("backend", "arch")} == \
        {k: v for k, v in native.items() if k not in ("backend", "arch", "cuda_graphs", "model")} | {"model": "model"}


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
