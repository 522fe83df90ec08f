"""The pending-tree handshake every backend's sequence follows, written once.

`TreeSequence` implements the `TargetSequence` bookkeeping (`models.base`): the committed tokens,
the one pending `(root, tree)` between `forward_tree` and `commit`, the room check against the
context window, the empty prefill, the validation of an incremental tree, the crop and commit
guards and the release. A backend's sequence subclasses it and writes only its tensor work, in
five hooks:

    _prefill_rows(ids, logits, hidden)     run ids causally after the cache (the result `prefill` returns)
    _tree_rows(root, tree, hidden)         run the root and every node (tree attention)
    _grow_rows(root, tree, first)          run nodes first.. of a tree whose first nodes are pending
    _keep_rows(prefix, tree, path)         keep prefix + root + path in the cache, drop the other rows
    _drop_rows(length) / _free()           roll the cache back to `length` tokens / free it

A batched pass over several sequences (`BatchedTargetModel.forward_trees`) goes through the same
handshake from outside: `begin_tree` before the pass, `set_pending` after it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

from specula.models.base import FeatureRequest, LogitsMode, feature_layers
from specula.tree import TokenTree


class TreeSequence(ABC):
    """One sequence's KV cache on a backend: the pending-tree handshake (see the module docstring).

    `tokens` mirrors exactly the committed tokens the cache holds. Subclasses set `backend` (a
    `TargetModel` that is also a `FeatureModel`: name, max_context, vocab_size, hidden_size,
    dtype, device) through `__init__` and implement the hooks."""

    logits_dtype: torch.dtype | None = None
    """Dtype of the logits the backend returns (None: the backend's activation dtype); what an
    empty incremental step returns."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._tokens: list[int] = []
        self._pending: tuple[int, TokenTree] | None = None  # (root, tree) run but not committed

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    # ------------------------------------------------------------------ guards
    def _assert_idle(self, call: str) -> None:
        """Refuse `call` while a tree waits for `commit`."""
        if self._pending is not None:
            raise RuntimeError(f"{call}() while a tree is pending: commit() it first")

    def _assert_room(self, extra: int) -> None:
        # The engine checks the context window once per request and sizes every step to fit;
        # reaching this is a bug in the caller, not bad input.
        if len(self._tokens) + extra > self.backend.max_context:
            raise RuntimeError(f"{self.backend.name}: {len(self._tokens) + extra} tokens exceed the context "
                               f"window of {self.backend.max_context}")

    def _show_output(self, ids: Sequence[int]) -> None:
        """Hand the tokens this sequence reads to an output layer that scores a draft vocabulary
        (`models.draft_vocab.SubsetOutput.see`: a draft then also scores the rare tokens of its
        context, the names a summary or an answer copies)."""
        layer = getattr(self.backend, "output_layer", None)
        see = getattr(layer(), "see", None) if layer is not None else None
        if see is not None:
            see(ids)

    # ------------------------------------------------------------------ TargetSequence
    def prefill(self, ids: Sequence[int], logits: LogitsMode = "last", hidden: FeatureRequest = False) -> Any:
        """Run `ids` causally after the cache and commit them.

        logits: "last" -> [vocab] for the last token, "all" -> [len(ids), vocab], "none" -> None;
        with `hidden`: (logits, hidden states [len(ids), E])."""
        self._assert_idle("prefill")
        ids = list(ids)
        if not ids:
            width = self.backend.hidden_size * (len(feature_layers(hidden, self.backend.num_layers)) if hidden else 1)
            empty = torch.empty((0, width), dtype=self.backend.dtype, device=self.backend.device)
            return (None, empty) if hidden else None
        self._assert_room(len(ids))
        self._show_output(ids)
        out = self._prefill_rows(ids, logits, hidden)
        self._tokens.extend(ids)
        return out

    def begin_tree(self, tree: TokenTree) -> int:
        """Check that a tree can be verified now (none pending, room in the window); its first slot
        (the root's position: the committed length)."""
        self._assert_idle("forward_tree")
        self._assert_room(len(tree) + 1)
        return len(self._tokens)

    def set_pending(self, root: int, tree: TokenTree) -> None:
        """The tree just run (by `forward_tree`, an increment or a batched pass) waits for `commit`."""
        self._pending = (root, tree)

    def forward_tree(self, root: int, tree: TokenTree, hidden: FeatureRequest = False) -> Any:
        """Logits [n + 1, vocab]: row 0 after the root, row i + 1 after node i (with `hidden`:
        (logits, hidden states [n + 1, E])); the tree is then pending until `commit`."""
        self.begin_tree(tree)
        self._show_output([root])
        out = self._tree_rows(root, tree, hidden)
        self.set_pending(root, tree)
        return out

    def forward_tree_incremental(self, tree: TokenTree) -> torch.Tensor:
        """Grow the pending tree: `tree` must start with the pending tree's nodes (same tokens
        and parents, in order); only the new nodes run, with the same tree attention as
        `forward_tree`. Returns logits [len(tree) - len(pending), vocab] for the new nodes
        (row i after new node i). A drafter expands its tree level by level this way, then
        `commit`s the accepted path (or `[]`)."""
        if self._pending is None:
            raise RuntimeError("forward_tree_incremental() needs a pending tree: call forward_tree() first")
        root, old = self._pending
        first = len(old)
        if tree.tokens[:first] != old.tokens or tree.parents[:first] != old.parents:
            raise ValueError("forward_tree_incremental: the tree must extend the pending tree (same first nodes)")
        if len(tree) == first:
            return torch.empty((0, self.backend.vocab_size), dtype=self.logits_dtype or self.backend.dtype,
                               device=self.backend.device)
        self._assert_room(len(tree) + 1)
        out = self._grow_rows(root, tree, first)
        self.set_pending(root, tree)
        return out

    def commit(self, path: Sequence[int]) -> None:
        """Keep prefix + root + the accepted `path` (node indices, root to deepest)."""
        if self._pending is None:
            raise RuntimeError("commit() without a pending forward_tree()")
        root, tree = self._pending
        path = list(path)
        if not all(0 <= i < len(tree) for i in path) or [tree.parents[i] for i in path] != [-1, *path][:len(path)]:
            raise ValueError(f"commit({path}): not a path from the root of the pending tree of {len(tree)} nodes "
                             "(each node's parent is the one before it)")
        self._pending = None
        self._keep_rows(len(self._tokens), tree, path)
        self._tokens.extend([root, *tree.tokens_of(path)])

    def crop(self, length: int) -> None:
        """Keep the first `length` committed tokens (rollback)."""
        self._assert_idle("crop")
        if not 0 <= length <= len(self._tokens):
            raise ValueError(f"crop({length}) outside 0..{len(self._tokens)}")
        self._drop_rows(length)
        del self._tokens[length:]

    def release(self) -> None:
        """Free the cache now (the sequence must not be used again)."""
        self._free()
        self._tokens = []
        self._pending = None

    # ------------------------------------------------------------------ the backend's tensor work
    @abstractmethod
    def _prefill_rows(self, ids: list[int], logits: LogitsMode, hidden: FeatureRequest) -> Any:
        """Run `ids` (non-empty, room checked) causally after the committed tokens; what `prefill`
        returns (the logits `logits` asks for, with `hidden` as `(logits, hidden [n, E])`)."""

    @abstractmethod
    def _tree_rows(self, root: int, tree: TokenTree, hidden: FeatureRequest) -> Any:
        """Run the root and every node of `tree` after the committed tokens (room checked): logits
        [n + 1, vocab] (with `hidden`: `(logits, hidden [n + 1, E])`)."""

    @abstractmethod
    def _grow_rows(self, root: int, tree: TokenTree, first: int) -> torch.Tensor:
        """Run nodes `first`.. of `tree` (`root` and its first `first` nodes already run and pending,
        room checked): logits [len(tree) - first, vocab]."""

    @abstractmethod
    def _keep_rows(self, prefix: int, tree: TokenTree, path: list[int]) -> None:
        """Make the cache hold the `prefix` committed tokens, the root and the rows of `path`
        (node indices of `tree`, root to deepest), in that order, and nothing else."""

    @abstractmethod
    def _drop_rows(self, length: int) -> None:
        """Roll the cache back to its first `length` committed tokens."""

    @abstractmethod
    def _free(self) -> None:
        """Free the cache's memory (the sequence is released)."""
