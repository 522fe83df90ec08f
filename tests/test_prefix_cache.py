"""The engine's prefix cache (`specula.prefix_cache`): a request whose prompt begins with tokens a finished
request's cache holds copies them instead of prefilling, and its output (and a head's drafts) equal an
uncached run's exactly; the cache keeps the longest prefixes within its budget, least recently used out."""

from __future__ import annotations

import pytest
import torch

from tiny import prompt_features, reference_greedy, tiny_model
from specula.api import build_decoder
from specula.engine import DEFAULT_PREFIX_CACHE_MIB, EngineConfig, SpeculativeDecoder
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.models.native import NativeCausalLM, NativeDecoder, configure, kernels
from specula.prefix_cache import PrefixCache, RowLog
from specula.sampling import SamplingParams
from specula.tree import TokenTree

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="specula's CPU kernels do not run here")

PROMPT = [5, 17, 33, 2, 5, 17, 40, 41, 42, 5, 17, 60, 61, 62, 63, 64, 60, 61, 9, 12, 30]
FOLLOW_UP = [70, 71, 72, 5, 17]


def native(model) -> NativeCausalLM:
    """specula's C kernels: every row computed alone (greedy guarantee "bitwise")."""
    return NativeCausalLM(configure(NativeDecoder.from_hf(model), "specula", "none", "sdpa"), "native",
                          eos_token_ids=[])


def greedy(n: int, **options) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **options)


def decoder(target, method: str, mib: int | None, draft=None, **options) -> SpeculativeDecoder:
    return build_decoder(method, target, None, draft, engine=EngineConfig(prefix_cache_mib=mib), **options)


def next_turn(cached: SpeculativeDecoder, fresh: SpeculativeDecoder):
    """A first turn on `cached`, then the next turn (its prompt the first's and its answer, and more) on both:
    (the next turn's prompt, its output with the cache, without)."""
    first = cached.generate(PROMPT, greedy(16))
    follow = PROMPT + first.token_ids + FOLLOW_UP
    return follow, cached.generate(follow, greedy(24)), fresh.generate(follow, greedy(24))


def assert_same_drafting(got, want) -> None:
    """The same drafts accepted in the same steps (fixed plans), and some."""
    assert (got.stats.drafted_tokens, got.stats.accepted_tokens, got.stats.steps) == \
           (want.stats.drafted_tokens, want.stats.accepted_tokens, want.stats.steps)
    assert got.stats.accepted_tokens > 0


# ---------------------------------------------------------------------------------------- the sequences


@needs_kernels
def test_a_copied_prefix_continues_bit_for_bit_as_a_fresh_prefill():
    """Keys and values written by a prefill and by verified trees, copied: the logits after them equal a
    fresh prefill's of the same tokens, bit for bit."""
    model = tiny_model("llama", seed=2)
    target = native(model)
    seq = target.new_sequence()
    seq.prefill(PROMPT[:12])
    seq.forward_tree(PROMPT[12], TokenTree.build([PROMPT[13], 90, PROMPT[14]], [-1, -1, 0]))
    seq.commit([0, 2])  # PROMPT[12..14] committed through a tree
    seq.prefill(PROMPT[15:18])
    copy = target.new_sequence()
    copy.copy_prefix(seq, 16)
    assert copy.tokens == PROMPT[:16] and seq.tokens == PROMPT[:18]
    got = copy.prefill(PROMPT[16:], logits="all")  # [5, vocab]
    fresh = target.new_sequence().prefill(PROMPT, logits="all")[16:]
    assert torch.equal(got, fresh)
    with pytest.raises(ValueError, match="copy_prefix"):
        target.new_sequence().copy_prefix(seq, 19)
    with pytest.raises(RuntimeError, match="holds tokens"):
        copy.copy_prefix(seq, 4)


@needs_kernels
def test_a_sequence_shrunk_to_fit_holds_its_tokens_only_and_continues_bit_for_bit():
    model = tiny_model("llama", seed=2)
    target = native(model)
    seq = target.new_sequence()
    seq.prefill(PROMPT[:12])
    assert seq.cache.capacity > 12
    per_token = seq.memory_bytes // seq.cache.capacity
    seq.shrink_to_fit()
    assert seq.cache.capacity == 12 and seq.memory_bytes == 12 * per_token
    copy = target.new_sequence()
    copy.copy_prefix(seq, 10)  # a shrunk sequence is copied from as before
    got = seq.prefill(PROMPT[12:], logits="all")  # and grows again
    fresh = target.new_sequence().prefill(PROMPT, logits="all")
    assert torch.equal(got, fresh[12:]) and torch.equal(copy.prefill(PROMPT[10:], logits="all"), fresh[10:])
    seq.forward_tree(PROMPT[0], TokenTree.chain([1, 2]))  # a tree pending (a request failed part-way): kept
    seq.shrink_to_fit()
    assert seq.cache.capacity == seq.slots == len(PROMPT) + 3
    seq.commit([0, 1])
    assert torch.equal(seq.prefill([7], logits="last"),
                       target.new_sequence().prefill(PROMPT + [PROMPT[0], 1, 2, 7], logits="last"))


def test_a_pooled_cache_keeps_its_size():
    from specula.models.native.cache import KVCache

    cache = KVCache(2, 1, 4, dtype=torch.float32, device=torch.device("cpu"), capacity=64)
    cache.owner = object()  # the graph path's pool: graphs are captured on these buffers
    cache.shrink_to_fit(3)
    assert cache.capacity == 64
    cache.owner = None
    cache.k[:, :, :3] = 7.0
    cache.shrink_to_fit(3)
    assert cache.capacity == 3 and torch.equal(cache.k, torch.full((2, 1, 3, 4), 7.0))


def assert_kept_fit(cache: PrefixCache) -> None:
    """Every kept sequence (and its features) holds its tokens' rows only, and the budget counts them."""
    assert len(cache) > 0
    for entry in cache._entries.values():
        assert entry.seq.cache.capacity == len(entry.seq.tokens)
        features = entry.features
        assert features is None or features.memory_bytes == features.rows().numel() * 4
        assert entry.bytes == entry.seq.memory_bytes + (0 if features is None else features.memory_bytes)
    assert cache.bytes == sum(entry.bytes for entry in cache._entries.values())


# ---------------------------------------------------------------------------------------- the engine


@needs_kernels
@pytest.mark.parametrize("method", ["none", "prompt-lookup"])
def test_a_chats_next_turn_reads_the_last_turns_cache_and_its_output_is_unchanged(method):
    model = tiny_model("llama", seed=3)
    target = native(model)
    assert target.greedy_guarantee == "bitwise"
    dec = decoder(target, method, None)  # on by default here
    assert dec.prefix_cache is not None and dec.prefix_cache.max_bytes == DEFAULT_PREFIX_CACHE_MIB << 20
    first = dec.generate(PROMPT, greedy(20))
    assert first.stats.cached_tokens == 0
    second_prompt = PROMPT + first.token_ids + FOLLOW_UP
    second = dec.generate(second_prompt, greedy(20))
    # the first request's cache held its prompt and all but its last token (the root of a step never run)
    assert second.stats.cached_tokens == len(PROMPT) + len(first.token_ids) - 1
    assert second.token_ids == reference_greedy(model, second_prompt, 20)
    again = dec.generate(second_prompt, greedy(20))  # the same prompt: all of it but the last token
    assert again.stats.cached_tokens == len(second_prompt) - 1
    assert again.token_ids == second.token_ids
    assert len(dec.prefix_cache) == 1  # each request's cache extended the one before: that one was dropped
    assert_kept_fit(dec.prefix_cache)


@needs_kernels
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_head_reads_the_same_features_from_the_cache_as_from_a_prefill(kind):
    """The hidden states of the cached tokens are kept beside them: with fixed plans, a head drafts and
    the target accepts exactly as much as without the cache, and the output is plain greedy."""
    from specula.drafters.heads.runtime import new_head

    model = tiny_model("llama", "eager", seed=4)
    target = native(model)
    head = new_head(kind, target, torch.arange(0, model.config.vocab_size), seed=1)
    cached = decoder(target, kind, 64, head=head, planner=False)
    fresh = decoder(target, kind, 0, head=head, planner=False)
    assert fresh.prefix_cache is None
    seen, alone = prompt_features(cached), prompt_features(fresh)
    follow, got, want = next_turn(cached, fresh)
    assert got.stats.cached_tokens == len(PROMPT) + 15
    # the prompt's features the head starts from: 36 rows kept from the first request's prefill and steps
    assert seen[-1].shape[0] == len(follow) - 1 and torch.equal(seen[-1], alone[-1])
    assert got.token_ids == want.token_ids == reference_greedy(model, follow, 24)
    assert_same_drafting(got, want)
    assert_kept_fit(cached.prefix_cache)
    assert all(entry.features is not None for entry in cached.prefix_cache._entries.values())


@needs_kernels
def test_a_draft_models_cache_is_kept_and_read_alike():
    """The draft model keeps its finished requests' caches too: a next turn's draft cache starts as a copy of
    the first turn's, and it drafts (and the target accepts) exactly what it does without."""
    from specula.drafters.draft_model import DraftModelDrafter
    from tiny import perturbed_copy

    model = tiny_model("llama", seed=3)
    target, draft = native(model), native(perturbed_copy(model, 0.05))
    cached = decoder(target, "draft-model", 64, draft=draft, planner=False)
    fresh = decoder(target, "draft-model", 0, draft=draft, planner=False)
    drafter = cached.drafters[0]
    assert isinstance(drafter, DraftModelDrafter) and drafter.prefix_cache.max_bytes == (64 << 20) // 4
    assert fresh.drafters[0].prefix_cache is None
    hits = []
    take = drafter.prefix_cache.take
    drafter.prefix_cache.take = lambda prompt, into, features=False: hits.append(take(prompt, into, features))
    follow, got, want = next_turn(cached, fresh)
    assert hits[0] is None and hits[1].length >= len(PROMPT)  # the first turn's draft cache, to where it drafted
    assert got.token_ids == want.token_ids == reference_greedy(model, follow, 24)
    assert_same_drafting(got, want)
    assert_kept_fit(drafter.prefix_cache)


@needs_kernels
def test_a_packed_batch_reads_and_fills_the_cache():
    model = tiny_model("llama", seed=3)
    target = native(model)
    dec = decoder(target, "prompt-lookup", 64)
    first = dec.generate(PROMPT, greedy(8)).token_ids
    prompts = [PROMPT + first[:5] + [80], PROMPT[:18] + [80], [9, 8, 7]]
    outs = dict(dec.generate_many(((k, p, greedy(12)) for k, p in enumerate(prompts)), max_batch_size=3))
    assert [outs[k].stats.cached_tokens for k in range(3)] == [len(PROMPT) + 5, 18, 0]  # 3 tokens: under MIN_REUSE
    assert [outs[k].token_ids for k in range(3)] == [reference_greedy(model, p, 12) for p in prompts]
    # the first request's cache and the first two of the batch's (each parts from the others); the third's 14
    # tokens are under MIN_REUSE: freed
    assert sorted(len(e.seq.tokens) for e in dec.prefix_cache._entries.values()) == [21 + 7, 19 + 11, 27 + 11]


@needs_kernels
@pytest.mark.parametrize("kind", ["none", "eagle3"])
def test_requests_running_at_once_prefill_a_shared_prompt_once(kind):
    """A running request's committed tokens (and the head's features at them) are copied too: of three requests
    started together on one system prompt, the first prefills it; the others copy it, with the same features
    a prefill gives, and every output is plain greedy."""
    from specula.drafters.heads.runtime import new_head

    model = tiny_model("llama", "eager", seed=4)
    target = native(model)
    options = {} if kind == "none" else {"head": new_head(kind, target, torch.arange(96), seed=1), "planner": False}
    dec = decoder(target, kind, 64, **options)
    seen = prompt_features(dec) if kind != "none" else []
    system = PROMPT[:18]
    prompts = [system + [70, 71, 72], system + [80, 81], system + [70, 71, 73, 74]]
    sessions = [dec.start(p, greedy(10)) for p in prompts]
    assert [s.stats.cached_tokens for s in sessions] == [0, 18, 20]  # the third: the first's 20 prompt tokens
    while not all(s.finished for s in sessions):
        dec.step(sessions)
    assert [s.generated for s in sessions] == [reference_greedy(model, p, 10) for p in prompts]
    for s in sessions:
        dec.finish(s)
    if kind != "none":
        fresh = decoder(target, kind, 0, **options)
        alone = prompt_features(fresh)
        for p in prompts:
            fresh.generate(p, greedy(1))
        assert all(torch.equal(a, b) for a, b in zip(seen, alone)) and len(seen) == 3


@needs_kernels
def test_requests_stepped_together_copy_each_others_draft_cache_in_their_first_step():
    """Requests that start together on one opening: in their first (packed) step the first's draft cache catches
    up on it and the others copy it once that pass has run, instead of catching up alike; each drafts, and the
    target accepts, exactly what it does without the cache."""
    from tiny import perturbed_copy

    model = tiny_model("llama", seed=3)
    target, draft = native(model), native(perturbed_copy(model, 0.05))
    system = PROMPT[:18]
    prompts = [system + [70, 71, 72], system + [70, 71, 72], system + [80, 81]]  # n = 2 of one prompt, and another

    def run(mib: int):
        dec = decoder(target, "draft-model", mib, draft=draft, planner=False)
        drafter, hits, passes = dec.drafters[0], [], []
        if drafter.prefix_cache is not None:
            take = drafter.prefix_cache.take
            drafter.prefix_cache.take = lambda prompt, into, features=False: hits.append(take(prompt, into, features))
        prefill = type(draft.new_sequence()).prefill
        sessions = [dec.start(p, greedy(10)) for p in prompts]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(sessions[0].seq), "prefill",
                       lambda seq, ids, *a, **k: (passes.append(len(ids)) if seq.backend is draft else None)
                       or prefill(seq, ids, *a, **k))
            dec.step(sessions)
        while not all(s.finished for s in sessions):
            dec.step(sessions)
        return sessions, hits, passes

    cached, hits, passes = run(64)
    fresh, _, fresh_passes = run(0)
    assert hits[0] is None and [h.length for h in hits[1:]] == [len(prompts[1]) - 1, len(system)]
    assert passes[0] == len(prompts[0]) and sum(passes) < sum(fresh_passes)  # the first step's draft passes
    for got, want, p in zip(cached, fresh, prompts):
        assert got.generated == want.generated == reference_greedy(model, p, 10)
        assert (got.stats.drafted_tokens, got.stats.accepted_tokens) == (want.stats.drafted_tokens,
                                                                        want.stats.accepted_tokens)


@needs_kernels
def test_prompt_logprobs_prefill_the_whole_prompt():
    model = tiny_model("llama", seed=3)
    dec = decoder(native(model), "none", 64)
    dec.generate(PROMPT, greedy(4))
    out = dec.generate(PROMPT, greedy(4, prompt_logprobs=2))
    assert out.stats.cached_tokens == 0
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPT)


def test_the_prefix_cache_is_off_where_sequences_cannot_copy_a_prefix_and_refused_when_asked_there():
    model = tiny_model("qwen2", seed=3)
    target = HFCausalLM(model, "hf", eos_token_ids=[])
    assert decoder(target, "none", None).prefix_cache is None
    with pytest.raises(ConfigError, match="prefix cache.*native backend"):
        decoder(target, "none", 16)
    import specula.api as api
    from specula.models.loading import LoadConfig

    with pytest.MonkeyPatch.context() as mp:  # refused before the target loads
        mp.setattr(api, "load_backend", lambda *a, **k: pytest.fail("a model was loaded"))
        with pytest.raises(ConfigError, match="the hf backend .*prefix cache"):
            api.load("smollm2-135m", method="none", config=LoadConfig(backend="hf"),
                     engine=EngineConfig(prefix_cache_mib=8))
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="prefix_cache_mib"):
            EngineConfig(prefix_cache_mib=bad)


def test_a_prefix_cache_asked_for_where_backend_auto_picks_hf_is_refused_before_the_load(tmp_path):
    import specula.api as api
    from specula.models.loading import LoadConfig
    from tiny import word_tokenizer

    tiny_model("gpt2", seed=3).save_pretrained(tmp_path)  # an architecture the native backend does not run
    word_tokenizer([f"w{i:02d}" for i in range(96)]).save_pretrained(str(tmp_path))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(api, "load_backend", lambda *a, **k: pytest.fail("a model was loaded"))
        with pytest.raises(ConfigError, match="GPT2LMHeadModel, which runs on the hf backend only.*prefix_cache_mib=0"):
            api.load(str(tmp_path), method="none", config=LoadConfig(backend="auto"),
                     engine=EngineConfig(prefix_cache_mib=8))
    spec = api.load(str(tmp_path), method="none", config=LoadConfig(backend="auto"))  # the default: off there
    assert isinstance(spec.target, HFCausalLM) and spec.decoder.prefix_cache is None


# ---------------------------------------------------------------------------------------- the cache itself


class FakeSequence:
    """A prefix-copying sequence of `size` bytes."""

    def __init__(self, tokens=(), size: int = 100) -> None:
        self.tokens = list(tokens)
        self.memory_bytes = size
        self.released = False

    def copy_prefix(self, source: "FakeSequence", length: int) -> None:
        assert not self.tokens
        self.tokens = source.tokens[:length]

    def release(self) -> None:
        self.released = True

    def shrink_to_fit(self) -> None:
        pass  # its size is what the test gives it

    # the rest of TargetSequence, never called here
    def prefill(self, ids, logits="last", hidden=False): raise AssertionError
    def forward_tree(self, root, tree, hidden=False): raise AssertionError
    def forward_tree_incremental(self, tree): raise AssertionError
    def commit(self, path): raise AssertionError
    def crop(self, length): raise AssertionError


def take(cache: PrefixCache, prompt, features: bool = False):
    """(tokens copied into a new sequence, the hit) of `cache.take`."""
    into = FakeSequence()
    hit = cache.take(prompt, into, features)
    return into.tokens, hit


def test_the_longest_common_prefix_is_taken_and_short_ones_are_not():
    cache = PrefixCache(10_000, min_tokens=4)
    a, b = FakeSequence(range(0, 10)), FakeSequence([0, 1, 2, 3, 4, 5, 50, 51])
    cache.put(a, None)
    cache.put(b, None)
    tokens, hit = take(cache, [0, 1, 2, 3, 4, 5, 50, 51, 52, 53])
    assert hit.length == 8 and tokens == b.tokens and hit.features is None
    assert cache.held_tokens == 18 and cache.bytes == 200
    tokens, hit = take(cache, list(range(0, 7)) + [99])
    assert hit.length == 7 and tokens == list(range(7))  # a holds 0..9; the prompt's last token is the first root
    assert take(cache, [0, 1, 2, 9, 9]) == ([], None)  # 3 common tokens: under min_tokens
    assert not a.released and not b.released


def test_the_least_recently_used_go_first_and_an_extended_prefix_is_dropped():
    cache = PrefixCache(250, min_tokens=2)
    a, b, c = FakeSequence([1, 2, 3]), FakeSequence([4, 5, 6]), FakeSequence([7, 8, 9])
    cache.put(a, None)
    cache.put(b, None)
    take(cache, [1, 2, 3, 0])  # a used: b is now the oldest
    cache.put(c, None)
    assert b.released and not a.released and not c.released and cache.bytes == 200
    longer = FakeSequence([1, 2, 3, 4])
    cache.put(longer, None)
    assert a.released and len(cache) == 2  # longer holds all a held
    big, short = FakeSequence(range(5), size=251), FakeSequence([1])
    cache.put(big, None)
    cache.put(short, None)
    assert big.released and short.released and len(cache) == 2
    cache.clear()
    assert c.released and longer.released and len(cache) == 0 and cache.bytes == 0


def test_features_are_taken_only_with_as_many_rows_as_tokens():
    cache = PrefixCache(1 << 20, min_tokens=2)
    seq = FakeSequence(range(8))
    log = RowLog(torch.arange(12.0).reshape(6, 2))  # features of the first 6 tokens only
    cache.put(seq, log)
    tokens, hit = take(cache, list(range(10)), features=True)
    assert hit.length == 6 == len(tokens) and torch.equal(hit.features, torch.arange(12.0).reshape(6, 2))
    assert take(cache, list(range(10)))[1].length == 8
    cache.put(FakeSequence(range(20, 30)), None)
    assert take(cache, list(range(20, 31)), features=True) == ([], None)  # no features kept for it


def test_a_running_sequence_is_copied_from_until_it_is_kept():
    cache = PrefixCache(1 << 20, min_tokens=2)
    running = FakeSequence(range(10))
    cache.share(running, None)
    tokens, hit = take(cache, list(range(12)))
    assert hit.length == 10 and tokens == list(range(10)) and len(cache) == 0 and cache.bytes == 0
    running.tokens.append(10)  # it commits on
    assert take(cache, list(range(12)))[1].length == 11
    cache.put(running, None)  # finished: kept, and no longer a running one
    assert len(cache) == 1 and len(cache._running) == 0 and take(cache, list(range(12)))[1].length == 11


def test_a_row_log_grows_and_keeps_its_rows():
    log = RowLog(torch.ones(3, 4))
    for k in range(40):
        log.extend(torch.full((5, 4), float(k)))
    rows = log.rows()
    assert rows.shape == (203, 4) and torch.equal(rows[:3], torch.ones(3, 4))
    assert torch.equal(rows[3 + 5 * 39:], torch.full((5, 4), 39.0))
    assert log.memory_bytes > 203 * 4 * 4
    log.shrink_to_fit()
    assert log.memory_bytes == 203 * 4 * 4 and torch.equal(log.rows(), rows)
    log.extend(torch.zeros(2, 4))  # grows again
    assert log.rows().shape == (205, 4) and torch.equal(log.rows()[:203], rows)
