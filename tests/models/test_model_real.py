"""Checks on the real embedded models; skipped unless `specula models install ...` was run."""

from __future__ import annotations

import time

import pytest
import torch

from specula.models import install as inst
from specula.models.loading import apply_chat_template, check_compatible, load_model
from specula.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, EMBEDDED_MODELS, QUICK_TARGET

pytestmark = pytest.mark.slow


def _require_converted(alias: str) -> None:
    status = inst.state(alias).status
    if status != inst.CONVERTED:
        pytest.skip(f"{alias} is {status}; run `specula models install {alias}`")


def test_smollm2_converted_matches_gguf() -> None:
    _require_converted(QUICK_TARGET)
    gguf = inst.verified_gguf(EMBEDDED_MODELS[QUICK_TARGET])
    if gguf is None:
        pytest.skip(f"the GGUF of {QUICK_TARGET} is gone (package uninstalled?)")
    model, tokenizer = load_model(QUICK_TARGET)
    reference, gguf_tokenizer = load_model(str(gguf))
    ids = apply_chat_template(tokenizer, "Write a Python function that reverses a string.")
    assert ids == apply_chat_template(gguf_tokenizer, "Write a Python function that reverses a string.")
    with torch.inference_mode():
        assert torch.equal(model(torch.tensor([ids])).logits, reference(torch.tensor([ids])).logits)


@pytest.mark.perf
def test_smollm2_converted_loads_fast() -> None:
    _require_converted(QUICK_TARGET)
    start = time.perf_counter()
    load_model(QUICK_TARGET)
    load_seconds = time.perf_counter() - start
    assert load_seconds < 10, f"loading the converted {QUICK_TARGET} took {load_seconds:.1f}s"


def test_qwen_pair_is_compatible() -> None:
    _require_converted(DEFAULT_TARGET)
    _require_converted(DEFAULT_DRAFT)
    target, target_tokenizer = load_model(DEFAULT_TARGET)
    draft, draft_tokenizer = load_model(DEFAULT_DRAFT)
    check = check_compatible(target_tokenizer, draft_tokenizer, target, draft)
    assert check.shared_size == check.target_tokens == check.draft_tokens
    assert check.target_logits == check.draft_logits == 151936
    assert target_tokenizer.eos_token == "<|im_end|>"
    ids = apply_chat_template(target_tokenizer, "def quicksort(xs):")
    with torch.inference_mode():
        t_next = target(torch.tensor([ids])).logits[0, -1].argmax().item()
        d_next = draft(torch.tensor([ids])).logits[0, -1].argmax().item()
    assert 0 <= t_next < check.shared_size and 0 <= d_next < check.shared_size


def test_smollm2_is_not_a_draft_for_qwen() -> None:
    _require_converted(QUICK_TARGET)
    _require_converted(DEFAULT_TARGET)
    from transformers import AutoTokenizer

    qwen = AutoTokenizer.from_pretrained(str(inst.model_dir_path(DEFAULT_TARGET)))
    smol = AutoTokenizer.from_pretrained(str(inst.model_dir_path(QUICK_TARGET)))
    from specula.errors import IncompatibleModelsError

    with pytest.raises(IncompatibleModelsError, match="different vocabularies"):
        check_compatible(qwen, smol, target_name=DEFAULT_TARGET, draft_name=QUICK_TARGET)
