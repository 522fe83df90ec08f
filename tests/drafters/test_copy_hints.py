"""Copy hints (`specula.drafters.heads.copy`, `HeadConfig.copy_ngram`): one definition for training
and drafting, held to a brute-force search; a head reading them drafts what training computes, on
torch and on the CPU kernels, and its output stays plain greedy; a head gains them at zero weight."""

from __future__ import annotations

import copy
import random
import tempfile
from pathlib import Path

import pytest
import torch

from tiny import reference_greedy, tiny_model
from specula.api import build_decoder
from specula.drafters.heads.copy import CopyIndex, sequence_hints
from specula.drafters.heads.runtime import TrainedHead, drafting_kernel, new_head
from specula.errors import ConfigError
from specula.models.native import NativeCausalLM, NativeDecoder, configure
from specula.sampling import SamplingParams


def brute_hints(tokens: list[int], n: int) -> tuple[list[int], list[int]]:
    """Per position p: the token after the latest j < p whose k tokens end like p's, k longest first."""
    hints, lengths = [], []
    for p in range(len(tokens)):
        found = (0, 0)
        for k in range(min(n, p + 1), 0, -1):
            ends = [j for j in range(k - 1, p) if tokens[j - k + 1: j + 1] == tokens[p - k + 1: p + 1]]
            if ends:
                found = (tokens[max(ends) + 1], k)
                break
        hints.append(found[0])
        lengths.append(found[1])
    return hints, lengths


def test_hints_of_a_sequence_are_the_latest_longest_earlier_match():
    assert sequence_hints([7, 8, 9, 7, 8, 4, 7, 8], 3) == ([0, 0, 0, 8, 9, 0, 8, 4], [0, 0, 0, 1, 2, 0, 1, 2])
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(1, 5)
        tokens = [rng.randrange(1, 6) for _ in range(rng.randrange(1, 40))]
        assert sequence_hints(tokens, n) == brute_hints(tokens, n)


def test_a_drafted_paths_hint_is_the_hint_of_the_sequence_it_would_make():
    """Committed in pieces (as a request commits steps), then any drafted path after them: each path
    token's hint over the committed tokens and the path before it equals `sequence_hints` of the
    concatenation."""
    rng = random.Random(1)
    for _ in range(150):
        n = rng.randrange(1, 5)
        tokens = [rng.randrange(1, 5) for _ in range(rng.randrange(2, 40))]
        committed = rng.randrange(1, len(tokens))
        index, at = CopyIndex(n), 0
        while at < committed:  # steps of the request
            step = min(committed, at + rng.randrange(1, 5))
            index.extend(tokens[at:step])
            assert index.committed_hints(at, step) == tuple(x[at:step] for x in brute_hints(tokens[:step], n))
            at = step
        for d in range(1, len(tokens) - committed + 1):
            want = brute_hints(tokens[:committed + d], n)
            assert index.path_hint(tokens[committed:committed + d]) == (want[0][-1], want[1][-1])


def native(model):
    return NativeCausalLM(configure(NativeDecoder.from_hf(model), "onednn", "none", "sdpa"), "native",
                          eos_token_ids=[])


def copy_head(kind: str, target, seed: int = 1) -> TrainedHead:
    """A head with 3-token copy hints whose hint weights are random (not the zero they start at)."""
    head = new_head(kind, target, torch.arange(0, 96, 2), seed=seed, copy_ngram=3)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.module.copy_proj.weight.normal_(0.0, 0.2, generator=g)
        head.module.copy_len.normal_(0.0, 0.2, generator=g)
        head.module.copy_gain.normal_(0.0, 0.2, generator=g)
    return head


PROMPT = [5, 17, 9, 33, 5, 17, 9, 40, 5, 17]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("kernel", [None, pytest.param("i8", marks=pytest.mark.skipif(
    drafting_kernel("cpu") is None, reason="specula's CPU kernels do not run here"))])
def test_a_head_reading_copy_hints_drafts_and_output_stays_plain_greedy(kind, kernel):
    model = tiny_model("llama", "eager", seed=4)
    target = native(model)
    head = copy_head(kind, target)
    if kernel is not None:
        head = TrainedHead(copy.deepcopy(head.module), head.d2t, target, kernel=kernel)
        assert head.kernel_pass is not None
    dec = build_decoder(kind, target, None, head=head, planner=False)
    out = dec.generate(PROMPT, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert out.token_ids == reference_greedy(model, PROMPT, 30)
    assert out.stats.drafted_tokens > 0


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_drafting_with_copy_hints_computes_what_training_computes(kind):
    """The drafting state's committed rows and depth-1/2 rows equal the training-time-test forward's,
    hints included (training's over the whole sequence, drafting's over the committed tokens and
    the drafted path), and the hints do change the rows."""
    from specula.drafters.heads.losses import eagle_outputs
    from specula.training.corpus import CorpusEntry
    from specula.training.features import extract_features
    from specula.training.trainer import batch

    model = tiny_model("llama", "eager", seed=3)
    target = native(model)
    seq = CorpusEntry("0", PROMPT, reference_greedy(model, PROMPT, 12))
    head = copy_head(kind, target, seed=5)
    with tempfile.TemporaryDirectory() as d:
        fs = extract_features(target, [seq], Path(d) / "f.safetensors", layers=head.config.feature_layers)
    toks, feats, _ = fs.sequence(0)
    if kind == "eagle3":
        feats = fs.layer_inputs(0)
    b = batch(fs, [(0, 0, 20)], head.embed, copy_ngram=3)
    assert int((b["hint_len"] > 0).sum()) >= 5
    outs = eagle_outputs(head, b, 3, 0.0, None)
    plain = TrainedHead(copy.deepcopy(head.module), head.d2t, target)
    plain.module.reset_copy()
    assert not torch.allclose(eagle_outputs(plain, b, 1, 0.0, None)[0], outs[0])
    for root in (9, 11):  # roots after a repeated phrase: their pairs have hints
        state = head.new_state()
        state.add_features(feats[:root].float())
        state.begin(toks[:root + 1].tolist())
        assert torch.allclose(state.last, outs[0][0, root - 1], atol=1e-5)
        state.feed([0], [int(toks[root + 1])], [-1])
        assert torch.allclose(state.out[0], outs[1][0, root], atol=1e-5)
        state.feed([1], [int(toks[root + 1]), int(toks[root + 2])], [-1, 0])
        assert torch.allclose(state.out[1], outs[2][0, root + 1], atol=1e-5)


@pytest.mark.skipif(drafting_kernel("cpu") is None, reason="specula's CPU kernels do not run here")
def test_the_kernel_pass_adds_the_copy_term_as_the_forward_does():
    from specula.drafters.heads.eagle import KVBuffer
    from specula.drafters.heads.kernel_pass import KernelHeadPass
    from specula.models.native.kernels import apply_kernels

    target = native(tiny_model("llama", "eager", seed=4))
    head = copy_head("eagle3", target, seed=3)
    module, cfg = head.module, head.config
    run = KernelHeadPass(apply_kernels(copy.deepcopy(module), "f32"))
    torch.manual_seed(0)
    t, e = 6, cfg.hidden_size
    emb, feats = torch.randn(t, e), torch.randn(t, e)
    hint_emb, hint_len = torch.randn(t, e), torch.tensor([0, 1, 3, 2, 0, 1])
    term = module.copy_term(hint_emb, hint_len)  # [T, E]
    caches = [KVBuffer(cfg.num_kv_heads, cfg.head_dim, head.dtype, "cpu") for _ in range(2)]
    with torch.inference_mode():
        want, _ = module(emb[None], feats[None], torch.arange(t)[None], cache=caches[0], copy=term[None])
        got, _, _ = run(emb, feats, torch.arange(t), None, caches[1], 0, 0, (hint_emb, hint_len))
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(drafting_kernel("cpu") is None, reason="specula's CPU kernels do not run here")
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_kernel_pass_runs_a_level_from_token_ids_to_logits(kind):
    """A head drafting on the kernels runs a level in one call from token ids: the embeddings looked
    up in the target's table, eagle3's raw features fused, the copy hints' term, the layer and the
    output layer, as the module's forward and `target_logits` compute them; `logits_from` keeps the
    last rows' logits only; a layer replaced after the pass was built is read anew."""
    from specula.drafters.heads.eagle import KVBuffer
    from specula.models.native.kernels import KernelLinear

    target = native(tiny_model("llama", "eager", seed=4))
    base = copy_head(kind, target, seed=3)
    head = TrainedHead(copy.deepcopy(base.module), base.d2t, target, kernel="f32")
    run, module, cfg = head.kernel_pass, head.module, head.config
    assert run is not None and run.table is not None and run.lm is not None
    t, e = 6, cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    ids, hint_ids = torch.randint(0, 96, (t,), generator=g), torch.randint(0, 96, (t,), generator=g)
    hint_len = torch.tensor([0, 1, 3, 2, 0, 1])
    raw = torch.randn(t, len(cfg.feature_layers or (0,)) * e, generator=g)  # eagle3: the target's layer inputs

    def want(cache):
        copy_term = module.copy_term(head.embed(hint_ids), hint_len)
        out, _ = module(head.embed(ids)[None], module.fuse_features(raw)[None], torch.arange(t)[None], cache=cache,
                        copy=copy_term[None])
        states = module.output_states(out[0])
        return out[0], states, head.target_logits(states)

    with torch.inference_mode():
        for replaced in (False, True):
            if replaced:  # a new output projection under the same module: the pass must read its pointers again
                module.wo = KernelLinear(torch.nn.Linear(cfg.num_heads * cfg.head_dim, e, bias=False), "f32")
            caches = [KVBuffer(cfg.num_kv_heads, cfg.head_dim, head.dtype, "cpu") for _ in range(2)]
            expected = want(caches[0])
            got = run(ids, raw, torch.arange(t), None, caches[1], 0, 0, (hint_ids, hint_len), raw=True)
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(caches[1].keys[:, :, :t], caches[0].keys[:, :, :t], atol=1e-5, rtol=1e-5)
        _, _, last = run(ids, raw, torch.arange(t), None, caches[1], 0, 0, (hint_ids, hint_len), t - 2, raw=True)
        assert last.shape == (2, len(head.d2t))
        torch.testing.assert_close(last, expected[2][-2:], atol=1e-4, rtol=1e-4)
        written = caches[1].keys.clone()
        for lengths in (hint_len + 3, hint_len - 1):  # past copy_gain's rows, and below 0
            with pytest.raises(ValueError, match="copy hints of lengths"):
                run(ids, raw, torch.arange(t), None, caches[1], 0, 0, (hint_ids, lengths), raw=True)
        for tokens, hints in ((ids + 96, hint_ids), (ids - 97, hint_ids), (ids, hint_ids + 96)):
            with pytest.raises(ValueError, match="outside the target's vocabulary"):
                run(tokens, raw, torch.arange(t), None, caches[1], 0, 0, (hints, hint_len), raw=True)
        assert torch.equal(caches[1].keys, written)  # refused before the pass wrote anything


@pytest.mark.skipif(drafting_kernel("cpu") is None, reason="specula's CPU kernels do not run here")
def test_the_kernel_pass_reads_its_modules_again_only_after_an_assignment(monkeypatch):
    """The pass walks the head's modules for stale pointers only where a module, parameter or buffer was
    assigned since its last look (or its output layer or table were set anew), not on every pass."""
    from specula.drafters.heads.eagle import KVBuffer
    from specula.drafters.heads.kernel_pass import KernelHeadPass
    from specula.models.native.kernels import KernelLinear

    target = native(tiny_model("llama", "eager", seed=4))
    base = copy_head("eagle3", target, seed=3)
    head = TrainedHead(copy.deepcopy(base.module), base.d2t, target, kernel="f32")
    run, cfg = head.kernel_pass, head.config
    walks = []
    held = KernelHeadPass._held
    monkeypatch.setattr(KernelHeadPass, "_held", lambda self: walks.append(1) or held(self))
    t, e = 3, cfg.hidden_size
    ids, raw = torch.tensor([5, 9, 2]), torch.randn(t, len(cfg.feature_layers) * e)
    hints = (torch.tensor([0, 4, 4]), torch.tensor([0, 1, 2]))

    def one_pass():
        cache = KVBuffer(cfg.num_kv_heads, cfg.head_dim, head.dtype, "cpu")
        return run(ids, raw, torch.arange(t), None, cache, 0, 0, hints, raw=True)

    with torch.inference_mode():
        first = one_pass()
        one_pass()
        assert walks == []
        head.module.wo = KernelLinear(torch.nn.Linear(cfg.num_heads * cfg.head_dim, e, bias=False), "f32")
        changed = one_pass()
        walked = len(walks)
        assert walked and not torch.equal(changed[0], first[0])  # the new projection is read
        one_pass()
        assert len(walks) == walked
        run.lm = KernelLinear(torch.nn.Linear(e, 7, bias=False), "f32")  # set anew: no module registration
        assert one_pass()[2].shape == (t, 7) and len(walks) > walked


def test_a_head_gains_copy_hints_at_zero_weight_and_drafts_as_before(tmp_path):
    """`specula train --init-head H --copy-ngram N` starts from H's weights with the hint's at zero:
    its rows equal H's until it learns; a head that has hints of another length, and a Medusa head,
    are refused."""
    from specula.drafters.heads.file import HeadFile, save_head, target_record
    from specula.training.run import initial_head
    from specula.training.trainer import TrainConfig

    model = tiny_model("llama", "eager", seed=4)
    target = native(model)
    base = new_head("eagle3", target, torch.arange(0, 96, 2), seed=2)
    path = save_head(tmp_path / "h.safetensors", HeadFile(base.config, base.module.state_dict(), base.d2t,
                                                          target_record(target, "tiny")))
    grown = initial_head(path, target, "tiny", TrainConfig(kind="eagle3", copy_ngram=3))
    assert grown.config.copy_ngram == 3 and not grown.module.copy_proj.weight.any()
    for head in (base, grown):
        dec = build_decoder("eagle3", target, None, head=head, planner=False)
        out = dec.generate(PROMPT, SamplingParams(max_new_tokens=20, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, PROMPT, 20)
    states = [h.new_state() for h in (base, grown)]
    _, feats = target.new_sequence().prefill(PROMPT, logits="none", hidden=base.feature_request)
    for s in states:
        s.add_features(feats[:9])
    assert torch.allclose(states[0].begin(PROMPT), states[1].begin(PROMPT), atol=1e-6)
    hinted = save_head(tmp_path / "c.safetensors", HeadFile(grown.config, grown.module.state_dict(), grown.d2t,
                                                            target_record(target, "tiny")))
    with pytest.raises(ConfigError, match="was trained with copy_ngram=3, not 2: .*drop copy_ngram$"):
        initial_head(hinted, target, "tiny", TrainConfig(kind="eagle3", copy_ngram=2))
    with pytest.raises(ConfigError, match="eagle / eagle3"):
        new_head("medusa", target, torch.arange(96), copy_ngram=2)
    medusa = new_head("medusa", target, torch.arange(96))
    medusa_path = save_head(tmp_path / "m.safetensors", HeadFile(medusa.config, medusa.module.state_dict(), medusa.d2t,
                                                                 target_record(target, "tiny")))
    with pytest.raises(ConfigError, match="eagle / eagle3"):
        initial_head(medusa_path, target, "tiny", TrainConfig(kind="medusa", copy_ngram=2))


def test_a_head_file_of_before_the_copy_gain_loads_with_it_at_zero(tmp_path):
    """A copy-hint head saved before `EagleHead.copy_gain` existed loads with the gain at zero, which is
    what it computed; one that has the gain reads it back."""
    from specula.drafters.heads.file import HeadFile, save_head, target_record
    from specula.drafters.heads.runtime import load_head

    model = tiny_model("llama", "eager", seed=4)
    target = native(model)
    head = new_head("eagle3", target, torch.arange(0, 96, 2), seed=2, copy_ngram=2)
    with torch.no_grad():
        head.module.copy_proj.weight.normal_(0, 0.02)
    old = {k: v for k, v in head.module.state_dict().items() if k != "copy_gain"}
    path = save_head(tmp_path / "old.safetensors", HeadFile(head.config, old, head.d2t, target_record(target, "tiny")))
    loaded = load_head(path, target, "tiny", torch.float32)
    assert not loaded.module.copy_gain.any()
    assert torch.equal(loaded.module.copy_proj.weight, head.module.copy_proj.weight)
    with torch.no_grad():
        head.module.copy_gain.fill_(0.5)
    path = save_head(tmp_path / "new.safetensors", HeadFile(head.config, head.module.state_dict(), head.d2t,
                                                            target_record(target, "tiny")))
    assert torch.equal(load_head(path, target, "tiny", torch.float32).module.copy_gain, head.module.copy_gain)
