"""A tree's target logits transformed row by row, each row by the path that leads to it.

Some requests change the target's distribution by what comes before each position: a grammar
(`specula.constraints.MaskedLogits`), repetition penalties (`specula.penalties.PenalizedLogits`).
In a tree every row has its own past (the committed tokens, then the path from the root to its
node), so each row is transformed on its own, and only when a rule asks for it: the rules touch
the rows on one path. `TreeRows` is shaped like the ``[n + 1, vocab]`` tensor for them
(`specula.verify.Rows`); its `argmax` covers the rows a greedy walk reaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from specula.tree import TokenTree

_NUMPY_ARGMAX = (torch.float32, torch.float64)
"""Row dtypes whose argmax numpy computes with torch's rules (the first maximal index; NaN counts
as the maximum, the first NaN wins): 8 us against torch's 125 us for a row of 49,152 on the 2-core
CPU (numpy's argmax is vectorised, torch's CPU argmax reduction is not)."""


def _numpy_ok(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _NUMPY_ARGMAX and not t.requires_grad


def argmax_row(row: torch.Tensor) -> int:
    """`int(row.argmax())` of one row [vocab] (numpy's where `_NUMPY_ARGMAX` says it is the same)."""
    return int(np.argmax(row.numpy())) if _numpy_ok(row) else int(row.argmax())


def row_argmax(rows: torch.Tensor) -> Callable[[int], int]:
    """`row -> int(rows[row].argmax())` for rows [n + 1, vocab] (numpy's where `_NUMPY_ARGMAX` says
    it is the same; the array made once)."""
    if _numpy_ok(rows):
        array = rows.numpy()  # shares the memory, any strides
        return lambda row: int(np.argmax(array[row]))
    return lambda row: int(rows[row].argmax())


def draft_top_k(logits, k: int) -> torch.Tensor:
    """LongTensor [n, k]: the k best ids of each row of `logits` ([n, vocab]) for a drafter to learn
    from: a tensor's exact top-k, or a row source's own `draft_top_k` where it has one (a screened
    pass's int8 logits, `models.native.screen.ScreenedLogits`: a drafter's choice needs no
    exactness, and no second pass is made for it)."""
    own = getattr(logits, "draft_top_k", None)
    return own(k) if own is not None else logits.topk(k, dim=-1).indices


def draft_top_k_into(logits, row: int, out) -> None:
    """Row `row` of `draft_top_k(logits, len(out))` written into out (numpy int32 [k], C-contiguous): a row
    source's own `draft_top_k_into` where it has one (one C call, no tensor made), else torch's top-k."""
    own = getattr(logits, "draft_top_k_into", None)
    if own is not None:
        own(row, out)
    else:
        out[:] = draft_top_k(logits[row: row + 1], len(out))[0].cpu().numpy()


def greedy_argmax(tree: TokenTree, argmax_of: Callable[[int], int]) -> torch.Tensor:
    """LongTensor [n + 1]: the argmax of the root's row and of every row whose node a greedy walk
    accepts (a node is accepted when its parent is and its token is the argmax of its parent's
    row), each from `argmax_of(row)` and only those; -1 in the rows no walk reaches (what they hold
    cannot matter to greedy verification). A step reads the rows of its accepted path, not the
    whole tree's (3-4 rows of 17-65 on a typical step)."""
    am = [-1] * (len(tree) + 1)
    am[0] = argmax_of(0)
    accepted = [False] * len(tree)
    for i, (tok, par) in enumerate(zip(tree.tokens, tree.parents)):
        if (par < 0 or accepted[par]) and tok == am[par + 1]:
            accepted[i] = True
            am[i + 1] = argmax_of(i + 1)
    return torch.tensor(am, dtype=torch.long)


@dataclass(frozen=True)
class RowEdit:
    """What the row sources stacked on a pass do to one of its rows, for an argmax taken without the
    whole row (`TreeRows.exact_argmax`): the row's values changed by `change`, then every id outside
    `allowed` at -inf. A mask may sit below a change in the stack: every change here (the penalties)
    keeps -inf at -inf, so a mask counts the same at any place."""

    allowed: torch.Tensor | None = None
    """[vocab] bool: the ids no source masks (None: every id)."""
    change: Callable[[torch.Tensor], torch.Tensor] | None = None
    """A [vocab] float32 row -> the changed row (a new tensor), each id's new value a function of its
    own value alone and never smaller for a larger one (monotone: a screened pass maps each id's interval
    through it, `OutputScreen.edited_argmax`). None: no change."""

    def masked(self, allowed: torch.Tensor) -> "RowEdit":
        """This edit with the ids outside `allowed` ([vocab] bool) masked too."""
        return RowEdit(allowed if self.allowed is None else self.allowed & allowed, self.change)

    def changed_first(self, change: Callable[[torch.Tensor], torch.Tensor]) -> "RowEdit":
        """`change` (a source's below this edit's) run before this edit's own change."""
        outer = self.change
        return RowEdit(self.allowed, change if outer is None else lambda row: outer(change(row)))


class TreeRows:
    """``[n + 1, vocab]`` rows of a tree (row 0 after the root, row i + 1 after node i), each
    computed by `_row` the first time it is asked for."""

    def __init__(self, logits, tree: TokenTree) -> None:
        self.logits = logits  # [n + 1, vocab]: a tensor, or another row source
        self.tree = tree
        self._rows: dict[int, torch.Tensor] = {}

    def _row(self, row: int) -> torch.Tensor:
        """Row `row` transformed ([vocab])."""
        raise NotImplementedError

    @property
    def shape(self) -> torch.Size:
        return self.logits.shape

    @property
    def device(self) -> torch.device:
        return self.logits.device

    def dim(self) -> int:
        return self.logits.dim()

    def __len__(self) -> int:
        return self.logits.shape[0]

    def path_tokens(self, row: int) -> list[int]:
        """The tree's tokens from the root's child to row `row`'s node (none for row 0)."""
        return self.tree.tokens_of(self.tree.path_to(row - 1)) if row > 0 else []

    def __getitem__(self, row: int) -> torch.Tensor:
        row = int(row)
        out = self._rows.get(row)
        if out is None:
            out = self._rows[row] = self._row(row)
        return out

    def full(self) -> torch.Tensor:
        """Every row: [n + 1, vocab] (for rules that take all rows at once on a device)."""
        return torch.stack([self[r] for r in range(len(self))])

    def argmax(self, dim: int = -1) -> torch.Tensor:
        """LongTensor [n + 1]: the argmax of the root's row and of every row whose node a greedy
        walk accepts (torch's tie rule: the first index); -1 in the rows no walk reaches (what they
        hold cannot matter)."""
        if dim not in (-1, 1):
            raise ValueError(f"{type(self).__name__}.argmax works along the vocabulary (dim=-1)")
        return greedy_argmax(self.tree, self._argmax_of)

    def _argmax_of(self, row: int) -> int:
        """Row `row`'s argmax (`argmax`'s walk asks each row it reaches): its transformed row's, taken
        without computing the row where the pass below can (`exact_argmax`)."""
        got = self.exact_argmax(row, RowEdit())
        return argmax_row(self[row]) if got is None else got

    def exact_argmax(self, row: int, edit: RowEdit) -> int | None:
        """The argmax of row `row` as this source transforms it and then `edit` (the sources above
        it), exactly, where the row source at the bottom of the stack takes it without the row (a
        screened pass: `models.native.screen.ScreenedLogits.exact_argmax`); None where not."""
        below = getattr(self.logits, "exact_argmax", None)
        own = None if below is None else self._edit(row, edit)
        return None if own is None else below(row, own)

    def exact_top(self, row: int, edit: RowEdit, top_k: int, within: float,
                  ranks_every_id: bool = False) -> tuple | None:
        """The ids of row `row` a truncated sample can keep and their exact values (with bounds on the others' for
        top-p over every id), as this source transforms the row and then `edit`
        (`models.native.screen.OutputScreen.edited_top`), where the row source at the bottom of the stack takes them
        without the row; None where not."""
        below = getattr(self.logits, "exact_top", None)
        own = None if below is None else self._edit(row, edit)
        return None if own is None else below(row, own, top_k, within, ranks_every_id)

    def _edit(self, row: int, edit: RowEdit) -> RowEdit | None:
        """`edit` with what this source does to row `row` put below it (None: this source cannot
        say it as a `RowEdit`)."""
        return None
