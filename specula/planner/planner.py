"""The hardware-aware planner: merges the drafters' trees and keeps, each step, the tree that
maximises expected tokens/s.

    cost model      target latency against tokens verified (measured once per backend
                    `cost_key()` + context bucket, cached on disk, then corrected online from
                    observed verify times; `specula.planner.cost`)
    merge           trie union of the candidate trees, retrieval branches pruned with the
                    draft model's probabilities (RASD; `specula.planner.merge`)
    calibration     raw edge scores -> acceptance probabilities (learned online, per source
                    and score bin), times a per-source correction factor (accepted /
                    predicted nodes over recent steps, decaying with time) that removes the
                    optimism of picking the nodes with the highest estimates and follows the
                    text at hand (a source that copies well in summaries may not in answers)
    selection       N* = argmax_N E(N) / (T_draft + T_verify(N + 1)), N = 0 = plain step,
                    chosen unless a tree's rate beats it by `min_gain`
    back-off        when drafting steps realise fewer tokens/s than plain steps would
                    (measured, not predicted), skip drafting for 1, 2, 4, ... steps (probing
                    again after each pause), so drafting cannot make decoding much slower
                    than plain decoding

What requests share (cost model, calibration, correction factors, the drafters' observe-time
estimate) lives in `HardwarePlanner`; what belongs to one request (back-off, exploration
pace, projection) in a `PlannerState` the engine keeps in the request's session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

from specula.ema import Ema
from specula.models.base import BatchedTargetModel, TargetModel
from specula.planner.batch_cost import DEFAULT_BATCH_SIZES, BatchCostCurve, load_or_measure_batch_curve
from specula.planner.calibration import CalibrationConfig, Calibrator
from specula.planner.cost import DEFAULT_SIZES, CostCurve, CostModel, load_or_measure_curve
from specula.planner.merge import merge_proposals
from specula.planner.select import chain_lookahead, choose_batch, choose_size, path_probabilities
from specula.step import DraftBudget, Proposal, StepResult
from specula.tree import TokenTree


@dataclass(frozen=True)
class PlannerConfig:
    """Planner settings."""

    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    """Binning / smoothing of acceptance estimates."""
    cost_sizes: tuple[int, ...] = DEFAULT_SIZES
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
    overhead_ema: float = 0.2
    """EMA weight of each step's drafter bookkeeping time (observe) in the drafting cost."""
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
    rasd_min_prob: float = 0.02
    """Draft probability below which a retrieval branch leaving the draft model's tree is pruned."""
    explore_prior: float = 0.8
    """Acceptance a chain drafter is assumed to have before the target has judged its tokens (with
    `calibration.prior_strength` pseudo-trials): optimistic, so a drafter with no data is tried,
    and its real acceptance and cost are learned within a few steps."""
    load_probe_every: int = 8
    """Under load, after two batch steps on which the goodput plan gave a request no node, that
    request skips drafting except on every this-many-th step (a probe: does it pay again?)."""


@dataclass
class PlannerState:
    """One request's planning state (kept in the engine's session)."""

    skip: int = 0
    """Plain steps left in the current back-off pause."""
    backoff: int = 1
    """Length of the next back-off pause."""
    skipped: bool = False
    """This step is one of a back-off's plain steps (nothing to learn from it)."""
    rate: Ema | None = None
    """Tokens/s of recent drafting steps (realised, or planned when nothing was verified)."""
    planned_rate: float | None = None
    """The plan's rate for the step in flight (None: a probe or a pause, which judge nothing)."""
    explore_gap: int = 1
    explore_wait: int = 1
    off_by_load: int = 0
    """Steps on which this request had a tree worth verifying alone but the batch's goodput plan
    gave it no node (speculation switched off by load)."""
    load_idle: int = 0
    """Consecutive batch steps on which the goodput plan gave this request no node."""
    projected: list[float] = field(default_factory=lambda: [0, 0.0, 0.0, 0])
    """Steps, expected tokens, expected seconds (on the unscaled curve), nodes chosen."""
    last_plan: dict = field(default_factory=dict)


class PlannerView:
    """The planner's read-only `specula.step.CostView` for one drafter in one step."""

    def __init__(self, planner: "HardwarePlanner", proposals: Sequence[Proposal], draft_seconds: float) -> None:
        self._planner = planner
        self._proposals = list(proposals)
        self._draft_seconds = draft_seconds

    def verify_seconds(self, n_tokens: int) -> float:
        return self._planner.cost.verify_seconds(n_tokens)

    @cached_property
    def baseline_rate(self) -> float:
        return self._planner.proposal_rate(merge_proposals(self._proposals), self._draft_seconds)

    def _edge_probs(self, source: str, edge_scores: Sequence[float]) -> list[float]:
        planner = self._planner
        bias = planner.bias_of(source)
        probs, acc = [], 1.0
        for raw in edge_scores:
            acc *= min(1.0, bias * planner.calibrator.estimate(source, raw))
            probs.append(acc)
        return probs

    def plan_chain(self, source: str, edge_scores: Sequence[float], seconds_per_token: float, spent_seconds: float,
                   max_more: int, one_time_seconds: float = 0.0, remaining_tokens: int = 1) -> int:
        planner = self._planner
        path = self._edge_probs(source, edge_scores)
        alpha = planner.expected_acceptance(source)
        if not path and one_time_seconds > 0:  # a one-time cost, spread over the request's future steps
            chain_tokens = sum(alpha ** i for i in range(max_more + 1))
            one_time_seconds /= max(1.0, remaining_tokens / chain_tokens)
        more, rate, _ = chain_lookahead(path, alpha, max_more, seconds_per_token, spent_seconds, self.verify_seconds,
                                        one_time_seconds if not path else 0.0)
        bar = self.baseline_rate * ((1.0 + planner.config.min_gain) if not path else 1.0)
        return more if more > 0 and rate >= bar else 0


class HardwarePlanner:
    """Merges and sizes every proposal to this hardware; learns acceptance and timing online."""

    def __init__(self, target: TargetModel | None = None, config: PlannerConfig = PlannerConfig(),
                 curve: CostCurve | None = None, batch_curve: BatchCostCurve | None = None) -> None:
        self.config = config
        self._target = target
        self.batch_curve = batch_curve
        """Latency of packed passes over several sequences (None until a batch needs it; see
        `prepare_batch`)."""
        self.batch_scale = 1.0  # observed / predicted packed-pass seconds (EMA)
        if curve is None:
            if target is None:
                raise ValueError("HardwarePlanner needs a target backend or a measured cost curve")
            curve = load_or_measure_curve(target, config.cost_sizes, config.cost_context, config.cost_repeats)
        self.cost = CostModel(curve, config.cost_correction)
        self.calibrator = Calibrator(config.calibration)
        self._recent: dict[str, list[float]] = {}  # per source, decayed sums: accepted, predicted nodes
        self._overhead = Ema(config.overhead_ema)  # the drafters' per-step observe time (seconds)

    # ------------------------------------------------------------------ per request
    def new_state(self) -> PlannerState:
        """A request's state: no back-off pause carried over (drafting may pay on this text; the
        first drafting step judges afresh). Estimates, bias and timings are shared."""
        return PlannerState()

    def should_draft(self, state: PlannerState, batch_size: int = 1) -> bool:
        """Whether this request drafts this step: not during its back-off pause, nor while it shares
        a batch at a load where its drafts have stopped paying (except on probe steps)."""
        if batch_size == 1:
            state.load_idle = 0
        elif state.load_idle >= 2 and state.load_idle % self.config.load_probe_every:
            state.load_idle += 1  # no drafts, no node: still idle
            return False
        state.skipped = state.skip > 0
        if state.skipped:
            state.skip -= 1
        return not state.skipped

    def view(self, proposals: Sequence[Proposal], draft_seconds: float) -> PlannerView:
        """The cost view for the next drafter of a step, after `proposals` cost `draft_seconds`."""
        return PlannerView(self, proposals, draft_seconds)

    # ------------------------------------------------------------------ estimates
    def expected_acceptance(self, source: str) -> float:
        """P(next chain token of `source` accepted | the previous one was): its calibrated mean acceptance
        (optimistic `explore_prior` until it has data), times its correction factor."""
        return min(1.0, self.bias_of(source) * self.calibrator.mean(source, self.config.explore_prior))

    def bias_of(self, source: str) -> float:
        """Correction factor of one source: accepted / predicted nodes over recent steps."""
        accepted, predicted = self._recent.get(source, (0.0, 0.0))
        k = self.config.bias_prior
        return (accepted + k) / (predicted + k)

    @property
    def bias(self) -> dict[str, float]:
        """Every source's correction factor (for reports)."""
        return {source: round(self.bias_of(source), 4) for source in self._recent}

    def _edge_probs(self, tree: TokenTree, corrected: bool = True) -> list[float]:
        """Estimated P(node accepted | parent accepted): per-source calibration (times the source's
        correction factor, at most 1)."""
        probs = [self.calibrator.estimate(src, raw) for src, raw in zip(tree.sources, tree.edge_scores)]
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
        return draft_seconds + self._overhead.get()

    def _best(self, proposal: Proposal, draft_seconds: float) -> tuple[list[int], int, float, float, list[float]]:
        """(best-first node order, N, expected tokens, rate, path probabilities) of the best
        ancestor-closed tree."""
        probs = self.estimate(proposal)
        order = proposal.tree.best_first_order(probs)
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

    # ------------------------------------------------------------------ per step
    def plan(self, proposals: Sequence[Proposal], budget: DraftBudget, state: PlannerState,
             draft_seconds: float) -> tuple[Proposal, float]:
        """Merge the step's proposals and keep the best-N ancestor-closed nodes within `budget`;
        returns (proposal, predicted accepted tokens incl. bonus)."""
        proposal = merge_proposals(proposals, self.config.rasd_min_prob).limit(budget)
        tree = proposal.tree
        if proposal.sampled and not tree.is_chain():
            # Sampled siblings must be verified as drawn: dropping some of them by score would
            # change the law the rule assumes (a chain may be cut: that is a stop rule).
            state.planned_rate = None
            return proposal, 1.0 + sum(self.estimate(proposal))
        if len(tree) == 0:
            # Drafters that ran and found nothing cost their time (judged by the back-off); a step
            # the back-off skipped says nothing about drafting's worth.
            state.planned_rate = None if state.skipped else self._plain_rate(draft_seconds)
            self._project(state, 0, 1.0, draft_seconds)
            return proposal, 1.0
        order, n, expected, rate, probs = self._best(proposal, draft_seconds)
        explore = False
        if n == 0:
            # Nothing is worth verifying: after 1, 2, 4, ... such steps verify the best node anyway,
            # or estimates that turned pessimistic could never be corrected.
            state.explore_wait -= 1
            if state.explore_wait <= 0 and self._one_node_can_pay(draft_seconds):
                explore, n = True, 1
                expected = 1.0 + probs[order[0]]
                state.explore_gap = min(2 * state.explore_gap, self.config.max_explore_gap)
                state.explore_wait = state.explore_gap
        else:
            state.explore_gap = max(1, state.explore_gap // 2)
            state.explore_wait = min(state.explore_wait, state.explore_gap)
        chosen = order[:n]
        state.last_plan = {"candidates": len(tree), "chosen": n, "expected": expected, "rate": rate,
                           "bias": self.bias, "explore": explore}
        state.planned_rate = None if explore else rate  # a probe says nothing about drafting's worth
        self._project(state, n, expected, draft_seconds)
        return proposal.restrict(sorted(chosen)), expected

    # ------------------------------------------------------------------ batches (SmartSpec)
    def prepare_batch(self, max_batch_size: int) -> None:
        """Measure (or load from the cache) the packed-pass cost table up to `max_batch_size`
        sequences, so that the first batched step does not stall on it (the server calls this at
        start-up). Nothing to do for backends that do not pack sequences into one pass."""
        if self.batch_curve is None and max_batch_size > 1 and isinstance(self._target, BatchedTargetModel):
            sizes = [b for b in DEFAULT_BATCH_SIZES if b < max_batch_size] + [max_batch_size]
            self.batch_curve = load_or_measure_batch_curve(self._target, sizes)

    def batch_seconds(self, batch_size: int, total_tokens: int) -> float:
        """Predicted latency of one packed pass (measured table times the online correction)."""
        assert self.batch_curve is not None
        return self.batch_scale * self.batch_curve.latency(batch_size, total_tokens)

    def observe_batch(self, batch_size: int, total_tokens: int, seconds: float) -> None:
        """A packed pass of `batch_size` sequences and `total_tokens` tokens took `seconds`."""
        if self.batch_curve is not None and batch_size > 1:
            ratio = seconds / max(self.batch_curve.latency(batch_size, total_tokens), 1e-9)
            c = self.config.cost_correction
            self.batch_scale = (1 - c) * self.batch_scale + c * ratio

    def plan_batch(self, requests: Sequence[tuple[Sequence[Proposal], DraftBudget, PlannerState, float]]
                   ) -> list[tuple[Proposal, float]]:
        """Size every running request's tree for one packed pass (SmartSpec): each request's
        candidates are merged as in `plan`, then nodes are taken across requests by estimated path
        probability while the batch's expected accepted tokens per second grows, so a request gets
        zero nodes when its drafts do not pay at the current load. `requests`: (proposals, budget,
        state, drafting seconds) per request; returns (proposal, predicted accepted tokens incl.
        bonus) per request. One request, or a backend that does not pack sequences, plans each
        request alone (`plan`)."""
        if len(requests) > 1 and self.batch_curve is None:
            self.prepare_batch(max(len(requests), DEFAULT_BATCH_SIZES[-1]))
        if len(requests) == 1 or self.batch_curve is None:
            return [self.plan(*request) for request in requests]
        batch = len(requests)
        merged: list[Proposal] = []
        ordered: list[list[float]] = []
        orders: list[list[int]] = []
        whole: list[float] = []  # per request: expected accepted tokens of a tree verified whole (bonus incl.)
        fixed_tokens, fixed_expected, drafting = batch, float(batch), 0.0
        for proposals, budget, state, draft_seconds in requests:
            proposal = merge_proposals(proposals, self.config.rasd_min_prob).limit(budget)
            state.planned_rate = None  # the back-off judges lone steps; under load the batch plan decides
            drafting += self._drafting_seconds(draft_seconds) if len(proposal.tree) else draft_seconds
            order: list[int] = []
            probs: list[float] = []
            whole.append(1.0)
            if proposal.sampled and not proposal.tree.is_chain():  # verified as drawn (see `plan`)
                whole[-1] += sum(self.estimate(proposal))
                fixed_tokens += len(proposal.tree)
                fixed_expected += whole[-1] - 1.0
            elif len(proposal.tree):
                probs = self.estimate(proposal)
                order = proposal.tree.best_first_order(probs)
            merged.append(proposal)
            orders.append(order)
            ordered.append([probs[i] for i in order])
        counts, expected, rate = choose_batch(ordered, fixed_tokens, fixed_expected, drafting,
                                              lambda total: self.batch_seconds(batch, total), self.config.min_gain)
        out: list[tuple[Proposal, float]] = []
        for (proposals, _, state, draft_seconds), proposal, order, probs, n, predicted in zip(
                requests, merged, orders, ordered, counts, whole):
            if proposals:  # it drafted (a request that skipped drafting counted its idle step already)
                state.load_idle = 0 if n or len(proposal.tree) and not order else state.load_idle + 1
            if not order:  # nothing to size: empty, or a sampled tree verified whole
                out.append((proposal, predicted))
                self._project(state, len(proposal.tree), predicted, draft_seconds)
                continue
            alone = choose_size(probs, self._drafting_seconds(draft_seconds), self.cost.verify_seconds,
                                self.config.min_gain)[0]
            if n == 0 and alone > 0:
                state.off_by_load += 1
            predicted = 1.0 + sum(probs[:n])
            state.last_plan = {"candidates": len(proposal.tree), "chosen": n, "expected": predicted,
                               "batch": batch, "batch_rate": rate, "batch_expected": expected, "alone": alone}
            self._project(state, n, predicted, draft_seconds)
            out.append((proposal.restrict(sorted(order[:n])), predicted))
        return out

    def _project(self, state: PlannerState, nodes: int, expected: float, draft_seconds: float) -> None:
        p = state.projected
        p[0] += 1
        p[1] += expected
        p[2] += draft_seconds + self.cost.curve.latency(nodes + 1)  # on the curve as given (unscaled)
        p[3] += nodes

    def projection(self, state: PlannerState) -> dict:
        """What the planner expected for one request on this cost curve, summed over planned
        steps: mean tree size, expected tokens per step and the projected speedup over plain
        decoding."""
        steps, tokens, seconds, nodes = state.projected
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

    def observe(self, step: StepResult, state: PlannerState, draft_seconds: float, verify_seconds: float,
                overhead_seconds: float = 0.0, batched: bool = False) -> None:
        """After a step: drafting and verify seconds, and the drafters' own observe time. A `batched`
        step's verify time is the packed pass's (see `observe_batch`), not this tree's alone."""
        self._overhead.update(overhead_seconds)
        tree = step.proposal.tree
        if not batched:
            self.cost.observe(len(tree) + 1, verify_seconds)
        d = self.config.bias_decay
        for sums in self._recent.values():  # evidence fades with time, drafted or not
            sums[0] *= d
            sums[1] *= d
        if state.skipped or (len(tree) == 0 and draft_seconds == 0.0):
            state.skipped = False
            return
        on_path = set(step.path)
        for i, par in enumerate(tree.parents):
            if par < 0 or par in on_path:  # a trial: the node's parent was accepted
                source, raw = tree.sources[i], tree.edge_scores[i]
                sums = self._recent.setdefault(source, [0.0, 0.0])
                sums[0] += i in on_path
                sums[1] += self.calibrator.estimate(source, raw)  # the factor divides calibration alone
                self.calibrator.update(source, raw, i in on_path)
        # Back-off: do drafting steps beat plain steps? A step that verified a tree is judged by
        # what it realised (tokens / its drafting + verify seconds), so a text on which every
        # estimate is wrong still stops drafting after a few losses; one that found nothing worth
        # verifying by its plan (plain step + drafting time). If drafting loses, pause it for
        # 1, 2, 4, ... steps, then probe again.
        if state.planned_rate is None:
            return
        rate, state.planned_rate = state.planned_rate, None
        if len(tree):
            rate = (1 + len(step.path)) / (self._drafting_seconds(draft_seconds) + verify_seconds)
        if state.rate is None:
            state.rate = Ema(self.config.rate_ema)
        smoothed = state.rate.update(rate)
        plain_rate = 1.0 / self.cost.verify_seconds(1)
        if smoothed < plain_rate * (1 - self.config.backoff_tolerance):
            state.skip = state.backoff
            state.backoff = min(2 * state.backoff, self.config.max_backoff)
        else:
            state.backoff = max(1, state.backoff // 2)
