"""The hardware-aware planner: merges the drafters' trees and keeps, each step, the tree that
maximises expected tokens/s.

    cost model      target latency against tokens verified: a prior (measured once per backend
                    `cost_key()` + context bucket, cached on disk) that the passes this run times
                    correct within a few steps, optimistic for sizes rarely timed yet so a
                    pessimistic prior is tried and corrected instead of trusted
                    (`specula.planner.cost.CostModel`)
    merge           trie union of the candidate trees, retrieval branches pruned with the
                    draft model's probabilities (RASD; `specula.planner.merge`)
    calibration     raw edge scores -> acceptance probabilities (learned online, per source
                    and score bin), times a per-source correction factor (accepted /
                    predicted nodes over recent steps, decaying with time) that removes the
                    optimism of picking the nodes with the highest estimates and follows the
                    text at hand (a source that copies well in summaries may not in answers);
                    in a merged tree, a node that several sources proposed, or one whose
                    sibling another source proposed, gets a factor learned for its source in
                    that sibling context instead (`select.sibling_contexts`: siblings exclude
                    each other, so where sources disagree each is less likely than alone); the
                    context is the merged tree's, carried by the plan to `observe`, so a node whose
                    contesting sibling was cut is still learned as contested
    tree kind       last, a factor per set of sources that proposed the merged tree (accepted /
                    predicted drafted tokens of recent trees of that kind): node estimates right
                    on average can be wrong on the steps a kind is picked on (where a draft model's
                    chain is refused beside prompt lookup's and token recycling's trees, because
                    theirs look best, those trees realised half what they predicted)
    selection       N* = argmax_N E(N) / (T_draft + T_verify(N + 1)), N = 0 = plain step,
                    chosen unless a tree's rate beats it by `min_gain`; T_draft is the step's
                    drafting, after the prefill or a pause at most that of steady steps (the
                    drafters' catch-up is spent whichever N is chosen: `_planned_draft`)
    drafting        a drafter that decides while it drafts (a chain's length, a tree's depth) asks
                    the cost view (`PlannerView.plan_chain`): its chain is valued by what it adds
                    to the tree the drafters before it proposed this step (siblings exclude each
                    other: where the chain's first token and their root children together exceed
                    probability 1, their nodes count for the mass the chain leaves them),
                    `select.chain_lookahead`; a chain refused on every step would never be verified
                    again, so its estimates, learned on other text, could never recover: 1, 2, 4,
                    ... steps (of any request) after its last probe, a refused chain is drafted as
                    an untried one would be and verified anyway (a probe, not judged by the
                    back-off); probes that pay on average bring the next one forward; in a packed
                    pass too (priced at the batch's load, the wait counted in batch steps)
    hold-back       what each costly drafter adds beside the others is measured, not modelled: after
                    a step, the tokens accepted and the seconds spent (its drafting + the cost
                    model's pass) against the same step without its nodes (the accepted path cut
                    at its first node no other drafter proposed, its drafting time and those
                    nodes' share of the pass taken off); a drafter whose recent steps realised
                    fewer tokens/s with it than without sits out 1, 2, 4, ... steps of a request,
                    drafting again after each pause (a probe, judged afresh; one that was not
                    judged, because a costlier drafter drafted beside it, it proposed nothing or
                    the step was batched, drafts again the next step). Correlated drafters
                    are what this is for: on prose a trained head already proposes most of what a
                    draft model would, at a fifth of its cost; on code the draft model's long
                    chains pay. Evidence counts only from steps where no costlier drafter drafted
                    beside it (two that propose alike would each look idle, and both be held)
    back-off        when drafting steps realise fewer tokens/s than plain steps would
                    (measured, not predicted), skip drafting for 1, 2, 4, ... steps (probing
                    again after each pause: a probe is judged afresh by what it realises, not
                    through the losses before the pause), so drafting cannot make decoding much slower
                    than plain decoding; a step after the prefill or a pause is judged at most
                    at the drafting time of steady steps (a head's catch-up is not its cost); a
                    step on which the hold-back held a drafter and nothing costly drafted is a
                    plain step, not judged (read as a win, it cut the back-off's pauses short)

What requests share (cost model, calibration, correction factors, the drafters' observe-time
estimate) lives in `HardwarePlanner`; what belongs to one request (back-off, exploration
pace, projection) in a `PlannerState` the engine keeps in the request's session. Each step's
decision is a `Plan` value the engine hands back to `observe` (`specula.planner.base`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Sequence

from specula.ema import Ema
from specula.models.base import BatchedTargetModel, TargetModel
from specula.planner.batch_cost import (DEFAULT_BATCH_SIZES, BatchCostCurve, load_or_measure_batch_curve,
                                        timed_batch_sizes)
from specula.planner.calibration import CalibrationConfig, Calibrator
from specula.planner.base import Plan, PlanRequest, StepTiming
from specula.planner.cost import DEFAULT_CONTEXT, DEFAULT_SIZES, CostCurve, CostModel, load_or_measure_curve
from specula.planner.merge import merge_proposals
from specula.planner.pause import Pause
from specula.planner.select import (best_children, chain_lookahead, choose_batch, choose_size, path_probabilities,
                                    probe_nodes, sibling_contexts, tree_kind)
from specula.step import FORCED_SOURCE, Proposal, StepResult
from specula.tree import TokenTree


def scaled_factor(factor: float, probs: Sequence[float]) -> float:
    """A tree kind's factor as applied to path probabilities `probs`: above 1, no more than keeps
    every one of them a probability (so the scaled tree's prediction divided by it is the unscaled one)."""
    top = max(probs, default=0.0)
    return min(factor, 1.0 / top) if factor > 1.0 and top > 0.0 else factor


@dataclass(frozen=True)
class PlannerConfig:
    """Planner settings."""

    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    """Binning / smoothing of acceptance estimates."""
    cost_sizes: tuple[int, ...] = DEFAULT_SIZES
    """Pass sizes measured for the cost curve."""
    cost_context: int = DEFAULT_CONTEXT
    """Context length (tokens in the cache) at which the cost curve is measured (`cost.DEFAULT_CONTEXT`)."""
    cost_repeats: int = 2
    """Timed repeats per size at start-up."""
    cost_explore: float = 0.4
    """Optimism of the cost model for multi-token passes this run has not timed yet: their estimate
    is cut by this fraction, shrinking as 1 / (1 + passes timed in the size's octave), so a prior
    that reads too slow is tried and corrected rather than trusted (`CostModel`)."""
    cost_window: int = 9
    """Passes per size whose median ratio to the prior gives the cost model's correction."""
    cost_horizon: int = 64
    """Passes of the run after which a multi-token size's timings no longer count: a size timed
    only while the machine was slow is then priced by its neighbours' recent passes and tried again
    (`CostModel`)."""
    rate_ema: float = 0.2
    """EMA weight of each judged drafting step's realised tokens/s in the back-off signal."""
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
    hold_decay: float = 0.7
    """Weight a drafter's earlier hold-back evidence keeps each time it drafts a new step (its
    tokens and seconds with and without it, `HardwarePlanner.adds_beside`): about the last
    three of its steps decide, so the evidence follows the text at hand."""
    hold_min_cost: float = 0.02
    """A drafter whose steady drafting time stays under this fraction of a plain step is never held
    back (prompt lookup, retrieval: little to save, and their hits come in bursts)."""
    max_hold: int = 16
    """Longest run of a request's steps a drafter sits out before it drafts again (a probe)."""


@dataclass
class Projection:
    """What the planner expected for one request, summed over its planned steps."""

    steps: int = 0
    tokens: float = 0.0
    """Expected accepted tokens."""
    seconds: float = 0.0
    """Expected seconds on the prior cost curve (drafting + verification)."""
    nodes: int = 0
    """Tree nodes chosen."""

    def add(self, nodes: int, tokens: float, seconds: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds
        self.nodes += nodes


@dataclass
class BatchBackoff:
    """Under load (one per batch size): do the batch's drafting steps realise more tokens per second
    than its plain steps? If not, nobody in a batch of that size drafts for 1, 2, 4, ... steps."""

    drafting: Ema
    """Tokens per second (drafting + pass) of batch steps on which some request drafted."""
    plain: Ema
    """Tokens per second of batch steps on which nobody drafted (the table's prediction until one is seen)."""
    pause: Pause = field(default_factory=Pause)
    """Batch steps sat out (1, 2, 4, ... after each loss)."""
    resumed: bool = False
    """A pause was sat out since the last drafting step: the next one is a probe, judged afresh by
    what it realises (through the average of the losses that paused drafting, a winning probe read
    as a loss and doubled the pause)."""


@dataclass
class PlannerState:
    """One request's planning state (kept in the engine's session)."""

    backoff: Pause = field(default_factory=Pause)
    """Plain steps left in the current back-off pause, and the length of the next."""
    rate: Ema | None = None
    """Tokens/s of recent drafting steps (realised, or planned when nothing was verified)."""
    resumed: bool = True
    """The next drafting step follows the prefill or a pause: its drafting may include the
    drafters' catch-up over the tokens committed meanwhile (a head's cache), which the back-off
    does not count as that step's cost."""
    afresh: bool = False
    """A pause was sat out since the last judged drafting step: the next one judged is a probe,
    judged afresh by what it realises (a step between that is not judged, e.g. an explore step,
    leaves this set)."""
    explore_gap: int = 1
    explore_wait: int = 1
    load_idle: int = 0
    """Consecutive batch steps on which the goodput plan gave this request no node."""
    idle_batch: int = 0
    """The batch size of the last of those steps: a smaller batch judges the request's drafts afresh."""
    evidence: dict[str, list[float]] = field(default_factory=dict)
    """Hold-back evidence per drafter (decayed sums: tokens and seconds with it, without it;
    `HardwarePlanner.adds_beside`): the process's latest when the request starts (`new_state`),
    then this request's own steps', so each request is judged on its own text (shared by the
    process throughout, two requests stepped in turn held a draft model where it paid and drafted
    it where it added nothing; started empty, one unlucky first step held it)."""
    holds: dict[str, Pause] = field(default_factory=dict)
    """Per drafter measured not to pay beside the others: its hold-back schedule (the next hold doubling
    after each probe that still does not pay)."""
    held: frozenset[str] = frozenset()
    """The drafters that sit this step out (set by `should_draft`)."""
    probing: frozenset[str] = frozenset()
    """The drafters that draft this step although measured not to pay: probes, judged afresh."""
    held_steps: dict[str, int] = field(default_factory=dict)
    """Per drafter: the steps it sat out (for the request's summary)."""
    paused_steps: int = 0
    """Steps this request sat out in a back-off pause (for the request's summary)."""
    chain_probes: set[str] = field(default_factory=set)
    """The chain drafters whose chain this step is drafted as a probe (`PlannerView._probe`): the
    plan verifies it whatever its estimates (`HardwarePlanner._lone`)."""
    last_drafted: frozenset[str] = frozenset()
    """The drafters that proposed nodes on this request's previous step (their drafting time then
    had no catch-up in it)."""
    projected: Projection = field(default_factory=Projection)


class PlannerView:
    """The planner's read-only `specula.step.CostView` for one drafter in one step."""

    def __init__(self, planner: "HardwarePlanner", proposals: Sequence[Proposal], draft_seconds: float,
                 batch_size: int = 1, state: PlannerState | None = None) -> None:
        self._planner = planner
        self._state = state
        """The request's planning state (None: no probes, e.g. a view asked outside a request's step)."""
        self._proposals = list(proposals)
        self._draft_seconds = draft_seconds
        self._pass_seconds, others = planner._pass_of(batch_size)
        self._batch = others + 1
        """Sessions in the pass this session's tree joins (1: verified alone, or a backend that
        does not pack sequences, whose sessions each get a pass)."""
        self._others = float(others)  # tokens the pass yields besides this session's: the others' roots
        self._costs = [0.0]  # [n]: latency of the pass holding n of this session's tokens, filled on demand

    def verify_seconds(self, n_tokens: int) -> float:
        table = self._costs
        while len(table) <= n_tokens:
            table.append(self._pass_seconds(len(table)))
        return table[n_tokens]

    @cached_property
    def baseline_rate(self) -> float:
        planner = self._planner
        tree, spend = self._merged.tree, planner.drafting_seconds(self._draft_seconds)
        if len(tree) == 0:
            return (1.0 + self._others) / (spend + self.verify_seconds(1))
        probs = self._probs
        order = tree.best_first_order(probs)
        return choose_size([probs[i] for i in order], spend, self.verify_seconds, planner.config.min_gain,
                           self._others)[2]

    @cached_property
    def _merged(self) -> Proposal:
        return merge_proposals(self._proposals)

    @cached_property
    def _probs(self) -> list[float]:
        """The planner's path probability of each node of the merged tree (read by `baseline_rate`
        and `_beside`, both asked before a chain's first token), scaled by the factor of the tree's
        kind. A chain is priced by its own estimates: the factor of the tree it would make with
        these nodes is one for all of them, so a chain beside nodes that fail would carry their
        blame (tried: beside prompt lookup's copy that missed, the draft model's chain priced so
        stayed refused and the back-off paused drafting)."""
        return self._planner.estimate(self._merged)

    @cached_property
    def _beside(self) -> tuple[list[float], float]:
        """The tree a further drafter's chain joins: path probabilities of the nodes proposed so far
        this step, best first, as many as are worth verifying without the chain (beside a chain
        fewer are), and the sum of those of the root children among them."""
        tree = self._merged.tree
        if len(tree) == 0:
            return [], 0.0
        planner, probs = self._planner, self._probs
        order = sorted(range(len(tree)), key=lambda i: -probs[i])
        n = choose_size([probs[i] for i in order], planner.drafting_seconds(self._draft_seconds),
                        self.verify_seconds, others=self._others)[0]
        return [probs[i] for i in order[:n]], sum(probs[i] for i in order[:n] if tree.parents[i] < 0)

    def _path_probs(self, source: str, edge_scores: Sequence[float]) -> list[float]:
        probs, acc = [], 1.0
        for raw in edge_scores:
            acc *= self._planner.source_acceptance(source, raw)
            probs.append(acc)
        return probs

    def plan_chain(self, source: str, edge_scores: Sequence[float], seconds_per_token: float, spent_seconds: float,
                   max_more: int, one_time_seconds: float = 0.0, remaining_tokens: int = 1) -> int:
        """A chain is valued beside the nodes the drafters before it proposed (`select.chain_lookahead`):
        before its first token it must beat their tree by `min_gain`, after it drafts on while more
        tokens beat stopping. A chain refused before its first token may be drafted anyway, as a
        probe (`_probe`)."""
        planner = self._planner
        probing = self._state is not None and source in self._state.chain_probes
        if edge_scores:
            if probing:  # a probe goes on as an untried chain would
                alpha = planner.config.explore_prior
                path = [alpha ** (i + 1) for i in range(len(edge_scores))]
            else:
                path, alpha = self._path_probs(source, edge_scores), planner.expected_acceptance(source)
            beside, beside_root = self._beside
            return chain_lookahead(path, alpha, max_more, seconds_per_token, spent_seconds, self.verify_seconds, 0.0,
                                   beside, beside_root, planner.drafting_seconds(self._draft_seconds), self._others)[0]
        more = self._first(planner.expected_acceptance(source), seconds_per_token, max_more, one_time_seconds,
                           remaining_tokens)
        return more or self._probe(source, seconds_per_token, max_more, one_time_seconds, remaining_tokens)

    def _first(self, alpha: float, seconds_per_token: float, max_more: int, one_time_seconds: float,
               remaining_tokens: int) -> int:
        """Before a chain's first token: its length if a chain accepted `alpha` per token beats the
        tree proposed so far by `min_gain`, else 0. A one-time cost (a draft cache catching up) is
        spread over the request's future steps."""
        planner = self._planner
        if one_time_seconds > 0:
            chain_tokens = sum(alpha ** i for i in range(max_more + 1))
            one_time_seconds /= max(1.0, remaining_tokens / chain_tokens)
        beside, beside_root = self._beside
        more, rate, _ = chain_lookahead([], alpha, max_more, seconds_per_token, 0.0, self.verify_seconds,
                                        one_time_seconds, beside, beside_root,
                                        planner.drafting_seconds(self._draft_seconds), self._others)
        return more if more > 0 and rate >= self.baseline_rate * (1.0 + planner.config.min_gain) else 0

    def _probe(self, source: str, seconds_per_token: float, max_more: int, one_time_seconds: float,
               remaining_tokens: int) -> int:
        """A chain refused this step may be drafted anyway, as a probe (its length; 0: no probe): where
        a chain would pay at the acceptance an untried drafter is assumed to have (its estimates,
        learned on other text, may be stale; its cost is not), priced by the pass it joins (a packed
        pass: beside the batch's other roots), drafted as long as such a chain would be, when the
        source's probe schedule has run out (`chain_probe`). A whole chain, not one token: a probe
        that pays teaches the calibration a trial per token. In a packed pass of B sessions the probe
        costs every one of them its drafting and its share of the pass, and every session's step
        counts the schedule down: the wait after it is B times as many session steps, as many batch
        steps as a lone request's (never probed in a batch, a refusal made under load stood while the
        load lasted)."""
        planner, state = self._planner, self._state
        if state is None or max_more <= 0:
            return 0
        if self._batch == 1 and not planner._one_node_can_pay(self._draft_seconds):
            return 0
        schedule = planner.chain_probe(source)
        if schedule.left > 0:
            return 0
        more = self._first(planner.config.explore_prior, seconds_per_token, max_more, one_time_seconds,
                           remaining_tokens)
        if more:
            schedule.left = schedule.next * self._batch  # no other probe of it before this one is judged
            state.chain_probes.add(source)
        return more


class HardwarePlanner:
    """Merges and sizes every proposal to this hardware; learns acceptance and timing online."""

    def __init__(self, target: TargetModel | None = None, config: PlannerConfig = PlannerConfig(),
                 curve: CostCurve | None = None, batch_curve: BatchCostCurve | None = None) -> None:
        self.config = config
        self._target = target
        self.batch_curve = batch_curve
        """Latency of packed passes over several sequences (None until a batch needs it; see
        `prepare_batch`)."""
        self._batch_costs: dict[int, CostModel] = {}
        """Per batch size: the table's row as a prior, corrected by this run's packed passes like the
        lone cost model (a plain batched step judged by plain ones; no optimism under load)."""
        if curve is None:
            if target is None:
                raise ValueError("HardwarePlanner needs a target backend or a measured cost curve")
            curve = load_or_measure_curve(target, config.cost_sizes, config.cost_context, config.cost_repeats)
        self.cost = CostModel(curve, config.cost_explore, config.cost_window,
                              target.padded_tokens if target is not None else None, config.cost_horizon)
        self.calibrator = Calibrator(config.calibration)
        self._recent: dict[str, list[float]] = {}  # per source, decayed sums: accepted, predicted nodes
        self._context: dict[tuple[str, str], list[float]] = {}  # per (source, sibling context): decayed sums
        self._trees: dict[frozenset[str], list[float]] = {}  # per tree kind: decayed accepted, predicted drafts
        self._overhead = Ema(config.overhead_ema)  # the drafters' per-step observe time (seconds)
        self._steady_draft = Ema(config.overhead_ema)  # drafting seconds of steps right after a drafting step
        self._batch_backoff: dict[int, BatchBackoff] = {}  # per batch size
        self._steady_seconds: dict[str, Ema] = {}  # per drafter: drafting seconds of a step right after one
        self._chain_probes: dict[str, Pause] = {}  # per chain source: steps until it may probe again
        self._evidence: dict[str, list[float]] = {}  # hold-back: the latest sums per drafter (a new request's start)
        self._probe_gain: dict[str, Ema] = {}  # per chain source: its probes' tokens/s over a plain step's

    # ------------------------------------------------------------------ per request
    def new_state(self) -> PlannerState:
        """A request's state: no back-off pause carried over (drafting may pay on this text; the
        first drafting step judges afresh); the hold-back's evidence as the process's latest steps
        left it, the request's own from then on. Estimates, bias and timings are shared."""
        return PlannerState(evidence={name: list(sums) for name, sums in self._evidence.items()})

    def should_draft(self, state: PlannerState, batch_size: int = 1) -> bool:
        """Whether this request drafts this step: not during its back-off pause, nor while it shares
        a batch at a load where its drafts have stopped paying (except on probe steps)."""
        backoff = self._batch_backoff.get(batch_size)
        state.chain_probes.clear()  # set by this step's views
        if batch_size < state.idle_batch:  # the load fell (alone again, or others finished): the drafts
            state.load_idle = state.idle_batch = 0  # refused at the heavier load may pay now
        if backoff is not None and backoff.pause.left > 0:
            state.resumed = state.afresh = True  # its next drafting step may carry the drafters' catch-up
            return False  # drafting loses at this load: the whole batch pauses it
        elif state.load_idle >= 2 and state.load_idle % self.config.load_probe_every:
            state.load_idle += 1  # no drafts, no node: still idle
            state.resumed = state.afresh = True
            return False
        if state.backoff.waiting():
            state.resumed = state.afresh = True
            state.paused_steps += 1
            return False
        state.held = self._hold(state)
        return True

    def held(self, state: PlannerState) -> frozenset[str]:
        return state.held

    def _hold(self, state: PlannerState) -> frozenset[str]:
        """The drafters that sit this step out: those measured to add less than they cost beside the
        others (`adds_beside`), except on probe steps (after 1, 2, 4, ... held steps)."""
        held, probing = [], []
        for name in state.evidence:
            if self.adds_beside(name, state):
                state.holds.pop(name, None)
                continue
            # found out on this request's last step: held at once; else (a new request) probed first
            hold = state.holds.setdefault(name, Pause(left=int(name in state.last_drafted)))
            if hold.waiting():
                held.append(name)
                state.held_steps[name] = state.held_steps.get(name, 0) + 1
            else:  # a probe: it drafts this step; judged by it, it sits out longer if it still does not
                probing.append(name)  # pay (`_observe_beside`), and probes again if it could not be judged
        state.probing = frozenset(probing)
        return frozenset(held)

    def is_cheap(self, name: str) -> bool:
        """Whether drafter `name` is known to draft in under `hold_min_cost` of a plain step (never held
        back: little to save, and the hits of prompt lookup or retrieval come in bursts)."""
        steady = self._steady_seconds.get(name)
        return steady is not None and steady.value is not None and \
            steady.value < self.config.hold_min_cost * self.cost.estimate(1)

    def adds_beside(self, name: str, state: PlannerState) -> bool:
        """Whether drafter `name` realised at least as many tokens/s on the request's recent steps as
        the same steps would have without its nodes and its drafting time (True: no evidence yet, or
        it costs under `hold_min_cost` of a plain step)."""
        sums = state.evidence.get(name)
        if sums is None or self.is_cheap(name):
            return True
        tokens, seconds, tokens_without, seconds_without = sums
        return tokens * seconds_without >= tokens_without * seconds

    def view(self, proposals: Sequence[Proposal], draft_seconds: float, batch_size: int = 1,
             state: PlannerState | None = None) -> PlannerView:
        """The cost view for the next drafter of a step, after `proposals` cost `draft_seconds`, for a
        session whose tree is verified beside `batch_size` - 1 others (priced by the packed pass);
        `state`: the request's, where the view may ask for a probe."""
        return PlannerView(self, proposals, draft_seconds, batch_size, state)

    def chain_probe(self, source: str) -> Pause:
        """The probe schedule of chain source `source`: steps (of any request) before it may probe
        again, `next` of them after each probe (`next` times B after a probe in a packed pass of B
        sessions, each of whose steps counts one: `next` batch steps); where its probes pay on
        average (`_judge_probes`) `next` halves and the source may probe again at once, else `next`
        doubles up to `max_explore_gap`."""
        return self._chain_probes.setdefault(source, Pause())

    # ------------------------------------------------------------------ estimates
    def expected_acceptance(self, source: str) -> float:
        """P(next chain token of `source` accepted | the previous one was): the calibrated acceptance of
        its best children, the nodes a chain extends by (optimistic `explore_prior` until it has
        data), times its correction factor."""
        return min(1.0, self.bias_of(source) * self.calibrator.mean(source, self.config.explore_prior, best=True))

    def bias_of(self, source: str) -> float:
        """Correction factor of one source: accepted / predicted nodes over recent steps."""
        return self._ratio(self._recent.get(source))

    @property
    def bias(self) -> dict[str, float]:
        """Every source's correction factor (for reports)."""
        return {source: round(self.bias_of(source), 4) for source in self._recent}

    def context_factor(self, source: str, context: str) -> float:
        """Correction factor of one source's nodes in one sibling context (`select.sibling_contexts`):
        accepted / estimated over recent steps, the estimate being the source's own (its factor
        included). Per source: a copy that token recycling contests keeps its odds, a recycled
        token that a copy contests loses them."""
        return self._ratio(self._context.get((source, context)))

    def tree_factor(self, kind: frozenset[str] | None) -> float:
        """Correction factor of a whole tree's estimates by the sources that proposed it: accepted /
        predicted drafted tokens of the recent trees of that kind, the prediction being every node's
        own corrected estimate. Those are right on average over a source's nodes, not over the steps
        the plan picks a mix of sources on: where a draft model's chain is refused beside prompt
        lookup's and token recycling's trees, it is refused because theirs look best, and those trees
        realised less than half what they predicted (1.5B, fusion without a head, 12 training prompts:
        4.06 tokens predicted, 2.49 realised, on 35 of 189 steps, against 3.48 / 3.57 where the chain
        was drafted; the refused steps' tree of 12 nodes cost 0.33 s against 0.26 s). A single
        source's tree has a kind too: its own factor (`bias_of`) learns per node, this one what its
        paths realise. Not capped at 1: capped, its noise around 1 averaged below 1 where the
        estimates were right. 1 for no kind (no tree, or a grammar-forced node)."""
        return self._ratio(self._trees.get(kind)) if kind else 1.0

    def _ratio(self, sums: Sequence[float] | None) -> float:
        """A correction factor from decayed [accepted, predicted] sums (None: none yet), both starting
        from `bias_prior` pseudo-nodes."""
        accepted, predicted = sums if sums is not None else (0.0, 0.0)
        k = self.config.bias_prior
        return (accepted + k) / (predicted + k)

    @property
    def tree_factors(self) -> dict[str, float]:
        """Every tree kind's correction factor (in each request's summary; sources joined by '+')."""
        return {"+".join(sorted(kind)): round(self.tree_factor(kind), 4) for kind in self._trees}

    def _source_estimates(self, tree: TokenTree) -> list[tuple[float, str]]:
        """Per node, its sources' estimate of P(accepted | parent accepted) and the source it is
        from: calibration times the source's correction factor (at most 1), the highest over the
        sources that proposed the node (each with its own score); 1 for a token the request's
        grammar forces."""
        return [max((self.source_acceptance(src, raw), src) for src, raw in tree.proposers(i))
                for i in range(len(tree))]

    def _edge_acceptance(self, tree: TokenTree, contexts: Sequence[str | None] | None = None) -> list[float]:
        """Estimated P(node accepted | parent accepted) of every node: its sources' estimate, times
        the factor of that source in the node's sibling context (`contexts`, default the tree's own)
        where it has one (at most 1). An estimate of 1 stays: a token the grammar forces (or one
        already capped at 1)."""
        contexts = sibling_contexts(tree) if contexts is None else contexts
        return [est if context is None or est >= 1.0 else min(1.0, self.context_factor(src, context) * est)
                for (est, src), context in zip(self._source_estimates(tree), contexts)]

    def source_acceptance(self, source: str, raw: float) -> float:
        """Estimated P(accept | parent accepted) of one source's node with raw edge score `raw`:
        its calibration times its correction factor (at most 1); 1 for a grammar-forced token."""
        if source == FORCED_SOURCE:
            return 1.0
        return min(1.0, self.bias_of(source) * self.calibrator.estimate(source, raw))

    def estimate(self, proposal: Proposal) -> list[float]:
        """Calibrated path probability of every node (corrected per source, per sibling context and
        by the tree's kind)."""
        return self._estimate(proposal)[0]

    def _estimate(self, proposal: Proposal) -> tuple[list[float], list[str | None], frozenset[str] | None, float]:
        """`estimate`, every node's sibling context it was corrected for, the tree's kind and the
        kind's factor the path probabilities were scaled by (`tree_factor`)."""
        tree = proposal.tree
        contexts = sibling_contexts(tree)
        probs = path_probabilities(tree, self._edge_acceptance(tree, contexts))  # [nodes]
        kind = tree_kind(tree, FORCED_SOURCE) if len(tree) else None
        factor = scaled_factor(self.tree_factor(kind), probs)
        return [factor * p for p in probs] if factor != 1.0 else probs, contexts, kind, factor

    def drafting_seconds(self, draft_seconds: float) -> float:
        """Seconds a drafting step costs besides verification: proposing plus the drafters'
        bookkeeping after the step (e.g. token recycling's matrix update), learned online."""
        return draft_seconds + self._overhead.get()

    def _planned_draft(self, r: PlanRequest) -> float:
        """The drafting seconds request `r`'s tree is sized at: what its drafters spent this step, but on a
        step after the prefill or a pause (`PlannerState.resumed`) at most the drafting time of steady steps,
        as the back-off judges that step. The drafters' catch-up over the tokens committed meanwhile (a
        head's cache over a long prompt: 28-41 ms on SmolLM2's 700-token summaries, 3-4 plain steps) is
        spent whichever tree is chosen; sized at it, the tree whose rate best carried that time was the
        largest, 16-64 nodes of 3-8 predicted tokens verified at 4-14 plain steps, after which the back-off
        paused drafting for over half of each answer in one trace (docs/training.md, session 142)."""
        steady = self._steady_draft.value
        if steady is not None and r.state.resumed:
            return min(r.draft_seconds, steady)
        return r.draft_seconds

    def _plain_rate(self, draft_seconds: float) -> float:
        """Expected tokens/s of a plain step that still paid `draft_seconds` of drafting."""
        return 1.0 / (self.drafting_seconds(draft_seconds) + self.cost.verify_seconds(1))

    def _one_node_can_pay(self, draft_seconds: float) -> bool:
        """Could a one-node tree beat a plain step at all, were its node always accepted? Not
        where a 2-token pass costs twice a 1-token one (e.g. a float32 GEMV -> GEMM jump on CPU):
        probing there only costs time."""
        spend = self.drafting_seconds(draft_seconds)
        return 2.0 / (spend + self.cost.verify_seconds(2)) > 1.0 / (spend + self.cost.verify_seconds(1))

    # ------------------------------------------------------------------ per step
    def plan(self, requests: Sequence[PlanRequest]) -> list[Plan]:
        """Merge each request's proposals and size every tree for the pass that verifies them: one
        request alone, its best ancestor-closed tree (`choose_size`); several packed into one pass,
        nodes taken across requests by estimated path probability while the batch's expected tokens
        per second grows (SmartSpec goodput), so a request gets no node when its drafts do not pay
        at the current load. A backend that does not pack sequences verifies (and plans) each
        request alone."""
        if len(requests) > 1 and self.batch_curve is None:
            self.prepare_batch(max(len(requests), DEFAULT_BATCH_SIZES[-1]))
        if len(requests) > 1 and self.batch_curve is not None:
            return self._plan_pass(requests)
        plans: list[Plan] = []
        for request in requests:
            plans += self._plan_pass([request]) if request.drafted else [self._undrafted(request)]
        return plans

    def _undrafted(self, r: PlanRequest) -> Plan:
        """The plan `_plan_pass` gives a lone request that drafts nothing this step (its back-off paused it), made
        without sizing anything: such a step's planning took 0.06 ms of a SmolLM2 step, plain decoding's 0.03."""
        proposal = Proposal.empty()
        plan = Plan(proposal, 1.0, None, 0, drafted=False, drafter_seconds=tuple(r.drafter_seconds),
                    probes=tuple(probe_nodes(proposal.tree, r.state.chain_probes)))
        r.state.projected.add(plan.nodes, plan.predicted, r.draft_seconds + self.cost.curve.latency(plan.nodes + 1))
        return plan

    def _plan_pass(self, requests: Sequence[PlanRequest]) -> list[Plan]:
        """Plans for the requests verified in one target pass."""
        batch = len(requests)
        pass_seconds = (self.cost.verify_seconds if batch == 1
                        else lambda total: self.batch_seconds(batch, total))
        merged: list[Proposal] = []
        ordered: list[list[float]] = []  # per request: path probabilities, best first
        orders: list[list[int]] = []
        contexts: list[list[str | None]] = []  # per request: every merged node's sibling context
        kinds: list[tuple[frozenset[str] | None, float]] = []  # per request: its tree's kind and factor
        whole: list[float] = []  # per request: expected tokens of a tree verified whole (bonus incl.)
        fixed_tokens, fixed_expected, drafting = batch, float(batch), 0.0
        for r in requests:
            proposal = merge_proposals(r.proposals, self.config.rasd_min_prob).limit(r.budget) if r.drafted \
                else Proposal.empty()
            drafting += self.drafting_seconds(self._planned_draft(r)) if len(proposal.tree) else r.draft_seconds
            order: list[int] = []
            probs: list[float] = []
            context: list[str | None] = []
            kind, factor = None, 1.0  # the tree's kind and its factor (none: no tree)
            whole.append(1.0)
            if proposal.sampled:
                # Sampled drafts are verified as drawn: a cut chosen by the estimates, which read each
                # node's own q, keeps a drawn token or not by its value and skews the law the rule
                # assumes (a chain is sized by its drafter before each draw, a valid stop rule).
                drawn, context, kind, factor = self._estimate(proposal)
                whole[-1] += sum(drawn)
                fixed_tokens += len(proposal.tree)
                fixed_expected += whole[-1] - 1.0
            elif len(proposal.tree):
                probs, context, kind, factor = self._estimate(proposal)
                order = proposal.tree.best_first_order(probs)
            merged.append(proposal)
            orders.append(order)
            contexts.append(context)
            kinds.append((kind, factor))
            ordered.append([probs[i] for i in order])
        counts, _, rate = choose_batch(ordered, fixed_tokens, fixed_expected, drafting, pass_seconds,
                                       self.config.min_gain)
        plans = []
        for r, proposal, order, probs, context, n, verified_whole, (kind, factor) in zip(
                requests, merged, orders, ordered, contexts, counts, whole, kinds):
            if batch == 1:
                plan, kept = self._lone(r, proposal, order, probs, n, verified_whole, rate)
            else:
                plan, kept = self._batched(r, proposal, order, probs, n, verified_whole, batch)
            plan = replace(plan, contexts=tuple(context[i] for i in kept) if context else None,
                           drafter_seconds=tuple(r.drafter_seconds), kind=kind, tree_factor=factor)
            r.state.projected.add(plan.nodes, plan.predicted, r.draft_seconds + self.cost.curve.latency(plan.nodes + 1))
            plans.append(plan)
        return plans

    def _lone(self, r: PlanRequest, proposal: Proposal, order: list[int], probs: list[float], n: int,
              verified_whole: float, rate: float) -> tuple[Plan, Sequence[int]]:
        """One request's plan for a pass of its own, and the merged tree's nodes it verifies: the
        back-off judges it by `rate`; after 1, 2, 4, ... steps on which no node was worth verifying
        the best one is verified anyway (a probe), or estimates that turned pessimistic could never
        be corrected. A chain drafted as a probe (`PlannerView._probe`) is verified whatever its
        estimates; that step is a probe too."""
        state, candidates = r.state, len(proposal.tree)
        probes = probe_nodes(proposal.tree, state.chain_probes, order)
        if not order:  # nothing to size: empty (a drafting step that found nothing), or a sampled tree
            # verified as drawn; both judged by the back-off (drafting next step or not depends on past
            # steps alone, so the law holds), else sampled drafts that lose never paused
            judged = None
            if r.drafted and candidates == 0:
                judged = self._plain_rate(r.draft_seconds)
            elif r.drafted and not state.chain_probes:
                judged = verified_whole / (self.drafting_seconds(r.draft_seconds)
                                           + self.cost.verify_seconds(candidates + 1))
            return Plan(proposal, verified_whole, judged, candidates, drafted=r.drafted,
                        probes=tuple(probes)), range(candidates)
        kept = set(order[:n])
        forced = {i for path in probes.values() for i in path} - kept
        explore = bool(forced)  # a probe's chain, not predicted to pay: not judged by the back-off
        if explore:
            kept |= forced
        elif n == 0:
            state.explore_wait -= 1
            if state.explore_wait <= 0 and self._one_node_can_pay(r.draft_seconds):
                explore = True
                kept = {order[0]}
                state.explore_gap = min(2 * state.explore_gap, self.config.max_explore_gap)
                state.explore_wait = state.explore_gap
        else:
            state.explore_gap = max(1, state.explore_gap // 2)
            state.explore_wait = min(state.explore_wait, state.explore_gap)
        kept_sorted = sorted(kept)
        plan = Plan(proposal.restrict(kept_sorted), 1.0 + sum(probs[k] for k, i in enumerate(order) if i in kept),
                    None if explore else rate, candidates, explore, drafted=r.drafted, probes=tuple(probes))
        return plan, kept_sorted

    def _batched(self, r: PlanRequest, proposal: Proposal, order: list[int], probs: list[float], n: int,
                 verified_whole: float, batch: int) -> tuple[Plan, Sequence[int]]:
        """One request's share of a packed pass, and the merged tree's nodes it verifies: a request
        whose drafts the goodput plan refuses twice in a row stops drafting (probing every
        `load_probe_every`-th step). A chain drafted as a probe (`PlannerView._probe`) is verified
        whatever the goodput plan gave the request."""
        state = r.state
        if r.drafted:  # a request that did not draft counted its idle step in `should_draft`
            state.load_idle = 0 if n or len(proposal.tree) and not order else state.load_idle + 1
            state.idle_batch = batch if state.load_idle else 0
        if not order:
            return (Plan(proposal, verified_whole, None, len(proposal.tree), batch=batch, drafted=r.drafted),
                    range(len(proposal.tree)))
        alone = choose_size(probs, self.drafting_seconds(self._planned_draft(r)), self.cost.verify_seconds,
                            self.config.min_gain)[0]
        probes = probe_nodes(proposal.tree, state.chain_probes, order)
        kept = sorted(set(order[:n]).union(*probes.values()))  # a probe's chain is verified whatever its estimates
        rank = {node: k for k, node in enumerate(order)}
        return (Plan(proposal.restrict(kept), 1.0 + sum(probs[rank[i]] for i in kept), None, len(proposal.tree),
                     batch=batch, alone=alone, drafted=r.drafted, off_by_load=n == 0 and alone > 0,
                     probes=tuple(probes)), kept)

    # ------------------------------------------------------------------ batches (SmartSpec)
    def prepare_batch(self, max_batch_size: int) -> None:
        """Measure (or load from the cache) the packed-pass cost table up to `max_batch_size`
        sequences, so that the first batched step does not stall on it (the server calls this at
        start-up). Nothing to do for backends that do not pack sequences into one pass."""
        if self.batch_curve is None and max_batch_size > 1 and isinstance(self._target, BatchedTargetModel):
            self.batch_curve = load_or_measure_batch_curve(self._target, timed_batch_sizes(max_batch_size))

    def _batch_cost(self, batch_size: int) -> CostModel:
        assert self.batch_curve is not None
        if batch_size not in self._batch_costs:
            self._batch_costs[batch_size] = CostModel(self.batch_curve.row_curve(batch_size), 0.0,
                                                      self.config.cost_window, horizon=self.config.cost_horizon)
        return self._batch_costs[batch_size]

    def batch_seconds(self, batch_size: int, total_tokens: int) -> float:
        """Predicted latency of one packed pass: the measured table (a prior) corrected by this run."""
        return self._batch_cost(batch_size).estimate(total_tokens - batch_size + 1)

    # ------------------------------------------------------------------ after the step
    def observe_pass(self, plans: Sequence[Plan], seconds: float, emitted: Sequence[int] = (),
                     draft_seconds: float = 0.0) -> None:
        """The target pass over `plans` took `seconds`: a lone pass corrects the cost model of its
        size, a packed one the packed-pass table and the batch's back-off (drafting judged by the
        tokens per second the batch realised, like a lone request's back-off)."""
        total = sum(plan.nodes + 1 for plan in plans)
        if len(plans) == 1:
            self.cost.observe(total, seconds)
            return
        if self.batch_curve is None:
            return
        batch = len(plans)
        self._batch_cost(batch).observe(total - batch + 1, seconds)
        if not emitted:
            return
        backoff = self._batch_backoff.get(batch)
        if backoff is None:
            plain = batch / self.batch_seconds(batch, batch)
            backoff = self._batch_backoff[batch] = BatchBackoff(Ema(self.config.rate_ema, plain),
                                                                Ema(self.config.rate_ema, plain))
        goodput = sum(emitted) / max(seconds + draft_seconds, 1e-12)
        if backoff.pause.waiting():
            backoff.plain.update(goodput)
            backoff.resumed = True
            return
        if not any(plan.drafted for plan in plans):
            backoff.plain.update(goodput)
            return
        if any(plan.probes for plan in plans):
            return  # a probe's chain, verified whatever its estimates: not judged (as alone)
        if backoff.resumed:
            backoff.resumed = False
            backoff.drafting = Ema(self.config.rate_ema, goodput)
        if backoff.drafting.update(goodput) < backoff.plain.get() * (1 - self.config.backoff_tolerance):
            backoff.pause.lose(self.config.max_backoff)
        else:
            backoff.pause.win()

    def observe(self, plan: Plan, step: StepResult, state: PlannerState, timing: StepTiming) -> None:
        """Learn acceptance from the step; the back-off judges the drafting steps by what they realised."""
        self._overhead.update(timing.overhead_seconds)
        tree = step.proposal.tree
        if not step.idle:  # evidence fades with the steps, drafted or not; not with a batch step on
            # which this session drafted nothing because drafts do not pay at the load (the batch
            # back-off decides when to try again). Faded there, 8 sessions idle through a 64-step
            # pause forgot everything (0.95^512), and each probe verified a tree priced at the
            # prior: 20-35 nodes in a pass of 8, at 2 ms each, of which a third to a half were accepted (SmolLM2).
            d = self.config.bias_decay
            for sums in (*self._recent.values(), *self._context.values(), *self._trees.values()):
                sums[0] *= d
                sums[1] *= d
        self._observe_kind(plan, step)
        on_path = set(step.path)
        best = best_children(tree)
        contexts = plan.contexts if plan.contexts is not None else sibling_contexts(tree)
        estimates = self._source_estimates(tree) if any(contexts) else []
        for i, par in enumerate(tree.parents):
            if par < 0 or par in on_path:  # a trial: the node's parent was accepted
                accepted = i in on_path
                if contexts[i] is not None:  # its context's factor learns; the sources' only alone
                    est, src = estimates[i]
                    sums = self._context.setdefault((src, contexts[i]), [0.0, 0.0])
                    sums[0] += accepted
                    sums[1] += est
                for source, raw in tree.proposers(i):  # every source that proposed it, on its own score
                    if contexts[i] is None:
                        sums = self._recent.setdefault(source, [0.0, 0.0])
                        sums[0] += accepted
                        sums[1] += self.calibrator.estimate(source, raw)  # the factor divides calibration alone
                    self.calibrator.update(source, raw, accepted, best=(i, source) in best)
        for schedule in self._chain_probes.values():  # probes are steps apart, not refusals: a drafter
            schedule.waiting()  # refused seldom (the back-off pausing the drafting steps) would wait for ever
        if plan.probes:
            self._judge_probes(plan, step, timing)
        if plan.batch == 1:
            self._observe_beside(plan, step, state, timing)
        if self._hold_pause(plan, state, timing):
            return
        # Back-off: do drafting steps beat plain steps? Each judged step counts what it realised
        # (tokens / its drafting + verify seconds; a step that found nothing worth verifying paid its
        # drafting for a plain step), so a text on which every estimate is wrong still stops
        # drafting after a few losses. If drafting loses, pause it for 1, 2, 4, ... steps, then
        # probe again.
        # A step after the prefill or a pause may carry the drafters' catch-up over the tokens
        # committed meanwhile (a head's cache: 1.7 plain steps over a prompt, SmolLM2): judged at
        # that cost, the probe after every pause lost and doubled the next pause. It is judged
        # at most at the drafting time of steps that follow a drafting step (not before one was
        # seen).
        resumed, drafted = state.resumed and plan.drafted, timing.draft_seconds
        if plan.drafted:
            state.resumed = False
            if not resumed:
                self._steady_draft.update(drafted)
        if resumed:
            if self._steady_draft.value is None:
                return
            drafted = min(drafted, self._steady_draft.value)
        if plan.rate is None:
            return
        afresh, state.afresh = state.afresh, False
        rate = (1 + len(step.path)) / (self.drafting_seconds(drafted) + timing.verify_seconds)
        if state.rate is None:  # the plan's prediction counts as one step: one unlucky first step pauses nothing
            prior = plan.rate
            if resumed and plan.predicted is not None:  # predicted at the drafting time it is judged at:
                # the plan's rate paid the catch-up (a draft model's prefill over the prompt), so on a
                # new request after others it read below plain and one unlucky first step paused drafting
                verify = self.cost.verify_seconds(len(plan.proposal.tree) + 1)
                prior = plan.predicted / (self.drafting_seconds(drafted) + verify)
            state.rate = Ema(self.config.rate_ema, 0.5 * (prior + rate))
            smoothed = state.rate.get()
        elif afresh:  # a probe after a pause: judged afresh by what it realised. Through the average of
            # the losses that paused drafting even a winning probe read below plain and doubled the
            # pause, so a request whose first drafts missed seldom drafted again (measured: an MT-bench
            # prompt on SmolLM2 drafted 8 of 63 steps where every step pays 1.68 tokens). Its prediction
            # does not count here: where the estimates are wrong every probe would win on it
            state.rate = Ema(self.config.rate_ema, rate)
            smoothed = rate
        else:
            smoothed = state.rate.update(rate)
        plain_rate = 1.0 / self.cost.estimate(1)
        if smoothed < plain_rate * (1 - self.config.backoff_tolerance):
            state.backoff.lose(self.config.max_backoff)
        else:
            state.backoff.win()

    def _hold_pause(self, plan: Plan, state: PlannerState, timing: StepTiming) -> bool:
        """Whether the step sat in the hold-back's pause rather than drafted: a drafter was held, the
        drafters that ran proposed no node and their drafting cost under `hold_min_cost` of a plain
        step. Such a step is a plain step in all but name; the back-off does not judge it (nor time
        it as a steady drafting step). Judged, it read as a win at the plain rate: a lone costly
        drafter that never pays, held between its probes, halved the back-off's pause on every held
        step and reset its average to plain after every pause, so the probes that lost were paused
        for 1 or 2 steps instead of 1, 2, 4, ... 64 (the hold-back's 16 became the back-off's longest).
        A step on which the drafters that were not held proposed nodes is judged: it is a drafting
        step of those drafters, and its rate is what drafting with them realises."""
        return (plan.drafted and plan.candidates == 0 and bool(state.held)
                and timing.draft_seconds < self.config.hold_min_cost * self.cost.estimate(1))

    def _observe_kind(self, plan: Plan, step: StepResult) -> None:
        """Learn the factor of the plan's tree kind (`tree_factor`): the drafted tokens accepted against
        the prediction before the factor (every path probability was scaled by it)."""
        if not plan.kind or plan.predicted is None or plan.nodes == 0:
            return
        sums = self._trees.setdefault(plan.kind, [0.0, 0.0])
        sums[0] += len(step.path)
        sums[1] += (plan.predicted - 1.0) / plan.tree_factor

    def _judge_probes(self, plan: Plan, step: StepResult, timing: StepTiming) -> None:
        """Did the probes pay? Each probing source's gain (the step's tokens/s over what the same step
        would have realised without its chain: the accepted path cut at its first node no other
        drafter proposed, its drafting and its nodes' share of the pass taken off, `_without`; its
        own drafting counted at most at its steady drafting time: a draft cache's catch-up after idle
        steps is not what drafting costs) is averaged over its probes, half the weight to the latest;
        over `min_gain`, the source may probe again at once (it drafts again once its estimates
        recover), else its next probe waits twice as long. Judged by each probe alone, or by the
        first token's acceptance, a drafter that does not pay on this text (half its tokens accepted
        at a quarter of a step each) won a third of its probes by luck and probed every few steps;
        judged by the whole step against a plain one, a chain never accepted probed on every step
        that prompt lookup's copy paid for."""
        spent = dict(plan.drafter_seconds)
        counted = dict(spent)
        for source in plan.probes:
            steady = self._steady_seconds.get(source)
            if source in spent and steady is not None and steady.value is not None:
                counted[source] = min(spent[source], steady.value)
        drafted = max(0.0, timing.draft_seconds - sum(spent.values()) + sum(counted.values()))
        seconds = self.drafting_seconds(drafted)
        pass_seconds, others = self._pass_of(plan.batch)
        with_it = seconds + pass_seconds(len(step.proposal.tree) + 1)
        for source in plan.probes:
            # its own drafting: as reported, else (a caller that times no drafter apart) all of the
            # step's drafting that no other drafter reported
            own = counted.get(source, drafted - sum(v for k, v in counted.items() if k != source))
            tokens_without, seconds_without = self._without(step, source, seconds, max(0.0, own), pass_seconds)
            gain = (others + 1 + len(step.path)) * seconds_without / (with_it * (others + tokens_without))
            schedule = self.chain_probe(source)
            if self._probe_gain.setdefault(source, Ema(0.5)).update(gain) >= 1.0 + self.config.min_gain:
                schedule.left = 0
                schedule.win()
            else:
                schedule.lose(self.config.max_explore_gap)
                schedule.left *= plan.batch  # counted down by every session of a packed pass: as many batch steps

    def _pass_of(self, batch: int) -> tuple[Callable[[int], float], int]:
        """The cost model's latency of the pass a session's step is verified in, as a function of that
        session's tokens in it (its root included), and the other sessions' roots in it (a packed
        pass of `batch`: the table's row; alone, or without a packed-pass table: the lone cost model).
        What a step is planned by (`PlannerView.verify_seconds`) and its probes judged by."""
        if batch > 1 and self.batch_curve is not None:
            return (lambda n: self.batch_seconds(batch, batch - 1 + n)), batch - 1
        return self.cost.verify_seconds, 0

    def _without(self, step: StepResult, name: str, seconds: float, own: float,
                 pass_seconds: Callable[[int], float] | None = None) -> tuple[int, float]:
        """The step as it would have gone without drafter `name`, whose drafting took `own` of the
        step's `seconds` of drafting: its tokens (the accepted path cut at the first node no other
        drafter proposed, the bonus token included) and seconds (that drafting less `own`, and the
        cost model's pass without its nodes: `pass_seconds` of the session's tokens, default a lone pass)."""
        tree, path = step.proposal.tree, step.path
        alone = [all(source == name for source, _ in tree.proposers(i)) for i in range(len(tree))]
        kept = next((k for k, i in enumerate(path) if alone[i]), len(path))
        pass_seconds = pass_seconds or self.cost.verify_seconds
        return 1 + kept, seconds - own + pass_seconds(len(tree) - sum(alone) + 1)

    def _observe_beside(self, plan: Plan, step: StepResult, state: PlannerState, timing: StepTiming) -> None:
        """Hold-back evidence of one lone step: per drafter that proposed nodes, the step's tokens and
        seconds with it, and without it (the accepted path cut at its first node no other drafter
        proposed; its drafting seconds and its nodes' share of the pass taken off). A drafter's
        seconds after a step it did not draft on may carry a catch-up (a draft cache or a head's
        over the tokens committed meanwhile, or the prompt): they count at most at its steady
        drafting time, and not at all before that is known."""
        spent = dict(plan.drafter_seconds)
        last, state.last_drafted = state.last_drafted, frozenset(spent)
        counted: dict[str, float] = {}
        for name, seconds in spent.items():
            steady = self._steady_seconds.setdefault(name, Ema(self.config.overhead_ema))
            if name in last:
                steady.update(seconds)
            if steady.value is not None:
                counted[name] = min(seconds, steady.value)
        if not counted:
            return  # nothing judged: a probe drafts again next step
        tree, path = step.proposal.tree, step.path
        # the step's drafting (planning and drafters that proposed nothing included; each timed drafter
        # at its counted seconds) and bookkeeping
        seconds = (max(0.0, timing.draft_seconds - sum(spent.values()))
                   + sum(counted.get(name, raw) for name, raw in spent.items()) + self._overhead.get())
        with_it = seconds + self.cost.verify_seconds(len(tree) + 1)
        d = self.config.hold_decay
        for name, own in counted.items():
            if any(other != name and cost > own for other, cost in counted.items()):
                # a costlier drafter drafted beside it: two that propose alike would each look idle.
                # A probe is not judged here (nor lost), as one that proposed nothing is not: the
                # evidence that held it is older than this step, and judged by it a cheap head beside
                # a draft model that drafts on every step (where the head mostly proposes nothing)
                # sat out most steps after one unlucky step alone (Qwen2.5-Coder-1.5B, everyday set:
                # held on 6-15 of a request's 10-22 steps)
                continue
            tokens_without, without = self._without(step, name, seconds, own)
            sums = state.evidence.setdefault(name, [0.0, 0.0, 0.0, 0.0])
            if name in state.probing:  # a probe judges afresh: the text may have changed since it paused
                sums[:] = [0.0, 0.0, 0.0, 0.0]
            for k, value in enumerate((1 + len(path), with_it, tokens_without, without)):
                sums[k] = d * sums[k] + value
            self._evidence[name] = list(sums)  # where the next request starts
            if name in state.probing and not self.adds_beside(name, state):
                state.holds[name].lose(self.config.max_hold)  # it still does not pay: a longer pause

    def summary(self, state: PlannerState) -> dict:
        """What the planner expected for one request on the prior cost curve, summed over planned
        steps: mean tree size, expected tokens per step and the projected speedup over plain
        decoding; and how this run's timed passes corrected the curve."""
        p = state.projected
        if p.steps == 0:
            return {"steps": 0, "paused_steps": state.paused_steps}
        plain_rate = 1.0 / self.cost.curve.latency(1)  # the same prior curve as the steps' seconds
        return {
            "steps": p.steps,
            "mean_tree_nodes": round(p.nodes / p.steps, 2),
            "expected_tokens_per_step": round(p.tokens / p.steps, 3),
            "projected_speedup": round((p.tokens / p.seconds) / plain_rate, 3),
            "plain_step_seconds": round(self.cost.estimate(1), 6),
            "cost_curve_ratio_8": round(self.cost.curve.ratio(8), 3),
            "observed_ratio_8": round(self.cost.estimate(8) / self.cost.estimate(1), 3),
            "paused_steps": state.paused_steps,
            **({"held_steps": dict(state.held_steps)} if state.held_steps else {}),
            **({"tree_factors": self.tree_factors} if self._trees else {}),
        }
