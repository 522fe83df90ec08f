"""The hardware-aware planner: picks, each step, the tree that maximises expected tokens/s.

    cost model      target latency against tokens verified (measured once per model +
                    dtype + threads + context bucket, cached on disk, then corrected
                    online from observed verify times)
    calibration     raw drafter scores -> acceptance probabilities (learned online, per
                    source and score bin), times one global correction factor
                    (realized / predicted extra tokens over recent steps) that removes the
                    optimism of picking the nodes with the highest estimates
    selection       N* = argmax_N E(N) / (T_draft + T_verify(N + 1)), N = 0 = plain step
    back-off        when drafting steps realise fewer tokens/s than plain steps would,
                    skip drafting for 1, 2, 4, ... steps (probing again after each pause),
                    so drafting can never make decoding much slower than plain decoding
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from specula.drafters.base import DraftContext, Proposal, StepResult
from specula.planner.calibration import CalibrationConfig, Calibrator
from specula.planner.select import chain_should_extend, choose_size, edge_scores, path_probabilities


@dataclass(frozen=True)
class PlannerConfig:
    """Planner settings."""

    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    """Binning / smoothing of acceptance estimates."""
    cost_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Pass sizes measured for the cost curve."""
    cost_context: int = 256
    """Context length (tokens in the cache) at which the cost curve is measured."""
    cost_repeats: int = 2
    """Timed repeats per size at start-up."""
    cost_correction: float = 0.1
    """EMA weight of each observed verify time in the cost model's scale factor."""
    rate_ema: float = 0.2
    """EMA weight of each drafting step's realised tokens/s (back-off signal)."""
    max_backoff: int = 64
    """Longest run of plain steps before drafting is probed again."""
    backoff_tolerance: float = 0.02
    """Back off only when drafting steps are predicted this much slower than plain steps."""
    bias_decay: float = 0.97
    """Per-step decay of the realized / predicted sums behind the global bias correction."""
    bias_prior: float = 2.0
    """Pseudo-tokens (realized = predicted) the bias correction starts from."""
    max_explore_gap: int = 64
    """Longest run of steps on which the planner finds no node worth verifying before it verifies
    the single best one anyway (1, 2, 4, ... steps apart), so its estimates keep learning."""


class CostModel:
    """A measured cost curve, rescaled online by observed step times."""

    def __init__(self, curve, correction: float = 0.1) -> None:
        self.curve = curve
        self.correction = correction
        self.scale = 1.0

    def verify_seconds(self, n_tokens: int) -> float:
        """Predicted latency of one target pass over n tokens (root + n - 1 nodes)."""
        return self.scale * self.curve.latency(n_tokens)

    def observe(self, n_tokens: int, seconds: float) -> None:
        ratio = seconds / max(self.curve.latency(n_tokens), 1e-9)
        self.scale = (1 - self.correction) * self.scale + self.correction * ratio


def cost_cache_key(target, context: int) -> str:
    """Cost curves are cached per model + backend + dtype + threads + context bucket."""
    cfg = target.model.config
    parts = {
        "model": str(getattr(cfg, "_name_or_path", "")) or target.name,
        "arch": type(target.model).__name__,
        "layers": getattr(cfg, "num_hidden_layers", None),
        "hidden": getattr(cfg, "hidden_size", None),
        "backend": "hf",
        "dtype": str(target.dtype),
        "device": str(target.device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "context_bucket": context,
        "quantize": getattr(target, "quantization", "none"),
        "attention": getattr(cfg, "_attn_implementation", None),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def load_or_measure_curve(target, config: PlannerConfig, progress: bool = False):
    """The target's cost curve from the on-disk cache, or measured now (and cached)."""
    from specula.bench.profile import CostCurve, measure_cost_curve
    from specula.paths import atomic_write_json, cache_dir

    context = min(config.cost_context, target.max_context - max(config.cost_sizes) - 1)
    path = cache_dir("cost") / f"{cost_cache_key(target, context)}.json"
    if path.exists():
        try:
            return CostCurve.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            path.unlink(missing_ok=True)  # unreadable cache entry: measure again
    curve = measure_cost_curve(target, config.cost_sizes, context=context, repeats=config.cost_repeats)
    atomic_write_json(path, curve.to_dict())
    return curve


class HardwarePlanner:
    """Sizes every proposal to this hardware; learns acceptance and timing online."""

    def __init__(self, target=None, config: PlannerConfig = PlannerConfig(), curve=None) -> None:
        self.config = config
        if curve is None:
            if target is None:
                raise ValueError("HardwarePlanner needs a target backend or a measured cost curve")
            curve = load_or_measure_curve(target, config)
        self.cost = CostModel(curve, config.cost_correction)
        self.calibrator = Calibrator(config.calibration)
        self._bias = [config.bias_prior, config.bias_prior]  # decayed sums: realized, predicted extra tokens
        self._step_raw: float | None = None  # uncorrected predicted extra tokens of this step's tree
        self._overhead: float | None = None  # EMA of the drafters' per-step observe time (seconds)
        self._explore_gap = 1
        self._explore_wait = 1
        self._rate: float | None = None
        self._skip = 0
        self._backoff = 1
        self._planned_rate: float | None = None
        self.last_plan: dict = {}
        self._projected = [0, 0.0, 0.0, 0]  # steps, expected tokens, expected seconds, nodes chosen

    # ------------------------------------------------------------------ per step
    def should_draft(self, ctx: DraftContext) -> bool:
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    @property
    def bias(self) -> float:
        """Global correction factor: realized / predicted extra tokens over recent steps."""
        return self._bias[0] / self._bias[1]

    def raw_estimate(self, proposal: Proposal) -> list[float]:
        """Path probability of every node from the per-source calibration alone."""
        tree = proposal.tree
        edges = edge_scores(tree)
        probs = [self.calibrator.estimate(src, raw) for src, raw in zip(tree.sources, edges)]
        return path_probabilities(tree, probs)

    def _corrected(self, probs: list[float]) -> list[float]:
        """Probabilities from the per-source calibration times the global bias, at most 1."""
        bias = self.bias
        return [min(1.0, bias * p) for p in probs]

    def estimate(self, proposal: Proposal) -> list[float]:
        """Calibrated path probability of every node (bias-corrected, at most 1)."""
        return self._corrected(self.raw_estimate(proposal))

    def _drafting_seconds(self, draft_seconds: float) -> float:
        """Seconds a drafting step costs besides verification: proposing plus the drafters'
        bookkeeping after the step (e.g. token recycling's matrix update), learned online."""
        return draft_seconds + (self._overhead or 0.0)

    def _best(self, proposal: Proposal, draft_seconds: float) -> tuple[list[int], int, float, float, list[float]]:
        """(best-first node order, N, expected tokens, rate, uncorrected path probabilities) of the
        best ancestor-closed tree."""
        raw = self.raw_estimate(proposal)
        probs = self._corrected(raw)
        order = proposal.tree.with_scores(probs).best_first_order()
        n, expected, rate = choose_size([probs[i] for i in order], self._drafting_seconds(draft_seconds),
                                        self.cost.verify_seconds)
        return order, n, expected, rate, raw

    def _one_node_can_pay(self, draft_seconds: float) -> bool:
        """Could a one-node tree beat a plain step at all, were its node always accepted? Not
        where a 2-token pass costs twice a 1-token one (e.g. a float32 GEMV -> GEMM jump on CPU):
        probing there only costs time."""
        spend = self._drafting_seconds(draft_seconds)
        return 2.0 / (spend + self.cost.verify_seconds(2)) > 1.0 / (spend + self.cost.verify_seconds(1))

    def proposal_rate(self, proposal: Proposal, draft_seconds: float) -> float:
        """Expected tokens/s of the best tree within `proposal` after `draft_seconds` of drafting."""
        if len(proposal.tree) == 0:
            return 1.0 / (self._drafting_seconds(draft_seconds) + self.cost.verify_seconds(1))
        return self._best(proposal, draft_seconds)[3]

    def plan(self, proposal: Proposal, ctx: DraftContext, draft_seconds: float) -> tuple[Proposal, float]:
        """Keep the best-N ancestor-closed nodes; returns (proposal, predicted accepted tokens)."""
        tree = proposal.tree
        if proposal.sibling_mode != "deterministic" and not tree.is_chain():
            # Sampled siblings must be verified as drawn: dropping some of them by score would
            # change the law the rule assumes (a chain may be cut: that is a stop rule).
            self._planned_rate = None
            self._step_raw = sum(self.raw_estimate(proposal))
            return proposal, 1.0 + sum(self.estimate(proposal))
        if len(tree) == 0:
            self._planned_rate = 1.0 / (self._drafting_seconds(draft_seconds) + self.cost.verify_seconds(1))
            self._step_raw = None
            self._project(0, 1.0, draft_seconds)
            return proposal, 1.0
        order, n, expected, rate, raw = self._best(proposal, draft_seconds)
        explore = False
        if n == 0:
            # Nothing is worth verifying: after 1, 2, 4, ... such steps verify the best node anyway,
            # or estimates that turned pessimistic could never be corrected.
            self._explore_wait -= 1
            if self._explore_wait <= 0 and self._one_node_can_pay(draft_seconds):
                explore, n = True, 1
                expected = 1.0 + self._corrected([raw[order[0]]])[0]
                self._explore_gap = min(2 * self._explore_gap, self.config.max_explore_gap)
                self._explore_wait = self._explore_gap
        else:
            self._explore_gap = max(1, self._explore_gap // 2)
            self._explore_wait = min(self._explore_wait, self._explore_gap)
        chosen = order[:n]
        self.last_plan = {"candidates": len(tree), "chosen": n, "expected": expected, "rate": rate,
                          "bias": self.bias, "explore": explore}
        self._planned_rate = None if explore else rate  # a probe says nothing about drafting's worth
        self._step_raw = sum(raw[i] for i in chosen) if n else None
        self._project(n, expected, draft_seconds)
        return proposal.restrict(sorted(chosen)), expected

    def _project(self, nodes: int, expected: float, draft_seconds: float) -> None:
        p = self._projected
        p[0] += 1
        p[1] += expected
        p[2] += draft_seconds + self.cost.curve.latency(nodes + 1)  # on the curve as given (unscaled)
        p[3] += nodes

    def projection(self) -> dict:
        """What the planner expected on this cost curve, summed over planned steps: mean tree
        size, expected tokens per step and the projected speedup over plain decoding."""
        steps, tokens, seconds, nodes = self._projected
        if steps == 0:
            return {"steps": 0}
        plain_rate = 1.0 / self.cost.curve.latency(1)  # the same unscaled curve as the steps' seconds
        return {
            "steps": steps,
            "mean_tree_nodes": round(nodes / steps, 2),
            "expected_tokens_per_step": round(tokens / steps, 3),
            "projected_speedup": round((tokens / seconds) / plain_rate, 3),
            "cost_curve_ratio_8": round(self.cost.curve.ratio(8), 3),
        }

    def chain_stop_rule(self, source: str):
        """A stop rule for chain drafters (SpecDec++-style, thresholds derived from the cost model):
        rule(raw_edge_scores, draft_step_seconds, draft_seconds) -> True to stop drafting."""
        def rule(raw_edges: list[float], draft_step_seconds: float, draft_seconds: float,
                 baseline_rate: float | None = None) -> bool:
            raw_paths, acc = [], 1.0
            for raw in raw_edges:
                acc *= self.calibrator.estimate(source, raw)
                raw_paths.append(acc)
            *probs, first = self._corrected([*raw_paths, self.calibrator.mean(source)])
            return not chain_should_extend(probs, draft_step_seconds, draft_seconds, self.cost.verify_seconds,
                                           baseline_rate, first)
        return rule

    def observe(self, step: StepResult, draft_seconds: float, verify_seconds: float,
                overhead_seconds: float = 0.0) -> None:
        """After a step: drafting and verify seconds, and the drafters' own observe time."""
        o = self._overhead
        self._overhead = overhead_seconds if o is None else 0.8 * o + 0.2 * overhead_seconds
        tree = step.proposal.tree
        self.cost.observe(len(tree) + 1, verify_seconds)
        if len(tree) == 0 and draft_seconds == 0.0:
            return
        if self._step_raw is not None:  # global bias: realized vs uncorrected predicted extra tokens
            d = self.config.bias_decay
            self._bias[0] = d * self._bias[0] + len(step.path)
            self._bias[1] = d * self._bias[1] + self._step_raw
            self._step_raw = None
        on_path = set(step.path)
        edges = edge_scores(tree)
        for i, par in enumerate(tree.parents):
            if par < 0 or par in on_path:
                self.calibrator.update(tree.sources[i], edges[i], i in on_path)
        # Back-off: were drafting steps predicted (with calibrated estimates, draft time included)
        # to beat plain steps? If not, pause drafting for 1, 2, 4, ... steps, then probe again.
        if self._planned_rate is None:
            return
        a = self.config.rate_ema
        rate, self._planned_rate = self._planned_rate, None
        self._rate = rate if self._rate is None else (1 - a) * self._rate + a * rate
        plain_rate = 1.0 / self.cost.verify_seconds(1)
        if self._rate < plain_rate * (1 - self.config.backoff_tolerance):
            self._skip = self._backoff
            self._backoff = min(2 * self._backoff, self.config.max_backoff)
            self._rate = None  # the next probe is judged afresh
        else:
            self._backoff = max(1, self._backoff // 2)
