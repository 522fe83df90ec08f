"""The padded-batch path of the corpus and its features (`training.padded`, what `specula train`
takes on a GPU), checked on the CPU against the one-at-a-time path: the same greedy answers (EOS
kept, then cut), the same cache file, the same features up to float16 rounding, whatever the
batch shapes."""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch

from tiny import reference_greedy, tiny_model
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.models.native import NativeCausalLM, NativeDecoder, configure
from specula.training.corpus import (CPU_FEATURE_TOKENS, CorpusConfig, CorpusEntry, PaddedConfig, generate_corpus,
                                     read_prompts)
from specula.training.features import extract_features
from specula.training.padded import greedy_padded, length_batches, padded_model


@pytest.mark.parametrize("seed", range(5))
def test_length_batches_hold_every_index_once_within_both_limits(seed):
    rng = random.Random(seed)
    lengths = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 40))]
    groups = length_batches(lengths, max_rows=4, max_tokens=120)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) <= 4
        assert len(g) == 1 or max(lengths[i] for i in g) * len(g) <= 120
        assert [lengths[i] for i in g] == sorted((lengths[i] for i in g), reverse=True)


def test_left_padded_greedy_equals_plain_greedy_and_stops_at_eos():
    model = tiny_model("llama", seed=3)
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 96) for _ in range(n)] for n in (3, 9, 1, 6, 14)]
    plain = [reference_greedy(model, p, 12) for p in prompts]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the cache under the model's own name: no deprecation
        assert greedy_padded(model, prompts, 12, []) == plain
    eos = plain[1][4]  # an EOS that one answer reaches mid-way: it is kept, and that row stops there
    cut = [a[: a.index(eos) + 1] if eos in a else a for a in plain]
    assert greedy_padded(model, prompts, 12, [eos]) == cut
    assert len(cut[1]) <= 5


def test_padded_corpus_equals_the_engine_corpus(tmp_path, tiny_tokenizer):
    model = tiny_model("qwen2", seed=5)
    target = HFCausalLM(model, "hf", eos_token_ids=[7])
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": " ".join(f"w{(i * 7 + k) % 90 + 2}" for k in range(1 + i % 5))})
                            + "\n" for i in range(9)))
    prompts = read_prompts([data])
    config = CorpusConfig(max_new_tokens=10)
    engine = generate_corpus(target, tiny_tokenizer, prompts, tmp_path / "a.jsonl", config)
    padded = generate_corpus(target, tiny_tokenizer, prompts, tmp_path / "b.jsonl", config,
                             padded=PaddedConfig(max_rows=4, max_tokens=64))
    assert padded == engine
    assert any(e.output_ids[-1] == 7 and len(e.output_ids) < 10 for e in engine)  # some answer ended at EOS
    rows = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(pid for pid, _ in prompts)  # the same cache file, any order


@pytest.mark.parametrize("feature_tokens", [1, 40, 10_000])
def test_padded_features_equal_one_prefill_per_sequence(tmp_path, feature_tokens):
    model = tiny_model("llama", seed=3, layers=3)
    target = HFCausalLM(model, "hf", eos_token_ids=[])
    rng = random.Random(4)
    corpus = [CorpusEntry(str(i), [rng.randrange(2, 96) for _ in range(rng.randrange(1, 12))],
                          [rng.randrange(2, 96) for _ in range(rng.randrange(1, 12))]) for i in range(11)]
    one = extract_features(target, corpus, tmp_path / "one.safetensors", layers=(0, 2))
    many = extract_features(target, corpus, tmp_path / f"many{feature_tokens}.safetensors", layers=(0, 2),
                            padded=PaddedConfig(feature_tokens=feature_tokens))
    assert torch.equal(many.tokens, one.tokens) and torch.equal(many.starts, one.starts)
    assert torch.equal(many.prompt_lens, one.prompt_lens) and many.layers == one.layers == (0, 2)
    assert torch.allclose(many.features.float(), one.features.float(), atol=2e-3, rtol=2e-3)
    assert torch.allclose(many.inputs.float(), one.inputs.float(), atol=2e-3, rtol=2e-3)


def test_padded_batches_need_a_hugging_face_model(tmp_path, tiny_tokenizer):
    from specula.training.run import run_training
    from specula.training.trainer import TrainConfig

    model = tiny_model("llama", seed=3)
    native = NativeCausalLM(configure(NativeDecoder.from_hf(model), "onednn", "none", "sdpa"), "native", eos_token_ids=[])
    assert padded_model(native) is None and padded_model(HFCausalLM(model, "hf")) is model
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "w5 w6"}) + "\n")
    with pytest.raises(ConfigError, match=r'with backend="hf" \(or padded=None\)$'):
        run_training(native, tiny_tokenizer, "tiny", tmp_path / "h", TrainConfig(), [data], eval_data=[],
                     padded=PaddedConfig())


def test_feature_passes_on_a_cpu_are_cut_to_the_cpu_size(tmp_path, tiny_tokenizer, monkeypatch):
    """A GPU-sized feature pass (65,536 padded tokens) runs slower on a CPU than passes of about a
    thousand: `specula train` hands the corpus a CPU's size there, and leaves a smaller one or a GPU's
    alone."""
    import specula.training.run as run
    from specula.training.trainer import TrainConfig

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert PaddedConfig().on(cpu).feature_tokens == CPU_FEATURE_TOKENS < PaddedConfig().feature_tokens
    assert PaddedConfig(feature_tokens=256).on(cpu).feature_tokens == 256
    assert PaddedConfig().on(cuda) == PaddedConfig()
    assert PaddedConfig(max_rows=7).on(cpu).max_rows == 7

    seen = []

    class Stop(Exception):
        pass

    def corpus_and_features(*args, **kwargs):
        seen.append(args[6])  # (target, tokenizer, per_file, corpus, layers, label, padded, ...)
        raise Stop  # before any pass: only the settings handed on are checked

    monkeypatch.setattr(run, "_corpus_and_features", corpus_and_features)
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "w5 w6"}) + "\n")
    with pytest.raises(Stop):
        run.run_training(HFCausalLM(tiny_model("llama", seed=3), "hf"), tiny_tokenizer, "tiny", tmp_path / "h",
                         TrainConfig(), [data], eval_data=[], padded=PaddedConfig(max_rows=5))
    assert seen == [PaddedConfig(max_rows=5, feature_tokens=CPU_FEATURE_TOKENS)]


def test_cached_answers_are_matched_to_prompts_by_their_tokens(tmp_path, tiny_tokenizer):
    """The cache file is written in prompt order; one written in the order answers finished (as the
    engine path did) is still read back answer-to-its-prompt."""
    target = HFCausalLM(tiny_model("qwen2", seed=5), "hf", eos_token_ids=[7])
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": " ".join(f"w{(i * 3 + k) % 90 + 2}" for k in range(1 + i % 4))})
                            + "\n" for i in range(7)))
    prompts = read_prompts([data])
    cache = tmp_path / "c.jsonl"
    first = generate_corpus(target, tiny_tokenizer, prompts, cache, CorpusConfig(max_new_tokens=6),
                            padded=PaddedConfig(max_rows=3))
    assert [json.loads(line)["id"] for line in cache.read_text().splitlines()] == [pid for pid, _ in prompts]
    lines = cache.read_text().splitlines()
    cache.write_text("\n".join(lines[::-1]) + "\n")  # another order
    again = generate_corpus(target, tiny_tokenizer, prompts, cache, CorpusConfig(max_new_tokens=6))
    assert again == first
    cache.write_text("\n".join(lines[1:] + [lines[1]]) + "\n")  # one prompt's answer missing
    with pytest.raises(ConfigError, match="holds no answer to prompt"):
        generate_corpus(target, tiny_tokenizer, prompts, cache, CorpusConfig(max_new_tokens=6))
