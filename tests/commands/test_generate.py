"""`specula generate` end to end on a tiny model (loading monkeypatched): output, --compare, --json."""

from __future__ import annotations

import json

import pytest

from tiny import tiny_model
import specula.api
from specula.cli import main
from specula.models.hf import HFCausalLM


@pytest.fixture
def tiny_load(monkeypatch, tiny_tokenizer):
    model = tiny_model("qwen2", seed=3)

    def load(target, draft=None, method=None, config=None, draft_quantize=None, **options):
        return specula.api.Specula(HFCausalLM(model, "target"), tiny_tokenizer, method or "fusion", **options)

    monkeypatch.setattr(specula.api, "load", load)


def run(capsys, *extra: str) -> tuple[int, str, str]:
    code = main(["generate", "--target", "tiny", "--prompt", "w5 w17 w33 w5 w17 w40", "--raw", "--max-new-tokens", "16",
                 "--ignore-eos", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_greedy_compare_says_identical(tiny_load, capsys):
    code, out, err = run(capsys, "--compare")
    assert code == 0 and out.strip()
    assert "output identical to plain decoding" in err and "speedup vs plain decoding" in err


def test_sampled_compare_does_not_call_another_draw_a_bug(tiny_load, capsys):
    code, _, err = run(capsys, "--compare", "--temperature", "1.0", "--seed", "4", "--method", "prompt-lookup")
    assert code == 0
    assert "DIFFERENT" not in err and "sampled run: a draw from the same distribution as plain decoding" in err
    code, out, _ = run(capsys, "--compare", "--temperature", "1.0", "--seed", "4", "--json")
    payload = json.loads(out)
    assert payload["identical_to_plain"] is None and payload["speedup"] > 0
    code, out, _ = run(capsys, "--compare", "--json")
    assert json.loads(out)["identical_to_plain"] is True
