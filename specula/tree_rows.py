"""A tree's target logits transformed row by row, each row by the path that leads to it.

Some requests change the target's distribution by what comes before each position: a grammar
(`specula.constraints.MaskedLogits`), repetition penalties (`specula.penalties.PenalizedLogits`).
In a tree every row has its own past (the committed tokens, then the path from the root to its
node), so each row is transformed on its own, and only when a rule asks for it: the rules touch
the rows on one path. `TreeRows` is shaped like the ``[n + 1, vocab]`` tensor for them
(`specula.verify.Rows`); its `argmax` covers the rows a greedy walk reaches.
"""

from __future__ import annotations

import torch

from specula.tree import TokenTree


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
        tree = self.tree
        am = [-1] * (len(tree) + 1)
        am[0] = int(self[0].argmax())
        accepted = [False] * len(tree)
        for i, (tok, par) in enumerate(zip(tree.tokens, tree.parents)):
            if (par < 0 or accepted[par]) and tok == am[par + 1]:
                accepted[i] = True
                am[i + 1] = int(self[i + 1].argmax())
        return torch.tensor(am, dtype=torch.long)
