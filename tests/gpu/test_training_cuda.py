"""CUDA: `specula train` on the GPU (skipped without one; CI has none). The padded-batch corpus and
features on the device equal the one-at-a-time ones on the CPU, and the command trains an eagle3
head on the device whose file then drafts on the CPU with greedy output unchanged."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tiny import reference_greedy, saved_training_setup, tiny_model
from specula.models.hf import HFCausalLM
from specula.training.corpus import CorpusEntry, PaddedConfig
from specula.training.features import extract_features
from specula.training.padded import greedy_padded

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_padded_answers_and_features_on_cuda_equal_the_cpu_ones(tmp_path):
    model = tiny_model("llama", seed=3, layers=3)
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 96) for _ in range(n)] for n in (2, 7, 11, 4)]
    on_gpu = tiny_model("llama", seed=3, layers=3).to("cuda")
    assert greedy_padded(on_gpu, prompts, 10, []) == [reference_greedy(model, p, 10) for p in prompts]
    corpus = [CorpusEntry(str(i), p, reference_greedy(model, p, 6)) for i, p in enumerate(prompts)]
    cpu = extract_features(HFCausalLM(model, "hf", eos_token_ids=[]), corpus, tmp_path / "cpu.safetensors", layers=(0, 2))
    gpu = extract_features(HFCausalLM(on_gpu, "hf", eos_token_ids=[]), corpus, tmp_path / "gpu.safetensors",
                           layers=(0, 2), padded=PaddedConfig(feature_tokens=30))
    assert gpu.features.device.type == "cpu" and torch.equal(gpu.tokens, cpu.tokens)
    assert torch.allclose(gpu.inputs.float(), cpu.inputs.float(), atol=2e-3, rtol=2e-3)
    assert torch.allclose(gpu.features.float(), cpu.features.float(), atol=2e-3, rtol=2e-3)


def test_train_command_on_cuda_writes_a_head_that_drafts_on_the_cpu(tmp_path, monkeypatch, tiny_tokenizer, capsys):
    from specula.cli import main
    from specula.drafters.heads.file import read_head

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    path, model, data = saved_training_setup(tmp_path, tiny_tokenizer, layers=4, prompts=12)
    code = main(["train", "--target", str(path), "--kind", "eagle3", "--data", str(data), "--out", str(tmp_path / "h"),
                 "--epochs", "2", "--draft-vocab", "64", "--max-new-tokens", "16", "--seq-len", "16", "--quiet",
                 "--eval-data", "--device", "cuda", "--backend", "hf", "--dtype", "float32", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["device"].startswith("cuda") and report["padded_batches"]["max_rows"] == 512
    assert report["training"]["steps"] == report["training"]["total_steps"] > 0
    assert all(loss == loss for loss in report["training"]["last_losses"])  # finite, no NaN
    head = read_head(tmp_path / "h" / "eagle3.safetensors")
    assert head.config.feature_layers == (1, 2)
    code = main(["generate", "--target", str(path), "--method", "eagle3", "--head", str(tmp_path / "h" / "eagle3.safetensors"),
                 "--prompt", "w5 w9 w13", "--raw", "--max-new-tokens", "12", "--ignore-eos", "--json", "--device", "cpu"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0
    assert payload["token_ids"] == reference_greedy(model, list(tiny_tokenizer.encode("w5 w9 w13")), 12)
