"""End to end through the engine at temperature > 0: the law of the first two emitted tokens equals
the target's exact law (8-token vocabulary, temperature 1.5) for every drafter and for fusion with
the planner, and planted engine bugs fail the same check.

Helpers: `laws.tv` / `laws.tv_bound` (bounds ~ 1/sqrt(trials); twice the expected TV of exact
samples here, 0.13 at 1500 trials on 64 cells).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from laws import exact_first_two, sample_first_two, tv, tv_bound
from tiny import perturbed_copy, tiny_model, word_tokenizer
from specula.api import build_decoder
from specula.models.hf import HFCausalLM
from specula.planner import CostCurve, HardwarePlanner
from specula.sampling import SamplingParams

V = 8
TEMP = 1.5
PROMPT = [3, 5, 1, 3, 5]  # a repeat: prompt lookup proposes from the first step
TRIALS = 1500
FLAT = CostCurve((1, 2, 4, 8, 16, 32, 64), (1e-3,) * 7, 64)  # verifying is free: the planner keeps what may pay


@pytest.fixture(autouse=True)
def steady_clock(monkeypatch):
    """Every `time.perf_counter()` read advances 0.1 ms: the planner's timing-driven choices (cost
    corrections, back-off) are the same on a quiet and on a busy machine, so the seeded trials,
    and the law check's outcome, do not depend on the load."""
    ticks = iter(range(10**12))
    monkeypatch.setattr("time.perf_counter", lambda: next(ticks) * 1e-4)


@pytest.fixture(scope="module")
def models():
    model = tiny_model("llama", seed=8, vocab=V)
    return model, perturbed_copy(model, 0.3)


@pytest.fixture(scope="module")
def exact(models):
    """P(first = a, second = b) of plain sampling: [V * V]."""
    return exact_first_two(models[0], PROMPT, TEMP)


@pytest.fixture(scope="module")
def datastore(tmp_path_factory):
    """A REST datastore over the 8 tokens (every bigram many times)."""
    from specula.datastore.build import BuildConfig, build_datastore

    tokenizer = word_tokenizer(V)
    root = tmp_path_factory.mktemp("laws")
    rng = np.random.default_rng(0)
    (root / "c.txt").write_text(" ".join(f"w{i}" for i in rng.integers(0, V, 4000)))
    return str(build_datastore(tokenizer, [root / "c.txt"], root / "laws.specds", BuildConfig(progress=False)).path)


def decoder(models, method: str, datastore: str | None = None):
    model, draft = models
    target = HFCausalLM(model, "target")
    options = {"datastore": datastore} if datastore else {}
    if method == "draft-model":
        options["greedy_proposals"] = False  # speculative sampling: chains drawn from q, seeded or not
    return build_decoder(method, target, None, HFCausalLM(draft, "draft") if method in ("fusion", "draft-model") else None,
                         planner=HardwarePlanner(curve=FLAT), **options)


def first_two(dec, trials: int = TRIALS) -> tuple[torch.Tensor, int]:
    """Codes first * V + second of `trials` seeded generations, and the draft tokens accepted."""
    return sample_first_two(dec, PROMPT, TEMP, V, trials)


@pytest.mark.parametrize("method", ["fusion", "prompt-lookup", "rest", "token-recycling", "draft-model"])
def test_sampled_output_follows_the_target_law(models, exact, datastore, method):
    dec = decoder(models, method, datastore if method in ("fusion", "rest") else None)
    codes, accepted = first_two(dec)
    assert accepted > TRIALS // 10, accepted  # drafts really were verified and accepted
    assert tv(codes, exact) < tv_bound(exact, TRIALS, c=2.0), method
    assert tv(codes, torch.roll(exact, 1)) > 3 * tv_bound(exact, TRIALS, c=2.0)  # the check has power


def test_planted_engine_bug_reusing_one_noise_for_every_position_is_detected(models, exact, monkeypatch):
    """Deterministic candidates are decided by one noise vector per output position; an engine that
    handed the same noise to every depth correlates consecutive tokens."""
    import specula.verify as verify

    real = verify.position_noise
    monkeypatch.setattr(verify, "position_noise", lambda seed, position, vocab: real(seed, 0, vocab))
    codes, accepted = first_two(decoder(models, "fusion"))
    assert accepted > 0
    assert tv(codes, exact) > tv_bound(exact, TRIALS, c=2.0)


def test_planted_engine_bug_misaligned_q_rows_is_detected(models, exact, monkeypatch):
    """A sampled draft-model chain whose first token is checked against the q row of the next
    position (rows off by one) breaks the law."""
    import specula.verify as verify

    real = verify.verify_rrs

    def misaligned(tree, p, q, generator, *, without_replacement):
        rows = [1 if len(tree) > 1 else 0, *range(1, len(tree) + 1)]  # the root's children read row 1
        return real(tree, p, q[rows], generator, without_replacement=without_replacement)

    monkeypatch.setattr(verify, "verify_rrs", misaligned)
    codes, accepted = first_two(decoder(models, "draft-model"))
    assert tv(codes, exact) > tv_bound(exact, TRIALS, c=2.0)


def test_deterministic_candidates_sample_what_plain_decoding_samples_with_the_same_seed(models, datastore):
    """The target's token at each position is decided by (seed, position) alone: fusion, prompt
    lookup, REST and token recycling return plain decoding's sample for the same seed."""
    plain = decoder(models, "none")
    for method in ("fusion", "prompt-lookup", "rest", "token-recycling"):
        dec = decoder(models, method, datastore if method in ("fusion", "rest") else None)
        accepted = 0
        for seed in range(40):
            params = SamplingParams(temperature=TEMP, max_new_tokens=12, seed=seed, ignore_eos=True)
            out = dec.generate(PROMPT, params)
            assert out.token_ids == plain.generate(PROMPT, params).token_ids, (method, seed)
            accepted += out.stats.accepted_tokens
        assert accepted > 0, method


def test_sampled_output_with_a_cut_draft_vocabulary_follows_the_target_law(models, exact):
    """A draft that scores 5 of the 8 tokens (`models.draft_vocab`, FR-Spec) samples from q with no
    mass on the other 3: the output law is still the target's, and drafts are accepted."""
    import copy

    from specula.models.draft_vocab import restrict_output

    model, draft = models
    cut = HFCausalLM(copy.deepcopy(draft), "draft")
    restrict_output(cut, torch.tensor([0, 2, 3, 5, 6]))
    dec = build_decoder("draft-model", HFCausalLM(model, "target"), None, cut, planner=HardwarePlanner(curve=FLAT),
                        greedy_proposals=False)
    codes, accepted = first_two(dec)
    assert accepted > TRIALS // 10, accepted
    assert tv(codes, exact) < tv_bound(exact, TRIALS, c=2.0)
