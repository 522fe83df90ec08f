"""The Hugging Face backend: tree logits (in one pass or grown incrementally) equal causal logits,
the cache equals a plain forward's after any steps (incremental growth included), and sequences
of one backend are independent. The pending-tree guards both backends share: test_sequence.py."""

import random
import warnings

import pytest
import torch

from tiny import assert_cache_equals_plain_forward, check_random_tree, random_steps, random_tree, tiny_model
from specula.errors import ConfigError
from specula.models.base import TargetModel, TargetSequence, check_context, output_room
from specula.models.hf import HFCausalLM, cache_kwarg
from specula.tree import TokenTree


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_logits_equal_causal_logits_over_each_path(arch, attn):
    model = tiny_model(arch, attn)
    tree = check_random_tree(model, HFCausalLM(model).new_sequence(), 0, 9, 14)
    assert not tree.is_chain()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_incremental_tree_logits_equal_causal_logits(arch, attn):
    model = tiny_model(arch, attn)
    # an empty first step and an empty increment
    check_random_tree(model, HFCausalLM(model).new_sequence(), 2, 7, 15, cuts=(0, 4, 9, 9))


def test_cache_equals_plain_forward_after_any_sequence_of_steps(arch):
    model = tiny_model(arch, "sdpa")
    lm = HFCausalLM(model).new_sequence()
    for committed in random_steps(lm, random.Random(1), 12):
        assert_cache_equals_plain_forward(model, lm, committed)


def test_commit_after_incremental_growth_leaves_an_exact_cache(arch):
    model = tiny_model(arch, "sdpa")
    lm = HFCausalLM(model).new_sequence()
    rng = random.Random(3)
    committed = [rng.randrange(96) for _ in range(5)]
    lm.prefill(committed, logits="none")
    for _ in range(6):
        root = rng.randrange(96)
        tree = random_tree(rng, rng.randrange(1, 12), 96)
        cut = rng.randrange(len(tree) + 1)
        lm.forward_tree(root, tree.subtree(range(cut)))
        lm.forward_tree_incremental(tree)
        path = tree.path_to(rng.randrange(len(tree))) if rng.random() < 0.8 else ()
        lm.commit(path)
        committed += [root, *tree.tokens_of(path)]
        assert_cache_equals_plain_forward(model, lm, committed)


def test_the_cache_goes_under_the_name_the_model_takes_without_a_deprecation_warning(arch):
    model = tiny_model(arch, "sdpa")
    lm = HFCausalLM(model).new_sequence()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers 5.24 warns so on past_key_values
        lm.prefill([3, 5, 7], logits="all")
        lm.forward_tree(9, random_tree(random.Random(0), 4, 96))
        lm.commit(())

    class Old(torch.nn.Module):  # an older (5.20) or remote-code forward: past_key_values
        def forward(self, input_ids, past_key_values=None, use_cache=None): ...

    assert cache_kwarg(model) == "cache"  # transformers >= 5.24 (pyproject.toml)
    assert cache_kwarg(Old()) == "past_key_values"


@pytest.mark.parametrize("prompt_len, max_new_tokens, room", [
    (200, None, 56), (200, 32, 32), (240, 32, 16), (256, 32, 0), (300, None, 0),
])
def test_output_room_is_what_fits_after_the_prompt(prompt_len, max_new_tokens, room):
    assert output_room(256, prompt_len, max_new_tokens) == room


def test_context_window_is_enforced_with_a_clear_error():
    lm = HFCausalLM(tiny_model("llama"))
    with pytest.raises(ConfigError, match="context window is 256"):
        check_context(lm, 257)
    check_context(lm, 256)
    seq = lm.new_sequence()  # past the one check, overflowing a sequence is a bug: refused loudly
    with pytest.raises(RuntimeError, match="context window of 256"):
        seq.prefill(list(range(257)), logits="none")
    assert seq.tokens == []


def test_sequences_of_one_backend_are_independent():
    model = tiny_model("qwen2")
    lm = HFCausalLM(model)
    assert isinstance(lm, TargetModel)
    a, b = lm.new_sequence(), lm.new_sequence()
    assert isinstance(a, TargetSequence)
    a.prefill([1, 2, 3, 4], logits="none")
    b.prefill([9, 8], logits="none")
    a.forward_tree(5, TokenTree.chain([6]))
    b.forward_tree(7, TokenTree.build([1, 2], [-1, -1]))
    a.commit([0])
    b.commit([1])
    assert_cache_equals_plain_forward(model, a, [1, 2, 3, 4, 5, 6])
    assert_cache_equals_plain_forward(model, b, [9, 8, 7, 2])
    b.release()
    assert b.tokens == [] and a.tokens == [1, 2, 3, 4, 5, 6]


def test_cost_key_names_what_latency_depends_on():
    key = HFCausalLM(tiny_model("llama")).cost_key()
    assert key["backend"] == "hf" and key["dtype"] == "torch.float32" and key["device"] == "cpu"
    assert key["quantize"] == "none" and key["linear_kernel"] == "aten" and key["attention"] == "sdpa"
    assert key["layers"] == 2 and key["threads"] >= 1


def _mistral(sliding_window: int):
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3,
                        attn_implementation="sdpa", bos_token_id=0, eos_token_id=1, pad_token_id=None,
                        sliding_window=sliding_window)
    return MistralForCausalLM(cfg).eval()


def test_a_sliding_window_no_shorter_than_the_context_is_full_attention():
    """Mistral's default window (4096) over a 256-token context: its cache is built of plain layers,
    which commits crop and gather; greedy output equals plain greedy decoding."""
    from tiny import SPECULATIVE_PROMPTS, reference_greedy
    from specula.drafters import make_drafter
    from specula.engine import SpeculativeDecoder
    from specula.sampling import SamplingParams

    model = _mistral(4096)
    target = HFCausalLM(model, "target")
    dec = SpeculativeDecoder(target, make_drafter("prompt-lookup"), eos_token_ids=[])
    accepted = 0
    for prompt in SPECULATIVE_PROMPTS:
        out = dec.generate(prompt, SamplingParams(max_new_tokens=32, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 32)
        accepted += out.stats.accepted_tokens
    assert accepted > 0
    assert not check_random_tree(model, target.new_sequence(), 0, 9, 14).is_chain()


def test_cache_layers_a_commit_cannot_roll_back_are_refused_when_the_backend_is_built():
    """A window shorter than the context drops positions a tree needs; a recurrent (hybrid) layer
    keeps state a rejected draft changed. Both are refused at once, naming the reason, not after
    the first rejected draft (or, for the hybrid layer, never: its output differed silently)."""
    import transformers

    with pytest.raises(ConfigError, match="sliding window of 8 tokens, shorter than the context of 256"):
        HFCausalLM(_mistral(8), "short")
    cfg = transformers.ZayaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                                  moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1, router_hidden_size=16,
                                  layer_types=["hybrid", "hybrid"], bos_token_id=0, eos_token_id=1, pad_token_id=None)
    with pytest.raises(ConfigError, match="LinearAttentionAndFullAttentionLayer .* not keys and values alone"):
        HFCausalLM(transformers.ZayaForCausalLM(cfg).eval(), "hybrid")


def _tiny(config_cls: str, model_cls: str, **fields):
    import transformers

    config = getattr(transformers, config_cls)(vocab_size=96, bos_token_id=0, eos_token_id=1, **fields)
    config._attn_implementation = "eager"
    return getattr(transformers, model_cls)(config).eval()


@pytest.mark.parametrize("build, words", [
    (lambda: _tiny("MptConfig", "MptForCausalLM", d_model=32, n_layers=2, n_heads=4, max_seq_len=64), "ALiBi"),
    (lambda: _tiny("BloomConfig", "BloomForCausalLM", hidden_size=32, n_layer=2, n_head=4), "ALiBi"),
    (lambda: _tiny("FalconConfig", "FalconForCausalLM", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   alibi=True, max_position_embeddings=64), "ALiBi"),
    (lambda: _tiny("Phi3Config", "Phi3ForCausalLM", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   original_max_position_embeddings=16, pad_token_id=None,
                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                    "original_max_position_embeddings": 16, "short_factor": [1.0] * 4,
                                    "long_factor": [4.0, 8.0, 16.0, 32.0]}), "longrope rotary scaling"),
    (lambda: _tiny("GPTNeoConfig", "GPTNeoForCausalLM", hidden_size=32, num_layers=2, num_heads=4,
                   attention_types=[[["global", "local"], 1]], window_size=8, max_position_embeddings=64),
     "local attention over a window of 8 tokens"),
])
def test_attention_a_tree_pass_cannot_reproduce_is_refused_at_build(build, words):
    """ALiBi from the sequence's length (wrong tree logits, or a crash), longrope factors picked from
    a pass's largest position (greedy output differed from plain decoding's) and GPT-Neo's local
    window counted in rows: refused when the backend is built, in one line."""
    with pytest.raises(ConfigError, match=words):
        HFCausalLM(build(), "tiny")


def test_a_model_that_fills_no_kv_cache_is_refused_at_its_first_prefill():
    model = _tiny("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", n_embd=32, n_layer=2, n_head=4, n_positions=64)
    seq = HFCausalLM(model, "gpt").new_sequence()
    with pytest.raises(ConfigError, match="does not fill a KV cache"):
        seq.prefill([5, 6, 7])


def test_rotary_scaling_that_keeps_rows_alike_is_accepted():
    """Dynamic NTK changes its factors only past max_position_embeddings (the context itself), and
    llama3 / linear scaling are static: accepted, as longrope within its original window is."""
    import transformers

    for rope in ({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16, "rope_theta": 1e4},
                 {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16, "rope_theta": 5e5},
                 {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}):
        config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          rope_parameters=rope)
        HFCausalLM(transformers.LlamaForCausalLM(config).eval(), "tiny")
