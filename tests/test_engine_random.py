"""Random requests through every method at once: each seed draws a target (Llama or Qwen2), a method with its drafts
(a draft model, a head over a cut draft vocabulary, learning online or not, a skip set, a REST datastore), a
planner, engine limits (tree size, a prefix cache), whether the output screen runs, and one or two rounds of one to
four requests (prompts with repeats, some sharing an opening, some an earlier request's prompt and answer and more,
as a chat's next turn does; a few prefilled in chunks) under random sampling settings: greedy or seeded samples at a
temperature, top-k, top-p, min-p, penalties, a logit bias, min_new_tokens, stop tokens, stop strings (where the
seed's tokenizer decodes text: words, raw bytes or Llama-style byte pieces), an end-of-sequence token, logprobs. The
requests are stepped in random subsets, so passes pack them in every combination. Each request's tokens (and
logprobs, the text it streamed and why it ended) equal what plain decoding gives it alone, unscreened: the one
promise, across what the focused tests take one at a time. (Planted bugs it catches: the race reading the next
position's noise, a step's logprob rows reversed, a prefix copied past the common tokens, a grammar's mask dropped or
read off the wrong path, a step's tokens kept past the stop string that ended it or their logprobs streamed, a step's
byte pieces decoded at once.)"""

from __future__ import annotations

import functools
import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from grammar_kit import (JSON_CHARS, JSON_MERGES, VOCAB as JSON_VOCAB, all_bytes_tokenizer, byte_level_tokenizer,
                         byte_merges, constraint_kinds)
from tiny import byte_pieces_tokenizer, perturbed_copy, random_stop, tiny_model, word_tokenizer
from specula.api import build_decoder
from specula.constraints import Constraint
from specula.drafters.heads.runtime import new_head
from specula.engine import EngineConfig
from specula.models.hf import HFCausalLM
from specula.models.native import NativeCausalLM, NativeDecoder, configure, kernels
from specula.models.native import screen as screen_module
from specula.penalties import penalize
from specula.planner import CostCurve
from specula.sampling import SamplingParams, gumbel_of, position_noise, race_scores

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"specula's CPU kernels cannot run here: {kernels.unavailable_reason()}")

VOCAB = 300
METHODS = ("prompt-lookup", "token-recycling", "draft-model", "draft-tree", "fusion", "eagle", "eagle3", "medusa",
           "hydra", "layer-skip", "rest", "none")
HEADS = ("eagle", "eagle3", "medusa", "hydra")
FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1e-3,) * 7, 64)  # verifying is free: the planner keeps what may pay
SEEDS_PER_METHOD = 5


def native(model, eos: int | None) -> NativeCausalLM:
    return NativeCausalLM(configure(NativeDecoder.from_hf(model), "specula", "none", "sdpa"), "native",
                          eos_token_ids=[] if eos is None else [eos])


def hf(model, eos: int | None) -> HFCausalLM:
    return HFCausalLM(model, "hf", eos_token_ids=[] if eos is None else [eos])


def random_params(rng: random.Random, eos: int | None, vocab: int = VOCAB, tokenizer=None) -> SamplingParams:
    """Random settings; with a `tokenizer`, some requests stop at strings (`random_stop`)."""
    kw: dict = dict(max_new_tokens=rng.randrange(1, 30), seed=rng.randrange(1000))
    if rng.random() < 0.55:
        kw["temperature"] = rng.choice([0.3, 0.7, 1.0, 1.5])
        if rng.random() < 0.4:
            kw["top_k"] = rng.choice([1, 2, 5, 40])
        if rng.random() < 0.4:
            kw["top_p"] = rng.choice([0.5, 0.8, 0.95])
        if rng.random() < 0.3:
            kw["min_p"] = rng.choice([0.02, 0.1, 0.3])
    if rng.random() < 0.25:
        kw["repetition_penalty"] = rng.choice([0.8, 1.2, 2.0])
    if rng.random() < 0.2:
        kw["frequency_penalty"] = rng.choice([-0.5, 0.4, 1.5])
    if rng.random() < 0.2:
        kw["presence_penalty"] = rng.choice([-1.0, 0.6])
    if rng.random() < 0.15:
        kw["logit_bias"] = {rng.randrange(2, vocab): rng.choice([-100, -3, 4, 100])}
    if rng.random() < 0.2:
        kw["min_new_tokens"] = rng.randrange(0, kw["max_new_tokens"] + 1)
    if eos is None or rng.random() < 0.5:
        kw["ignore_eos"] = True
    if rng.random() < 0.15:
        kw["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.15:
        kw["stop_token_ids"] = [rng.randrange(2, vocab)]
    if tokenizer is not None and rng.random() < 0.4:
        kw["stop"] = [random_stop(rng, tokenizer, vocab) for _ in range(rng.choice([1, 2]))]
    return SamplingParams(**kw)


TOKENIZERS = (
    lambda: None,
    lambda: word_tokenizer(VOCAB),  # "w12 w40": the datastore's (it refuses another)
    lambda: all_bytes_tokenizer(byte_merges(VOCAB - 258)),  # raw bytes: characters whole, split, invalid
    lambda: byte_pieces_tokenizer(VOCAB),  # Llama / Mistral style: invalid byte groups rewrite decoded characters
)
"""Builders of the decoders' tokenizers: the text and stop strings of whole words, raw bytes or byte pieces (None: no
text)."""


def random_prompt(rng: random.Random, vocab: int = VOCAB) -> list[int]:
    """A few ids, then pieces of them repeated among new ones (prompt lookup and the heads' copy hints find
    matches)."""
    base = [rng.randrange(2, vocab) for _ in range(rng.randrange(1, 8))]
    out = list(base)
    while len(out) < rng.randrange(1, 40):
        out += base[: rng.randrange(1, len(base) + 1)] if rng.random() < 0.6 else [rng.randrange(2, vocab)]
    return out


@pytest.fixture(scope="module")
def datastore(tmp_path_factory) -> str:
    """A REST datastore over text of the tiny vocabulary: phrases that recur among single ids."""
    from specula.datastore.build import BuildConfig, build_datastore

    rng = random.Random(0)
    phrases = [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(3, 9))] for _ in range(40)]
    ids: list[int] = []
    while len(ids) < 6000:
        ids += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(2, VOCAB)]
    root = tmp_path_factory.mktemp("random")
    (root / "corpus.txt").write_text(" ".join(f"w{i}" for i in ids))
    return str(build_datastore(word_tokenizer(VOCAB), [root / "corpus.txt"], root / "random.specds",
                               BuildConfig(progress=False)).path)


def seeds(methods: tuple[str, ...], count: int = SEEDS_PER_METHOD) -> list:
    return [pytest.param(method, i, id=f"{method}-{i}") for method in methods for i in range(count)]


@pytest.mark.parametrize("method,index", seeds(METHODS))
def test_random_requests_in_packed_passes_equal_plain_decoding_alone(method, index, datastore, monkeypatch):
    random_requests(native, method, METHODS.index(method) * 1000 + index, datastore, monkeypatch)


HF_METHODS = tuple(m for m in METHODS if m != "layer-skip")  # (skipping layers needs the native decoder)
HF_SEEDS_PER_METHOD = 2


@pytest.mark.parametrize("method,index", seeds(HF_METHODS, HF_SEEDS_PER_METHOD))
def test_random_requests_on_the_hugging_face_backend_equal_its_plain_decoding_alone_but_at_float_ties(
        method, index, datastore, monkeypatch):
    """As above with every model a transformers one (`HFCausalLM`, no prefix cache: that backend keeps none): that
    backend promises float32 closeness, so a tree pass may round a row otherwise than a one-token step; a request may
    part from plain decoding only where plain decoding's pick was a near tie (greedy: the two penalised logits;
    sampled: the two race scores, within 1e-4), and must equal it up to there."""
    random_requests(hf, method, 20_000 + HF_METHODS.index(method) * 1000 + index, datastore, monkeypatch)


def random_requests(make, method: str, seed: int, datastore: str, monkeypatch) -> None:
    """One seed of the random test: models on the backend `make` builds (`native` or `hf`), the method's drafts,
    planner and engine limits drawn from `seed`, then `run_and_check`."""
    rng = random.Random(seed)
    model = tiny_model(rng.choice(["llama", "qwen2"]), seed=rng.randrange(100), vocab=VOCAB)
    screened = rng.random() < 0.7
    for name in ("SCREEN_MIN_WEIGHTS", "TOP_SCREEN_MIN_WEIGHTS"):  # the tiny models' layers are below both
        monkeypatch.setattr(screen_module, name, 0 if screened else 1 << 40)
    eos = rng.choice([None, 1, 7])
    target = make(model, eos)
    draft, options = None, {}
    if method in ("draft-model", "draft-tree") or (method == "fusion" and rng.random() < 0.8):
        draft = make(perturbed_copy(model, scale=rng.choice([0.01, 0.05, 0.3]), seed=seed), None)
    if method in HEADS or (method == "fusion" and rng.random() < 0.5):
        kind = method if method in HEADS else rng.choice(["eagle", "eagle3"])
        options["head"] = new_head(kind, target, torch.arange(0, VOCAB, rng.choice([1, 2, 3])), seed=seed)
    if method == "layer-skip":  # a fixed set: on two layers the search finds none that beats plain decoding
        options["skip_layers"] = rng.choice(["mlp:1", "attn:1", "attn:0,mlp:1"])
    if method == "rest" or (method == "fusion" and rng.random() < 0.4):
        options["datastore"] = datastore
    if "head" in options and options["head"].kind != "eagle3" and rng.random() < 0.3:  # the head learns from each
        options["online_distill"] = True  # finished request (OSD; an eagle3 head learns offline only)
    planner = rng.choice(["hardware", "none", FLAT])
    engine = EngineConfig(max_tree_nodes=rng.choice([1, 4, 16, 64]),
                          prefix_cache_mib=rng.choice([0, 8]) if make is native else 0)
    tokenizer = rng.choice(TOKENIZERS[:2] if "datastore" in options else TOKENIZERS)()  # (a datastore: its own)
    dec = build_decoder(method, target, tokenizer, draft, planner=planner, engine=engine, **options)
    sessions = run_and_check(rng, dec, model, eos, VOCAB, None, monkeypatch, make)
    proposes_always = draft is not None or "head" in options or method == "layer-skip"  # (not history's drafts)
    room = any(s.params.max_new_tokens > 1 for s, *_ in sessions)  # (one token: the first step's own, no draft)
    if proposes_always and planner == "none" and engine.max_tree_nodes > 1 and room:  # the drafts as proposed were
        assert sum(s.stats.drafted_tokens for s, *_ in sessions) > 0, seed  # verified (a planner prices them: may not)



CONSTRAINED_METHODS = ("none", "prompt-lookup", "token-recycling", "draft-model", "fusion", "eagle3")


@functools.cache
def constraints() -> tuple[Constraint, ...]:
    return (*constraint_kinds().values(), Constraint.json(), Constraint.choice(["ab", "cd-x"]))


@pytest.mark.parametrize("method,index", seeds(CONSTRAINED_METHODS))
def test_random_requests_some_under_grammars_equal_plain_decoding_alone(method, index, monkeypatch):
    """As above on a byte-level tokenizer, some requests under a JSON schema, a regex, a grammar, any JSON object or
    a choice (`grammar_kit`), packed with unconstrained ones: the grammar's masks ride on the same passes."""
    pytest.importorskip("llguidance")
    seed = 50_000 + CONSTRAINED_METHODS.index(method) * 1000 + index
    rng = random.Random(seed)
    model = tiny_model(rng.choice(["llama", "qwen2"]), seed=rng.randrange(100), vocab=JSON_VOCAB)
    screened = rng.random() < 0.7
    for name in ("SCREEN_MIN_WEIGHTS", "TOP_SCREEN_MIN_WEIGHTS"):
        monkeypatch.setattr(screen_module, name, 0 if screened else 1 << 40)
    eos = rng.choice([None, 1])  # the tokenizer's EOS (a match ends with it where the target names none)
    target = native(model, eos)
    draft = native(perturbed_copy(model, scale=0.05, seed=seed), None) if method in ("draft-model", "fusion") else None
    options = {}
    if method == "eagle3" or (method == "fusion" and rng.random() < 0.5):
        options["head"] = new_head("eagle3", target, torch.arange(JSON_VOCAB), seed=seed)
    dec = build_decoder(method, target, byte_level_tokenizer(JSON_CHARS, JSON_MERGES), draft,
                        planner=rng.choice(["hardware", "none", FLAT]),
                        engine=EngineConfig(max_tree_nodes=rng.choice([4, 16, 64]),
                                            prefix_cache_mib=rng.choice([0, 8])), **options)
    run_and_check(rng, dec, model, eos, JSON_VOCAB, lambda r: r.choice(constraints()) if r.random() < 0.6 else None,
                  monkeypatch)


def run_and_check(rng: random.Random, dec, model, eos: int | None, vocab: int, constraint_of, monkeypatch,
                  make=native) -> list:
    """One or two rounds of one to four random requests through `dec` (`constraint_of(rng)`: a request's constraint
    or None), stepped in random subsets; then each request's tokens and logprobs against plain decoding alone on
    the backend `make` builds, unscreened (on `hf`, up to a near tie: `parting_at_a_tie`). Returns the sessions."""
    requests, sessions = [], []
    opening = random_prompt(rng, vocab) + random_prompt(rng, vocab) + [rng.randrange(2, vocab) for _ in range(16)]
    for _ in range(rng.choice([1, 2])):
        batch = []
        for _ in range(rng.randrange(1, 5)):
            if sessions and rng.random() < 0.4:  # a chat's next turn: an earlier prompt, its answer, more
                (prompt, _, _), (earlier, *_) = rng.choice(list(zip(requests, sessions)))
                prompt = prompt + earlier.generated + random_prompt(rng, vocab)
            else:  # a shared opening (a system prompt) or none
                prompt = (opening[: rng.randrange(1, len(opening) + 1)] if rng.random() < 0.5 else []) + \
                    random_prompt(rng, vocab)
            params = random_params(rng, eos, vocab, dec.tokenizer)
            constraint = None if constraint_of is None else constraint_of(rng)
            if constraint is not None:
                params = replace(params, min_new_tokens=0)  # (refused with a constraint)
            batch.append((prompt, params, constraint))
        started = [dec.start(prompt, params, constraint) for prompt, params, constraint in batch]
        logprobs = {id(session): [] for session in started}  # what each session's chunks streamed
        texts = {id(session): "" for session in started}
        for session in started:
            if rng.random() < 0.4:  # a prompt prefilled in chunks of 1-5 tokens
                while not dec.prefill(session, rng.randrange(1, 6)):
                    pass
        # the subsets from a generator of their own: how many steps a round takes follows the planner's timing, and
        # the next round's requests must not (a failing seed then replays its requests)
        subsets = random.Random(rng.randrange(1 << 30))
        while not all(s.finished for s in started):
            live = [s for s in started if not s.finished]
            subsets.shuffle(live)
            stepped = live[: subsets.randrange(1, len(live) + 1)]  # any subset packed in one pass
            for session, chunk in zip(stepped, dec.step(stepped)):
                logprobs[id(session)] += chunk.logprobs or []
                texts[id(session)] += chunk.text
        for session in started:
            dec.finish(session)
        requests += batch
        sessions += [(session, logprobs[id(session)], texts[id(session)]) for session in started]
    monkeypatch.setattr(screen_module, "SCREEN_MIN_WEIGHTS", 1 << 40)
    monkeypatch.setattr(screen_module, "TOP_SCREEN_MIN_WEIGHTS", 1 << 40)
    plain = build_decoder("none", make(model, eos), dec.tokenizer)
    for i, ((prompt, params, constraint), (session, streamed, text)) in enumerate(zip(requests, sessions)):
        alone = plain.generate(prompt, params, constraint)
        same = len(alone.token_ids)
        if make is not native and session.generated != alone.token_ids:
            same = parting_at_a_tie(model, prompt, params, session.generated, alone.token_ids)
        assert session.generated[:same] == alone.token_ids[:same], (i, prompt, params, constraint)
        assert same < len(alone.token_ids) or session.generated == alone.token_ids, (i, prompt, params, constraint)
        if session.generated == alone.token_ids:  # the text streamed, a stop string's cut, why it ended
            got, want = (text, session.stats.finish_reason), (alone.text, alone.stats.finish_reason)
            assert got == want, (i, prompt, params, got, want)
        if params.logprobs is not None:
            assert len(streamed) == len(session.generated), i  # one a token emitted (none past a stop)
            assert [(lp.token_id, lp.rank, lp.top and [t for t, _ in lp.top]) for lp in streamed[:same]] == [
                (lp.token_id, lp.rank, lp.top and [t for t, _ in lp.top]) for lp in alone.logprobs[:same]], i
            assert [lp.logprob for lp in streamed[:same]] == pytest.approx(
                [lp.logprob for lp in alone.logprobs[:same]], abs=1e-4), i
    return sessions


TIE = 1e-4
"""How close two scores must be for float32 rounding to pick either (`parting_at_a_tie`)."""


@torch.inference_mode()
def parting_at_a_tie(model, prompt: list[int], params: SamplingParams, got: list[int], want: list[int]) -> int:
    """Where a request's tokens `got` first part from plain decoding's `want` (an index into both), asserting the
    parting is a near tie there: the two tokens' scores within `TIE`, the scores being the logits penalised for the
    output before the position (`penalties.penalize`), at a temperature the race's: those / T - log E with the
    position's noise."""
    k = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert k is not None, ("one is a prefix of the other: not a parting", got, want, prompt, params)
    logits = penalize(model(torch.tensor([prompt + want[:k]])).logits[0, -1], Counter(want[:k]), prompt, params)
    if not params.greedy:
        logits = race_scores(logits, params.temperature, gumbel_of(position_noise(params.seed, k, logits.shape[0])))
    gap = abs(float(logits[got[k]] - logits[want[k]]))
    assert gap <= TIE * max(1.0, abs(float(logits[want[k]]))), (k, got[k], want[k], gap, prompt, params)
    return k
