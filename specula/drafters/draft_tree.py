"""`draft-tree`: a draft model expands a token tree level by level (EAGLE-2, DySpec, RSD).

Each level runs the draft once over the new frontier nodes with tree attention in the
request's own draft KV cache (`TargetSequence.forward_tree_incremental`): a node sees the
committed prefix and its ancestors. After the step the draft cache keeps the committed prefix
plus the accepted nodes it already ran (`observe`); the next step syncs by longest common
prefix, like `draft-model`.

How siblings are drafted (`tree_sampling`) and the acceptance rule that matches:

* greedy requests (temperature 0), every mode: EAGLE-2 dynamic expansion. Each frontier node
  gets the draft's top-k tokens as children; a node's score is the product of draft
  probabilities along its path; the best k nodes of each level form the next frontier;
  finally the best N nodes overall are kept (`TokenTree.top_node_indices`, ancestor-closed
  as path scores shrink along paths). Verified by the greedy rule: output = plain greedy.
* ``deterministic`` (sampled requests): the same expansion on the draft's processed
  distribution (the request's temperature / top-k / top-p); fixed candidates, verified by the
  deterministic rule. Each node's first child is coupled: the token its q races to with the
  noise the target's token at that position is raced with (`DraftContext.coupling_noise`), so
  where q is close to p it is the target's token; the path of first children is always
  expanded (`_top_children`, `_frontier`).
* ``iid``: each expanded node gets k children drawn i.i.d. from its processed q; verified by
  RRS with replacement, or SpecTr K-SEQ (`tree_verifier="kseq"`, sibling mode ``iid_kseq``).
* ``without_replacement``: k children drawn without replacement (Gumbel-top-k); RRS without
  replacement.
* ``beam``: stochastic beam search (RSD-S; Kool et al. 2019): every beam node's children are
  ranked by Gumbel-perturbed log path probability (truncated so that a child never beats its
  parent), and the best k children over the whole level form the next beam. A node's kept
  children are a prefix of its Gumbel-top-k order, i.e. draws without replacement; RRS
  without replacement.

A long prompt (`draft_window`, default 512): the draft cache reads the prompt's first and last
halves of the window, then everything generated, as `draft-model`'s does (`draft_model.window_view`):
its catch-up costs a fixed amount however long the prompt; the target still verifies every node.

With a planner (`ctx.cost`), expansion reads its cost view: once a drafting pass has been
timed, the drafter asks `plan_chain` before its first pass whether drafting pays at all this step
(a head or draft model that the target seldom agrees with, or that costs too much of a step, then
drafts nothing: the method can never be slower than not drafting by much more than its timing
probe), and before each further level whether one more level along the best path pays. Which
levels are run depends only on what was drafted before, so the sampled modes stay lossless.

Losslessness of the sampled modes rests on one rule, kept here: the number of children of a
node is fixed before they are drawn, or (beam) depends only on Gumbel key values, which are
independent of which token holds them given the earlier draws. Which nodes are expanded may
depend on anything drawn before (path scores). So sampled trees are never pruned after
drawing: the drafter stops drawing at the node budget instead. Edge scores of sampled nodes
are their probabilities under q, for planners that size trees; a planner must not drop sampled
siblings by these scores (only whole draw-order suffixes, chosen without looking at them).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Callable, Literal, Sequence, get_args

import torch

from specula.drafters.base import DraftContext, Proposal, StepResult, method_config
from specula.drafters.draft_model import VocabFit, fitted_window, resolve_window, window_view
from specula.drafters.lockstep import Clock, Steps, drive, immediate
from specula.ema import Ema
from specula.errors import ConfigError
from specula.models.base import TargetModel, TargetSequence, keep_common_prefix
from specula.sampling import (SamplingParams, gumbel_keys, probabilities, race, sample_iid,
                              sample_without_replacement)
from specula.tree import SiblingMode, TokenTree

TreeSampling = Literal["deterministic", "iid", "without_replacement", "beam"]
TreeVerifier = Literal["rrs", "kseq"]


@dataclass(frozen=True)
class DraftTreeConfig:
    """Draft-model tree settings."""

    tree_sampling: TreeSampling = "deterministic"
    """How siblings are drafted for sampled requests (greedy requests always expand the top-k)."""
    tree_top_k: int = 4
    """Children per expanded node, and frontier (beam) nodes kept per level."""
    tree_depth: int = 5
    """Deepest level drafted."""
    tree_nodes: int = 24
    """Most nodes proposed: deterministic trees keep the best N; sampled trees stop drawing at N."""
    tree_verifier: TreeVerifier = "rrs"
    """Acceptance rule for i.i.d. siblings: recursive rejection sampling or SpecTr K-SEQ."""
    adaptive: bool = True
    """With a planner: draft only while its cost view says drafting pays (before the first pass,
    and before each level); False drafts the configured tree every step."""

    def __post_init__(self) -> None:
        if self.tree_sampling not in get_args(TreeSampling):
            raise ConfigError(f"tree_sampling must be one of {', '.join(get_args(TreeSampling))}, "
                              f"got {self.tree_sampling!r}")
        if self.tree_verifier not in get_args(TreeVerifier):
            raise ConfigError(f"tree_verifier must be rrs or kseq, got {self.tree_verifier!r}")
        if self.tree_verifier == "kseq" and self.tree_sampling != "iid":
            raise ConfigError('tree_verifier="kseq" needs i.i.d. siblings: use tree_sampling="iid" with '
                              'tree_verifier="kseq"')
        for name in ("tree_top_k", "tree_depth", "tree_nodes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def sibling_mode(self) -> SiblingMode:
        """The verification mode of this configuration's sampled trees."""
        if self.tree_sampling == "iid":
            return "iid_kseq" if self.tree_verifier == "kseq" else "iid"
        if self.tree_sampling in ("without_replacement", "beam"):
            return "without_replacement"
        return "deterministic"


# ---------------------------------------------------------------------------- stochastic beam search
def _log1mexp(a: torch.Tensor) -> torch.Tensor:
    """log(1 - e^a) for a <= 0 (stable on both ends)."""
    return torch.where(a > -0.6931, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def truncated_child_scores(parent: float, keys: torch.Tensor, top: float) -> torch.Tensor:
    """Stochastic beam search: the perturbed scores of a node's children, conditioned on their
    maximum being the parent's perturbed score (Kool et al. 2019, appendix B):
    G = -log(e^-parent - e^-top + e^-key), computed stably. keys: [m] untruncated
    perturbed scores (log path probability + Gumbel), top: their maximum over all children.
    Monotone in the key, and the child with key == top gets exactly `parent`."""
    v = parent - keys + _log1mexp(keys - top)  # [m]
    return parent - v.clamp(min=0.0) - torch.log1p(torch.exp(-v.abs()))


# ---------------------------------------------------------------------------- the draft-side tree
class _DraftSide:
    """The tree the draft cache holds while drafting: first the committed tokens the cache
    lacked (the first is the draft tree's root, the rest a chain ending at the proposal's
    root), then the proposal nodes that were run (the expanded ones), in run order."""

    def __init__(self, missing: Sequence[int]) -> None:
        self.root = int(missing[0])
        self.chain = len(missing) - 1
        self.tokens: list[int] = [int(t) for t in missing[1:]]
        self.parents: list[int] = list(range(-1, self.chain - 1))
        self.base = self.chain - 1  # draft node the proposal's root children hang from
        self.fed: dict[int, int] = {}  # proposal node -> draft node
        self.child: dict[tuple[int, int], int] = {}  # (draft parent, token) -> first draft child

    def add(self, node: int, token: int, parent: int) -> None:
        par = self.base if parent < 0 else self.fed[parent]
        index = len(self.tokens)
        self.fed[node] = index
        self.child.setdefault((par, token), index)
        self.tokens.append(token)
        self.parents.append(par)

    def tree(self) -> TokenTree:
        return TokenTree.build(self.tokens, self.parents)

    def commit_path(self, accepted: Sequence[int]) -> list[int]:
        """Draft nodes to keep: the chain, then the longest run of `accepted` tokens the draft ran."""
        path = list(range(self.chain))
        node = self.base
        for tok in accepted:
            nxt = self.child.get((node, int(tok)))
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        return path


# ---------------------------------------------------------------------------- the drafter
class _TreeState:
    """One request's draft cache, and the tree it holds while a step is in flight."""

    def __init__(self, seq: TargetSequence, fit: VocabFit | None = None) -> None:
        self.seq = seq
        self.fit = fit  # the draft beside a target of another vocabulary width (None: alike)
        self.side: _DraftSide | None = None

    def begin(self, tokens: Sequence[int]) -> torch.Tensor:
        """Sync the draft cache with the committed tokens and run the root (with any committed
        tokens the cache lacks, as a chain): logits [vocab] after the root."""
        self.finish(())
        keep = keep_common_prefix(self.seq, tokens, limit=len(tokens) - 1)
        missing = list(tokens[keep:])  # the last one is the root
        self.side = _DraftSide(missing)
        logits = self.seq.forward_tree(missing[0], TokenTree.chain(missing[1:]))  # [len(missing), vocab]
        return logits[-1] if self.fit is None else self.fit.scores(logits[-1])

    def feed(self, nodes: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Run proposal nodes (their parents already ran) through the draft: logits [len(nodes), vocab]."""
        side = self.side
        assert side is not None
        for node in nodes:
            side.add(node, tokens[node], parents[node])
        logits = self.seq.forward_tree_incremental(side.tree())
        return logits if self.fit is None else self.fit.scores(logits)

    def finish(self, accepted: Sequence[int]) -> None:
        """Commit the drafted tree: keep the accepted tokens the draft already ran."""
        if self.side is not None:
            self.seq.commit(self.side.commit_path(accepted))
            self.side = None

    vocab_index = None
    """Token id of each logit index ([V_draft] long), or None: logit index = token id."""

    @staticmethod
    def token_ids(indices: Sequence[int]) -> list[int]:
        """Logit indices -> token ids (a draft model predicts over the target's vocabulary)."""
        return [int(i) for i in indices]

    def release(self) -> None:
        self.seq.release()


def _run(state, name: str, *args) -> Steps:
    """The state's `begin` / `feed` as lockstep steps: its `begin_steps` / `feed_steps` generator
    where it has one (a trained head's passes, which a batch runs together), else the direct call."""
    steps = getattr(state, f"{name}_steps", None)
    return (yield from (immediate(getattr(state, name), *args) if steps is None else steps(*args)))


@functools.cache
def _kernel_top_k() -> Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None:
    """specula's C top-k with softmax probabilities (`models.native.kernels.top_k_probs`) where its CPU
    kernels run, else None (torch's topk and logsumexp then)."""
    from specula.models.native import kernels

    return kernels.top_k_probs if kernels.usable() else None


class DraftTreeDrafter:
    """Dynamic token trees from a smaller causal LM (see the module docstring)."""

    name = "draft-tree"

    def __init__(self, draft: TargetModel, config: DraftTreeConfig = DraftTreeConfig(), draft_window: int = 0,
                 fit: VocabFit | None = None) -> None:
        self.draft = draft
        self.config = config
        self.fit = fit
        """How the draft reads and scores the target's ids where their widths differ (None: alike)."""
        self.draft_window = draft_window if draft is None else fitted_window(draft_window, draft.max_context)
        """Most prompt tokens the draft model reads (`draft_model.window_view`, `fitted_window`; 0: the
        whole prompt). The trained heads (a subclass) read the target's features of every token: 0."""
        self._level_seconds = Ema(0.2)
        """Seconds of one level's drafting pass over its frontier (the root's pass may carry a
        prompt's catch-up, so it is not timed): what the cost view prices a level at."""

    @property
    def memory_bytes(self) -> int:
        """Bytes of the draft model's weights (its per-request KV caches come on top)."""
        return self.draft.weight_bytes

    @property
    def max_context(self) -> int:
        """Most tokens the drafting state can hold (committed tokens + the nodes it ran)."""
        return self.draft.max_context

    @property
    def vocab_size(self) -> int:
        """Width of the proposal's q rows (the target's token ids)."""
        return self.draft.vocab_size if self.fit is None else min(self.fit.draft_vocab, self.fit.target_vocab)

    # ------------------------------------------------------------------ protocol
    def start(self) -> _TreeState:
        return _TreeState(self.draft.new_sequence(), self.fit)

    def propose(self, ctx: DraftContext, state: _TreeState) -> Proposal:
        return drive(self.propose_steps(ctx, state, time.perf_counter))

    def propose_steps(self, ctx: DraftContext, state: _TreeState, clock: Clock) -> Steps:
        """`propose` as lockstep steps (`drafters.lockstep`): yields each drafting pass, returns the
        proposal; `clock` reads this session's drafting seconds (what the cost view prices)."""
        cfg = self.config
        tokens = window_view(ctx.tokens, ctx.prompt_len, self.draft_window)  # what the draft reads
        if self.fit is not None:
            tokens = self.fit.read(tokens)
        room = self.max_context - len(tokens)  # the draft cache holds tokens + the nodes it ran
        budget = min(cfg.tree_nodes, ctx.budget.max_nodes, room)
        depth = min(cfg.tree_depth, ctx.budget.max_depth)
        if budget <= 0 or depth <= 0:
            return Proposal.empty()
        # Until a pass has been timed the tree is drafted in full once: that measures it.
        adaptive = cfg.adaptive and ctx.cost is not None and self._level_seconds.value is not None
        # (The view also answers yes now and then where drafting does not pay: a probe, so estimates
        # learned on other text can recover.)
        if adaptive and ctx.cost.plan_chain(self.name, [], self._level_seconds.value, 0.0, depth) <= 0:
            return Proposal.empty()  # not worth a drafting pass this step (the state catches up later)
        t0 = clock()
        root_logits = yield from _run(state, "begin", tokens)
        if root_logits is None:  # nothing to draft from yet
            return Proposal.empty()
        mode = "deterministic" if ctx.params.greedy else cfg.tree_sampling
        if mode == "beam":
            return (yield from self._beam(state, root_logits, ctx, budget, depth, clock, t0 if adaptive else None))
        return (yield from self._expand(state, root_logits, ctx, budget, depth, mode, room, clock,
                                        t0 if adaptive else None))

    def _level_pays(self, ctx: DraftContext, best: int, parents: list[int], edges: list[float], levels_left: int,
                    clock: Clock, t0: float | None) -> bool:
        """Whether the cost view says one more level along the path to node `best` pays, `t0` being
        when drafting began on `clock` (None: not adaptive, always)."""
        if t0 is None:
            return True
        return ctx.cost.plan_chain(self.name, self._path_edges(best, parents, edges), self._level_seconds.value,
                                   clock() - t0, levels_left) > 0

    def observe(self, step: StepResult, state: _TreeState) -> None:
        state.finish(step.accepted_tokens)

    def finish(self, state: _TreeState) -> None:
        state.release()

    # ------------------------------------------------------------------ expansion
    @staticmethod
    def _top_children(logits: torch.Tensor, params: SamplingParams, k: int,
                      noise: torch.Tensor | None = None) -> tuple[list[list[float]], list[list[int]]]:
        """Per frontier row of logits [F, vocab], its k best children: (probabilities, indices), best
        first, without the children outside the row's support. Greedy requests score by the plain
        softmax, computed for the k picks only (their logits less the row's logsumexp: no [F, vocab]
        distribution is built; on CPU in one C pass per row where specula's kernels run); sampled
        requests by the processed distribution (temperature, top-k, top-p), whose support may hold
        fewer than k tokens. `noise` ([vocab], a sampled request that couples: the noise its target's
        token at this level's position is raced with, `DraftContext.coupling_noise`): each row's first
        child is the token its q races to (the target's token as often as q's closeness to p allows), scored
        as sure as the row's best, then the others best first, each scored q(x) (1 - the row's best): the
        target's token is seldom another where q is sure, so their subtrees do not outrank the coupled path's
        (a coupled child outside the top k takes the k-th's place)."""
        c_top_k = _kernel_top_k() if params.greedy and logits.device.type == "cpu" else None
        if c_top_k is not None:
            values, indices = c_top_k(logits.float(), k)  # [F, k] each
        elif params.greedy:
            logits = logits.float()
            top = logits.topk(k, dim=-1)
            values, indices = (top.values - logits.logsumexp(-1, keepdim=True)).exp(), top.indices  # [F, k]
        else:
            q = probabilities(logits, params)  # [F, vocab]
            top = q.topk(k, dim=-1)
            values, indices = top.values, top.indices
            if noise is not None:  # the coupled child first; the k-th gives way where it is new
                won = race(q, noise).argmax(-1, keepdim=True)  # [F, 1]
                rest = indices != won  # [F, k]: one False where the winner is among the top k
                rest[:, -1] &= ~rest.all(-1)  # ... else the k-th gives way
                rows, best = indices.shape[0], values[:, :1]  # best: [F, 1]
                indices = torch.cat([won, indices[rest].view(rows, k - 1)], -1)  # [F, k]
                values = torch.cat([best, values[rest].view(rows, k - 1) * (1 - best)], -1)
        probs, idx = values.tolist(), indices.tolist()
        for f, row in enumerate(probs):  # best first: a zero ends the row's support
            if params.greedy and row and row[0] != row[0]:  # NaN: a +inf logit (e^(inf - inf)); as the C pass,
                infs = int(logits[f].isposinf().sum())  # softmax's limit: the +inf logits share the mass
                row = [1.0 / infs if logits[f, i] == float("inf") else 0.0 for i in idx[f]] if infs else row
            keep = next((j for j, p in enumerate(row) if not p > 0), len(row))
            probs[f], idx[f] = row[:keep], idx[f][:keep]
        return probs, idx

    def _expand(self, state: _TreeState, root_logits: torch.Tensor, ctx: DraftContext, budget: int, depth: int,
                mode: str, room: int, clock: Clock, t0: float | None = None) -> Steps:
        """Top-k (deterministic) or sampled (iid / without_replacement) children per frontier
        node; the best top_k nodes of each level by path score are expanded next, while the cost
        view says a level more pays (`t0`: when drafting began; None: no cost view) and the draft
        cache has `room` for the nodes run through it."""
        cfg, gen = self.config, ctx.generator
        sampled = mode != "deterministic"
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []  # path probabilities (to pick the frontier)
        edges: list[float] = []
        q_rows: dict[int, torch.Tensor] = {}  # row -> q its children were drawn from
        nodes, level_logits = [-1], root_logits[None]  # the frontier and the logits after each [F, vocab]
        spine: int | None = None  # a coupled tree's path of first children: its node at the last level (-1: root)
        fed = 0  # nodes run through the draft cache
        for level in range(1, depth + 1):
            new: list[int] = []
            if sampled:
                q = probabilities(level_logits, ctx.params)  # [F, vocab]
                picks, drawn = [], 0
                for f, node in enumerate(nodes):
                    k = min(cfg.tree_top_k, budget - len(tokens) - drawn)
                    if k <= 0:  # fixed before drawing
                        break
                    draw = sample_iid if mode == "iid" else sample_without_replacement
                    kids = draw(q[f], k, gen).tolist()
                    q_rows[node + 1] = q[f]
                    picks.append((node, kids, q[f][kids].tolist()))
                    drawn += len(kids)
            else:  # one top-k over the whole frontier; a row keeps no more children than it has support
                noise = ctx.coupling_noise(level - 1, level_logits.shape[-1], state.vocab_index)
                spine = (-1 if level == 1 else spine) if noise is not None else None
                probs, idx = self._top_children(level_logits, ctx.params, min(cfg.tree_top_k, level_logits.shape[-1]),
                                                noise)
                picks = [(node, idx[f], probs[f]) for f, node in enumerate(nodes)]
            ids = state.token_ids([i for _, kids, _ in picks for i in kids])
            at = 0
            parent_of_spine, spine = spine, None
            for node, kids, probs in picks:
                if node == parent_of_spine and kids:
                    spine = len(tokens)  # its first child: the coupled one
                score = 1.0 if node < 0 else scores[node]
                for tok, prob in zip(ids[at:at + len(kids)], probs):
                    tokens.append(int(tok))
                    parents.append(node)
                    scores.append(score * prob)
                    edges.append(prob)
                    new.append(len(tokens) - 1)
                at += len(kids)
            if level == depth or not new or (sampled and len(tokens) >= budget):
                break
            chosen = self._frontier(new, tokens, parents, scores, dedupe=mode == "iid", keep=spine)
            chosen = chosen[:max(0, room - fed)]  # the draft cache holds the tokens and every node fed
            best = max(new, key=lambda i: scores[i])
            if not chosen or not self._level_pays(ctx, best, parents, edges, depth - level, clock, t0):
                break
            fed += len(chosen)
            t_level = clock()
            level_logits = yield from _run(state, "feed", chosen, tokens, parents)  # [len(chosen), vocab]
            self._level_seconds.update(clock() - t_level)
            nodes = chosen
        tree = TokenTree.build(tokens, parents, edges, self.name)
        if not sampled:
            return Proposal(tree.top_nodes(budget))
        return Proposal(tree, self._stack(q_rows, len(tree), state), self.config.sibling_mode)

    @staticmethod
    def _path_edges(node: int, parents: list[int], edges: list[float]) -> list[float]:
        """Edge probabilities from the root's child down to `node`."""
        path = []
        while node >= 0:
            path.append(edges[node])
            node = parents[node]
        return path[::-1]

    def _frontier(self, new: list[int], tokens: list[int], parents: list[int], scores: list[float],
                  dedupe: bool, keep: int | None = None) -> list[int]:
        """The best top_k of this level's nodes by path score (ties: node order), in node order, and
        node `keep` whatever its score (a coupled tree's path of first children, `_top_children`).
        With i.i.d. siblings a repeated token under the same parent stays a leaf (its subtree
        would repeat its twin's)."""
        seen: set[tuple[int, int]] = set()
        chosen: list[int] = [] if keep is None else [keep]
        for i in sorted(new, key=lambda i: (-scores[i], i)):
            if i == keep:
                continue
            if len(chosen) == self.config.tree_top_k or not scores[i] > 0:
                break
            key = (parents[i], tokens[i])
            if dedupe and key in seen:
                continue
            seen.add(key)
            chosen.append(i)
        return sorted(chosen)

    def _beam(self, state: _TreeState, root_logits: torch.Tensor, ctx: DraftContext, budget: int,
              depth: int, clock: Clock, t0: float | None = None) -> Steps:
        """Stochastic beam search of width top_k; children of a beam node in Gumbel order. A level more
        is drafted while the cost view says it pays along the likeliest beam (`t0`: when drafting
        began; None: no cost view), as `_expand` asks; each level's pass is timed for it."""
        width, gen = self.config.tree_top_k, ctx.generator
        tokens: list[int] = []
        parents: list[int] = []
        edges: list[float] = []
        q_rows: dict[int, torch.Tensor] = {}
        beams = [(-1, root_logits, 0.0, 0.0)]  # (node, logits, perturbed score G, log path prob)
        for level in range(1, depth + 1):
            w = min(width, budget - len(tokens))  # fixed before drawing
            if w <= 0:
                break
            candidates = []  # (G, beam, rank, token, log path prob)
            dists = []
            for b, (node, logits, g_parent, log_path) in enumerate(beams):
                q = probabilities(logits, ctx.params)  # [vocab]
                dists.append(q)
                keys = log_path + gumbel_keys(q, gen)  # [vocab]: Gumbel-top-k order = draws w/o replacement
                top = keys.topk(min(w, int((q > 0).sum())))
                g_child = truncated_child_scores(g_parent, top.values, float(top.values[0]))
                log_q = q[top.indices].double().log()
                kids = state.token_ids(top.indices.tolist())
                for rank, (g, tok, lq) in enumerate(zip(g_child.tolist(), kids, log_q.tolist())):
                    candidates.append((g, b, rank, int(tok), log_path + lq, lq))
            chosen = sorted(sorted(candidates, key=lambda c: -c[0])[:w], key=lambda c: (c[1], c[2]))
            new_beams = []
            for g, b, _, tok, log_path, lq in chosen:
                node = beams[b][0]
                tokens.append(tok)
                parents.append(node)
                edges.append(math.exp(lq))
                q_rows[node + 1] = dists[b]
                new_beams.append((len(tokens) - 1, g, log_path))
            if level == depth or len(tokens) >= budget:
                break
            best = max(new_beams, key=lambda beam: beam[2])[0]  # the likeliest path so far
            if not self._level_pays(ctx, best, parents, edges, depth - level, clock, t0):
                break
            t_level = clock()
            logits = yield from _run(state, "feed", [n for n, _, _ in new_beams], tokens, parents)
            self._level_seconds.update(clock() - t_level)
            beams = [(n, logits[j], g, lp) for j, (n, g, lp) in enumerate(new_beams)]
        tree = TokenTree.build(tokens, parents, edges, self.name)
        return Proposal(tree, self._stack(q_rows, len(tree), state), "without_replacement")

    def _stack(self, q_rows: dict[int, torch.Tensor], n: int, state) -> torch.Tensor:
        """q for the proposal: [n + 1, vocab] over the target's token ids (a reduced draft
        vocabulary's rows scattered back, zero elsewhere), zeros in rows without children."""
        width = max(self.vocab_size, *(len(d) for d in q_rows.values())) if q_rows else self.vocab_size
        q = torch.zeros((n + 1, width), dtype=torch.float32)
        for row, dist in q_rows.items():
            if state.vocab_index is None:
                q[row, : len(dist)] = dist.float()
            else:
                q[row, state.vocab_index] = dist.float()
        return q


CONFIG = DraftTreeConfig
"""The options `create` takes besides its keywords (`specula.methods`)."""


def create(*, target=None, draft: TargetModel | None = None, draft_window: int | None = None,
           **options) -> DraftTreeDrafter:
    """options: DraftTreeConfig fields (tree_sampling, tree_top_k, tree_depth, tree_nodes, tree_verifier);
    draft_window: as `draft-model`'s (`DraftModelConfig.draft_window`; None: `DEFAULT_WINDOW`)."""
    if draft is None:
        raise ConfigError("method 'draft-tree' needs a draft model: pass draft=MODEL (same tokenizer as the target)")
    return DraftTreeDrafter(draft, method_config("draft-tree", DraftTreeConfig, options), resolve_window(draft_window),
                            VocabFit.of(draft, target))
