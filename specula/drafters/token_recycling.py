"""`token-recycling`: draft from the target's own past top-k predictions (Luo et al., ACL 2025).

An adjacency matrix `M[vocab, k]` (k = 8) holds, for each token `v`, the target's top-k next
tokens the last time `v` was in a verified tree. Each step fills a static 80-node template
breadth-first: a node whose path of child ranks is `(r_1, .., r_d)` gets token
`M[parent token][r_d]`, the root's parent token being the last committed token. After
verification, the root and every tree node (accepted or not) get their row overwritten with the
top-k of the target logits at that node. The prompt prefill does not write (the engine's prefill
calls no drafter).

Choices made here:
- Rows never written yet hold -1; a template node whose parent row is unwritten is skipped, and
  so are its descendants (a cold start proposes nothing until the first step writes the root).
- When one token occurs at several nodes of a step, the row written is the one from its deepest
  accepted occurrence, else the root, else its last occurrence in node order: rows written from
  the accepted path describe the text actually generated.
- A node's edge score is a per-rank prior (`rank_prior`), a stand-in estimate of each child
  rank's acceptance for the planner to calibrate.
- The matrix is shared by every request (no per-request state). With `state_path` it is loaded
  at creation (refused for another vocabulary or tokenizer; another model's with the same tokenizer is
  loaded with a note on stderr: its rows still draft, losslessly) and saved atomically when a request
  finishes (at most every `SAVE_SECONDS`) and at interpreter exit (`save_states`), or on `save()`.
"""

from __future__ import annotations

import atexit
import json
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from specula.datastore.tokenizers import tokenizer_fingerprint
from specula.drafters.base import DraftContext, Proposal, StepResult, method_config, within_budget
from specula.errors import ConfigError
from specula.paths import atomic_file
from specula.tree import TokenTree
from specula.tree_rows import draft_top_k, draft_top_k_into

SAVE_SECONDS = 30.0
"""Least time between two saves of the state file when requests finish (the exit saves the rest)."""
STATE_FORMAT = "specula-token-recycling"
STATE_VERSION = 1


def _ranks(prefix: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """prefix + (0,), ..., prefix + (n - 1,)"""
    return [(*prefix, r) for r in range(n)]


# The paper's 80-node template (docs/algorithms.md section 3): each node is its path of child ranks.
TEMPLATE_LEVELS: tuple[tuple[tuple[int, ...], ...], ...] = (
    tuple(_ranks((), 8)),
    tuple(_ranks((0,), 8) + _ranks((1,), 4) + _ranks((2,), 3) + _ranks((3,), 2)
          + [(4, 0), (5, 0), (6, 0), (7, 0)]),
    tuple(_ranks((0, 0), 8) + _ranks((0, 1), 3) + _ranks((0, 2), 2)
          + [(0, 3, 0), (0, 4, 0), (0, 5, 0), (0, 6, 0), (0, 7, 0)]
          + _ranks((1, 0), 2) + [(1, 1, 0), (2, 0, 0), (3, 0, 0), (4, 0, 0), (5, 0, 0)]),
    tuple(_ranks((0, 0, 0), 5) + _ranks((0, 0, 1), 2) + [(0, 0, 2, 0), (0, 0, 3, 0), (0, 0, 4, 0)]
          + [(0, 1, 0, 0), (0, 2, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0), (3, 0, 0, 0)]),
    tuple(_ranks((0, 0, 0, 0), 3) + [(0, 0, 0, 1, 0), (0, 0, 0, 2, 0), (0, 0, 1, 0, 0), (0, 1, 0, 0, 0),
                                      (1, 0, 0, 0, 0)]),
    ((0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 1), (0, 0, 0, 1, 0, 0)),
)
TEMPLATE: tuple[tuple[int, ...], ...] = tuple(path for level in TEMPLATE_LEVELS for path in level)
assert [len(level) for level in TEMPLATE_LEVELS] == [8, 21, 25, 15, 8, 3] and len(TEMPLATE) == 80
assert len(set(TEMPLATE)) == 80 and all(p[:-1] in set(TEMPLATE) for p in TEMPLATE if len(p) > 1)


@dataclass(frozen=True)
class TokenRecyclingConfig:
    """Token Recycling settings."""

    top_k: int = 8
    """Next tokens kept per matrix row (the template uses ranks 0..7, so at least 8)."""
    rank_prior: tuple[float, ...] = (0.5, 0.15, 0.08, 0.05, 0.035, 0.025, 0.02, 0.015)
    """Prior acceptance of the child of each rank (a node's edge score)."""
    state_path: str | None = None
    """File the matrix is loaded from (if it exists) and saved to (hot start across processes)."""

    def __post_init__(self) -> None:
        if self.top_k < 8:
            raise ConfigError(f"token-recycling needs top_k >= 8 (the template uses ranks 0..7), got {self.top_k}")
        if len(self.rank_prior) < 8 or not all(0.0 < p <= 1.0 for p in self.rank_prior):
            raise ConfigError("rank_prior needs 8 probabilities in (0, 1]")


@dataclass(frozen=True)
class _Template:
    """The template as arrays, in breadth-first (topological) order."""

    parents: np.ndarray  # [80] int64, -1 for first-level nodes
    ranks: np.ndarray  # [80] int64, rank of each node among its parent's row
    levels: tuple[slice, ...]  # node range of each level
    edge_scores: np.ndarray  # [80] float64, the rank prior of each node


def _template(rank_prior: Sequence[float]) -> _Template:
    position = {path: i for i, path in enumerate(TEMPLATE)}
    parents = np.array([position[p[:-1]] if len(p) > 1 else -1 for p in TEMPLATE], dtype=np.int64)
    ranks = np.array([p[-1] for p in TEMPLATE], dtype=np.int64)
    edge_scores = np.array([rank_prior[p[-1]] for p in TEMPLATE], dtype=np.float64)
    bounds = np.cumsum([0, *(len(level) for level in TEMPLATE_LEVELS)])
    levels = tuple(slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]))
    return _Template(parents, ranks, levels, edge_scores)


def fill_template(matrix: np.ndarray, root: int, template: _Template) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of the template nodes hung from `root`, and which nodes are usable.

    matrix: [vocab, k] int (-1 = unwritten). Returns tokens [80] int64 and valid [80] bool
    (ancestor-closed: a node is valid iff its parent is and the parent's row entry is written)."""
    n = len(template.ranks)
    tokens = np.full(n, -1, dtype=np.int64)
    valid = np.zeros(n, dtype=bool)
    for level in template.levels:
        par = template.parents[level]
        parent_tokens = np.where(par >= 0, tokens[np.maximum(par, 0)], root)
        parent_ok = np.where(par >= 0, valid[np.maximum(par, 0)], True)
        rows = np.clip(parent_tokens, 0, len(matrix) - 1)
        level_tokens = matrix[rows, template.ranks[level]].astype(np.int64)
        tokens[level] = level_tokens
        valid[level] = parent_ok & (parent_tokens >= 0) & (parent_tokens < len(matrix)) & (level_tokens >= 0)
    return tokens, valid


def rows_to_write(step: StepResult) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, logits rows) to write after a step: the root and every node, one row per distinct
    token, chosen by priority deepest accepted node > root > last other occurrence."""
    tree = step.proposal.tree
    on_path = set(step.path)
    row_of: dict[int, int] = {}  # token -> its row; a later write wins (a dict, not numpy: 1-65 rows a step)
    for i, token in enumerate(tree.tokens):
        if i not in on_path:
            row_of[token] = i + 1
    row_of[step.root] = 0
    for i in step.path:
        row_of[tree.tokens[i]] = i + 1
    return np.fromiter(row_of.keys(), np.int64, len(row_of)), np.fromiter(row_of.values(), np.int64, len(row_of))


class TokenRecyclingDrafter:
    """Static-template tree filled from the recycled top-k matrix."""

    name = "token-recycling"

    def __init__(self, vocab_size: int, config: TokenRecyclingConfig = TokenRecyclingConfig(),
                 fingerprint: str | None = None, model: str | None = None) -> None:
        self.config = config
        self.vocab_size = int(vocab_size)
        self.fingerprint = fingerprint
        self.model = model  # the target whose top-k the matrix holds (None: unknown), recorded in the state file
        self.matrix = np.full((self.vocab_size, config.top_k), -1, dtype=np.int32)  # [vocab, k]
        self.template = _template(config.rank_prior)
        self.dirty = False
        self._saved_at = float("-inf")  # `time.monotonic()` of the last save to the state file
        if config.state_path is not None:
            path = Path(config.state_path)
            _save_earlier(path)  # an earlier drafter's pending changes reach the file before it is read
            if path.exists():
                self.load(path)
            _register(self)

    # ------------------------------------------------------------------ drafting
    def start(self) -> None:
        return None

    def propose(self, ctx: DraftContext, state: None = None) -> Proposal:
        tokens, valid = fill_template(self.matrix, int(ctx.tokens[-1]), self.template)
        keep = np.flatnonzero(valid)
        if len(keep) == 0:
            return Proposal.empty()
        tree = TokenTree.from_subset(tokens.tolist(), self.template.parents.tolist(),
                                     self.template.edge_scores.tolist(), keep.tolist(), self.name)
        # A row's top-k are distinct, so siblings are too; merge() still guarantees it (it dedups).
        return within_budget(Proposal(TokenTree.empty().merge(tree)), ctx.budget)

    @property
    def memory_bytes(self) -> int:
        """Bytes of the recycling matrix [vocab, k] (independent of context length)."""
        return int(self.matrix.nbytes)

    def observe(self, step: StepResult, state: None = None) -> None:
        if step.idle:  # a batch step on which this request drafted nothing: no bookkeeping
            return
        if not len(step.proposal.tree):  # no draft verified (a paused step): the root's row, in one call
            if step.root < self.vocab_size:
                draft_top_k_into(step.logits, 0, self.matrix[step.root])
            self.dirty = True
            return
        tokens, rows = rows_to_write(step)
        inside = tokens < self.vocab_size
        # top-k of every row, then pick (cheaper than gathering the rows of [n + 1, vocab] first)
        topk = draft_top_k(step.logits, self.config.top_k).to(torch.int32).cpu().numpy()  # [n + 1, k]
        self.matrix[tokens[inside]] = topk[rows[inside]]
        self.dirty = True

    def finish(self, state: None = None) -> None:
        """A request ended: the matrix is kept (hot start); a pending state file is saved, at most
        once every `SAVE_SECONDS` (each save writes the whole matrix, 4.6 MiB for a 151k vocabulary,
        on the decoding thread), and at exit."""
        if self.dirty and self.config.state_path is not None and \
                time.monotonic() - self._saved_at >= SAVE_SECONDS:
            _save_or_warn(self)  # the request's output is done: a failed write is reported, not raised

    # ------------------------------------------------------------------ state file
    def save(self, path: str | Path | None = None) -> Path:
        """Write the matrix atomically (npz: matrix + JSON metadata)."""
        path = Path(path if path is not None else self.config.state_path or "")
        if not path.name:
            raise ConfigError("no path to save the token-recycling state to: pass recycling_state=FILE")
        meta = {"format": STATE_FORMAT, "version": STATE_VERSION, "vocab_size": self.vocab_size,
                "top_k": self.config.top_k, "fingerprint": self.fingerprint, "model": self.model}
        with atomic_file(path, "wb") as handle:
            np.savez(handle, matrix=self.matrix, meta=np.array(json.dumps(meta)))
        if self.config.state_path is None or path == Path(self.config.state_path):
            self.dirty = False  # a copy elsewhere leaves the configured state pending
            self._saved_at = time.monotonic()
        return path

    def load(self, path: str | Path) -> None:
        """Replace the matrix by a saved one; refuse one made for another vocabulary or tokenizer."""
        path = Path(path)
        fix = f"delete {str(path)!r} or pass another recycling_state file"
        try:
            data = np.load(path, allow_pickle=False)
            if not isinstance(data, np.lib.npyio.NpzFile):  # a .npy array (np.save): not a state
                raise ValueError("an array file, not a saved state (npz)")
            with data:
                meta = json.loads(str(data["meta"]))
                matrix = np.asarray(data["matrix"])
            if not isinstance(meta, dict):
                raise ValueError("its metadata is not an object")
            if matrix.dtype.kind not in "iu":
                raise ValueError(f"its matrix holds {matrix.dtype} values, not token ids")
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:  # EOFError: an empty file
            raise ConfigError(f"{str(path)!r} is not a readable token-recycling state ({exc}); {fix}") from exc
        if meta.get("format") != STATE_FORMAT or meta.get("version") != STATE_VERSION:
            raise ConfigError(f"{str(path)!r} is not a token-recycling state of version {STATE_VERSION}; {fix}")
        if meta.get("vocab_size") != self.vocab_size or matrix.shape != self.matrix.shape:
            raise ConfigError(
                f"token-recycling state {str(path)!r} is for a vocabulary of {meta.get('vocab_size')} tokens "
                f"(top-{meta.get('top_k')}), this target has {self.vocab_size} (top-{self.config.top_k}); {fix}"
            )
        theirs = meta.get("fingerprint")
        if theirs is not None and self.fingerprint is not None and theirs != self.fingerprint:
            raise ConfigError(f"token-recycling state {str(path)!r} was made with another tokenizer; {fix}")
        if self.fingerprint is None:  # a drafter without a tokenizer keeps the file's, so its save does not drop it
            self.fingerprint = theirs
        learned_on = _recorded_model(meta.get("model"))
        if learned_on is not None and self.model is not None and learned_on != self.model:
            # another model with this tokenizer (Qwen2.5-Coder 0.5B and 1.5B): its rows still draft, losslessly,
            # but they are that model's next tokens until this one verifies them; said, not refused
            print(f"note: token-recycling state {str(path)!r} was learned on {learned_on}, not {self.model}; "
                  f"its rows draft until {self.model} rewrites them (the output is unchanged either way)",
                  file=sys.stderr)
        if self.model is None:
            self.model = learned_on
        if matrix.min(initial=0) < -1 or matrix.max(initial=0) >= self.vocab_size:
            raise ConfigError(f"token-recycling state {str(path)!r} holds ids outside the vocabulary; {fix}")
        self.matrix = matrix.astype(np.int32, copy=True)
        self.dirty = False


def _recorded_model(value: object) -> str | None:
    """The model a state file says its matrix was learned on; None (unknown) where it names none, or
    names "None": what states saved for a backend whose cost key names no model used to record."""
    return value if isinstance(value, str) and value != "None" else None


def _model_of(target) -> str | None:
    """The model `target`'s cost key names, as the state file records it (None: it names none)."""
    model = target.cost_key().get("model")
    return None if model is None else str(model)


_WITH_STATE: dict[Path, TokenRecyclingDrafter] = {}
"""The latest drafter of each state file, kept alive until exit so that `save_states` can write it
(a CLI run drops its drafter before the interpreter exits). One a file: a process that builds
decoders again and again (a bench's rounds) keeps one matrix a file, not every one it made."""


def _save_earlier(path: Path) -> None:
    """Save the registered drafter of the state file `path` if it has changes pending (a new drafter
    of the file reads it next: it loaded the file as last saved, and its saves then dropped the
    earlier one's updates)."""
    earlier = _WITH_STATE.get(path.resolve())
    if earlier is not None and earlier.dirty:
        _save_or_warn(earlier)


def _register(drafter: TokenRecyclingDrafter) -> None:
    """Keep `drafter` for `save_states`, in place of an earlier drafter of the same file (saved first
    if it has changes pending)."""
    key = Path(drafter.config.state_path).resolve()
    earlier = _WITH_STATE.get(key)
    if earlier is not None and earlier is not drafter and earlier.dirty:
        _save_or_warn(earlier)
    _WITH_STATE[key] = drafter


def save_states() -> list[Path]:
    """Save every drafter state with unsaved changes (registered with atexit); returns the paths.
    A state that cannot be written is reported on stderr, not raised (this runs at exit)."""
    saved = [_save_or_warn(drafter) for drafter in list(_WITH_STATE.values()) if drafter.dirty]
    return [path for path in saved if path is not None]


def _save_or_warn(drafter: TokenRecyclingDrafter) -> Path | None:
    """Save `drafter`'s state to its configured file; a write that fails is reported on stderr
    (the state stays pending) and gives None."""
    try:
        return drafter.save()
    except OSError as exc:
        print(f"warning: could not save the token-recycling state {drafter.config.state_path}: {exc}",
              file=sys.stderr)
        return None


atexit.register(save_states)


CONFIG = TokenRecyclingConfig
"""The options `create` takes besides its keywords (`specula.methods`)."""


def create(*, target=None, draft=None, recycling_state: str | None = None, tokenizer=None,
           vocab_size: int | None = None, **options) -> TokenRecyclingDrafter:
    """recycling_state: state file for hot starts (loaded if present, saved after requests);
    tokenizer: the target's tokenizer for the state's fingerprint (None: the state keeps the
    fingerprint it was saved with, and none is checked); vocab_size: matrix rows (default: the target's logit width);
    options: TokenRecyclingConfig fields (top_k, rank_prior)."""
    if vocab_size is None:
        if target is None:
            raise ConfigError("token-recycling needs the target model (or vocab_size) to size its matrix")
        vocab_size = target.vocab_size
    fingerprint = tokenizer_fingerprint(tokenizer) if recycling_state and tokenizer is not None else None
    config = method_config("token-recycling", TokenRecyclingConfig, options, state_path=recycling_state)
    if config.top_k > vocab_size:  # its top-k of a step's logits would fail mid-generation
        raise ConfigError(f"token-recycling top_k ({config.top_k}) exceeds the vocabulary ({vocab_size}); "
                          "pass a smaller top_k")
    model = None if target is None or not recycling_state else _model_of(target)
    return TokenRecyclingDrafter(vocab_size, config, fingerprint, model)
