"""A minimum output length: the tokens that would end the output masked where it is too short (pure).

Until the output holds `SamplingParams.min_new_tokens` tokens, the end-of-sequence token (unless
`ignore_eos`) and the stop token ids get -inf, as transformers' `MinNewTokensLengthLogitsProcessor`
and vLLM's `min_tokens` do. In a tree each row decides its own output position (the output's length
before the step plus its node's depth), so `EndsMasked` masks each row by that position and the
acceptance rules keep what plain decoding with the same minimum produces (greedy token for token,
sampled in law). Stop strings are held back in `specula.stopping`.
"""

from __future__ import annotations

from typing import Iterable

import torch

from specula.sampling import SamplingParams
from specula.tree import TokenTree
from specula.tree_rows import RowEdit, TreeRows


def ending_ids(params: SamplingParams, eos_token_ids: Iterable[int], vocab: int) -> list[int]:
    """The ids that end an output: the stop token ids, and EOS unless the request ignores it (those
    inside the logits' `vocab`)."""
    ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    return sorted(t for t in ids if 0 <= t < vocab)


class EndsMasked(TreeRows):
    """A tree's rows ([n + 1, vocab], a tensor or another row source) with the ending ids at -inf
    in every row whose token would leave the output shorter than `min_new_tokens`: row 0 decides
    output position `generated`, row i + 1 position `generated` + depth of node i."""

    def __init__(self, logits, tree: TokenTree, generated: int, params: SamplingParams,
                 eos_token_ids: Iterable[int]) -> None:
        super().__init__(logits, tree)
        self.short = params.min_new_tokens - generated  # rows deciding positions below it are masked
        self.ids = torch.tensor(ending_ids(params, eos_token_ids, logits.shape[-1]), dtype=torch.long,
                                device=logits.device)
        self._allowed: torch.Tensor | None = None  # [vocab] bool: every id but the ending ones (`_edit`)

    def _row(self, row: int) -> torch.Tensor:
        return self.logits[row].index_fill(0, self.ids, float("-inf")) if self._masks(row) else self.logits[row]

    def _masks(self, row: int) -> bool:
        """Whether row `row` decides a position before `min_new_tokens` (its ending ids masked)."""
        depth = self.tree.depth[row - 1] if row > 0 else 0
        return depth < self.short and len(self.ids) > 0

    def _edit(self, row: int, edit: RowEdit) -> RowEdit:
        """`edit` with row `row`'s ending ids masked where it decides a position that is too early."""
        if not self._masks(row):
            return edit
        if self._allowed is None:
            self._allowed = torch.ones(self.shape[-1], dtype=torch.bool, device=self.ids.device)  # [vocab]
            self._allowed[self.ids] = False
        return edit.masked(self._allowed)
