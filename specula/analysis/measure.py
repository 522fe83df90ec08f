"""Measure multi-draft acceptance on real next-token distributions against the optimal bounds.

For each prompt the target writes its own continuation (sampled at the analysed temperature,
seeded); then target and draft are run teacher-forced over prompt + continuation, giving at
every continuation position the processed target distribution ``p`` and draft distribution
``q``. A prompt with a JSON schema (`--prompts structured`) is analysed as the engine decodes
structured output: the continuation is sampled under the schema, ``p`` is the target's
distribution masked by it (`GrammarState.masked`, the engine's masking) and ``q`` the draft's own,
unmasked. At each position and for n = 1..max_drafts drafts:

* bounds (`specula.analysis.bounds`): alpha* for i.i.d., without-replacement and greedy drafts;
* verifiers, the probability that one of the n drafts is accepted at that position:
  RRS with replacement (exact: the residual after j rejections does not depend on the
  rejected tokens, so P(all n rejected) = prod_j (1 - sum min(p_j, q))), SpecTr K-SEQ (exact:
  1 - (1 - beta)^n at the smallest feasible rho, `specula.verify.kseq_acceptance`) and RRS
  without replacement (Rao-Blackwellised Monte Carlo: trajectories of rejected tokens, each
  drawn from its law given rejection, (q_j - p_j)+; the product of the exact rejection
  probabilities along a trajectory is an unbiased estimate of P(all n rejected)).

Coarse-graining: the tokens outside the smallest top set (by max(p, q)) whose leftover mass is
at most `lump_mass` in both p and q are merged into one token. Every number is then exact (up
to Monte Carlo for RRS without replacement) for that coarse-grained pair, so each verifier
is compared with its bound on the same distributions; merging tokens can only raise the i.i.d.
and without-replacement alpha* (for i.i.d. drafts by at most about n * lump_mass; for drafts
without replacement no limit is known, and a built pair moved it by 0.29 at n = 5 with 1e-4 of
mass merged). The greedy bound is computed on the pair before merging: the merged token, ranked
by its summed q, could push a token carrying much of p out of the greedy top n - 1 and lower it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from specula.analysis.bounds import alpha_greedy, alpha_iid, alpha_without_replacement
from specula.errors import ConfigError

BOUNDS = ("iid", "without_replacement", "greedy")
"""Draft schemes whose optimal acceptance is computed."""
VERIFIERS = ("rrs_iid", "kseq", "rrs_without_replacement")
"""Verifiers whose acceptance is measured; their draft scheme is `VERIFIER_SCHEME`."""
VERIFIER_SCHEME = {"rrs_iid": "iid", "kseq": "iid", "rrs_without_replacement": "without_replacement"}


ACCEPTANCE_FLAGS = {"temperatures": "--temperature", "max_drafts": "--drafts"}
"""`AcceptanceConfig`'s fields whose `specula analyze acceptance` flag is not their name's (its other fields' flags
are: `--positions`, `--lump-mass`, `--trajectories`)."""


@dataclass(frozen=True)
class AcceptanceConfig:
    """Settings of `specula analyze acceptance`. Its errors name its fields (`max_drafts`); the command shows its
    flags (`--drafts`: `ACCEPTANCE_FLAGS`)."""

    temperatures: tuple[float, ...] = (1.0,)
    """Sampling temperatures analysed (each > 0); one continuation per prompt and temperature."""
    max_drafts: int = 8
    """Numbers of drafts n = 1..max_drafts."""
    positions: int = 24
    """Continuation tokens per prompt (teacher-forced positions analysed)."""
    seed: int = 0
    """Seed of the continuations and of the Monte Carlo estimates."""
    lump_mass: float = 1e-4
    """Most mass (of p and of q) merged into one tail token per position."""
    trajectories: int = 128
    """Monte Carlo trajectories per position for RRS without replacement."""

    def __post_init__(self) -> None:
        if not self.temperatures or any(not (t > 0 and math.isfinite(t)) for t in self.temperatures):
            raise ConfigError(f"temperatures= must be finite and > 0 (acceptance of sampling), got "
                              f"{list(self.temperatures)}")
        if len(set(self.temperatures)) != len(self.temperatures):  # each would be measured, then counted, twice
            raise ConfigError(f"temperatures= lists a temperature twice ({list(self.temperatures)}); give each once")
        if not 1 <= self.max_drafts <= 16:
            raise ConfigError(f"max_drafts must be between 1 and 16, got {self.max_drafts}")
        if self.positions < 1:
            raise ConfigError(f"positions= must be >= 1, got {self.positions}")
        if not 0 <= self.lump_mass < 0.01:
            raise ConfigError(f"lump_mass must be in [0, 0.01), got {self.lump_mass}")
        if self.trajectories < 2:  # one trajectory has no standard error (the bound check's slack)
            raise ConfigError(f"trajectories= must be >= 2, got {self.trajectories}")


# ---------------------------------------------------------------------------- per position (numpy)
def coarse_grain(p: np.ndarray, q: np.ndarray, lump_mass: float) -> tuple[np.ndarray, np.ndarray]:
    """(p', q') over the kept tokens plus one merged tail token (omitted when empty): the
    smallest top set by max(p, q) whose leftover p and q masses are both <= lump_mass."""
    p = np.asarray(p, dtype=np.float64) / np.sum(p)
    q = np.asarray(q, dtype=np.float64) / np.sum(q)
    order = np.argsort(-np.maximum(p, q), kind="stable")
    p_tail = np.concatenate([np.cumsum(p[order][::-1])[::-1], [0.0]])  # mass from rank k on
    q_tail = np.concatenate([np.cumsum(q[order][::-1])[::-1], [0.0]])
    keep = int(np.argmax((p_tail <= lump_mass) & (q_tail <= lump_mass)))
    head, tail = order[:keep], order[keep:]
    if len(tail) == 0 or (p[tail].sum() == 0 and q[tail].sum() == 0):
        return p[head], q[head]
    return np.append(p[head], p[tail].sum()), np.append(q[head], q[tail].sum())


def rrs_iid_acceptance(p: np.ndarray, q: np.ndarray, n_max: int) -> np.ndarray:
    """P(one of n i.i.d. drafts is accepted by RRS), n = 1..n_max: ``[n_max]`` (exact)."""
    pj = p / p.sum()
    q = q / q.sum()
    reject = np.empty(n_max)
    left = 1.0
    for j in range(n_max):
        accept = np.minimum(pj, q).sum()
        left *= max(0.0, 1.0 - accept)
        reject[j] = left
        residual = np.maximum(pj - q, 0.0)
        if not residual.sum() > 0:
            reject[j:] = 0.0 if accept >= 1 - 1e-12 else reject[j]
            break
        pj = residual / residual.sum()
    return 1.0 - reject


def rrs_wor_acceptance(p: np.ndarray, q: np.ndarray, n_max: int, rng: np.random.Generator,
                       trajectories: int) -> tuple[np.ndarray, np.ndarray]:
    """P(one of n drafts without replacement is accepted by RRS), n = 1..n_max, by
    Rao-Blackwellised Monte Carlo: (mean ``[n_max]``, standard error ``[n_max]``). n = 1 is exact.

    Each step's rejected tokens are drawn with uniforms stratified across the trajectories (a
    Latin hypercube over the steps: every trajectory still follows the exact law, so the mean
    is unbiased, but rare rejected tokens are neither missed nor over-drawn by chance). The
    standard error is the trajectories' spread (see the end of the function): where a rejected
    token is less likely than 1/M every trajectory may take the same branch, the spread is then
    near 0 while the mean is off by up to about 1/M, so `summarize` adds 1/M to its slack."""
    m = trajectories
    pj = np.tile(p / p.sum(), (m, 1))  # [M, V]
    qj = np.tile(q / q.sum(), (m, 1))  # [M, V]
    weight = np.ones(m)  # P(all drafts so far rejected | trajectory)
    reject = np.empty((n_max, m))
    rows = np.arange(m)
    for j in range(n_max):
        q_mass = qj.sum(1)  # [M]; 0 once q's support is exhausted (no further draft)
        accept = np.where(q_mass > 0, np.minimum(pj, qj).sum(1), 0.0)
        weight = weight * np.clip(1.0 - accept, 0.0, 1.0)
        reject[j] = weight
        if j + 1 == n_max:
            break
        over = np.maximum(qj - pj, 0.0)  # law of a rejected draft (unnormalised)
        over_mass = over.sum(1)
        live = (over_mass > 0) & (weight > 0)
        if not live.any():
            reject[j + 1 :] = reject[j]  # no further change possible
            break
        cdf = np.cumsum(over[live], axis=1)
        strata = (rng.permutation(m) + rng.random(m)) / m  # Latin hypercube: one uniform per stratum
        u = strata[live] * cdf[:, -1]
        x = np.minimum((cdf < u[:, None]).sum(1), pj.shape[1] - 1)  # rejected token per live trajectory
        residual = np.maximum(pj - qj, 0.0)
        res_mass = residual.sum(1, keepdims=True)
        pj = np.where(res_mass > 0, residual / np.where(res_mass > 0, res_mass, 1.0), pj)
        qj[rows[live], x] = 0.0
        q_mass = qj.sum(1, keepdims=True)
        qj = np.where(q_mass > 0, qj / np.where(q_mass > 0, q_mass, 1.0), qj)
    # Owen (1997): Latin hypercube sampling never has more than M/(M-1) times the variance of
    # i.i.d. sampling; this is the i.i.d. formula so scaled, over the spread seen (which can miss
    # a branch no trajectory took: the docstring).
    stderr = reject.std(1, ddof=1) * math.sqrt(m / (m - 1)) / math.sqrt(m) if m > 1 else np.full(n_max, np.nan)
    return 1.0 - reject.mean(1), stderr


def kseq_acceptance_curve(p: np.ndarray, q: np.ndarray, n_max: int) -> np.ndarray:
    """P(one of n i.i.d. drafts is accepted by SpecTr K-SEQ), n = 1..n_max: ``[n_max]`` (exact)."""
    from specula.verify import kseq_acceptance

    pt, qt = torch.from_numpy(np.asarray(p, dtype=np.float64)), torch.from_numpy(np.asarray(q, dtype=np.float64))
    return np.array([kseq_acceptance(pt, qt, n) for n in range(1, n_max + 1)])


def position_metrics(p: np.ndarray, q: np.ndarray, n_max: int, rng: np.random.Generator,
                     trajectories: int, full: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Every bound and verifier for one position's (coarse-grained) p, q: name -> ``[n_max]``.
    `full`: the pair before coarse-graining, on which the greedy bound is computed (see the
    module docstring); None: p, q themselves."""
    wor, wor_err = rrs_wor_acceptance(p, q, n_max, rng, trajectories)
    return {
        "iid": alpha_iid(p, q, n_max),
        "without_replacement": alpha_without_replacement(p, q, n_max),
        "greedy": alpha_greedy(*(full if full is not None else (p, q)), n_max),
        "rrs_iid": rrs_iid_acceptance(p, q, n_max),
        "kseq": kseq_acceptance_curve(p, q, n_max),
        "rrs_without_replacement": wor,
        "rrs_without_replacement_stderr": wor_err,
    }


# ---------------------------------------------------------------------------- models
@torch.inference_mode()
def continuation_rows(target, draft, prompt_ids: Sequence[int], temperature: float, positions: int,
                      seed: int, constraint=None, tokenizer=None) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The target's own sampled continuation (up to `positions` tokens; drawn with draft-model
    speculative sampling, which is lossless: an exact sample of the target, only faster) and,
    teacher-forced over it, the processed target and draft distributions predicting each
    continuation token: (tokens, p [m, vocab], q [m, vocab]) with m = len(tokens).

    `constraint` (a `specula.constraints.Constraint`, with the target's `tokenizer`): the continuation
    is sampled under it and each row of p is masked by the grammar state after the tokens before it,
    as the engine masks the target for structured output; q stays the draft's own, unmasked."""
    from specula.drafters.draft_model import DraftModelDrafter
    from specula.engine import SpeculativeDecoder
    from specula.sampling import SamplingParams, probabilities

    params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=positions)
    sampler = SpeculativeDecoder(target, DraftModelDrafter(draft), tokenizer, eos_token_ids=None)
    cont = sampler.generate(prompt_ids, params, constraint).token_ids
    ids = list(prompt_ids) + cont
    start = len(prompt_ids) - 1  # row predicting cont[0]
    rows = []
    for model in (target, draft):
        seq = model.new_sequence()
        seq.prefill(ids[:start], logits="none")
        logits = seq.prefill(ids[start:-1], logits="all")  # [m, vocab]
        seq.release()
        if model is target and constraint is not None:
            logits = masked_rows(constraint, tokenizer, target.vocab_size, sampler.eos_token_ids, cont, logits)
        rows.append(probabilities(logits, params))
    vocab = min(rows[0].shape[-1], rows[1].shape[-1])
    if rows[1][:, vocab:].sum() > 0 or rows[0][:, vocab:].sum() > 0:
        raise ConfigError("target and draft put probability on different vocabularies; use a draft with the target's tokenizer")
    return cont, rows[0][:, :vocab], rows[1][:, :vocab]


def masked_rows(constraint, tokenizer, vocab: int, eos_token_ids, tokens: Sequence[int],
                logits: torch.Tensor) -> torch.Tensor:
    """logits [m, vocab] predicting each of `tokens` (teacher-forced), each row masked by `constraint`'s
    grammar after the tokens before it (forbidden tokens at -inf): the engine's constrained law, through
    its own `GrammarState.masked` over the chain of `tokens`."""
    from specula.constraints import GrammarState
    from specula.tree import TokenTree

    state = GrammarState(constraint, tokenizer, vocab, sorted(eos_token_ids))
    return state.masked(logits, TokenTree.chain(list(tokens[:-1]))).full()


def measure(target, draft, tokenizer, prompts, config: AcceptanceConfig,
            progress: Callable[[str], None] = lambda _: None) -> dict:
    """Analyse every prompt (`specula.bench.datasets.BenchPrompt`, first turn; one with a `schema`
    under its constraint, `continuation_rows`) at every temperature; returns the results document
    (see `summarize`)."""
    from specula.prompts import encode_prompt

    rng = np.random.default_rng(config.seed)
    records: list[dict] = []
    for temperature in config.temperatures:
        for i, prompt in enumerate(prompts):
            ids = encode_prompt(tokenizer, prompt.turns[0])
            tokens, p_rows, q_rows = continuation_rows(target, draft, ids, temperature, config.positions,
                                                       config.seed + i, prompt.constraint, tokenizer)
            for pos in range(len(tokens)):
                full = p_rows[pos].double().numpy(), q_rows[pos].double().numpy()
                p, q = coarse_grain(*full, config.lump_mass)
                metrics = position_metrics(p, q, config.max_drafts, rng, config.trajectories, full)
                records.append({"temperature": temperature, "category": prompt.category, "prompt": prompt.id,
                                "position": pos, "token": int(tokens[pos]), "kept_tokens": len(p),
                                **{k: v.round(6).tolist() for k, v in metrics.items()}})
            progress(f"T={temperature:g} prompt {i + 1}/{len(prompts)} ({prompt.category}): {len(tokens)} positions")
    return summarize(records, config)


def _mean(rows: list[dict], key: str) -> list[float]:
    return np.mean([r[key] for r in rows], axis=0).round(5).tolist()


def summarize(records: list[dict], config: AcceptanceConfig) -> dict:
    """Means per temperature (overall and per category), the per-position records, and the
    checks: does drafting without replacement beat drafting with replacement, and does every
    verifier stay below its bound (per position; RRS without replacement within 4 Monte Carlo
    standard errors plus 1 / trajectories, `rrs_wor_acceptance`)."""
    runs = []
    for temperature in config.temperatures:
        rows = [r for r in records if r["temperature"] == temperature]
        if not rows:
            continue
        above = {}
        for name in VERIFIERS:
            bound = np.array([r[VERIFIER_SCHEME[name]] for r in rows])
            value = np.array([r[name] for r in rows])
            slack = (4 * np.array([r["rrs_without_replacement_stderr"] for r in rows]) + 1 / config.trajectories
                     if name == "rrs_without_replacement" else 0.0)
            excess = value - bound - slack
            above[name] = {"positions_above_bound": int((excess > 1e-9).any(axis=1).sum()),
                           "max_excess": round(float(np.max(value - bound)), 6)}
        overall = {k: _mean(rows, k) for k in (*BOUNDS, *VERIFIERS)}
        overall["rrs_without_replacement_stderr"] = (
            np.sqrt(np.sum(np.square([r["rrs_without_replacement_stderr"] for r in rows]), axis=0)) / len(rows)
        ).round(6).tolist()
        categories = {}
        for cat in dict.fromkeys(r["category"] for r in rows):
            sub = [r for r in rows if r["category"] == cat]
            categories[cat] = {"positions": len(sub), **{k: _mean(sub, k) for k in (*BOUNDS, *VERIFIERS)}}
        runs.append({
            "temperature": temperature,
            "positions": len(rows),
            "prompts": len({(r["category"], r["prompt"]) for r in rows}),
            "mean_kept_tokens": round(float(np.mean([r["kept_tokens"] for r in rows])), 1),
            "overall": overall,
            "categories": categories,
            "records": [{k: v for k, v in r.items() if k != "temperature"} for r in rows],
            "checks": {
                "without_replacement_bound_above_iid_bound": bool(
                    np.all(np.array(overall["without_replacement"]) >= np.array(overall["iid"]) - 1e-9)),
                "rrs_without_replacement_above_rrs_iid": bool(
                    # >=: the two are equal where the draft is the target or a position is certain
                    np.all(np.array(overall["rrs_without_replacement"])[1:]
                           >= np.array(overall["rrs_iid"])[1:] - 1e-9)),
                "verifiers": above,
            },
        })
    return {"config": asdict(config), "runs": runs}
