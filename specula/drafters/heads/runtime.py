"""A loaded head bound to its target, and the per-request drafting states of each kind.

`TrainedHead` = the head module + the draft vocabulary mapping (`d2t`) + the target's output rows
of that vocabulary (`lm_rows`, [V_draft, E]) + the target's embedding (through
`FeatureModel.embed_tokens`). Each kind has a per-request state with the interface the
`draft-tree` expansion drives (`begin(tokens)` -> logits after the root, `feed(nodes, ...)` ->
logits after those nodes, `finish(accepted)`), in the head's draft vocabulary; `token_ids` maps an
index of those logits to the target's token id.

Features arrive from the engine: the prompt's after prefill (`add_features`), then every step's
root and accepted nodes. Position i's feature f_i is the target's last hidden state after token
x_i, which the target's head turns into x_{i+1}.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import numpy as np
import torch

from specula.drafters.heads.config import HeadConfig, feature_layers_of
from specula.drafters.heads.copy import CopyIndex
from specula.drafters.heads.eagle import EagleHead, KVBuffer
from specula.drafters.heads.file import HeadFile, check_target, read_head
from specula.drafters.heads.kernel_pass import HeadPass, HeadRows, KernelHeadPass, embedding_table, kernel_pass_fits
from specula.drafters.heads.medusa import HydraHeads, MedusaHeads
from specula.drafters.lockstep import Steps, drive
from specula.errors import ConfigError, HeadFileError
from specula.logprobs import step_rows_of

MODULES = {"eagle": EagleHead, "eagle3": EagleHead, "medusa": MedusaHeads, "hydra": HydraHeads}


def build_module(config: HeadConfig) -> torch.nn.Module:
    return MODULES[config.kind](config)


def check_d2t(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft vocabulary's map to target ids ([V_draft] long): integers, each a target id, none twice
    (q is scattered back through it: a token mapped twice would get one draft id's mass, and the
    sampling law would be off); a ConfigError otherwise."""
    if d2t.dim() != 1 or d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool:
        raise ConfigError(f"a head's draft vocabulary map must be a 1-D tensor of token ids, got {d2t.dtype} "
                          f"of shape {tuple(d2t.shape)}")
    d2t = d2t.to(torch.long)
    if len(d2t) and (int(d2t.min()) < 0 or int(d2t.max()) >= vocab or int(d2t.unique().numel()) != len(d2t)):
        raise ConfigError(f"a head's draft vocabulary map must hold distinct token ids in 0..{vocab - 1}")
    return d2t


class TrainedHead:
    """A head module bound to its target (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, d2t: torch.Tensor, target, file: HeadFile | None = None,
                 kernel: str | None = None) -> None:
        self.module = module.eval().requires_grad_(False)
        self.config: HeadConfig = module.cfg
        self.target = target
        self.file = file
        self.d2t = check_d2t(d2t, target.vocab_size)  # [V_draft]
        self._d2t_list: list[int] | None = None  # `d2t_list`, built on first use
        dtype = next(module.parameters()).dtype
        rows = target.output_rows(self.d2t).to(dtype)  # [V_draft, E]
        self.lm_rows: torch.Tensor | None = None if kernel is not None else rows.clone()
        """The target's output rows of the draft vocabulary (None when packed for kernel drafting)."""
        self.dtype = dtype
        seq_len = (file.training.get("config") or {}).get("seq_len") if file is not None else None
        self.window: int | None = int(seq_len) if seq_len else None
        """Committed pairs an eagle / eagle3 head attends to while drafting (a sliding window), or
        None: all. It is the context the head was trained on (`specula train` cuts sequences into
        chunks of `seq_len` pairs, positions from 0), so a head never sees more keys than it
        learned on, and a long prompt costs a catch-up pass over `window` rows, not over the
        whole prompt (SmolLM2's eagle3 head: 50 ms for a 750-token prompt in float32, about three
        plain target steps; 17 ms for 256 rows)."""
        self.context_vocab = DEFAULT_CONTEXT_VOCAB
        """Most target tokens outside the draft vocabulary a request's context adds to the head's
        output while drafting (`HeadState.add_context`; 0: none): see `DEFAULT_CONTEXT_VOCAB`."""
        self._in_vocab: torch.Tensor | None = None  # [V_target] bool: in the draft vocabulary (built on first use)
        self.kernel: str | None = None
        """The CPU kernel its linear layers draft on (`drafting_kernel`), or None: torch's, trainable."""
        self._lm: torch.nn.Module | None = None  # the output rows as a kernel linear, when `kernel` is set
        self.kernel_pass: KernelHeadPass | None = None
        """An eagle / eagle3 layer's drafting pass as direct kernel calls (`kernel_pass`), set with
        `kernel` where its shapes fit; None: the module's forward."""
        if kernel is not None:
            self._use_kernel(kernel, rows)

    def _use_kernel(self, kind: str, rows: torch.Tensor) -> None:
        """Draft on specula's CPU kernels (`models.native.kernels`, kind `i8`: int8 weights and
        activations): every linear layer of the head and the output rows; eagle3's `fuse` keeps float
        activations (kind `w8`): it reads the target's raw residual stream, whose few huge channels
        would leave the others a handful of int8 levels; an eagle layer drafts through
        `KernelHeadPass` (a level's rows, token ids to logits, in one kernel call) where its shapes
        fit; `rows` [V_draft, E]: the output rows to pack. Drafting only: the head cannot train after."""
        from specula.models.native.kernels import KernelLinear, apply_kernels, pack_weight

        if self.dtype != torch.float32:
            raise ValueError(f"kernel drafting takes a float32 head, got {self.dtype}")
        if self.config.feature_layers:
            self.module.fuse = KernelLinear(self.module.fuse, "w8")
        apply_kernels(self.module, kind, skip=("fuse",))
        self._lm = KernelLinear.from_packed(kind, self.config.hidden_size, len(self.d2t),
                                            *pack_weight(rows.float().contiguous(), kind))
        if kernel_pass_fits(self.module):
            self.kernel_pass = KernelHeadPass(self.module, self._lm, embedding_table(self.target))
        self.kernel = kind

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def memory_bytes(self) -> int:
        from specula.models.linears import weight_bytes

        lm = self._lm.memory_bytes if self._lm is not None else self.lm_rows.numel() * self.lm_rows.element_size()
        return weight_bytes(self.module) + lm

    @property
    def feature_request(self):
        """What it reads from the target's passes (`models.base.FeatureRequest`): the inputs of its
        feature layers (eagle3), else the last hidden state (True)."""
        return self.config.feature_layers or True

    def logits(self, out: torch.Tensor, extra_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The head's output [..., E] -> logits [..., V_draft] float32 (eagle3 norms it first), or
        [..., V_draft + X] with `extra_rows` [X, E] (float32 target output rows of X more tokens,
        `HeadState.add_context`) scored by the same hidden state."""
        return self.state_logits(self.module.output_states(out) if self.kind == "eagle3" else out, extra_rows)

    def state_logits(self, states: torch.Tensor, extra_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`logits` of the states the output rows read (eagle3: the output already normed)."""
        logits = self.target_logits(states)
        if extra_rows is None:
            return logits
        return torch.cat([logits, states.float() @ extra_rows.t()], dim=-1)

    def in_draft_vocab(self) -> torch.Tensor:
        """[V_target] bool: which target tokens the draft vocabulary holds."""
        if self._in_vocab is None:
            mask = torch.zeros(int(self.config.target_vocab), dtype=torch.bool)
            mask[self.d2t.cpu()] = True
            self._in_vocab = mask
        return self._in_vocab

    def target_logits(self, feat: torch.Tensor) -> torch.Tensor:
        """A final-normed target feature [..., E] -> the target's logits over the draft vocabulary
        [..., V_draft] float32 (what the losses distil)."""
        if self._lm is not None:
            return self._lm(feat.float())
        return (feat.to(self.dtype) @ self.lm_rows.t()).float()

    def embed(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Token ids [...] (a list or a long tensor of any shape) -> target embeddings [..., E] in the
        head's dtype (a normal tensor, usable in autograd)."""
        ids = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.long)
        flat = self.target.embed_tokens(ids.flatten()).to(self.dtype)  # [n, E]
        return flat.view(*ids.shape, -1).clone()

    def token_ids(self, indices: Sequence[int]) -> list[int]:
        """Draft-vocabulary indices -> target token ids (the exact mapping back)."""
        index = self.d2t_list
        return [index[i] for i in indices]

    @property
    def d2t_list(self) -> list[int]:
        """`d2t` as a list of ints (built once): what drafting maps indices through."""
        if self._d2t_list is None:
            self._d2t_list = self.d2t.tolist()
        return self._d2t_list

    def new_state(self) -> "HeadState":
        return {"eagle": EagleState, "eagle3": EagleState, "medusa": MedusaState, "hydra": HydraState}[self.kind](self)


DEFAULT_CONTEXT_VOCAB = 0
"""Tokens outside the draft vocabulary that a request's prompt and output add to a head's output
rows (the target's own rows for them, scored by the head's hidden state like the others;
`--head-context-vocab N`). A draft vocabulary of the corpus's 8,192 most frequent tokens holds
92-98% of SmolLM2's tokens in chat, code and math answers but 82% in news summaries and 69% in
translations (names, numbers, foreign words, mostly copied from the prompt): a chain stops at every
token the head cannot name. Off by default: with N = 1024 SmolLM2's head accepted more wherever
every drafted node was verified, but under the planner `eagle3` ran 1.00x of itself without it on
Spec-Bench and on the everyday set, and `fusion` 0.95x on the everyday set (docs/training.md,
"Long contexts and the draft vocabulary")."""

DRAFTING_KERNEL = "i8"
"""The kernel a head drafts on where specula's CPU kernels run (`drafting_kernel`)."""


def drafting_kernel(device: torch.device | str) -> str | None:
    """The CPU kernel a head drafts on: `i8` (int8 weights and activations, `TrainedHead._use_kernel`)
    wherever specula's CPU kernels run; None elsewhere (CUDA, whose head passes are launch-bound; a
    CPU without AVX2 or a C compiler). On SmolLM2's eagle3 head (2 threads) a one-row level costs
    0.57 ms against 2.88 ms in bfloat16 torch and 5.13 ms in float32, and greedy 5-token chains
    accept as much (1.670 tokens per step against 1.671 in float32; `scripts/head_kernels.py`): a
    draft needs no exactness, the target verifies every token."""
    if torch.device(device).type != "cpu":
        return None
    from specula.models.native.kernels import available

    return DRAFTING_KERNEL if available() else None


def drafting_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype a head drafts in without a drafting kernel: bfloat16 on a CPU with AVX512-BF16
    (oneDNN's `vdpbf16ps` passes: about twice as fast as float32 there), else float32 (an AVX2-only
    CPU would emulate bfloat16 slower than float32; CUDA keeps float32 too, its head passes are
    launch-bound)."""
    if torch.device(device).type != "cpu":
        return torch.float32
    from specula.models.native.kernels import cpu_has_bf16

    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def load_head(path: str | os.PathLike, target, target_name: str, dtype: torch.dtype | None = None) -> TrainedHead:
    """Read, check against `target`, build: a `HeadFileError` (one line, the fix named) for a
    missing, corrupted, mismatched or other-target file; nothing is loaded then. `dtype`: the
    weights' dtype (None: drafting only, on `drafting_kernel` where it runs, else in `drafting_dtype`;
    float32 for a head that keeps learning)."""
    file = read_head(path)
    check_target(file, target, path, target_name)
    with torch.device("meta"):  # no random weights drawn (0.2-0.3 s for the 1.5B's head): the file holds them all
        module = build_module(file.config)
    state = file.state
    if file.config.copy_ngram and "copy_gain" not in state:  # a head of before `copy_gain`: zero is what it computed
        state = state | {"copy_gain": torch.zeros(module.copy_gain.shape)}
    try:
        module.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:  # the first line is a header ("Error(s) in loading state_dict for ..."): name the cause
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        first = lines[1] if len(lines) > 1 else lines[0] if lines else "shape mismatch"
        raise HeadFileError(f"head {path} does not fit its own config ({first[:120]}); re-create it with "
                            "`specula train`") from None
    kernel = drafting_kernel(target.device) if dtype is None else None
    dtype = torch.float32 if kernel is not None else dtype or drafting_dtype(target.device)
    return TrainedHead(module.to(target.device, dtype), file.d2t, target, file, kernel=kernel)


# ---------------------------------------------------------------------------- per-request states
class HeadState:
    """Features of the committed tokens the head has not consumed yet; tree bookkeeping."""

    def __init__(self, head: TrainedHead) -> None:
        self.head = head
        self.pending: list[torch.Tensor] = []  # features f_i for positions start, start + 1, ...
        self.start = 0  # position of pending[0]
        self.depth: dict[int, int] = {}  # proposal node -> depth (1 = child of the root)
        self.history: tuple[list[int], list[torch.Tensor]] | None = None
        """(committed tokens, their features) when the request is recorded (online distillation)."""
        self.extra: list[int] = []
        """Target ids of this request's context vocabulary: its tokens outside the draft vocabulary
        (`add_context`); logit index V_draft + i is extra[i]."""
        self.extra_rows: torch.Tensor | None = None  # [len(extra), E] float32: their output rows
        self._extra_set: set[int] = set()
        self._index: torch.Tensor | None = None  # [V_draft + len(extra)] long, built on demand
        self._index_list: list[int] | None = None  # `vocab_index` as a list (`token_ids`), built on demand

    @property
    def known(self) -> int:
        """Positions whose feature arrived: 0 .. known - 1."""
        return self.start + len(self.pending)

    def add_features(self, hidden: torch.Tensor) -> None:
        """hidden [m, E] (eagle3: [m, k E], the layer inputs it fuses): features of the next m
        committed positions."""
        rows = hidden.to(self.head.dtype).unbind(0)
        self.pending.extend(rows)
        if self.history is not None:
            self.history[1].extend(rows)

    def observe(self, hidden: torch.Tensor, path: Sequence[int]) -> None:
        """A verified step: keep the root's and the accepted nodes' features (rows 0, path + 1). A
        chain's path is the rows' first ones: copied as one slice (the pass may reuse its buffer)
        instead of gathered by a list of rows (most steps of a batch accept nothing: 60 us each)."""
        self.add_features(step_rows_of(hidden, path).clone())  # a gathered path's rows copied twice: few steps

    def add_context(self, tokens: Sequence[int]) -> None:
        """Tokens of the request (its prompt, then what it commits): those outside the draft vocabulary
        join this request's head output, up to `head.context_vocab` of them (first come)."""
        room = self.head.context_vocab - len(self.extra)
        if room <= 0 or not tokens:
            return
        in_vocab = self.head.in_draft_vocab()
        ids = torch.tensor(list(tokens), dtype=torch.long)
        ids = ids[(ids >= 0) & (ids < len(in_vocab))]
        new = [t for t in dict.fromkeys(ids[~in_vocab[ids]].tolist()) if t not in self._extra_set]
        if not new:
            return
        new = new[:room]
        rows = self.head.target.output_rows(torch.tensor(new, dtype=torch.long)).float()  # [k, E]
        self.extra.extend(new)
        self._extra_set.update(new)
        self.extra_rows = rows if self.extra_rows is None else torch.cat([self.extra_rows, rows])
        self._index = self._index_list = None

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The head's output [..., E] -> logits over the draft vocabulary and this request's context
        vocabulary [..., V_draft + len(extra)]."""
        return self.head.logits(out, self.extra_rows)

    def token_ids(self, indices: Sequence[int]) -> list[int]:
        """Logit indices (draft vocabulary, then this request's context vocabulary) -> target ids (through
        a list: indexing the tensor cost more than the rest of a drafting level's bookkeeping)."""
        if not self.extra:
            return self.head.token_ids(indices)
        if self._index_list is None:
            self._index_list = self.vocab_index.tolist()
        return [self._index_list[i] for i in indices]

    def feature_before_root(self, tokens: Sequence[int]) -> torch.Tensor | None:
        """Medusa / Hydra: f of the token before the root (earlier pending features dropped), or
        None when there is none yet (a one-token prompt)."""
        root_pos = len(tokens) - 1
        if root_pos < 1 or self.known < root_pos:
            return None
        keep = root_pos - 1 - self.start
        del self.pending[:keep]
        self.start += keep
        return self.pending[0]

    @property
    def vocab_index(self) -> torch.Tensor:
        """[V_draft + len(extra)] long: the target token id of each logit index."""
        if not self.extra:
            return self.head.d2t
        if self._index is None:
            self._index = torch.cat([self.head.d2t, torch.tensor(self.extra, dtype=torch.long,
                                                                 device=self.head.d2t.device)])
        return self._index

    def finish(self, accepted: Sequence[int]) -> None:
        self.depth = {}

    def release(self) -> None:
        self.pending = []

    def _depths(self, nodes: Sequence[int], parents: Sequence[int]) -> list[int]:
        for node in nodes:
            par = parents[node]
            self.depth[node] = 1 if par < 0 else self.depth[par] + 1
        return [self.depth[n] for n in nodes]


def window_mask(rows: torch.Tensor, lo: int, end: int, window: int) -> torch.Tensor:
    """Bool [len(rows), end - lo]: row r (a position) sees keys lo .. end - 1 that are at most r and
    later than r - window (its `window` most recent pairs, itself included)."""
    keys = torch.arange(lo, end)
    return (keys[None] <= rows[:, None]) & (keys[None] > rows[:, None] - window)


@functools.lru_cache(maxsize=1024)
def run_window_mask(count: int, first: int, keys: int, window: int) -> torch.Tensor:
    """`window_mask` of the `count` consecutive positions lo + first .. over keys lo .. lo + keys - 1: it
    depends on those offsets alone, and a request's catch-up passes past its window repeat a few of them
    (`begin_steps` needs one only where a row's window starts past the oldest key: else the pass is causal).
    Shared: read it, never write it."""
    return window_mask(torch.arange(first, first + count), 0, keys, window)


class EagleState(HeadState):
    """The head's own KV cache (`KVBuffer`, written by position): rows 0 .. fed - 1 hold the
    committed pairs, the rows after them this step's tree (scratch: the next step overwrites them)."""

    def __init__(self, head: TrainedHead) -> None:
        super().__init__(head)
        cfg = head.config
        self.cache = KVBuffer(cfg.num_kv_heads, cfg.head_dim, head.dtype, head.target.device)
        self.fed = 0  # pairs (f_i, x_{i+1}) in the cache: i = 0 .. fed - 1
        self.window = head.window  # keys a row attends to (None: every committed pair)
        self.first = 0  # rows first .. fed - 1 were computed (a window skips the ones before)
        self.last: torch.Tensor | None = None  # output of the last committed pair [E]
        self.last_states: torch.Tensor | None = None  # its output states [E] (what the output rows read)
        self.last_logits: torch.Tensor | None = None  # their logits over the draft vocabulary [V_draft]
        self.rows: dict[int, int] = {}  # proposal node -> scratch row (cache row fed + row)
        self.out: dict[int, torch.Tensor] = {}  # proposal node (-1: root) -> predicted feature [E]
        self.ancestors: list[list[int]] = []  # scratch row -> scratch rows it sees (itself included)
        self.copy = CopyIndex(cfg.copy_ngram) if cfg.copy_ngram else None  # the committed tokens, for copy hints
        self.paths: dict[int, list[int]] = {}  # proposal node -> its path's tokens (root's child .. itself)

    def begin(self, tokens: Sequence[int]) -> torch.Tensor | None:
        """Feed the new committed pairs (the last one is (f_before_root, root)): logits [V_draft]
        after the root, or None when the root has no feature before it (a one-token prompt)."""
        return drive(self.begin_steps(tokens))

    @torch.inference_mode()
    def begin_steps(self, tokens: Sequence[int]) -> Steps:
        """`begin` as lockstep steps (`drafters.lockstep`): yields its head pass, returns the logits."""
        root_pos = len(tokens) - 1
        if self.known < root_pos:
            raise RuntimeError(f"eagle head: features for {self.known} positions, the root is at {root_pos}")
        if self.copy is not None:
            self.copy.extend(tokens[len(self.copy.tokens):])
        new = root_pos - self.fed  # pairs fed..root_pos - 1
        if new > 0:
            assert self.start == self.fed
            w = self.window
            skip = max(0, new - w) if w else 0  # pairs no row of this step's tree can see
            if skip:
                del self.pending[:skip]
                self.start += skip
                self.fed = self.first = self.fed + skip
                new -= skip
            a = self.fed
            lo = max(self.first, a - w + 1) if w else 0  # the oldest key any of these rows sees
            feats = torch.stack(self.pending[:new])  # [new, k E]: the target's features, fused in the pass
            # causal where no row's window starts past lo (every key lo .. its own is in it): a short context,
            # or a step that accepted nothing; the window's mask made afresh there cost 40 us a step
            mask = None if not w or lo >= root_pos - w else run_window_mask(new, a - lo, root_pos - lo, w)
            hints = None if self.copy is None else self.copy.committed_hints(a + 1, root_pos + 1)
            out, states, logits = yield from self._run(tokens[a + 1: root_pos + 1], feats, True,
                                                       torch.arange(a, root_pos), mask, a, lo, hints,
                                                       last_only=True)  # [new, E] each; logits [1, V]
            self.fed, self.last, self.last_states, self.last_logits = root_pos, out[-1], states[-1], logits[-1]
            del self.pending[:new]
            self.start += new
        if self.last is None:
            return None
        self.rows, self.ancestors, self.depth, self.paths = {}, [], {}, {}
        self.out = {-1: self.last}
        return self._with_context(self.last_logits, self.last_states)

    def _with_context(self, logits: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [..., V_draft] -> with this request's context vocabulary
        scored by the same states [..., E] (`add_context`) [..., V_draft + len(extra)]."""
        if self.extra_rows is None:
            return logits
        return torch.cat([logits, states.float() @ self.extra_rows.t()], dim=-1)

    def _run(self, tokens: Sequence[int], feats: torch.Tensor, raw: bool, pos: torch.Tensor, mask: torch.Tensor | None,
             at: int, lo: int, hints: tuple[list[int], list[int]] | None, last_only: bool = False) -> Steps:
        """One head pass of this sequence's rows: the pairs' tokens [T], their features feats [T, E]
        (raw: the target's [T, k E], still to fuse), positions pos [T], mask [T, P + T] or None,
        written at cache rows at .., seeing rows lo ..; hints: the copy hints (tokens, match
        lengths) or None. Returns (out [T, E], its output states [T, E], logits over the draft
        vocabulary [T, V_draft], or [1, V_draft] of the last row with `last_only`), in one kernel
        call where the head has a kernel pass (yielded as a `HeadPass`, which a packed batch runs
        with its other sessions' passes), else through the module's forward (nothing yielded)."""
        run = self.head.kernel_pass
        if run is not None:
            ids = torch.tensor(list(tokens), dtype=torch.long)
            ids = ids if run.table is not None else self.head.embed(ids)
            if hints is not None:
                hint_ids = torch.tensor(hints[0], dtype=torch.long)
                hints = (hint_ids if run.table is not None else self.head.embed(hint_ids),
                         torch.tensor(hints[1], dtype=torch.long))
            out, states, logits = yield HeadPass(run, HeadRows(ids, feats, pos, mask, self.cache, at, lo, hints,
                                                               len(tokens) - 1 if last_only else 0, raw))
            if logits is None:  # a pass without the output layer (tests hand one to a torch head)
                logits = self.head.target_logits(states[-1:] if last_only else states)
            return out, states, logits
        module = self.head.module
        feats = (module.fuse_features(feats) if raw else feats)[None]  # [1, T, E]
        device = self.cache.keys.device
        copy = None
        if hints is not None:
            lengths = torch.tensor(hints[1], dtype=torch.long, device=device)
            copy = module.copy_term(self.head.embed(hints[0]), lengths)[None]  # [1, T, E]
        out, _ = module(self.head.embed(tokens)[None], feats, pos.to(device)[None], cache=self.cache, at=at, lo=lo,
                        mask=None if mask is None else mask.to(device)[None], copy=copy)
        out = out[0]
        states = module.output_states(out)
        return out, states, self.head.target_logits(states[-1:] if last_only else states)

    def feed(self, nodes: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Run proposal nodes (children of the root or of fed nodes) in one head pass over the
        frontier, against the committed rows and their own ancestors: logits [len(nodes), V_draft]."""
        return drive(self.feed_steps(nodes, tokens, parents))

    @torch.inference_mode()
    def feed_steps(self, nodes: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> Steps:
        """`feed` as lockstep steps (`drafters.lockstep`): yields its head pass, returns the logits."""
        depths = self._depths(nodes, parents)
        first = len(self.ancestors)
        m, total = len(nodes), first + len(nodes)
        lo = max(self.first, self.fed - self.window) if self.window else 0  # committed keys: lo .. fed - 1
        seen_fed = self.fed - lo
        # [m, committed keys + scratch rows], built in numpy: the same three ops in torch took 60 us a level
        mask = np.zeros((m, seen_fed + total), dtype=np.bool_)
        mask[:, :seen_fed] = True
        at_row: list[int] = []  # (row, scratch key) pairs each node sees: its ancestors and itself
        at_key: list[int] = []
        for j, node in enumerate(nodes):
            par = parents[node]
            seen = ([] if par < 0 else self.ancestors[self.rows[par]]) + [first + j]
            self.ancestors.append(seen)
            self.rows[node] = first + j
            at_row += [j] * len(seen)
            at_key += seen
        mask[at_row, [seen_fed + r for r in at_key]] = True
        mask = torch.from_numpy(mask)
        feats = torch.stack([self.out[parents[n]] for n in nodes])  # [m, E]
        pos = torch.tensor([self.fed - 1 + d for d in depths])
        hints = None
        if self.copy is not None:
            hints = ([], [])
            for node in nodes:
                par = parents[node]
                path = self.paths[node] = ([] if par < 0 else self.paths[par]) + [tokens[node]]
                hint, n = self.copy.path_hint(path)
                hints[0].append(hint)
                hints[1].append(n)
        out, states, logits = yield from self._run([tokens[n] for n in nodes], feats, False, pos, mask,
                                                   self.fed + first, lo, hints)
        self.out.update(zip(nodes, out.unbind(0)))
        return self._with_context(logits, states)

    def finish(self, accepted: Sequence[int]) -> None:
        self.rows, self.out, self.ancestors, self.depth, self.paths = {}, {}, [], {}, {}


class MedusaState(HeadState):
    """Only the last committed feature matters: every head reads it."""

    def __init__(self, head: TrainedHead) -> None:
        super().__init__(head)
        self.levels: torch.Tensor | None = None  # [K, V_draft] logits of each level this step

    @torch.inference_mode()
    def begin(self, tokens: Sequence[int]) -> torch.Tensor | None:
        feat = self.feature_before_root(tokens)
        if feat is None:
            return None
        self.levels = self.logits(self.head.module(feat))  # [K, V_draft]
        self.depth = {}
        return self.levels[0]

    def feed(self, nodes: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        depths = self._depths(nodes, parents)
        return self.levels[depths]  # node at depth d: its children come from head d


class HydraState(HeadState):
    """Head d sees the feature before the root, the root and the node's d ancestors' tokens."""

    @torch.inference_mode()
    def begin(self, tokens: Sequence[int]) -> torch.Tensor | None:
        self.feat = self.feature_before_root(tokens)
        if self.feat is None:
            return None
        self.path_emb = {-1: self.head.embed([tokens[-1]])}  # node -> embeddings [d + 1, E] root..node
        self.depth = {}
        return self.logits(self.head.module.forward_one(0, self.feat, self.path_emb[-1]))

    @torch.inference_mode()
    def feed(self, nodes: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        depths = self._depths(nodes, parents)
        outs = []
        for node, d in zip(nodes, depths):
            embs = torch.cat([self.path_emb[parents[node]], self.head.embed([tokens[node]])])  # [d + 1, E]
            self.path_emb[node] = embs
            outs.append(self.head.module.forward_one(d, self.feat, embs))
        return self.logits(torch.stack(outs))


def head_config(kind: str, target, draft_vocab: int, num_offsets: int = 4, intermediate_size: int = 0,
                num_kv_heads: int = 0, copy_ngram: int = 0) -> HeadConfig:
    """The default shape of a new head for `target`: an eagle layer of 64-wide heads (a quarter of
    the width on tiny models), one key/value head per query head and an MLP of 8/3 E (Llama's
    ratio), unless `num_kv_heads` / `intermediate_size` (> 0) say otherwise; eagle3 reads
    EAGLE-3's three depths (`feature_layers_of`); Medusa / Hydra: `num_offsets`; eagle / eagle3 read
    copy hints of up to `copy_ngram` tokens (0: none)."""
    e = int(target.hidden_size)
    d = 64 if e % 64 == 0 else max(2, e // 4)
    if num_kv_heads and (e // d) % num_kv_heads:  # HeadConfig's own check names no option (it reads files too)
        fits = ", ".join(str(n) for n in range(1, e // d + 1) if (e // d) % n == 0)
        raise ConfigError(f"num_kv_heads={num_kv_heads} does not divide the head's {e // d} query heads (the "
                          f"target's hidden size {e} / {d}); give one of {fits} (or 0: one per query head)")
    layers = feature_layers_of(kind, int(target.num_layers))
    return HeadConfig(kind=kind, hidden_size=e, target_vocab=int(target.vocab_size), draft_vocab=draft_vocab,
                      feature_layers=layers,
                      num_heads=e // d, num_kv_heads=num_kv_heads or e // d, head_dim=d,
                      intermediate_size=intermediate_size or max(1, round(8 * e / 3 / 64) * 64 if e >= 96 else 2 * e),
                      num_offsets=num_offsets, copy_ngram=copy_ngram)


def new_head(kind: str, target, d2t: torch.Tensor, seed: int = 0, num_offsets: int = 4, intermediate_size: int = 0,
             num_kv_heads: int = 0, copy_ngram: int = 0) -> TrainedHead:
    """A freshly initialised head (deterministic in `seed`) over draft vocabulary `d2t`; shape
    arguments as `head_config`."""
    module = build_module(head_config(kind, target, len(d2t), num_offsets, intermediate_size, num_kv_heads,
                                      copy_ngram))
    module.reset_parameters(torch.Generator().manual_seed(seed))
    return TrainedHead(module.to(target.device), d2t, target)
