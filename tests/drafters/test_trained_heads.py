"""Trained heads (`eagle`, `eagle3`, `medusa`, `hydra`): greedy output equals plain greedy decoding on every
backend and in packed batches, sampled output follows the target's exact law, the drafting
state computes exactly what training computes, and bad head files are refused in one line."""

from __future__ import annotations

import functools
import random
import subprocess
import sys

import pytest
import torch

from laws import exact_first_two, sample_first_two, tv, tv_bound
from tiny import reference_greedy, tiny_model
from specula.api import build_decoder
from specula.drafters.heads.file import HeadFile, read_head, save_head, target_record
from specula.drafters.heads.runtime import (TrainedHead, drafting_dtype, drafting_kernel, load_head, new_head,
                                           run_window_mask, window_mask)
from specula.drafters.trained import create_head_drafter
from specula.models.native.kernels import KernelLinear
from specula.errors import ConfigError, HeadFileError
from specula.models.hf import HFCausalLM
from specula.models.native import NativeCausalLM, NativeDecoder, configure
from specula.planner import CostCurve, HardwarePlanner
from specula.sampling import SamplingParams

KINDS = ("eagle", "eagle3", "medusa", "hydra")
FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1e-3,) * 7, 64)


def native(model):
    return NativeCausalLM(configure(NativeDecoder.from_hf(model), "onednn", "none", "sdpa"), "native",
                          eos_token_ids=[])


def oracle_d2t(vocab: int) -> torch.Tensor:
    """A reduced draft vocabulary: every other token id (the mapping back must be exact)."""
    return torch.arange(0, vocab, 2)


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_output_equals_plain_greedy(kind, backend):
    model = tiny_model("qwen2" if backend == "hf" else "llama", "eager", seed=4)
    target = native(model) if backend == "native" else HFCausalLM(model, "hf", eos_token_ids=[])
    head = new_head(kind, target, oracle_d2t(model.config.vocab_size), seed=1)
    dec = build_decoder(kind, target, None, head=head, planner=False)
    rng = random.Random(2)
    for _ in range(3):
        prompt = [rng.randrange(2, 96) for _ in range(rng.randrange(1, 9))]
        out = dec.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 30), (kind, prompt)
        assert out.stats.drafted_tokens > 0 or len(prompt) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_bfloat16_head_drafts_and_output_stays_plain_greedy(kind):
    """The drafting dtype on an AVX512-BF16 CPU: a draft needs no exactness, the output does."""

    model = tiny_model("llama", "eager", seed=4)
    target = native(model)
    fresh = new_head(kind, target, oracle_d2t(model.config.vocab_size), seed=1)
    head = TrainedHead(fresh.module.to(torch.bfloat16), fresh.d2t, target)
    assert head.lm_rows.dtype == torch.bfloat16
    dec = build_decoder(kind, target, None, head=head, planner=False)
    prompt = [5, 17, 9, 33, 5, 17]
    out = dec.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert out.token_ids == reference_greedy(model, prompt, 24)
    assert out.stats.drafted_tokens > 0


@pytest.mark.skipif(drafting_kernel("cpu") is None, reason="specula's CPU kernels do not run here")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_head_drafting_on_int8_kernels_stays_close_and_output_stays_plain_greedy(kind, backend):
    """The CPU drafting kernel: every linear layer (and the output rows) int8, eagle3's fuse with
    float activations; its logits track the float head's, and the output is plain greedy. An
    eagle layer's level runs in one kernel call that looks its tokens up in the target's own
    embedding table, on either backend."""
    import copy

    model = tiny_model("llama", "eager", seed=4)
    target = native(model) if backend == "native" else HFCausalLM(model, "hf", eos_token_ids=[])
    fresh = new_head(kind, target, oracle_d2t(model.config.vocab_size), seed=1)
    head = TrainedHead(copy.deepcopy(fresh.module), fresh.d2t, target, kernel="i8")
    assert head.kernel == "i8" and head.lm_rows is None
    if kind in ("eagle", "eagle3"):
        assert head.kernel_pass is not None and head.kernel_pass.table is not None
    assert not any(isinstance(m, torch.nn.Linear) for m in head.module.modules())
    if kind == "eagle3":
        assert head.module.fuse.kind == "w8"
    feat = torch.randn(5, head.config.hidden_size)  # [5, E]
    exact, drafted = fresh.target_logits(feat), head.target_logits(feat)  # [5, V_draft]
    assert torch.allclose(drafted, exact, atol=0.05 * float(exact.abs().max()))
    assert (drafted.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.8
    dec = build_decoder(kind, target, None, head=head, planner=False)
    prompt = [5, 17, 9, 33, 5, 17]
    out = dec.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert out.token_ids == reference_greedy(model, prompt, 24)
    assert out.stats.drafted_tokens > 0


@functools.cache
def trained_on_its_target(kind: str):
    """(model, native target, head, corpus): a head trained briefly on 12 greedy answers of a tiny target."""
    from specula.training.corpus import CorpusEntry
    from specula.training.features import extract_features
    from specula.training.trainer import TrainConfig, train_head

    model = tiny_model("llama", "eager", seed=6)
    target = native(model)
    rng = random.Random(0)
    corpus = []
    for i in range(12):
        p = [rng.randrange(2, 96) for _ in range(5)]
        corpus.append(CorpusEntry(str(i), p, reference_greedy(model, p, 40)))
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        head = new_head(kind, target, torch.arange(96), seed=0)
        fs = extract_features(target, corpus, Path(d) / "f.safetensors", layers=head.config.feature_layers)
        train_head(head, fs, TrainConfig(kind=kind, epochs=60, seq_len=48, batch_size=4, holdout=0.0, lr=3e-3),
                   Path(d))
    return model, target, head, corpus


@pytest.mark.parametrize("kind", KINDS)
def test_a_head_that_knows_the_target_is_accepted_and_batches_stay_exact(kind):
    """A head trained briefly on the target's own text drafts tokens the target accepts; two
    sessions stepped together in packed passes each equal plain greedy."""
    _, target, head, corpus = trained_on_its_target(kind)
    dec = build_decoder(kind, target, None, head=head, planner=False)
    sessions = [dec.start(c.prompt_ids, SamplingParams(max_new_tokens=40, ignore_eos=True)) for c in corpus[:2]]
    while not all(s.finished for s in sessions):
        dec.step(sessions)
    for s, c in zip(sessions, corpus[:2]):
        assert s.generated == c.output_ids
        assert s.stats.accepted_tokens > 0, kind


@pytest.mark.skipif(drafting_kernel("cpu") is None, reason="specula's CPU kernels do not run here")
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("planner", [False, "hardware"])
def test_a_packed_batch_drafts_each_head_level_in_one_call_and_each_session_as_it_would_alone(kind, planner,
                                                                                               monkeypatch):
    """Sessions stepped together draft in lockstep (`drafters.lockstep`): a level's head passes of
    the whole batch run as one kernel call, and each session drafts exactly the trees it drafts
    alone (fixed trees: the same drafted and accepted counts) and outputs plain greedy."""
    import copy

    from specula.drafters.heads.kernel_pass import KernelHeadPass

    _, target, trained, corpus = trained_on_its_target(kind)
    head = TrainedHead(copy.deepcopy(trained.module), trained.d2t, target, kernel="i8")
    assert head.kernel_pass is not None
    sizes = []
    many = KernelHeadPass.many
    monkeypatch.setattr(KernelHeadPass, "many", lambda self, parts: sizes.append(len(parts)) or many(self, parts))
    dec = build_decoder(kind, target, None, head=head, planner=planner)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    jobs = corpus[:3]
    sessions = [dec.start(c.prompt_ids, params) for c in jobs]
    while not all(s.finished for s in sessions):
        dec.step(sessions)
    assert max(sizes) == 3  # the three sessions' passes of a level in one call
    for s, c in zip(sessions, jobs):
        assert s.generated == c.output_ids
    if planner is False:  # fixed trees: what each drafts alone
        for s, c in zip(sessions, jobs):
            alone = dec.generate(c.prompt_ids, params)
            assert (s.stats.drafted_tokens, s.stats.accepted_tokens, s.stats.steps) == (
                alone.stats.drafted_tokens, alone.stats.accepted_tokens, alone.stats.steps)
            assert s.stats.accepted_tokens > 0


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_drafting_state_computes_what_training_computes(kind):
    """The eagle state's root row and depth-1/2 rows equal the training-time-test forward's (eagle3:
    the state fuses the target's layer inputs as training does)."""
    from specula.training.corpus import CorpusEntry
    from specula.training.features import extract_features
    from specula.drafters.heads.losses import eagle_outputs
    from specula.training.trainer import batch
    import tempfile
    from pathlib import Path

    model = tiny_model("llama", "eager", seed=3)
    target = native(model)
    seq = CorpusEntry("0", [5, 9, 22], reference_greedy(model, [5, 9, 22], 12))
    head = new_head(kind, target, oracle_d2t(96), seed=5)
    with tempfile.TemporaryDirectory() as d:
        fs = extract_features(target, [seq], Path(d) / "f.safetensors", layers=head.config.feature_layers)
    toks, feats, _ = fs.sequence(0)
    if kind == "eagle3":
        assert fs.layers == head.config.feature_layers == (0, 1)
        feats = fs.layer_inputs(0)  # [n, 2 E]: what the engine hands an eagle3 head
    outs = eagle_outputs(head, batch(fs, [(0, 0, 12)], head.embed), 3, 0.0, None)
    state = head.new_state()
    state.add_features(feats[:5].float())
    state.begin(toks[:6].tolist())  # root x_5, root pair (f_4, x_5)
    assert torch.allclose(state.last, outs[0][0, 4], atol=1e-5)
    state.feed([0], [int(toks[6])], [-1])
    assert torch.allclose(state.out[0], outs[1][0, 5], atol=1e-5)
    state.feed([1], [int(toks[6]), int(toks[7])], [-1, 0])
    assert torch.allclose(state.out[1], outs[2][0, 6], atol=1e-5)


def test_head_kv_buffer_grows_and_keeps_what_was_written():
    from specula.drafters.heads.eagle import KVBuffer

    buf = KVBuffer(2, 3, torch.float32, "cpu", capacity=4)
    keys = torch.randn(1, 2, 11, 3)
    values = torch.randn(1, 2, 11, 3)
    buf.write(0, keys[:, :, :3], values[:, :, :3])
    k, v = buf.write(3, keys[:, :, 3:10], values[:, :, 3:10])  # past the capacity: grows
    assert buf.capacity >= 10 and torch.equal(k, keys[:, :, :10]) and torch.equal(v, values[:, :, :10])
    k, v = buf.write(5, keys[:, :, 10:], values[:, :, 10:])  # overwrite in place (scratch rows), views to row 6
    assert torch.equal(k, torch.cat([keys[:, :, :5], keys[:, :, 10:]], 2)) and v.shape[2] == 6


def kernel_pass_of(module):
    """A `KernelHeadPass` over a copy of `module` whose linear layers are float32 kernels (the same
    weights: its results track the module's within float rounding)."""
    import copy

    from specula.drafters.heads.kernel_pass import KernelHeadPass
    from specula.models.native.kernels import apply_kernels

    return KernelHeadPass(apply_kernels(copy.deepcopy(module), "f32"))


@pytest.mark.skipif(drafting_kernel("cpu") is None, reason="specula's CPU kernels do not run here")
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_kernel_pass_computes_the_heads_forward(kind):
    """The drafting pass as direct kernel calls (`KernelHeadPass`) equals the module's forward within
    float tolerance, outputs and output states: a causal catch-up that grows the cache, then rows
    against it with a tree mask, with a sliding window's leading hidden keys, and causally; grouped KV
    heads too. Its cache rows are the module's."""
    from specula.drafters.heads.eagle import KVBuffer

    target = native(tiny_model("llama", "eager", seed=4))
    for kv_heads in (0, 2):
        head = new_head(kind, target, oracle_d2t(96), seed=3, num_kv_heads=kv_heads)
        module, cfg = head.module, head.config
        run = kernel_pass_of(module)
        e, t, p = cfg.hidden_size, 5, 12
        torch.manual_seed(kv_heads)
        emb, feats = torch.randn(p + t, e), torch.randn(p + t, e)
        tree = torch.ones(t, p + t, dtype=torch.bool)
        tree[:, p:] = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0],
                                    [1, 1, 0, 0, 1]], dtype=torch.bool)
        window = tree.clone()
        window[:, :4] = False  # keys before the window
        caches = [KVBuffer(cfg.num_kv_heads, cfg.head_dim, head.dtype, "cpu", capacity=8) for _ in range(2)]
        with torch.inference_mode():
            want, _ = module(emb[None, :p], feats[None, :p], torch.arange(p)[None], cache=caches[0], at=0)
            got, states, _ = run(emb[:p], feats[:p], torch.arange(p), None, caches[1], 0, 0)
            torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(states, module.output_states(want[0]) if kind == "eagle3" else want[0])
            torch.testing.assert_close(caches[1].keys[:, :, :p], caches[0].keys[:, :, :p], atol=1e-5, rtol=1e-5)
            for mask, lo in ((tree, 0), (window[:, 4:], 4), (None, 0)):
                rows = torch.arange(p, p + t)
                want, _ = module(emb[None, p:], feats[None, p:], rows[None], mask=None if mask is None else mask[None],
                                 cache=caches[0], at=p, lo=lo)
                got, _, _ = run(emb[p:], feats[p:], rows, mask, caches[1], p, lo)
                torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(drafting_kernel("cpu") is None, reason="specula's CPU kernels do not run here")
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("kernel", ["f32", "i8"])
def test_the_kernel_pass_runs_a_batchs_sequences_in_one_call_bit_for_bit_as_each_alone(kind, kernel):
    """`KernelHeadPass.many`: three sequences' rows in one call (a packed batch's level) give each one
    exactly what its own call gives, outputs, states, logits and cache rows: their catch-ups over
    prefixes of different lengths (raw target features, logits of the last row only), then a level
    each with its own tree mask, a sliding window's hidden keys, causal rows and copy hints."""
    import copy

    from specula.drafters.heads.eagle import KVBuffer
    from specula.drafters.heads.kernel_pass import HeadRows, KernelHeadPass, embedding_table
    from specula.models.native.kernels import apply_kernels

    target = native(tiny_model("llama", "eager", seed=4))
    head = new_head(kind, target, oracle_d2t(96), seed=3, num_kv_heads=2, copy_ngram=3)
    cfg, e = head.config, head.config.hidden_size
    lm = KernelLinear(torch.nn.Linear(e, 48, bias=False), kernel)
    run = KernelHeadPass(apply_kernels(copy.deepcopy(head.module), kernel), lm, embedding_table(target))
    width = run.module.fuse.in_features if kind == "eagle3" else e
    gen = torch.Generator().manual_seed(7)

    def ints(n, hi):
        return torch.randint(0, hi, (n,), generator=gen)

    prefixes, rows = (9, 4, 13), (1, 3, 4)
    catch_up = [HeadRows(ints(p, 96), torch.randn(p, width, generator=gen), torch.arange(p), None, None, 0, 0,
                         (ints(p, 96), ints(p, 4)), p - 1, True) for p in prefixes]
    masks = [torch.ones(1, 10, dtype=torch.bool),
             torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool),
             None]
    level = []
    for p, t, mask in zip(prefixes, rows, masks):
        lo = 2 if p == 4 else 0  # a window: keys 0, 1 hidden
        full = None if mask is None else torch.cat([torch.ones(t, p - lo, dtype=torch.bool), mask[:, -t:]], 1)
        level.append(HeadRows(ints(t, 96), torch.randn(t, e, generator=gen), p + torch.arange(t), full, None, p, lo,
                              (ints(t, 96), ints(t, 4)), 0, False))
    results = {}
    for way in ("alone", "together"):
        caches = [KVBuffer(cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu", capacity=4) for _ in prefixes]
        got = []
        for stage in (catch_up, level):
            parts = [HeadRows(**{**vars(r), "cache": c}) for r, c in zip(stage, caches)]
            got += run.many(parts) if way == "together" else [run.many([part])[0] for part in parts]
        results[way] = got, [c.keys[:, :, :p + t].clone() for c, p, t in zip(caches, prefixes, rows)]
    (alone, keys_alone), (together, keys_together) = results["alone"], results["together"]
    assert [tuple(x.shape) for x in together[0]] == [(9, e), (9, e), (1, 48)]
    for a, b in zip(alone, together):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for a, b in zip(keys_alone, keys_together):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("attention", ["sdpa", *(pytest.param(a, marks=pytest.mark.skipif(
    drafting_kernel("cpu") is None, reason="specula's CPU kernels do not run here"))
    for a in ("kernel pass", "kernel head"))])
def test_head_kv_cache_equals_a_from_scratch_forward_after_random_commits(kind, window, attention):
    """Steps of random trees and random commits: every drafted node's predicted feature equals a
    from-scratch causal head forward over the committed pairs and the node's own ancestor chain
    (the cache written by position holds exactly the committed prefix; scratch rows of rejected
    branches never leak into later steps). With a sliding window (`TrainedHead.window`) the
    committed pairs are the last `window` ones, and a first catch-up longer than the window
    computes only those. On the CPU kernels: the layer as separate kernel calls, and a head drafting
    on them (a level in one call)."""
    model = tiny_model("llama", "eager", seed=7)
    target = native(model)
    rng = random.Random(11)
    text = [rng.randrange(2, 96) for _ in range(90)]
    seq = target.new_sequence()
    from specula.drafters.heads.eagle import KVBuffer

    head = new_head(kind, target, oracle_d2t(96), seed=9)
    if attention == "kernel head":  # drafting on float32 kernels: a level in one call, from token ids to logits
        head = TrainedHead(head.module, head.d2t, target, kernel="f32")
        assert head.kernel_pass is not None and head.kernel_pass.table is not None
    head.window = window
    _, feats = seq.prefill(text, logits="none", hidden=head.feature_request)  # [90, k E]: f_i after token x_i
    seq.release()
    module = head.module
    if attention == "kernel pass":  # how a head drafting on the CPU kernels runs its layer (float kernels here)
        head.kernel_pass = kernel_pass_of(module)
    fused = module.fuse_features(feats)  # [90, E]: the feature each committed pair carries

    def scratch(chain_tokens: list[int], chain_feats: list[torch.Tensor], start: int = 0) -> torch.Tensor:
        """Causal forward over pairs (feature, next token) from position `start`: the last row's output."""
        emb = head.embed(chain_tokens)[None]
        out, _ = module(emb, torch.stack(chain_feats)[None], torch.arange(start, start + len(chain_tokens))[None])
        return out[0, -1]

    state = head.new_state()
    state.cache = KVBuffer(state.cache.keys.shape[1], state.cache.keys.shape[3], head.dtype, "cpu", capacity=8)
    root = 3 if window is None else 20  # a first catch-up longer than the window
    state.add_features(feats[:root])
    compared = 0
    with torch.inference_mode():
        while root < 80:
            state.begin(text[: root + 1])
            if window is not None and compared == 0:  # the pairs before the window were never run
                assert not state.cache.keys[:, :, : root - window].any() and state.cache.keys[:, :, root - 1].any()
            lo = 0 if window is None else max(0, root - window)  # the committed pairs a row sees
            committed_feats = [fused[i] for i in range(lo, root)]  # f_lo .. f_{root-1}
            committed_toks = text[lo + 1: root + 1]  # x_{lo+1} .. x_root
            assert torch.allclose(state.last, scratch(committed_toks, committed_feats, lo), atol=1e-5)
            parents: list[int] = []
            tokens: list[int] = []
            frontier = [-1]
            for _ in range(rng.randrange(1, 4)):  # levels, each one head pass over its frontier
                level = []
                for par in frontier:
                    for _ in range(rng.randrange(1, 3)):
                        parents.append(par)
                        tokens.append(rng.randrange(2, 96))
                        level.append(len(tokens) - 1)
                state.feed(level, tokens, parents)
                frontier = level
            for node in range(len(tokens)):
                chain = [node]
                while parents[chain[-1]] >= 0:
                    chain.append(parents[chain[-1]])
                chain.reverse()  # root's child .. node
                chain_feats = committed_feats + [state.out[parents[n]] for n in chain]
                chain_toks = committed_toks + [tokens[n] for n in chain]
                assert torch.allclose(state.out[node], scratch(chain_toks, chain_feats, lo), atol=1e-5), (root, node)
                compared += 1
            state.finish([])
            accepted = rng.randrange(0, 4)  # the engine hands the root's and accepted nodes' features
            state.add_features(feats[root: root + accepted + 1])
            root += accepted + 1
    assert compared > 20


def test_a_catch_ups_window_mask_depends_on_its_offsets_alone():
    """`run_window_mask` (cached by offsets, what a catch-up pass reads) equals `window_mask` of the same
    consecutive positions wherever the keys start, and hands out one shared tensor per offsets."""
    rng = random.Random(3)
    for _ in range(300):
        count, window, lo = rng.randint(1, 9), rng.randint(1, 12), rng.randint(0, 40)
        first = rng.randint(0, 20)
        keys = first + count + rng.randint(0, 3)
        expected = window_mask(torch.arange(lo + first, lo + first + count), lo, lo + keys, window)
        assert torch.equal(run_window_mask(count, first, keys, window), expected), (count, first, keys, window, lo)
    assert run_window_mask(3, 5, 9, 4) is run_window_mask(3, 5, 9, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_a_requests_context_adds_the_tokens_its_draft_vocabulary_lacks(kind):
    """The context vocabulary: a request's tokens outside the draft vocabulary (first come, at most
    `context_vocab`, none twice) are scored with the target's own output rows by the head's hidden
    state, mapped back exactly, and scattered into q; greedy output stays plain greedy."""
    model = tiny_model("llama", "eager", seed=4)
    target = native(model)
    head = new_head(kind, target, oracle_d2t(model.config.vocab_size), seed=1)  # even ids only
    v = len(head.d2t)
    off = head.new_state()  # the default: no context vocabulary
    off.add_context([3, 5])
    assert off.extra == [] and off.vocab_index is head.d2t
    head.context_vocab = 1024
    state = head.new_state()
    state.add_context([3, 4, 5, 3, 7, 6])
    assert state.extra == [3, 5, 7]
    assert torch.equal(state.extra_rows, target.output_rows(torch.tensor([3, 5, 7])).float())
    assert state.vocab_index.tolist() == [*head.d2t.tolist(), 3, 5, 7]
    assert state.token_ids([0, v, v + 2]) == [0, 3, 7]
    state.add_context([9, 5, 11])
    assert state.extra == [3, 5, 7, 9, 11]
    assert state.token_ids([v + 4, 1, v + 3, v]) == [11, head.d2t[1].item(), 9, 3]  # the grown vocabulary's map
    assert off.token_ids([1, 0]) == head.d2t[[1, 0]].tolist() == head.token_ids([1, 0])
    out = torch.randn(2, head.config.hidden_size)  # [2, E] the head's output
    logits = state.logits(out)  # [2, V_draft + 5]
    normed = head.module.output_states(out) if kind == "eagle3" else out
    assert logits.shape == (2, v + 5)
    assert torch.allclose(logits[:, :v], head.logits(out))
    assert torch.allclose(logits[:, v:], normed.float() @ target.output_rows(torch.tensor([3, 5, 7, 9, 11])).float().t())
    head.context_vocab = 2
    capped = head.new_state()
    capped.add_context([3, 5, 7])
    capped.add_context([9])
    assert capped.extra == [3, 5]
    head.context_vocab = 0
    off = head.new_state()
    off.add_context([3, 5])
    assert off.extra == [] and off.logits(out).shape == (2, v)
    head.context_vocab = 1024
    dec = build_decoder(kind, target, None, head=head, planner=False)
    prompt = [3, 5, 7, 9, 11, 3, 5, 7]  # every prompt token outside the draft vocabulary
    out = dec.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert out.token_ids == reference_greedy(model, prompt, 24)
    with pytest.raises(ConfigError, match="head_context_vocab must be an integer >= 0"):
        create_head_drafter(kind, target=target, head=head, head_context_vocab=-1)
    assert create_head_drafter(kind, target=target, head=head, head_context_vocab=0).head.context_vocab == 0


# ---------------------------------------------------------------------------- sampling laws
V = 8
TEMP = 1.5
PROMPT = [3, 5, 1, 3, 5]
TRIALS = 1500


@pytest.fixture(scope="module")
def law_model():
    return tiny_model("llama", seed=8, vocab=V)


@pytest.mark.parametrize("kind,sampling,kernel,prompt", [
    ("eagle", "deterministic", None, PROMPT), ("eagle", "iid", None, PROMPT),
    ("hydra", "without_replacement", None, PROMPT), ("medusa", "iid", None, PROMPT), ("eagle3", "iid", None, PROMPT),
    ("eagle3", "iid", "i8", PROMPT),
    ("eagle", "iid", None, [4, 5, 7, 3, 4]),  # tokens 4 and 7 join the head's output from the prompt
    ("eagle3", "deterministic", None, [4, 5, 7, 3, 4])])  # coupled children over the draft and context vocabulary
def test_sampled_output_follows_the_target_law(law_model, kind, sampling, kernel, prompt):

    if kernel is not None and drafting_kernel("cpu") is None:
        pytest.skip("specula's CPU kernels do not run here")
    target = HFCausalLM(law_model, "target")
    head = new_head(kind, target, torch.tensor([0, 1, 2, 3, 5, 6]), seed=2)  # draft vocabulary without 4 and 7
    if kernel is not None:  # q = what the int8 head's logits give, the distribution children are drawn from
        head = TrainedHead(head.module, head.d2t, target, kernel=kernel)
    head.context_vocab = 16  # the request's tokens outside the draft vocabulary join q (4 and 7 in the last case)
    dec = build_decoder(kind, target, None, head=head, planner=HardwarePlanner(curve=FLAT), tree_sampling=sampling,
                        tree_top_k=3, tree_depth=2, adaptive=False)  # every step drafts: the rule is exercised
    exact = exact_first_two(law_model, prompt, TEMP)
    codes, accepted = sample_first_two(dec, prompt, TEMP, V, TRIALS)
    assert accepted > TRIALS // 10, accepted
    assert tv(codes, exact) < tv_bound(exact, TRIALS, c=2.0)
    assert tv(codes, torch.roll(exact, 1)) > 3 * tv_bound(exact, TRIALS, c=2.0)


# ---------------------------------------------------------------------------- head files
@pytest.fixture()
def saved(tmp_path):
    model = tiny_model("llama", "eager", seed=4)
    target = native(model)
    head = new_head("eagle", target, oracle_d2t(96), seed=1)
    path = save_head(tmp_path / "eagle.safetensors",
                     HeadFile(head.config, head.module.state_dict(), head.d2t, target_record(target, "tiny")))
    return model, target, head, path


def test_a_saved_head_loads_back_identically(saved):
    _, target, head, path = saved
    loaded = load_head(path, target, "tiny", torch.float32)
    for name, tensor in head.module.state_dict().items():
        assert torch.equal(loaded.module.state_dict()[name], tensor)
    assert torch.equal(loaded.d2t, head.d2t)
    drafting = load_head(path, target, "tiny")  # drafting only: on specula's int8 kernels where they run
    if drafting_kernel("cpu") is not None:
        assert drafting.kernel == "i8" and drafting.lm_rows is None
        assert all(isinstance(m, KernelLinear) for m in (drafting.module.fc, drafting.module.wqkv, drafting.module.w_down))
    else:
        assert drafting.dtype == drafting_dtype("cpu") and drafting.lm_rows.dtype == drafting.dtype
        for name, tensor in head.module.state_dict().items():
            assert torch.equal(drafting.module.state_dict()[name], tensor.to(drafting.dtype))


def test_a_head_drafts_within_the_context_it_was_trained_on(saved, tmp_path):
    """`specula train` records its chunk length (`seq_len`); the head attends to that many committed
    pairs while drafting. A file without it (trained elsewhere) attends to every pair."""
    _, target, head, path = saved
    assert load_head(path, target, "tiny").window is None
    trained = save_head(tmp_path / "trained.safetensors",
                        HeadFile(head.config, head.module.state_dict(), head.d2t, target_record(target, "tiny"),
                                 {"config": {"seq_len": 32}}))
    loaded = load_head(trained, target, "tiny")
    assert loaded.window == 32 and loaded.new_state().window == 32
    from specula.drafters.trained import create_head_drafter

    assert create_head_drafter("eagle", target=target, head=trained).head.window == 32
    assert create_head_drafter("eagle", target=target, head=trained, head_window=0).head.window is None  # all
    assert create_head_drafter("eagle", target=target, head=trained, head_window=8).head.window == 8
    with pytest.raises(ConfigError, match="head_window must be an integer >= 0"):
        create_head_drafter("eagle", target=target, head=trained, head_window=-1)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_head_loads_on_its_target_quantized(tmp_path, quantize):
    """A head made for a model with its own output head (Qwen2.5's GGUFs), on that model through
    int4 kernels: the fingerprint's values moved by up to 8% of the largest (int4 groups), and the
    head was refused as made for another model, in words that named the same model twice."""
    from tiny import word_tokenizer

    from specula.models.loading import LoadConfig, load_backend

    directory = tmp_path / "untied"
    word_tokenizer(96, decoder=True, unk_token="w0", eos_token="w1").save_pretrained(directory)
    model = tiny_model("qwen2", seed=3, vocab=96)
    assert not model.config.tie_word_embeddings
    model.save_pretrained(directory)
    target, _ = load_backend(str(directory), LoadConfig(quantize="none"), "target")
    head = new_head("eagle3", target, torch.arange(96), seed=1)
    path = save_head(tmp_path / "eagle3.safetensors",
                     HeadFile(head.config, head.module.state_dict(), head.d2t, target_record(target, "untied")))
    quantized, _ = load_backend(str(directory), LoadConfig(quantize=quantize), "target")
    assert load_head(path, quantized, "untied").config == head.config
    other = native(tiny_model("qwen2", seed=9, vocab=96))  # same shape, other weights: still refused
    with pytest.raises(HeadFileError, match="output head differs"):
        load_head(path, other, "other")


def test_bad_head_files_are_refused_with_the_fix(saved, tmp_path):
    model, target, _, path = saved
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(HeadFileError, match="truncated or corrupted.*specula train.*than .*cut.safetensors as "
                                             "head=FILE$"):  # the keyword a Python caller gives it by
        read_head(tmp_path / "cut.safetensors")
    with pytest.raises(HeadFileError, match="does not exist"):
        read_head(tmp_path / "none.safetensors")
    with pytest.raises(HeadFileError, match="is a directory"):  # it said the folder did not exist
        read_head(tmp_path)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(HeadFileError, match="not a specula head"):
        read_head(tmp_path / "plain.safetensors")
    other = native(tiny_model("llama", "eager", seed=9))  # same shape, other weights
    with pytest.raises(HeadFileError, match="output head differs"):
        load_head(path, other, "other")
    wider = native(tiny_model("llama", "eager", seed=4, vocab=128))
    with pytest.raises(HeadFileError, match="vocabulary 96.*vocabulary 128"):
        load_head(path, wider, "wider")


def test_head_files_with_a_non_integer_map_non_finite_or_misshapen_weights_are_refused(saved, tmp_path):
    """A float d2t (2.5 read as 2: one target id for two draft ids, and the sampled law off), NaN
    weights (a float head drafted nothing, an int8 one garbage) and a weight of the wrong shape (the
    message named no parameter) are one-line errors; a map with a repeat or outside the vocabulary
    is refused without a file too."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model, target, _, path = saved
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    weight = next(k for k, v in tensors.items() if k.startswith("head.") and v.is_floating_point() and v.dim() == 2)

    def rewritten(name, **changed):
        out = tmp_path / f"{name}.safetensors"
        save_file({**tensors, **changed}, str(out), metadata=meta)
        return out

    d2t = tensors["d2t"].double()
    d2t[3] = float(d2t[2]) + 0.5 if float(d2t[2]) + 0.5 not in d2t.tolist() else d2t[3]
    with pytest.raises(HeadFileError, match="mapping holds torch.float64 values, not token ids"):
        read_head(rewritten("float_map", d2t=d2t))
    nan = tensors[weight].clone()
    nan[0, 0] = float("nan")
    with pytest.raises(HeadFileError, match=f"weight {weight.removeprefix('head.')} holds NaN or infinite"):
        read_head(rewritten("nan", **{weight: nan}))
    with pytest.raises(HeadFileError, match="size mismatch for"):
        load_head(rewritten("short", **{weight: tensors[weight][:-1]}), target, "tiny")
    ids = torch.arange(8)
    for bad in (torch.tensor([0, 1, 2, 2, 5, 6]), torch.tensor([-1, 1, 2]), ids.double()):
        with pytest.raises(ConfigError, match="draft vocabulary map"):
            new_head("eagle", target, bad)


def test_cli_refuses_a_corrupted_head_in_one_line_with_exit_2(saved, tmp_path):
    _, _, _, path = saved
    data = path.read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data[:100])
    proc = subprocess.run([sys.executable, "-m", "specula", "generate", "--target", str(tmp_path / "missing-model"),
                           "--method", "eagle", "--head", str(bad), "--prompt", "hi"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert "truncated or corrupted" in proc.stderr and "specula train" in proc.stderr  # before the model load
    assert proc.stderr.endswith("bad.safetensors as --head FILE\n")  # the flag (head=FILE to a Python caller)


@pytest.mark.parametrize("options, python, argv, flags", [
    ({"method": "medusa"}, 'method="medusa" got an eagle head; use method="eagle" or a medusa head',
     ["--method", "medusa"], "--method medusa got an eagle head; use --method eagle or a medusa head"),
    ({"method": "fusion", "recycling_state": "STATE"},
     'recycling_state is for token-recycling, which fusion leaves out when a trained head drafts; pass head="none" '
     "to keep token-recycling (or drop recycling_state)",
     ["--method", "fusion", "--recycling-state", "STATE"],
     "--recycling-state is for token-recycling, which fusion leaves out when a trained head drafts; pass --head none "
     "to keep token-recycling (or drop --recycling-state)"),
])
def test_a_head_methods_error_names_the_keywords_in_python_and_the_flags_on_the_command_line(
        saved, tmp_path, monkeypatch, tiny_tokenizer, capsys, options, python, argv, flags):
    """A head drafter's errors named --method and --recycling-state to a Python caller, who had written method= and
    recycling_state=; they name the keywords now, and `specula generate` (its load monkeypatched to the head's
    tiny target) shows the flags."""
    import specula.api
    from specula.cli import main

    _, target, _, path = saved
    state = str(tmp_path / "state.npz")
    options = {k: state if v == "STATE" else v for k, v in options.items()}
    with pytest.raises(ConfigError) as caught:
        build_decoder(options.pop("method"), target, None, head=str(path), target_name="tiny", planner=False,
                      **options)
    assert str(caught.value) == python
    monkeypatch.setattr(specula.api, "load", lambda name, draft=None, method=None, config=None, draft_quantize=None,
                        skip_layers=None, draft_vocab=None, **kw: specula.api.Specula(target, tiny_tokenizer, method,
                                                                                      **kw))
    code = main(["generate", "--target", "tiny", "--head", str(path), *(state if a == "STATE" else a for a in argv),
                 "--prompt", "w5 w6", "--raw", "--max-new-tokens", "4"])
    assert code == 2 and capsys.readouterr().err == f"error: {flags}\n"


def test_online_distillation_updates_the_head_and_never_changes_the_output():
    model = tiny_model("llama", "eager", seed=6)
    target = native(model)
    head = new_head("eagle", target, torch.arange(96), seed=0)
    before = {k: v.clone() for k, v in head.module.state_dict().items()}
    dec = build_decoder("eagle", target, None, head=head, planner=False, online_distill=True)
    drafter = dec.drafters[0]
    rng = random.Random(3)
    for _ in range(3):
        prompt = [rng.randrange(2, 96) for _ in range(6)]
        out = dec.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 24)
    assert drafter.online.updates == 3 and len(drafter.online.buffer) == 3
    assert drafter.online.buffer[0][0].shape[0] == drafter.online.buffer[0][1].shape[0] == 6 + 24 - 1
    assert any(not torch.equal(v, head.module.state_dict()[k]) for k, v in before.items())
    assert not head.module.training and not any(p.requires_grad for p in head.module.parameters())


def test_the_replay_buffer_is_bounded_in_memory_as_well_as_in_requests():
    """Whole feature matrices of long requests (75 MiB for 4,000 tokens at the 1.5B's width) are
    kept within buffer_mib: oldest requests dropped first, one longer than the bound alone keeps its
    last positions (at least a window)."""
    from specula.drafters.heads.online import OnlineDistillConfig, OnlineDistiller

    head = new_head("eagle", native(tiny_model("llama", "eager", seed=6)), torch.arange(96), seed=0)
    e = 16  # the feature width: the buffer holds what it is given (steps=0: no update reads them)
    row = e * 4  # bytes of a float32 feature row
    config = OnlineDistillConfig(buffer_mib=40 * row / 2**20, window=8, steps=0)
    online = OnlineDistiller(head, config)
    for n in (12, 12, 12, 12):
        online.add(list(range(2, 2 + n)), [torch.randn(e) for _ in range(n - 1)])
    assert [len(t) for t, _ in online.buffer] == [11, 11, 11]  # 44 rows would pass 40: the oldest went
    assert online.buffer_bytes == sum(f.numel() * 4 for _, f in online.buffer) <= 40 * row
    tokens = list(range(100))
    online.add(tokens, [torch.full((e,), float(i)) for i in range(99)])
    (kept, feats), = online.buffer  # alone, cut to its last 40 positions
    assert kept.tolist() == tokens[59:99] and feats[:, 0].tolist() == [float(i) for i in range(59, 99)]
    small = OnlineDistiller(head, OnlineDistillConfig(buffer_sequences=2, steps=0))
    for _ in range(3):
        small.add([5, 6, 7, 8], [torch.randn(e) for _ in range(3)])
    assert len(small.buffer) == 2


def test_online_distillation_refuses_heads_it_cannot_train_or_of_another_target(saved):
    """A head drafting on int8 kernels has no weights to train (its first update raised after the
    request was decoded: on the server, the worker died); a head loaded for another target would
    be trained on a mix of two targets' features. Both are refused when the decoder is built."""
    model, target, _, path = saved
    if drafting_kernel("cpu") is not None:
        with pytest.raises(ConfigError, match="cannot train: load it with"):
            build_decoder("eagle", target, None, head=load_head(path, target, "tiny"), planner=False,
                          online_distill=True)
    other = native(tiny_model("llama", "eager", seed=5))
    with pytest.raises(ConfigError, match="loaded for another target"):
        build_decoder("eagle", other, None, head=load_head(path, target, "tiny", torch.float32), planner=False)


def test_an_online_update_that_fails_ends_distillation_not_the_request(capsys):
    model = tiny_model("llama", "eager", seed=6)
    target = native(model)
    dec = build_decoder("eagle", target, None, head=new_head("eagle", target, torch.arange(96), seed=0),
                        planner=False, online_distill=True)
    drafter = dec.drafters[0]

    def broken():
        raise RuntimeError("no gradient")

    drafter.online.update = broken
    prompt = [5, 17, 33, 2, 5, 17]
    out = dec.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert out.token_ids == reference_greedy(model, prompt, 12) and drafter.online is None
    assert "online distillation stopped" in capsys.readouterr().err


def test_shipped_heads_install_checked_by_sha256(saved, tmp_path, monkeypatch):
    import hashlib

    from specula.drafters.heads import shipped

    _, _, _, path = saved
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "tiny-eagle.safetensors").write_bytes(path.read_bytes())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(shipped, "PACKAGE_DIR", package)
    monkeypatch.setattr(shipped, "SHIPPED", (shipped.ShippedHead("smollm2-135m", "eagle", "tiny-eagle.safetensors",
                                                                  digest),))
    assert shipped.default_head("smollm2-135m", "eagle") is None
    killed = shipped.installed_path("smollm2-135m", "eagle").with_name(".eagle.safetensors.tmp-killed")
    killed.parent.mkdir(parents=True)
    killed.write_bytes(b"half a head")  # what an install killed mid-copy left
    [installed] = shipped.install_heads("smollm2-135m")
    assert installed.read_bytes() == path.read_bytes() and not killed.exists()
    assert shipped.default_head("smollm2-135m", "eagle") == installed
    assert shipped.default_head("smollm2-135m", "medusa") is None and shipped.install_heads("qwen2.5-coder-1.5b") == []
    installed.unlink()
    (package / "tiny-eagle.safetensors").write_bytes(path.read_bytes()[:-10])  # corrupted in the package
    with pytest.raises(HeadFileError, match="sha256"):
        shipped.install_heads("smollm2-135m")
    assert not installed.exists()


def test_ship_head_fits_the_limit_and_never_leaves_a_half_written_file(saved, tmp_path, monkeypatch):
    import hashlib

    from specula.drafters.heads import shipped

    _, _, _, path = saved
    out = tmp_path / "ship"
    entry, dest = shipped.ship_head(path, "tiny", out)  # float16 fits
    assert dest == out / "tiny-eagle.safetensors"
    assert entry == shipped.ShippedHead("tiny", "eagle", dest.name, hashlib.sha256(dest.read_bytes()).hexdigest())
    assert all(v.dtype == torch.float16 for v in read_head(dest).state.values())
    f16 = dest.stat().st_size
    monkeypatch.setattr(shipped, "MAX_SHIPPED_BYTES", f16 - 1)  # float16 over the limit: int8 matrices
    entry8, dest8 = shipped.ship_head(path, "tiny", out)
    assert dest8 == dest and dest.stat().st_size < f16 and entry8.sha256 != entry.sha256
    assert read_head(dest).config.kind == "eagle"
    kept = dest.read_bytes()
    monkeypatch.setattr(shipped, "MAX_SHIPPED_BYTES", 1000)  # too big even as int8: the shipped file stays
    with pytest.raises(HeadFileError, match="even with int8"):
        shipped.ship_head(path, "tiny", out)
    with pytest.raises(HeadFileError, match="trained for 'tiny', not 'smollm2-135m'"):
        shipped.ship_head(path, "smollm2-135m", out)
    assert dest.read_bytes() == kept and [p.name for p in out.iterdir()] == [dest.name]


def test_every_shipped_head_is_in_the_package_within_the_size_limit():
    import hashlib

    from specula.drafters.heads import shipped

    for head in shipped.SHIPPED:
        path = shipped.PACKAGE_DIR / head.file
        assert path.stat().st_size <= shipped.MAX_SHIPPED_BYTES, head
        assert hashlib.sha256(path.read_bytes()).hexdigest() == head.sha256, head
        assert read_head(path).config.kind == head.kind


def test_an_eagle3_head_file_keeps_its_feature_layers(tmp_path):
    model = tiny_model("llama", "eager", seed=4, layers=4)
    target = native(model)
    head = new_head("eagle3", target, oracle_d2t(96), seed=1)
    assert head.config.feature_layers == (1, 2) and head.feature_request == (1, 2)
    path = save_head(tmp_path / "eagle3.safetensors",
                     HeadFile(head.config, head.module.state_dict(), head.d2t, target_record(target, "tiny")))
    loaded = load_head(path, target, "tiny", torch.float32)
    assert loaded.config == head.config
    for name, tensor in head.module.state_dict().items():
        assert torch.equal(loaded.module.state_dict()[name], tensor)


def test_a_narrow_grouped_query_head_saved_as_int8_stays_close_and_output_stays_plain_greedy(tmp_path):
    """A wide target's head is kept small by a narrower MLP, fewer key/value heads and int8 rows
    (format 2): reading gives floats within about half a step of each row's scale, and the target still
    decides every token."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from specula.drafters.heads.file import INT8_FORMAT, META_KEY

    model = tiny_model("llama", "eager", seed=4)
    target = native(model)
    head = new_head("eagle3", target, oracle_d2t(96), seed=1, intermediate_size=24, num_kv_heads=2)
    cfg = head.config
    assert (cfg.intermediate_size, cfg.num_kv_heads, cfg.num_heads) == (24, 2, 4)
    assert head.module.w_down.weight.shape == (32, 24)
    assert head.module.wqkv.weight.shape == ((4 + 2 * 2) * cfg.head_dim, 32)
    record = HeadFile(cfg, head.module.state_dict(), head.d2t, target_record(target, "tiny"))
    path = save_head(tmp_path / "int8.safetensors", record, dtype=torch.int8)
    with safe_open(str(path), "pt") as f:
        assert f.get_slice("head.fuse.weight").get_dtype() == "I8" and '"format": 2' in f.metadata()[META_KEY]
        assert f.get_slice("head.post_norm").get_dtype() == "F16"
    assert INT8_FORMAT == 2
    loaded = read_head(path)
    for name, w in head.module.state_dict().items():
        got = loaded.state[name]
        assert got.dtype == (torch.float32 if w.dim() == 2 else torch.float16) and got.shape == w.shape
        step = (w.abs().amax(dim=1, keepdim=True) / 127) if w.dim() == 2 else w.abs().max() * 2 ** -10
        assert bool(((got.float() - w).abs() <= 0.6 * step + 1e-6).all()), name  # half a step + float16 scale
    assert not torch.equal(loaded.state["fuse.weight"], head.module.state_dict()["fuse.weight"])  # really rounded
    dec = build_decoder("eagle3", target, None, head=load_head(path, target, "tiny", torch.float32), planner=False)
    rng = random.Random(5)
    for _ in range(3):
        prompt = [rng.randrange(2, 96) for _ in range(rng.randrange(2, 9))]
        out = dec.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 24), prompt
        assert out.stats.drafted_tokens > 0
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    del tensors["scale.fuse.weight"]
    save_file(tensors, str(tmp_path / "noscale.safetensors"), metadata=meta)
    with pytest.raises(HeadFileError, match="int8 matrix has no scale"):
        read_head(tmp_path / "noscale.safetensors")


def test_eagle3_refuses_online_distillation_and_mixed_feature_requests():
    from specula.engine import feature_request
    from specula.errors import ConfigError

    model = tiny_model("llama", "eager", seed=4)
    target = native(model)
    eagle3 = new_head("eagle3", target, oracle_d2t(96), seed=1)
    with pytest.raises(ConfigError, match="^online_distill trains eagle, .*: drop online_distill$"):  # as Python
        build_decoder("eagle3", target, None, head=eagle3, planner=False, online_distill=True)  # names it
    with pytest.raises(ConfigError, match='^method="eagle" got an eagle3 head; use method="eagle3"'):  # not --method:
        build_decoder("eagle", target, None, head=eagle3, planner=False)  # the bench takes --methods
    eagle = new_head("eagle", target, oracle_d2t(96), seed=1)
    drafters = [build_decoder(k, target, None, head=h, planner=False).drafters[0]
                for k, h in (("eagle", eagle), ("eagle3", eagle3))]
    assert feature_request(drafters[:1]) is True and feature_request(drafters[1:]) == (0, 1)
    with pytest.raises(ConfigError, match="different target features"):
        feature_request(drafters)
