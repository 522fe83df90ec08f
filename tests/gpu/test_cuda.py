"""CUDA: the same promises as on CPU, on the GPU (skipped without one; CI has none).

Tree logits equal causal logits, the cache equals a plain forward's, greedy speculative output
equals plain greedy, and the sampled output law equals the target's, for the Hugging Face and the
native backend, in float32 (exact to float tolerance) and bfloat16 (lossless up to near-ties). The
native backend runs on its default CUDA-graph path ("native") and eagerly ("native-eager")."""

from __future__ import annotations

import random

import pytest
import torch

from laws import tv, tv_bound
from tiny import assert_tree_logits_are_causal, perturbed_copy, random_steps, random_tree, tiny_model
from specula.api import build_decoder
from specula.models.hf import HFCausalLM
from specula.models.native import NativeCausalLM, NativeDecoder, configure
from specula.sampling import SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
DEVICE = torch.device("cuda:0")


def backend(kind: str, model):
    model = model.to(DEVICE)
    if kind == "hf":
        return HFCausalLM(model, "hf", eos_token_ids=[])
    decoder = configure(NativeDecoder.from_hf(model), "aten", "none", "sdpa")
    return NativeCausalLM(decoder, kind, eos_token_ids=[], cuda_graphs=None if kind == "native" else False)


@pytest.mark.parametrize("kind", ["hf", "native", "native-eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tree_logits_equal_causal_logits_on_cuda(kind, arch):
    model = tiny_model(arch, seed=4)
    reference = tiny_model(arch, seed=4)  # the same weights, on the CPU
    seq = backend(kind, model).new_sequence()
    rng = random.Random(5)
    prompt = [rng.randrange(96) for _ in range(11)]
    seq.prefill(prompt[:-1], logits="none")
    tree = random_tree(rng, 16, 96)
    logits = seq.forward_tree(prompt[-1], tree)
    assert logits.device.type == "cuda"
    assert_tree_logits_are_causal(reference, prompt, tree, logits.float().cpu())


@pytest.mark.parametrize("kind", ["hf", "native", "native-eager"])
def test_cache_equals_plain_forward_on_cuda(kind):
    model = tiny_model("qwen2", seed=8)
    seq = backend(kind, model).new_sequence()
    *_, committed = random_steps(seq, random.Random(9), 10, crop=False)
    assert seq.tokens == committed
    with torch.inference_mode():
        ref = model(torch.tensor([committed], device=DEVICE), use_cache=True).past_key_values
    for (k, v), layer in zip(seq.cache_tensors(), ref.layers):
        torch.testing.assert_close(k, layer.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, layer.values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["hf", "native", "native-eager"])
@pytest.mark.parametrize("method", ["prompt-lookup", "token-recycling", "draft-model", "draft-tree", "fusion"])
def test_greedy_speculative_output_equals_plain_greedy_on_cuda(kind, method):
    model = tiny_model("llama", seed=3)
    draft_model = perturbed_copy(model, 0.2)
    target = backend(kind, model)
    draft = backend(kind, draft_model) if method in ("draft-model", "draft-tree", "fusion") else None
    plain = build_decoder("none", target)
    dec = build_decoder(method, target, None, draft, planner=False)
    for prompt in ([5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17], [60, 61, 62, 63]):
        params = SamplingParams(max_new_tokens=30, ignore_eos=True)
        assert dec.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids, (kind, method)


@pytest.mark.parametrize("method", ["fusion", "draft-model"])
def test_sampled_output_follows_the_target_law_on_cuda(method):
    model = tiny_model("llama", seed=8, vocab=8)
    prompt, temp, trials = [3, 5, 1, 3, 5], 1.5, 1000
    with torch.inference_mode():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double() / temp, -1)
        rows = [torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1].double() / temp, -1) for a in range(8)]
    exact = (p1[:, None] * torch.stack(rows)).flatten()
    draft_model = perturbed_copy(model, 0.3)
    options = {"greedy_proposals": False} if method == "draft-model" else {}  # seeded trials draw from q
    dec = build_decoder(method, backend("native", model), None, backend("native", draft_model), planner=False,
                        **options)
    codes = torch.empty(trials, dtype=torch.long)
    for s in range(trials):
        ids = dec.generate(prompt, SamplingParams(temperature=temp, max_new_tokens=3, seed=s, ignore_eos=True)).token_ids
        codes[s] = ids[0] * 8 + ids[1]
    assert tv(codes, exact) < tv_bound(exact, trials, c=2.0)


def test_verify_step_on_the_device_takes_the_tokens_the_cpu_walk_takes():
    """Deterministic candidates on an accelerator: every row's token at once (`target_tokens`),
    then the greedy match; the same path and token as the lazy walk on the CPU."""
    from specula.tree import TokenTree
    from specula.verify import verify_step

    torch.manual_seed(6)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    tree = TokenTree.build([3, 4, 5, 6, 7], [-1, -1, 0, 2, 2])
    for seed in range(100):
        logits = torch.randn(6, 40) * 3  # [n + 1, vocab]
        logits[:, [3, 5, 6]] += 3  # drafted tokens likely enough to be accepted
        on_cpu = verify_step(tree, logits, params, seed=seed, position=seed % 7)
        assert verify_step(tree, logits.to(DEVICE), params, seed=seed, position=seed % 7) == on_cpu


@pytest.mark.parametrize("kind", ["hf", "native", "native-eager"])
@pytest.mark.parametrize("head_kind", ["eagle", "eagle3", "medusa", "hydra"])
def test_trained_heads_draft_on_cuda_and_greedy_output_equals_plain_greedy(kind, head_kind):
    """A head on the device (its KV cache, positions and tree masks there) drafts, and the output
    is plain greedy."""
    from specula.drafters.heads.runtime import new_head

    model = tiny_model("llama", seed=4)
    reference = tiny_model("llama", seed=4)
    target = backend(kind, model)
    head = new_head(head_kind, target, torch.arange(0, 96, 2), seed=1)
    dec = build_decoder(head_kind, target, None, head=head, planner=False)
    rng = random.Random(2)
    for _ in range(3):
        prompt = [rng.randrange(2, 96) for _ in range(rng.randrange(2, 9))]
        out = dec.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
        with torch.inference_mode():
            ids = list(prompt)
            for _ in range(30):
                ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.token_ids == ids[len(prompt):], (kind, head_kind, prompt)
        assert out.stats.drafted_tokens > 0
