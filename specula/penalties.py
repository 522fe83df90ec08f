"""Repetition, frequency and presence penalties and a logit bias, applied to a tree's rows (pure).

The penalised distribution at a position depends on the tokens before it, and in a tree each row
has its own: the output so far, then the path from the root to the row's node. `PenalizedLogits`
penalises every row by exactly that history, so the acceptance rules keep what plain decoding
with the same penalties would produce (greedy token for token; sampled in law, and with the same
seed the same tokens).

Per row, in this order (vLLM's): the logit bias is added; every token of the prompt or the output
(path included) has its logit divided by `repetition_penalty` when positive and multiplied by it
otherwise (Hugging Face's and vLLM's rule); every token of the output loses
`frequency_penalty` once per occurrence and `presence_penalty` once (OpenAI's rule). Then
temperature, top-k and top-p apply as always.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import torch

from specula.sampling import SamplingParams
from specula.tree import TokenTree
from specula.tree_rows import RowEdit, TreeRows


def penalize(row: torch.Tensor, output: Counter, prompt: Iterable[int], params: SamplingParams) -> torch.Tensor:
    """One row of logits ([vocab]) penalised for an output holding `output` (token -> count) after
    `prompt`'s tokens: a new float32 tensor."""
    out = row.float().clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=out.device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype, device=out.device)
        out.index_add_(0, ids, bias)  # ids inside the vocabulary: `SpeculativeDecoder.start` refuses others
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=out.device)
        values = out[seen]
        out[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output:
        ids = torch.tensor(list(output), dtype=torch.long, device=out.device)
        counts = torch.tensor(list(output.values()), dtype=out.dtype, device=out.device)
        out[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return out


class PenalizedLogits(TreeRows):
    """A tree's rows ([n + 1, vocab], a tensor or another row source such as a grammar's masked
    rows) penalised by each row's own history: `generated` (the output before this step, the
    root's token last), then the row's path."""

    def __init__(self, logits, tree: TokenTree, prompt: Sequence[int], generated: Sequence[int],
                 params: SamplingParams) -> None:
        super().__init__(logits, tree)
        self.params = params
        self.prompt = set(prompt) if params.repetition_penalty != 1.0 else set()
        self.output = Counter(generated)

    def _row(self, row: int) -> torch.Tensor:
        return penalize(self.logits[row], self._history(row), self.prompt, self.params)

    def _history(self, row: int) -> Counter:
        """The output row `row` follows: the output before this step, then the row's path."""
        path = self.path_tokens(row)
        return self.output + Counter(path) if path else self.output

    def _edit(self, row: int, edit: RowEdit) -> RowEdit:
        """`edit` with this row's penalties run first: `penalize` itself (each token's penalised logit is
        a monotone function of its own: a bias added, a division or multiplication by a positive penalty,
        a subtraction, each rounded monotonically in float32)."""
        output = self._history(row)
        return edit.changed_first(lambda logits: penalize(logits, output, self.prompt, self.params))
