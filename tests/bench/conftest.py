"""Bench fixtures: a tiny tokenizer with a chat template, tiny target + draft, a prompt file."""

from __future__ import annotations

import copy
import json

import pytest

from specula.models.hf import HFCausalLM
from tiny import perturbed_copy, tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}w2 {% else %}w3 {% endif %}{{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}w4{% endif %}"
)
"""user -> 'w2 <text>', assistant -> 'w3 <text>', generation prompt 'w4' (all tiny-vocab words)."""

PROMPTS = [
    {"id": "a1", "category": "alpha", "turns": ["w5 w6 w7 w8 w5 w6 w7 w8 w5 w6", "w9 w10 w9 w10 w9"]},
    {"id": "b1", "category": "beta", "turns": ["w20 w21 w22 w20 w21 w22 w20"]},
    {"id": "a2", "category": "alpha", "turns": ["w30 w31 w32 w33 w30 w31"]},
    {"id": "b2", "category": "beta", "turns": ["w40 w41 w40 w41 w40 w41 w40"]},
]


@pytest.fixture(scope="session")
def chat_tokenizer(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def tiny_pair():
    """(target backend, draft backend): a tiny Qwen2 and a lightly perturbed copy."""
    model = tiny_model("qwen2")
    return HFCausalLM(model, "target"), HFCausalLM(perturbed_copy(model, scale=0.02), "draft")


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path
