"""The hardware-aware planner: picks, each step, the tree that maximises expected tokens/s.

    cost model      target latency against tokens verified (measured once per model +
                    dtype + threads + context bucket, cached on disk, then corrected
                    online from observed verify times)
    calibration     raw drafter scores -> acceptance probabilities (learned online, per
                    source and score bin), times a per-source correction factor (accepted /
                    predicted nodes over recent steps, decaying with time) that removes the
                    optimism of picking the nodes with the highest estimates and follows the
                    text at hand (a source that copies well in summaries may not in answers)
    selection       N* = argmax_N E(N) / (T_draft + T_verify(N + 1)), N = 0 = plain step,
                    chosen unless a tree's rate beats it by `min_gain`
    back-off        when drafting steps realise fewer tokens/s than plain steps would
                    (measured, not predicted), skip drafting for 1, 2, 4, ... steps (probing
                    again after each pause), so drafting cannot make decoding much slower
                    than plain decoding
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from specula.drafters.base import DraftContext, Proposal, StepResult
from specula.models.prepack import linear_kernel_of
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
    """EMA weight of each drafting step's tokens/s (realised, or planned when it verified no
    tree) in the back-off signal."""
    max_backoff: int = 64
    """Longest run of plain steps before drafting is probed again."""
    backoff_tolerance: float = 0.02
    """Back off only when drafting steps are predicted this much slower than plain steps."""
    bias_decay: float = 0.95
    """Per-step decay (every step, drafted or not) of the accepted / predicted sums behind each
    source's correction factor: evidence fades with time, so a pessimistic factor returns towards 1
    and the source is tried again."""
    bias_prior: float = 2.0
    """Pseudo-nodes (accepted = predicted) each correction factor starts from."""
    min_gain: float = 0.1
    """Expected gain over a plain step (as a fraction of its tokens/s) a tree needs before it is
    verified. Estimates of the best-looking nodes stay optimistic on texts where drafts rarely
    hit (measured: predictions 6-14% above realized overall in the benches), so a tree predicted
    to win by less loses on average."""
    max_explore_gap: int = 64
    """Longest run of steps on which the planner finds no node worth verifying before it verifies
    the single best one anyway (1, 2, 4, ... steps apart), so its estimates keep learning."""


class CostModel:
    """A measured cost curve, corrected online by observed step times.

    Two corrections, both ratios observed / curve: one global `scale` (every observation; it
    rescales sizes never verified yet, e.g. when the whole machine is slower than at start-up)
    and one per pass size actually verified. The per-size one matters on CPUs, where the curve
    is bumpy (a 3-token pass can cost more than a 4-token one) and a short start-up measurement
    misses such bumps; it is the running mean of a size's first 1 / correction observations,
    then an EMA (sizes not observed yet use the global scale)."""

    def __init__(self, curve, correction: float = 0.1) -> None:
        self.curve = curve
        self.correction = correction
        self.scale = 1.0
        self._size_scale: dict[int, list[float]] = {}  # n_tokens -> [ratio, observations]

    def verify_seconds(self, n_tokens: int) -> float:
        """Predicted latency of one target pass over n tokens (root + n - 1 nodes)."""
        entry = self._size_scale.get(n_tokens)
        return (entry[0] if entry is not None else self.scale) * self.curve.latency(n_tokens)

    def observe(self, n_tokens: int, seconds: float) -> None:
        ratio = seconds / max(self.curve.latency(n_tokens), 1e-9)
        self.scale = (1 - self.correction) * self.scale + self.correction * ratio
        entry = self._size_scale.setdefault(n_tokens, [0.0, 0.0])
        entry[1] += 1.0  # the first observation has weight 1: the start value never counts
        weight = max(self.correction, 1.0 / entry[1])
        entry[0] = (1 - weight) * entry[0] + weight * ratio


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
        "linear_kernel": linear_kernel_of(target.model),
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
        self._recent: dict[str, list[float]] = {}  # per source, decayed sums: accepted, predicted nodes
        self._overhead: float | None = None  # EMA of the drafters' per-step observe time (seconds)
        self._explore_gap = 1
        self._explore_wait = 1
        self._rate: float | None = None
        self._skip = 0
        self._skipped = False  # this step is one of a back-off's plain steps (nothing to learn from it)
        self._backoff = 1
        self._planned_rate: float | None = None
        self.last_plan: dict = {}
        self._projected = [0, 0.0, 0.0, 0]  # steps, expected tokens, expected seconds, nodes chosen

    def reset(self) -> None:
        """Start a request: a back-off pause learned on the previous text ends (drafting may pay
        on this one; the first drafting step judges afresh). Estimates, bias and timings carry over."""
        self._skip, self._backoff, self._skipped, self._rate = 0, 1, False, None

    # ------------------------------------------------------------------ per step
    def should_draft(self, ctx: DraftContext) -> bool:
        self._skipped = self._skip > 0
        if self._skipped:
            self._skip -= 1
        return not self._skipped

    def bias_of(self, source: str) -> float:
        """Correction factor of one source: accepted / predicted nodes over recent steps."""
        accepted, predicted = self._recent.get(source, (0.0, 0.0))
        k = self.config.bias_prior
        return (accepted + k) / (predicted + k)

    @property
    def bias(self) -> dict[str, float]:
        """Every source's correction factor (for reports)."""
        return {source: round(self.bias_of(source), 4) for source in self._recent}

    def _edge_probs(self, tree, corrected: bool = True) -> list[float]:
        """Estimated P(node accepted | parent accepted): per-source calibration (times the source's
        correction factor, at most 1)."""
        edges = edge_scores(tree)
        probs = [self.calibrator.estimate(src, raw) for src, raw in zip(tree.sources, edges)]
        if corrected:
            probs = [min(1.0, self.bias_of(src) * p) for src, p in zip(tree.sources, probs)]
        return probs

    def raw_estimate(self, proposal: Proposal) -> list[float]:
        """Path probability of every node from the per-source calibration alone."""
        return path_probabilities(proposal.tree, self._edge_probs(proposal.tree, corrected=False))

    def estimate(self, proposal: Proposal) -> list[float]:
        """Calibrated path probability of every node (corrected per source)."""
        return path_probabilities(proposal.tree, self._edge_probs(proposal.tree))

    def _drafting_seconds(self, draft_seconds: float) -> float:
        """Seconds a drafting step costs besides verification: proposing plus the drafters'
        bookkeeping after the step (e.g. token recycling's matrix update), learned online."""
        return draft_seconds + (self._overhead or 0.0)

    def _best(self, proposal: Proposal, draft_seconds: float) -> tuple[list[int], int, float, float, list[float]]:
        """(best-first node order, N, expected tokens, rate, path probabilities) of the best
        ancestor-closed tree."""
        probs = self.estimate(proposal)
        order = proposal.tree.with_scores(probs).best_first_order()
        n, expected, rate = choose_size([probs[i] for i in order], self._drafting_seconds(draft_seconds),
                                        self.cost.verify_seconds, self.config.min_gain)
        return order, n, expected, rate, probs

    def _plain_rate(self, draft_seconds: float) -> float:
        """Expected tokens/s of a plain step that still paid `draft_seconds` of drafting."""
        return 1.0 / (self._drafting_seconds(draft_seconds) + self.cost.verify_seconds(1))

    def _one_node_can_pay(self, draft_seconds: float) -> bool:
        """Could a one-node tree beat a plain step at all, were its node always accepted? Not
        where a 2-token pass costs twice a 1-token one (e.g. a float32 GEMV -> GEMM jump on CPU):
        probing there only costs time."""
        spend = self._drafting_seconds(draft_seconds)
        return 2.0 / (spend + self.cost.verify_seconds(2)) > 1.0 / (spend + self.cost.verify_seconds(1))

    def proposal_rate(self, proposal: Proposal, draft_seconds: float) -> float:
        """Expected tokens/s of the best tree within `proposal` after `draft_seconds` of drafting."""
        if len(proposal.tree) == 0:
            return self._plain_rate(draft_seconds)
        return self._best(proposal, draft_seconds)[3]

    def plan(self, proposal: Proposal, ctx: DraftContext, draft_seconds: float) -> tuple[Proposal, float]:
        """Keep the best-N ancestor-closed nodes; returns (proposal, predicted accepted tokens)."""
        tree = proposal.tree
        if proposal.sibling_mode != "deterministic" and not tree.is_chain():
            # Sampled siblings must be verified as drawn: dropping some of them by score would
            # change the law the rule assumes (a chain may be cut: that is a stop rule).
            self._planned_rate = None
            return proposal, 1.0 + sum(self.estimate(proposal))
        if len(tree) == 0:
            # Drafters that ran and found nothing cost their time (judged by the back-off); a step
            # the back-off skipped says nothing about drafting's worth.
            self._planned_rate = None if self._skipped else self._plain_rate(draft_seconds)
            self._project(0, 1.0, draft_seconds)
            return proposal, 1.0
        order, n, expected, rate, probs = self._best(proposal, draft_seconds)
        explore = False
        if n == 0:
            # Nothing is worth verifying: after 1, 2, 4, ... such steps verify the best node anyway,
            # or estimates that turned pessimistic could never be corrected.
            self._explore_wait -= 1
            if self._explore_wait <= 0 and self._one_node_can_pay(draft_seconds):
                explore, n = True, 1
                expected = 1.0 + probs[order[0]]
                self._explore_gap = min(2 * self._explore_gap, self.config.max_explore_gap)
                self._explore_wait = self._explore_gap
        else:
            self._explore_gap = max(1, self._explore_gap // 2)
            self._explore_wait = min(self._explore_wait, self._explore_gap)
        chosen = order[:n]
        self.last_plan = {"candidates": len(tree), "chosen": n, "expected": expected, "rate": rate,
                          "bias": self.bias, "explore": explore}
        self._planned_rate = None if explore else rate  # a probe says nothing about drafting's worth
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
            bias = self.bias_of(source)
            probs, acc = [], 1.0
            for raw in raw_edges:
                acc *= min(1.0, bias * self.calibrator.estimate(source, raw))
                probs.append(acc)
            first = min(1.0, bias * self.calibrator.mean(source))
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
        d = self.config.bias_decay
        for sums in self._recent.values():  # evidence fades with time, drafted or not
            sums[0] *= d
            sums[1] *= d
        if self._skipped or (len(tree) == 0 and draft_seconds == 0.0):
            self._skipped = False
            return
        on_path = set(step.path)
        edges = edge_scores(tree)
        for i, par in enumerate(tree.parents):
            if par < 0 or par in on_path:  # a trial: the node's parent was accepted
                source = tree.sources[i]
                sums = self._recent.setdefault(source, [0.0, 0.0])
                sums[0] += i in on_path
                sums[1] += self.calibrator.estimate(source, edges[i])  # the factor divides calibration alone
                self.calibrator.update(source, edges[i], i in on_path)
        # Back-off: do drafting steps beat plain steps? A step that verified a tree is judged by
        # what it realised (tokens / its drafting + verify seconds), so a text on which every
        # estimate is wrong still stops drafting after a few losses; one that found nothing worth
        # verifying by its plan (plain step + drafting time). If drafting loses, pause it for
        # 1, 2, 4, ... steps, then probe again.
        if self._planned_rate is None:
            return
        rate, self._planned_rate = self._planned_rate, None
        if len(tree):
            rate = (1 + len(step.path)) / (self._drafting_seconds(draft_seconds) + verify_seconds)
        a = self.config.rate_ema
        self._rate = rate if self._rate is None else (1 - a) * self._rate + a * rate
        plain_rate = 1.0 / self.cost.verify_seconds(1)
        if self._rate < plain_rate * (1 - self.config.backoff_tolerance):
            self._skip = self._backoff
            self._backoff = min(2 * self._backoff, self.config.max_backoff)
        else:
            self._backoff = max(1, self._backoff // 2)
