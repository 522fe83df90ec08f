"""Chunked prefill (`specula.prefill`, `SpeculativeDecoder.start(max_prefill_tokens=...)` and `prefill`): a prompt
run a chunk at a time, between other sessions' steps, leaves the same cache and hidden states, bit for bit, as
one pass over it on the row-invariant CPU kernels, so every output, a head's drafts and the prompt's logprobs are
what a whole prefill gives."""

from __future__ import annotations

import pytest
import torch

from tiny import prompt_features, reference_greedy, tiny_model
from specula.api import build_decoder
from specula.drafters.heads.runtime import new_head
from specula.engine import EngineConfig, SpeculativeDecoder
from specula.errors import ConfigError
from specula.models.native import NativeCausalLM, NativeDecoder, configure, kernels
from specula.prefill import PromptPrefill
from specula.sampling import SamplingParams

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels do not run here")

PROMPT = [5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17, 60, 61, 62, 63, 64, 60, 61, 9, 12, 30]
OTHER = [9, 8, 7, 5, 17, 33, 2, 44, 45, 46]


def native(model) -> NativeCausalLM:
    """specula's C kernels: every row computed alone (greedy guarantee "bitwise")."""
    return NativeCausalLM(configure(NativeDecoder.from_hf(model), "specula", "none", "sdpa"), "native",
                          eos_token_ids=[])


def greedy(n: int, **options) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **options)


def plain_decoder(method: str, mib: int = 0):
    """(a tiny model, a decoder of `method` on its native target with a `mib` prefix cache)."""
    model = tiny_model("llama", seed=3)
    return model, build_decoder(method, native(model), None, engine=EngineConfig(prefix_cache_mib=mib))


def head_decoder(target, kind: str, mib: int = 0) -> SpeculativeDecoder:
    head = new_head(kind, target, torch.arange(0, target.vocab_size), seed=1)
    return build_decoder(kind, target, None, head=head, planner=False, engine=EngineConfig(prefix_cache_mib=mib))


def run_chunked(dec: SpeculativeDecoder, prompt: list[int], params: SamplingParams, chunk: int, others=()):
    """Start `prompt` with `chunk`-token prefill passes, stepping the sessions `others` between them; then
    decode it to the end alone: (its session, how many prefill calls it took)."""
    session = dec.start(prompt, params, max_prefill_tokens=chunk)
    calls = 1
    while not session.prefilled:
        running = [s for s in others if not s.finished]
        if running:
            dec.step(running)
        dec.prefill(session, chunk)
        calls += 1
    while not session.finished:
        dec.step([session])
    return session, calls


# ---------------------------------------------------------------------------------------- the prompt's passes


@needs_kernels
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_a_prompt_run_in_chunks_leaves_the_cache_and_states_of_one_pass(chunk):
    model = tiny_model("llama", seed=2)
    target = native(model)
    whole, parts = target.new_sequence(), target.new_sequence()
    one = PromptPrefill(list(PROMPT), hidden=True)
    one.run(whole)
    assert one.finished and one.passes == 1
    pieces = PromptPrefill(list(PROMPT), hidden=True)
    while not pieces.finished:
        pieces.run(parts, chunk)
    assert pieces.passes == -(-(len(PROMPT) - 1) // chunk)
    assert parts.tokens == whole.tokens == PROMPT[:-1]  # the last token is the first step's root
    assert torch.equal(pieces.features(), one.features())  # [len(PROMPT) - 1, E]
    assert torch.equal(parts.prefill(PROMPT[-1:], logits="last"), whole.prefill(PROMPT[-1:], logits="last"))


def test_a_prompt_with_nothing_to_run_makes_one_empty_pass_and_bad_chunks_are_refused():
    model = tiny_model("llama", seed=2)
    target = native(model)
    seq = target.new_sequence()
    pending = PromptPrefill([7], hidden=True)
    assert not pending.finished and pending.remaining == 0
    pending.run(seq, 4)
    assert pending.finished and pending.features().shape[0] == 0 and seq.tokens == []
    with pytest.raises(ValueError, match="at least 1"):
        PromptPrefill(list(PROMPT)).run(target.new_sequence(), 0)


# ---------------------------------------------------------------------------------------- the engine


@needs_kernels
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_chunked_prefill_between_other_sessions_steps_changes_nothing(kind):
    """A prompt prefilled 3 tokens at a time while another session decodes: the head starts from the same
    features, drafts and gets accepted exactly as after one pass, and both outputs are plain greedy."""
    model = tiny_model("llama", "eager", seed=4)
    target = native(model)
    dec = head_decoder(target, kind)
    seen = prompt_features(dec)
    want = dec.generate(PROMPT, greedy(16))
    other = dec.start(OTHER, greedy(40))
    got, calls = run_chunked(dec, PROMPT, greedy(16), 3, others=[other])
    assert calls == 7 and got.stats.prompt_tokens == len(PROMPT)  # 20 tokens to run, 3 a pass
    assert torch.equal(seen[-1], seen[0])  # seen: the whole run's, the other's, the chunked run's
    assert got.generated == want.token_ids == reference_greedy(model, PROMPT, 16)
    assert (got.stats.drafted_tokens, got.stats.accepted_tokens, got.stats.steps) == \
           (want.stats.drafted_tokens, want.stats.accepted_tokens, want.stats.steps)
    assert got.stats.accepted_tokens > 0 and got.stats.prefill_seconds > 0
    while not other.finished:
        dec.step([other])
    assert other.generated == reference_greedy(model, OTHER, 40)
    for s in (got, other):
        dec.finish(s)


@needs_kernels
def test_prompt_logprobs_and_a_prefix_cache_hit_come_out_as_from_one_pass():
    model, dec = plain_decoder("prompt-lookup", 64)
    asked = greedy(8, prompt_logprobs=2)
    want = dec.generate(PROMPT, asked)
    got, _ = run_chunked(dec, PROMPT, asked, 4)
    assert got.stats.cached_tokens == 0  # prompt logprobs read every row: no cache
    assert got.prompt_logprobs == want.prompt_logprobs and len(got.prompt_logprobs) == len(PROMPT)
    with torch.inference_mode():  # row j of one plain forward: log p(. | PROMPT[: j + 1])
        ref = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, :-1].float(), dim=-1)
    assert [e.logprob for e in got.prompt_logprobs[1:]] == \
           pytest.approx([float(ref[j, t]) for j, t in enumerate(PROMPT[1:])], abs=1e-4)
    dec.finish(got)
    follow = PROMPT + got.generated + OTHER
    cached, calls = run_chunked(dec, follow, greedy(12), 5)
    assert cached.stats.cached_tokens == len(PROMPT) + 7  # the first request's cache, then 10 tokens in 2 passes
    assert calls == 2 and cached.generated == reference_greedy(model, follow, 12)
    dec.finish(cached)


@needs_kernels
def test_a_session_still_prefilling_cannot_step_and_can_be_abandoned():
    model, dec = plain_decoder("prompt-lookup", 0)
    session = dec.start(PROMPT, greedy(8), max_prefill_tokens=5)
    assert not session.prefilled and session.seq.tokens == PROMPT[:5] and session.drafter_states == []
    with pytest.raises(ConfigError, match="still prefilling"):
        dec.step([session])
    assert not dec.prefill(session, 5) and len(session.seq.tokens) == 10
    dec.finish(session)  # the client went away half-way
    assert session.prefilled and session.freed and session.finish_reason == "cancelled"
    with pytest.raises(ConfigError, match="finished session"):
        dec.prefill(session, 5)
    assert dec.step([session])[0].finished


@needs_kernels
def test_a_failed_prefill_pass_frees_the_session():
    model, dec = plain_decoder("none", 0)
    session = dec.start(PROMPT, greedy(8), max_prefill_tokens=4)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    session.seq.prefill = broken
    with pytest.raises(RuntimeError, match="out of memory"):
        dec.prefill(session, 4)
    assert session.freed and session.finish_reason == "cancelled"


@needs_kernels
def test_a_prompt_abandoned_half_way_is_kept_for_a_retry_with_its_features():
    """A client gone during a chunked prefill: what ran stays in the prefix cache with the head's features at it,
    so the same prompt sent again copies it and its head starts from the features one pass gives."""
    model = tiny_model("llama", "eager", seed=4)
    target = native(model)
    dec = head_decoder(target, "eagle3", mib=64)
    seen = prompt_features(dec)
    prompt = PROMPT + OTHER
    gone = dec.start(prompt, greedy(8), max_prefill_tokens=10)
    dec.prefill(gone, 10)
    dec.finish(gone)  # 20 of the prompt's 30 tokens ran (MIN_REUSE: 16)
    retry = dec.start(prompt, greedy(8))
    assert retry.stats.cached_tokens == 20
    fresh = head_decoder(target, "eagle3")
    alone = prompt_features(fresh)
    want = fresh.generate(prompt, greedy(8))
    assert torch.equal(seen[-1], alone[-1])
    while not retry.finished:
        dec.step([retry])
    assert retry.generated == want.token_ids == reference_greedy(model, prompt, 8)
    dec.finish(retry)
