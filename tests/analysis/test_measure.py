"""Measured acceptance: the closed forms and the Monte Carlo estimate equal exact enumeration
and the real rules (`specula.verify`), every verifier stays below its bound, coarse-graining
keeps the masses, and `specula analyze acceptance` runs end to end on tiny models."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from laws import random_pair
from tiny import tiny_model
from specula.analysis.bounds import alpha_iid, alpha_without_replacement
from specula.analysis.measure import (
    AcceptanceConfig,
    coarse_grain,
    kseq_acceptance_curve,
    position_metrics,
    rrs_iid_acceptance,
    rrs_wor_acceptance,
    summarize,
)
from specula.errors import ConfigError
from specula.sampling import make_generator
from specula.tree import TokenTree
from specula.sampling import sample_iid, sample_without_replacement
from specula.verify import verify_rrs


def exact_rrs_wor_rejection(p: np.ndarray, q: np.ndarray, n: int) -> float:
    """P(all n drafts drawn without replacement are rejected by RRS), by enumerating the
    rejected tokens (small vocabularies)."""
    if n == 0 or not q.sum() > 0:
        return 1.0
    p, q = p / p.sum(), q / q.sum()
    total = 0.0
    residual = np.maximum(p - q, 0.0)
    nxt_p = residual / residual.sum() if residual.sum() > 0 else p
    for x in np.flatnonzero(q > 0):
        reject_x = q[x] - min(q[x], p[x])  # P(draw x and reject it)
        if reject_x > 0:
            q_next = q.copy()
            q_next[x] = 0.0
            total += reject_x * exact_rrs_wor_rejection(nxt_p, q_next, n - 1)
    return total


def test_rrs_with_replacement_closed_form_matches_the_rule():
    rng = np.random.default_rng(0)
    p, q = random_pair(rng, 6)
    n, trials = 3, 4000
    gen = make_generator(1)
    pt, qt = torch.tensor(p), torch.tensor(q)
    hits = 0
    for _ in range(trials):
        tree = TokenTree.build(sample_iid(qt, n, gen).tolist(), [-1] * n)
        hits += len(verify_rrs(tree, pt.expand(n + 1, -1), qt.expand(n + 1, -1), gen, without_replacement=False).path) > 0
    exact = rrs_iid_acceptance(p, q, n)[-1]
    assert abs(hits / trials - exact) < 4 * math.sqrt(exact * (1 - exact) / trials) + 1e-9


def test_rrs_without_replacement_estimate_matches_enumeration_and_the_rule():
    rng = np.random.default_rng(1)
    for _ in range(6):
        p, q = random_pair(rng, 6)
        mean, err = rrs_wor_acceptance(p, q, 4, np.random.default_rng(2), 400)
        exact = np.array([1 - exact_rrs_wor_rejection(p, q, n) for n in range(1, 5)])
        assert mean[0] == pytest.approx(exact[0], abs=1e-12)  # one draft: no sampling involved
        assert (np.abs(mean - exact) <= 4 * err + 1e-9).all(), (mean, exact, err)
    # And the enumeration is the rule itself: simulate verify_rrs on Gumbel-top-k siblings.
    p, q = random_pair(np.random.default_rng(3), 5)
    n, trials = 3, 4000
    gen = make_generator(4)
    pt, qt = torch.tensor(p), torch.tensor(q)
    hits = sum(
        len(verify_rrs(TokenTree.build(kids := sample_without_replacement(qt, n, gen).tolist(), [-1] * len(kids)),
                       pt.expand(len(kids) + 1, -1), qt.expand(len(kids) + 1, -1), gen, without_replacement=True).path) > 0
        for _ in range(trials)
    )
    exact = 1 - exact_rrs_wor_rejection(p, q, n)
    assert abs(hits / trials - exact) < 4 * math.sqrt(exact * (1 - exact) / trials) + 1e-9


def test_verifiers_stay_below_their_bounds():
    rng = np.random.default_rng(5)
    for _ in range(25):
        p, q = random_pair(rng, int(rng.integers(2, 9)))
        iid, wor = alpha_iid(p, q, 5), alpha_without_replacement(p, q, 5)
        assert (rrs_iid_acceptance(p, q, 5) <= iid + 1e-9).all()
        assert (kseq_acceptance_curve(p, q, 5) <= iid + 1e-9).all()
        exact_wor = np.array([1 - exact_rrs_wor_rejection(p, q, n) for n in range(1, 6)])
        assert (exact_wor <= wor + 1e-9).all()
        overlap = np.minimum(p, q).sum()  # n = 1: every rule reaches 1 - TV
        assert rrs_iid_acceptance(p, q, 1)[0] == pytest.approx(overlap) == kseq_acceptance_curve(p, q, 1)[0]


def test_coarse_grain_keeps_mass_and_merges_only_a_small_tail():
    rng = np.random.default_rng(6)
    p = rng.dirichlet(np.ones(2000) * 0.05)
    q = rng.dirichlet(np.ones(2000) * 0.05)
    pc, qc = coarse_grain(p, q, 1e-3)
    assert pc.sum() == pytest.approx(1.0) and qc.sum() == pytest.approx(1.0)
    assert len(pc) < 2000 and pc[-1] <= 1e-3 and qc[-1] <= 1e-3
    kept = np.sort(np.maximum(p, q))[::-1][: len(pc) - 1]  # the head holds the largest tokens
    np.testing.assert_allclose(np.sort(np.maximum(pc[:-1], qc[:-1]))[::-1], kept)
    full_p, full_q = coarse_grain(p, q, 0.0)
    assert len(full_p) == int(((p > 0) | (q > 0)).sum())


def test_summary_checks_and_position_metrics():
    rng = np.random.default_rng(7)
    config = AcceptanceConfig(temperatures=(0.7,), max_drafts=4, positions=3, trajectories=32)
    records = []
    for i in range(6):
        p, q = random_pair(rng, 7)
        metrics = position_metrics(p, q, 4, rng, 32)
        records.append({"temperature": 0.7, "category": "ab"[i % 2], "prompt": i, "kept_tokens": 7,
                        **{k: v.tolist() for k, v in metrics.items()}})
    doc = summarize(records, config)
    run = doc["runs"][0]
    assert run["positions"] == 6 and set(run["categories"]) == {"a", "b"}
    assert run["checks"]["without_replacement_bound_above_iid_bound"]
    assert all(v["positions_above_bound"] == 0 for v in run["checks"]["verifiers"].values())
    assert doc["config"]["max_drafts"] == 4
    with pytest.raises(ConfigError, match="^temperatures= must be finite and > 0"):  # its fields; the command: flags
        AcceptanceConfig(temperatures=(0.0,))
    with pytest.raises(ConfigError, match="finite"):  # refused before any model loads, not in the sampler
        AcceptanceConfig(temperatures=(float("inf"),))
    # counted twice, its error read as smaller
    with pytest.raises(ConfigError, match="^temperatures= lists a temperature twice"):
        AcceptanceConfig(temperatures=(1.0, 0.7, 1.0))
    with pytest.raises(ConfigError, match="^trajectories= must be >= 2"):  # one has no standard error: NaN
        AcceptanceConfig(trajectories=1)
    for keywords, message in (({"max_drafts": 0}, "^max_drafts must be between 1 and 16, got 0$"),
                              ({"positions": 0}, "^positions= must be >= 1, got 0$"),
                              ({"lump_mass": 0.5}, r"^lump_mass must be in \[0, 0.01\), got 0.5$")):
        with pytest.raises(ConfigError, match=message):  # its fields (was --drafts, ...: the command's flags)
            AcceptanceConfig(**keywords)


def test_rrs_checks_hold_where_the_draft_is_the_target():
    """p == q: both RRS verifiers accept for sure, equal at every n; the report's check says yes
    (a strict > read the tie as a failed check)."""
    from specula.analysis.plots import render_markdown

    rng = np.random.default_rng(0)
    config = AcceptanceConfig(max_drafts=4, trajectories=32)
    records = []
    for i in range(5):
        p = rng.dirichlet(np.ones(12))
        metrics = position_metrics(p, p.copy(), 4, rng, 32)
        records.append({"temperature": 1.0, "category": "c", "prompt": i, "kept_tokens": 12,
                        **{k: v.tolist() for k, v in metrics.items()}})
    doc = summarize(records, config)
    overall = doc["runs"][0]["overall"]
    assert overall["rrs_iid"] == pytest.approx([1.0] * 4) and overall["rrs_without_replacement"] == pytest.approx([1.0] * 4)
    assert doc["runs"][0]["checks"]["rrs_without_replacement_above_rrs_iid"]
    assert "RRS without replacement >= RRS with replacement for n >= 2: yes" in render_markdown(doc)


def test_analyze_acceptance_cli_end_to_end(tmp_path, tiny_tokenizer, capsys):
    from specula.cli import main

    dirs = []
    for name, seed in (("target", 3), ("draft", 4)):
        path = tmp_path / name
        tiny_model("llama", seed=seed).save_pretrained(path)
        tiny_tokenizer.save_pretrained(path)
        dirs.append(str(path))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "category": c, "turns": [f"w{3 + i} w{9 + i} w{17 + i}"]})
                                 for i, c in enumerate(["alpha", "beta"])) + "\n")
    out = tmp_path / "out"
    code = main(["analyze", "acceptance", "--target", dirs[0], "--draft", dirs[1], "--prompts", str(prompts),
                 "--drafts", "3", "--temperature", "0.8", "1.2", "--positions", "4", "--trajectories", "16",
                 "--out", str(out)])
    assert code == 0
    doc = json.loads((out / "results.json").read_text())
    assert [r["temperature"] for r in doc["runs"]] == [0.8, 1.2]
    for run in doc["runs"]:
        assert set(run["categories"]) == {"alpha", "beta"} and 2 <= run["positions"] <= 8
        assert len(run["overall"]["without_replacement"]) == 3
        assert all(v["positions_above_bound"] == 0 for v in run["checks"]["verifiers"].values())
    report = (out / "report.md").read_text()
    assert "## T = 0.8" in report and "RRS without replacement" in report
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["analyze", "acceptance", "--target", dirs[0], "--out", str(out)]) == 2
    assert "needs a draft model" in capsys.readouterr().err


def test_continuation_rows_are_the_teacher_forced_distributions():
    from specula.analysis.measure import continuation_rows
    from specula.models.hf import HFCausalLM
    from specula.sampling import SamplingParams, probabilities

    target, draft = tiny_model("qwen2", seed=3), tiny_model("qwen2", seed=4)
    prompt = [5, 17, 33, 2, 8]
    tokens, p, q = continuation_rows(HFCausalLM(target), HFCausalLM(draft), prompt, 0.9, 6, seed=1)
    assert 1 <= len(tokens) <= 6 and p.shape == q.shape == (len(tokens), 96)
    params = SamplingParams(temperature=0.9)
    with torch.inference_mode():
        for model, rows in ((target, p), (draft, q)):
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
            torch.testing.assert_close(rows, probabilities(logits, params), atol=1e-5, rtol=1e-4)


def test_the_greedy_bound_is_taken_before_merging_the_tail():
    """The merged tail token, ranked by its summed q, can push a token carrying half of p out of the
    greedy top n - 1: the coarse pair's greedy bound is then lower than the real one, so the
    greedy bound is computed on the pair before merging (the other bounds only rise)."""
    from specula.analysis.bounds import alpha_greedy

    p_tail, q_tail = np.full(1000, 1e-7), np.full(1000, 9.9e-8)  # 1e-4 and 9.9e-5 in all
    q_head = [0.5, 0.0, 2e-6] + [1.9e-6] * 5
    q_head[1] = 1 - sum(q_head) - q_tail.sum()
    p = np.concatenate([[0.5, 0.0, 0.4999] + [0.0] * 5, p_tail])
    q = np.concatenate([q_head, q_tail])
    pc, qc = coarse_grain(p, q, 1e-4)
    assert alpha_greedy(pc, qc, 5)[3] < alpha_greedy(p, q, 5)[3] - 0.3  # merged: far below the real bound
    metrics = position_metrics(pc, qc, 5, np.random.default_rng(0), 16, full=(p, q))
    np.testing.assert_allclose(metrics["greedy"], alpha_greedy(p, q, 5))
    assert (metrics["iid"] >= alpha_iid(p, q, 5) - 1e-9).all()
    assert (metrics["without_replacement"] >= alpha_without_replacement(p, q, 5) - 1e-9).all()


def test_rrs_without_replacement_is_not_flagged_above_its_bound_when_no_trajectory_saw_a_rare_branch():
    """p and q nearly disjoint: a rejected token rarer than 1 / trajectories is taken by all of them
    or by none, the spread is then ~0 while the mean is off; the check's slack includes 1 / M. A
    value truly above its bound is still flagged."""
    p = np.array([0.99965, 3.47e-4, 2.3e-9])
    q = np.array([1.57e-4, 1.64e-3, 0.99820])
    config = AcceptanceConfig(temperatures=(1.0,), max_drafts=2, trajectories=128)
    records = [{"temperature": 1.0, "category": "a", "prompt": seed, "kept_tokens": 3,
                **{k: v.round(6).tolist() for k, v in position_metrics(p, q, 2, np.random.default_rng(seed),
                                                                        128).items()}}
               for seed in range(20)]
    assert summarize(records, config)["runs"][0]["checks"]["verifiers"]["rrs_without_replacement"][
        "positions_above_bound"] == 0
    records[0]["rrs_without_replacement"] = [v + 0.05 for v in records[0]["without_replacement"]]
    assert summarize(records, config)["runs"][0]["checks"]["verifiers"]["rrs_without_replacement"][
        "positions_above_bound"] == 1


SCHEMA = {"type": "object", "properties": {"name": {"enum": ["ab", "cd"]}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def printable_tokenizer():
    """A byte-level tokenizer llguidance reads, over every printable ASCII character (the shipped
    structured prompts' text and schemas are written in them)."""
    import string

    from grammar_kit import JSON_MERGES, byte_level_tokenizer

    return byte_level_tokenizer(list(string.printable[:95]) + ["\n"], JSON_MERGES)


def _grammar_prefix(tokenizer, vocab: int, schema: dict, tokens: list[int]) -> list[torch.Tensor]:
    """The grammar's allowed-token mask before each of `tokens` (a fresh llguidance matcher fed them:
    every token must be allowed)."""
    from llguidance import LLMatcher

    from specula.constraints import Constraint, grammar_tokenizer
    from specula.constraints.matcher import unpack_bitmask

    matcher = LLMatcher(grammar_tokenizer(tokenizer, vocab, [tokenizer.eos_token_id]),
                        Constraint.json_schema(schema).grammar_text())
    masks = []
    for tok in tokens:
        masks.append(unpack_bitmask(matcher.compute_bitmask(), vocab))
        assert masks[-1][tok], (tok, tokens)  # sampled under the schema
        if tok != tokenizer.eos_token_id:
            assert matcher.consume_token(tok)
    return masks


def test_continuation_rows_under_a_schema_mask_p_and_leave_q(printable_tokenizer):
    """A structured prompt is analysed as the engine decodes it: the continuation follows the schema, p is
    the target's distribution masked by the grammar at each position (0 outside it), q the draft's own."""
    from specula.analysis.measure import continuation_rows
    from specula.constraints import Constraint
    from specula.models.hf import HFCausalLM
    from specula.sampling import SamplingParams, probabilities

    vocab = len(printable_tokenizer) + 3
    target, draft = tiny_model("llama", seed=3, vocab=vocab), tiny_model("llama", seed=4, vocab=vocab)
    prompt = printable_tokenizer.encode("Name and age as JSON:")
    tokens, p, q = continuation_rows(HFCausalLM(target), HFCausalLM(draft), prompt, 0.9, 8, seed=1,
                                     constraint=Constraint.json_schema(SCHEMA), tokenizer=printable_tokenizer)
    assert printable_tokenizer.decode(tokens).startswith('{"name": "')  # the schema's forced opening
    masks = _grammar_prefix(printable_tokenizer, vocab, SCHEMA, tokens)
    params = SamplingParams(temperature=0.9)
    with torch.inference_mode():
        t_logits = target(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        d_logits = draft(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    allowed = torch.stack(masks)  # [m, vocab]
    assert (p[~allowed] == 0).all() and (p.sum(-1) - 1).abs().max() < 1e-5
    torch.testing.assert_close(p, probabilities(t_logits.masked_fill(~allowed, float("-inf")), params),
                               atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(q, probabilities(d_logits, params), atol=1e-5, rtol=1e-4)  # unmasked
    assert (q[~allowed] > 0).any()


def test_analyze_acceptance_on_the_structured_prompts(tmp_path, printable_tokenizer, monkeypatch, capsys):
    """`analyze acceptance --prompts structured`: each prompt's continuation follows its schema (the
    records' tokens are a prefix its grammar accepts) and the report says p was masked."""
    import specula.api
    from specula.bench.datasets import load_prompts, select_prompts
    from specula.cli import main
    from specula.models.hf import HFCausalLM

    vocab = len(printable_tokenizer) + 3
    target = HFCausalLM(tiny_model("llama", seed=3, vocab=vocab), "target")
    draft = HFCausalLM(tiny_model("llama", seed=4, vocab=vocab), "draft")
    monkeypatch.setattr(specula.api, "load_backend", lambda *args, **kwargs: (target, printable_tokenizer))
    monkeypatch.setattr(specula.api, "load_draft", lambda *args, **kwargs: draft)
    out = tmp_path / "out"
    code = main(["analyze", "acceptance", "--target", "tiny", "--draft", "self", "--prompts", "structured",
                 "--per-category", "1", "--drafts", "2", "--positions", "5", "--trajectories", "4", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    prompts = {p.id: p for p in select_prompts(load_prompts("structured"), 1, None, 0)}
    assert doc["models"]["constrained_prompts"] == len(prompts) == 5
    records = doc["runs"][0]["records"]
    assert {r["prompt"] for r in records} == set(prompts)
    for pid, prompt in prompts.items():
        tokens = [r["token"] for r in sorted((r for r in records if r["prompt"] == pid), key=lambda r: r["position"])]
        assert printable_tokenizer.decode(tokens)[:1] in "{[", pid  # JSON, not the tiny model's free text
        _grammar_prefix(printable_tokenizer, vocab, prompt.schema, tokens)  # every token the schema allowed
    assert "carry a JSON schema" in (out / "report.md").read_text()


def test_analyze_help_lists_structured_among_the_prompt_sets(capsys):
    from specula.cli import main

    with pytest.raises(SystemExit):
        main(["analyze", "acceptance", "--help"])
    assert "spec-bench, everyday or structured" in " ".join(capsys.readouterr().out.split())
