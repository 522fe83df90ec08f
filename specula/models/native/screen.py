"""An exact greedy argmax of the target's float32 output layer through a cheap int8 pass (the screen).

Why: a greedy step needs each verified row's argmax, not its logits, and the output layer reads its
whole weight matrix whatever the rows: the 1.5B's float32 layer (890 MiB) took 12-18 ms of a ~105 ms
plain step on the 2-core EPYC, the screen's argmax 6.4 ms (1 row; `SCREEN_MAX_ROWS` for more).

Where the kernels run AVX-512 with VNNI, the int8 pass is the `i8` kernels' (int8 weights and int8 activations,
`vpdpbusd`; session 137), over two rows for each row `x`: `x` itself and its residual `d = x - xs q` (`q`, `xs`:
the codes and scale the kernel quantizes `x` by), whose logits are added. One row's int8 codes step by its
largest |x| / 127, and a final state's largest inputs are a few channels far above the rest (SmolLM2's rows: max
|x| about 12.5 times the mean): one int8 row alone left a median of 48 candidates a row on SmolLM2's real rows
and a 90th percentile of 656, where the residual's codes step 254 times finer and leave what the weights' codes
leave, as float32 activations did (the `w8` screen before; `runs/s137/screen_ab.py`: a median of 3, a 90th
percentile of 15, on `fusion`'s passes). Two int8 rows cost less than one w8 row: SmolLM2's screen went from
1.68 to 1.35 ms a pass over the same passes. On AVX2 alone (`maddubs`) two int8 rows cost more than one w8 row
from 4 rows on (SmolLM2's layer at 8 rows: 4.3 ms against 2.7), so there the copy stays `w8`: its logit is
within `slack_v |x|_1 + 2^-20 |a_v|` (the bound below with no `hw1` term and `L = |x|_1`), and passes of up to
`W8_SCREEN_MAX_ROWS` rows are screened.

How, exactly (the argmax is the float32 layer's bit for bit, ties included): the screen's logit `a_v` of a row
`x` differs from the float32 layer's `l_v` by at most

    bound_v = slack_v * L + hw1_v * xs' + 2^-20 |a_v|,   L = |x|_1 + E xs' / 2 * (1 + 2^-10),
    xs' = xs2 + 2^-21 xs,   slack_v = scale_v * (1/2 + 2 * 127 * gamma_(E+2)) * (1 + 2^-10),
    gamma_m = m u / (1 - m u), u = 2^-24,   hw1_v = sum_j |w_vj| / 2 * (1 + 2^-10)
    (`screen.c`; each rounded up past its float32 rounding):

the residual row is quantized to `xs2 q2` with every `|d_j - xs2 q2_j| <= xs2 / 2` (up to the quotient's
rounding: the 2^-10), and `d` itself is `x - xs q` but for two float32 roundings, at most `u (|x_j| + xs)`;
so `x = xs q + xs2 q2 + e` with `|e_j| <= xs' / 2 * (1 + 2^-10) + u |x_j|`. Each weight is `scale_v q` but for
at most `scale_v / 2`, so `sum w x - sum (scale q)(xs q + xs2 q2) = sum w e + sum (w - scale q)(xs q + xs2 q2)`
is at most `hw1_v xs' + scale_v / 2 * L` (and `u sum |w x|`). The float32 layer's dot product of E =
in_features terms is off by at most `gamma * sum_j |w_vj x_j| <= gamma * 127 scale_v |x|_1` whatever order
its kernel sums in; the slack's second share of that covers the `u sum |w x|` and the three float32 roundings
that make each row's exact int32 sum a logit (3u of each: the first row's at most `3u 127 scale_v (|x|_1 + E xs
/ 2) <= 3u 127 scale_v |x|_1 (1 + E / 254)`, the residual's far less; within the share for E >= 3, as every
output layer is); `a_v +- bound`, the two rows' addition and the bound itself round too: the 2^-20 |a_v| =
16u |a_v| and the bound's own 2^-20 cover them. Every id whose upper end `a_v + bound` reaches the largest lower
end `max(a - bound)` is a candidate: the exact maximum, at every id that holds it, is among them. The
candidates' float32 logits come from the layer's own rows (`screen.c`'s `specula_screen_exact`: each the f32
kernels' FMA chain, bit for bit the whole layer's outputs; a row's lone candidate needs none), and the first
maximal candidate in id order is torch's `argmax`. A row with a value or a bound that is not finite, or with more than
`CANDIDATE_CAP` candidates, is computed whole.

On the 1.5B's rows over the everyday prompts (session 124, `docs/training.md`): a median of 1
candidate a row, at most 29; the exact argmax among them every time.

The screen is built when a decoder starts on a target whose float32 output layer has at least
`SCREEN_MIN_WEIGHTS` weights (a pass over its packed rows, 0.1 s for the 1.5B; else on the first
greedy pass), and is not a module of the decoder: the weight bytes, the quantization and the prepared entry are the
target's as before. `ScreenedLogits` is what a verification pass returns then: its `argmax` goes
through the screen, and so does the argmax of a row that a grammar masks or penalties change
(`exact_argmax`, `OutputScreen.edited_argmax`); anything else (a sampled row, logprobs) computes the
float32 logits once, as the pass did before.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch

from specula.models.native.kernels import KernelLinear, isa, library, top_k_ids
from specula.models.quantize import _TINY  # a weight column's smallest scale, as quantize_rows floors it

if TYPE_CHECKING:
    from specula.tree_rows import RowEdit

Kept = tuple[torch.Tensor, torch.Tensor, "tuple[torch.Tensor, torch.Tensor] | None"]
"""What `OutputScreen.edited_top` gives: ids [m] long ascending, their exact values [m], and bounds (lower [V], upper
[V], -inf at the m) of the other ids' values where asked (`sampling.truncated_race`'s `rest`), else None."""

SCREEN_MIN_WEIGHTS = 8 << 20
"""The smallest float32 output layer (out x in weights, 32 MiB) screened: below it the full layer is a
small part of a step and the screen's own pass would not pay (SmolLM2's 49,152 x 576 = 28.3M is
screened; the tests' tiny models are not, unless a test attaches a screen)."""
TOP_SCREEN_MIN_WEIGHTS = 64 << 20
"""The smallest float32 output layer (256 MiB) whose passes give top-p over every id through the screen, and through a
w8 copy (AVX2 alone) any truncated sample's kept ids (`OutputScreen.edited_top`, `fits`): their candidates are
hundreds of rows where an argmax's are one or two. Through a w8 copy, below it, the int8 pass and the candidates cost
about what the whole layer does (SmolLM2's 28.3M weights, top-k 40: one row 1.9-2.1 ms against 2.3-3.0 whole, but
`fusion` 0.90-1.01x in three rounds; the 1.5B's 233M: a row 6.0 ms against 13.6). Through an i8 copy with the kept
ids in one C pass (session 138) top-k and min-p pay on SmolLM2 too, top-p over every id does not (`eagle3` and
`fusion` 0.81-0.95x in two rounds: its bounds on every other id cost more a row); `docs/native.md`."""
W8_SCREEN_MAX_ROWS = 14
"""`SCREEN_MAX_ROWS` of a w8 copy (AVX2 alone): past 14 rows (`MULTI_ROWS` in `kernels/linear.h`) the w8 call runs
panels and no longer pays (session 125's table, `docs/native.md`)."""
SCREEN_MAX_ROWS = 48
"""A pass of more rows computes its float32 logits as before (an i8 copy; a w8 copy: `W8_SCREEN_MAX_ROWS`). The
screen's int8 pass costs more with the rows (two int8 rows each) where the float32 layer's barely does (it reads
memory). Until session 137 the copy ran as w8 and passes of up to 14 rows were screened (past `MULTI_ROWS` in
`kernels/linear.h` the w8 call lost its items of several column blocks). The i8 screen's argmax against the
float32 layer's and its argmax on real final states (ms, 2-core EPYC, `runs/s137/screen_maxrows.py ALIAS ROWS`,
one process), 1 / 14 / 16 / 24 / 32 / 48 rows: SmolLM2 1.23 / 3.71 / 4.60 / 6.15 / 8.53 / 12.01 against 3.68 /
5.49 / 6.77 / 9.44 / 12.79 / 16.08 (64 rows: 15.6 against 19.1); the 1.5B 5.5 / 22.1 / 25.8 / 41.5 / 49.2 / 93.2
against 18.9 / 36.2 / 44.5 / 61.8 / 82.7 / 124.4. A packed batch's pass (several requests' trees) can hold more
than 14 rows."""
CANDIDATE_CAP = 256
"""At most this many candidates a row go through the layer's own rows; a row with more is computed
whole (on the 1.5B a row had at most 29)."""
NUCLEUS_CANDIDATES = 64
"""For top-p over every id (`OutputScreen.edited_top`'s `ranks_every_id`): the candidates are the ids whose upper
end reaches this many-th largest lower end. On the Qwen pair's real rows (T 1.0, top-p 0.9-0.95) a median nucleus
of 2 ids, the 90th percentile 5-18; the bounds on the others decide 79-99% of rows (`docs/native.md`)."""
TOP_CANDIDATE_CAP = 2048
"""`CANDIDATE_CAP` for the ids a truncated sample can keep (`OutputScreen.edited_top`): about the k-th largest
logit the int8 copy's intervals overlap far more than about the largest (SmolLM2's rows at top-k 40: a median of
206 candidates, at most 392; top-k 100: 489, at most 877), and their rows cost little beside the whole layer's
(2,048 of the 1.5B's 1,536-wide rows: 12 MiB of its 890)."""


ROOM = 1 + 2.0 ** -10
"""The quotients' rounding in a weight's or an activation's int8 code (module docstring): at most half a step
times this."""


def slack_of(scale: torch.Tensor, in_features: int) -> torch.Tensor:
    """[V] float32 (rounded up): how far the int8 copy's logit can be from the float32 layer's, per
    unit of the row's |x|_1, for int8 columns of `scale` [V] over `in_features` inputs (module
    docstring)."""
    u = 2.0 ** -24
    m = in_features + 2
    gamma = m * u / (1 - m * u)
    c = (0.5 + 2 * 127 * gamma) * ROOM
    slack = scale.double() * c * (1 + 2.0 ** -20)  # the float32 rounding below stays above the bound
    return slack.float()


def screen_rows(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(both [2n, E], xs [n], L [n], xs' [n]) float32 for rows states [n, E] (float32, contiguous), in one C call
    (`screen.c`'s `specula_screen_rows`; a dozen small torch ops took 0.1-0.2 ms of a SmolLM2 step): both = the rows
    and then each row's residual d = x - xs q after the codes q and scale xs the i8 kernel quantizes it by (its own
    quantizer, `specula_quantize_rows`), computed in float32; L and xs' as `row_terms` gives them (module
    docstring)."""
    n, inp = states.shape
    both = torch.empty((2 * n, inp), dtype=torch.float32)
    xs, total, step = (torch.empty(n, dtype=torch.float32) for _ in range(3))
    if library().specula_screen_rows(states.data_ptr(), both.data_ptr(), xs.data_ptr(), total.data_ptr(),
                                     step.data_ptr(), n, inp, 0.5 * ROOM):
        raise MemoryError(f"the screen could not allocate its rows' codes ({n} x {inp})")
    return both, xs, total, step


def row_terms(states: torch.Tensor, kind: str = "i8") -> tuple[torch.Tensor, torch.Tensor]:
    """(L [n], xs' [n]) float32 of rows states [n, E] through a `kind` copy: for i8 each row's `|x|_1 + E xs' / 2 *
    ROOM` and the step that bounds what its two int8 rows leave of it, `xs' = xs2 + 2^-21 xs` (xs2 = the residual's
    largest |d| / 127, the kernel's step for it; `screen_rows`); for w8 (float32 activations) `|x|_1` and 0 (module
    docstring). L rounded up past its rounding; not finite where the row is not."""
    states = states.float().contiguous()
    if kind == "w8":
        return (states.double().abs().sum(dim=1) * (1 + 2.0 ** -20)).float(), states.new_zeros(len(states))
    _, _, total, step = screen_rows(states)
    return total, step


def default_kind() -> str:
    """The int8 copy an `OutputScreen` builds unless told: "i8" where the kernels run AVX-512 (VNNI), "w8" on AVX2
    alone (module docstring)."""
    return "w8" if isa() == "avx2" else "i8"


def top_floor(top_k: int, within: float) -> Callable[[torch.Tensor, float], float]:
    """What a truncated sample's candidates must reach (`OutputScreen.edited_top`): of the changed lower ends low
    [V] and their largest, the top_k-th largest (0 < top_k < V, else -inf) or the largest less `within`, whichever
    is higher (compared with the upper ends in float32)."""
    def floor(low: torch.Tensor, best_low: float) -> float:
        kth = float(low.topk(top_k).values[-1]) if 0 < top_k < low.shape[0] else float("-inf")
        return max(kth, best_low - within)
    return floor


class OutputScreen:
    """The int8 copy of a float32 `KernelLinear` output layer and the exact argmax through it."""

    def __init__(self, head: KernelLinear, kind: str | None = None) -> None:
        """`kind`: the copy's kernels, "i8" (each row and its residual, int8 activations) or "w8" (float32
        activations); None: i8 where the kernels run AVX-512 (VNNI), w8 on AVX2 alone (module docstring)."""
        kind = kind or default_kind()
        if kind not in ("i8", "w8"):
            raise ValueError(f"an output screen's copy is i8 or w8, got {kind!r}")
        if head.kind != "f32" or head.bias is not None:
            raise ValueError(f"an output screen takes a float32 layer without bias, got {head.kind} "
                             f"{'with' if head.bias is not None else 'without'} bias")
        self.head = head
        out, inp = head.out_features, head.in_features
        block = library().specula_block()
        blocks = (out + block - 1) // block
        quads = kind == "i8"
        packed = torch.empty(blocks * block * ((inp + 3) // 4 * 4 if quads else inp), dtype=torch.int8)
        scale = torch.empty(blocks * block, dtype=torch.float32)
        w1 = torch.empty(blocks * block, dtype=torch.float64)  # sum_j |w_vj|
        library().specula_screen_pack(head.packed.data_ptr(), packed.data_ptr(), scale.data_ptr(), w1.data_ptr(),
                                      inp, out, _TINY, int(quads), torch.get_num_threads())
        scale = scale[:out].contiguous()
        self.approx = KernelLinear.from_packed(kind, inp, out, packed, scale)
        self.slack = slack_of(scale, inp)  # [V]
        self.hw1 = (w1[:out] * (0.5 * ROOM) * (1 + 2.0 ** -20)).float()  # [V], rounded up past its rounding

    @property
    def kind(self) -> str:
        """The copy's kernels: "i8" or "w8"."""
        return self.approx.kind

    @property
    def max_rows(self) -> int:
        """The most rows of a pass the screen takes (`SCREEN_MAX_ROWS`, `W8_SCREEN_MAX_ROWS`)."""
        return SCREEN_MAX_ROWS if self.kind == "i8" else W8_SCREEN_MAX_ROWS

    @classmethod
    def fits(cls, head: object, top: bool = False, nucleus: bool = False) -> bool:
        """Whether `head` is an output layer a screen pays on: float32 on specula's kernels, no bias,
        at least `SCREEN_MIN_WEIGHTS` weights; `top` (a truncated sample's kept ids) through a w8 copy, and
        `nucleus` (top-p over every id) through any, at least `TOP_SCREEN_MIN_WEIGHTS`."""
        least = TOP_SCREEN_MIN_WEIGHTS if nucleus or (top and default_kind() == "w8") else SCREEN_MIN_WEIGHTS
        return (isinstance(head, KernelLinear) and head.kind == "f32" and head.bias is None
                and head.out_features * head.in_features >= least)

    def argmax(self, states: torch.Tensor) -> torch.Tensor:
        """LongTensor [n]: `head(states).argmax(-1)` exactly (torch's rule: the first maximal id),
        for states [n, E] float32."""
        return self.argmax_and_approx(states)[0]

    def argmax_and_approx(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`argmax(states)` [n], the int8 copy's logits [n, V] it screened)."""
        states = states.float().contiguous()
        approx = self.approx_logits(states)
        return self.decide(states, approx), approx

    def approx_logits(self, states: torch.Tensor) -> torch.Tensor:
        """The screen's logits [n, V] of states [n, E] (float32, contiguous): the int8 pass over each row and its
        residual (`screen_rows`), their logits added (module docstring)."""
        return self.approx_and_terms(states)[0]

    def approx_and_terms(self, states: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """(`approx_logits(states)`, the rows' `row_terms` where the pass made them (i8), else None)."""
        n, out = states.shape[0], self.head.out_features
        if self.kind == "w8":
            return self.approx.into(states, torch.empty((n, out), dtype=torch.float32)), None
        both, _, total, step = screen_rows(states)  # [2n, E], [n] x3
        logits = self.approx.into(both, torch.empty((2 * n, out), dtype=torch.float32))  # [2n, V]
        # added in C: torch's add woke its sleeping OpenMP workers (0.29 ms of a SmolLM2 step, `docs/native.md`)
        library().specula_screen_add_halves(logits.data_ptr(), n, out, torch.get_num_threads())
        return logits[:n], (total, step)

    def decide(self, states: torch.Tensor, approx: torch.Tensor,
               terms: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """LongTensor [n]: each row's exact argmax from its int8 logits approx [n, V] (`approx_logits` of
        states [n, E], float32, contiguous; `terms`: their `row_terms` where already made)."""
        return self._decide(states, approx, None, terms)

    def edited_argmax(self, state: torch.Tensor, approx: torch.Tensor, edit: RowEdit) -> int | None:
        """The argmax of `head(state)` as `edit` changes and masks it (state [E] float32, approx [V]: the
        copy's logits of it), exactly. A change (the penalties) is monotone in each id's own value and
        computed in float32 with monotone roundings, so it maps the bound's interval of each id's logit to
        an interval of its changed value: `edit.change` of the lower and of the upper ends, the masked ids at
        -inf; every id whose changed upper end reaches the largest changed lower end is a candidate, and the
        first maximal candidate of their float32 logits through the layer's own rows, changed, is the argmax.
        None where only the whole row can say: a value or bound not finite, every id masked, more than
        `CANDIDATE_CAP` candidates."""
        if edit.change is None:
            return self.masked_argmax(state, approx, edit.allowed)
        got = self._edited_candidates(state, approx, edit, lambda low, best_low: best_low, CANDIDATE_CAP)
        if got is None:
            return None
        ids, values, _ = got
        return int(ids[int(values.argmax())])

    def edited_top(self, state: torch.Tensor, approx: torch.Tensor, edit: RowEdit, top_k: int, within: float,
                   ranks_every_id: bool = False) -> Kept | None:
        """The ids a truncated sample can keep, with their exact values: (ids [m] long ascending, the float32 logits
        of `head(state)` there as `edit` changes and masks them [m], None), every id whose value reaches the
        `top_k`-th largest (0: no top-k) and lies within `within` of the largest among them
        (`sampling.truncated_race`). The candidates are the ids whose changed upper end reaches both the `top_k`-th
        largest changed lower end and the largest lower end less `within` (each exact value lies in its interval, so
        no kept id is missed; with top-p `within` is infinite, `SamplingParams.kept_within`: it ranks every id the
        top k holds, or every id allowed where they are fewer).

        `ranks_every_id` (top-p without top-k, `SamplingParams.ranks_every_id`): the ids whose changed upper end
        reaches the `NUCLEUS_CANDIDATES`-th largest changed lower end, and as third item the other ids' changed
        (lower [V], upper [V]) ends (-inf at the candidates), which bound the rest of the nucleus' normaliser
        (`truncated_race`'s `rest`). None where only the whole row can say (`edited_argmax`'s cases)."""
        if ranks_every_id:
            top_k, within = NUCLEUS_CANDIDATES, math.inf
        if edit.change is None:  # the ids `top_floor` gives below, in one C pass
            return self._kept_ids(state, approx, edit.allowed, top_k, within, ranks_every_id)
        return self._edited_candidates(state, approx, edit, top_floor(top_k, within), TOP_CANDIDATE_CAP, ranks_every_id)

    def _kept_ids(self, state: torch.Tensor, approx: torch.Tensor, allowed: torch.Tensor | None, top_k: int,
                  within: float, rest: bool) -> Kept | None:
        """`_edited_candidates` of `edited_top` for an edit that masks (`allowed` [V] bool, or None) and changes
        nothing, in one C pass over the row (`screen.c`'s `specula_screen_top`: the same float32 steps, so the same
        ids, values and bounds; SmolLM2's 49,152 ids 0.21-0.37 ms a row against 0.28-0.63 for the torch steps). The
        row's terms are `_edited_candidates`' (`_edited_terms`)."""
        state = state.float().view(1, -1).contiguous()
        l1, xs = self._edited_terms(state)
        vocab = self.head.out_features
        approx = approx.float().contiguous()
        mask = None if allowed is None else allowed.to(torch.uint8).contiguous()  # [V]
        ids = torch.empty(TOP_CANDIDATE_CAP, dtype=torch.int32)
        lower, upper = torch.empty(vocab), torch.empty(vocab)  # [V] each: the others' ends
        kth = max(1, min(top_k, vocab))
        kth_vals, kth_ids = torch.empty(kth), torch.empty(kth, dtype=torch.long)  # the k-th largest's scratch
        count = library().specula_screen_top(approx.data_ptr(), self.slack.data_ptr(), self.hw1.data_ptr(), l1, xs,
                                             None if mask is None else mask.data_ptr(), vocab, top_k, within,
                                             ids.data_ptr(), TOP_CANDIDATE_CAP, lower.data_ptr(), upper.data_ptr(),
                                             kth_vals.data_ptr(), kth_ids.data_ptr())
        if not 0 < count <= TOP_CANDIDATE_CAP:  # an end not finite, every id masked, or too many
            return None
        ids = ids[:count]
        values = self._exact(state, ids.view(1, -1), torch.tensor([count], dtype=torch.int32))[0]  # [k]
        if bool(values.isnan().any()):
            return None
        return ids.long(), values, (lower, upper) if rest else None

    def _edited_terms(self, state: torch.Tensor) -> tuple[float, float]:
        """One row's (L, xs') of `row_terms` for state [1, E], each rounded up further (the edited and truncated
        paths' bound, `_edited_candidates` and `_kept_ids` alike)."""
        l1, xs = (float(t) * (1 + 2.0 ** -16) for t in row_terms(state, self.kind))
        return l1, xs

    def _edited_candidates(self, state: torch.Tensor, approx: torch.Tensor, edit: RowEdit,
                           floor: Callable[[torch.Tensor, float], float], cap: int,
                           rest: bool = False) -> Kept | None:
        """(ids [k] long ascending, their exact changed and masked values [k], and with `rest` the other ids' changed
        and masked (lower [V], upper [V]) ends, -inf at the k, else None) of every id not masked whose changed upper end
        reaches `floor(changed lower ends [V], their largest)` (ascending: a first maximal id is torch's); None where a
        value or bound is not finite, every id is masked, or more than `cap` ids reach it."""
        l1, xs = self._edited_terms(state.float().view(1, -1))
        bound = self.slack * l1 + self.hw1 * xs + approx.abs() * 2.0 ** -18  # [V]: `_decide`'s, room for roundings
        lower, upper = approx - bound, approx + bound  # [V]
        if not math.isfinite(float(lower.sum()) + float(upper.sum())):  # an end not finite (or sums past float32's
            return None  # range: the whole row then too), in 0.03 ms where `isfinite` took 0.23 on the 1.5B's row
        change = edit.change or (lambda row: row)
        low, high = change(lower), change(upper)  # [V] each: the changed values' interval
        if edit.allowed is not None:
            low = low.masked_fill(~edit.allowed, float("-inf"))
            high = high.masked_fill(~edit.allowed, float("-inf"))
        best_low = float(low.max())
        if not math.isfinite(best_low):  # every id masked
            return None
        reach = (high >= floor(low, best_low)) & (high > float("-inf"))  # [V]
        ids = reach.nonzero().view(-1)  # [k] ascending
        if len(ids) > cap:
            return None
        # the others' ends, the candidates at -inf (a boolean gather of 152k ids cost 1.4 ms), before `lower` below
        # takes the exact values
        others = (low.masked_fill(reach, float("-inf")), high.masked_fill(reach, float("-inf"))) if rest else None
        exact = self._exact(state.float().view(1, -1), ids.to(torch.int32).view(1, -1),
                            torch.tensor([len(ids)], dtype=torch.int32))[0]  # [k]
        lower[ids] = exact  # a row holding the candidates' logits: a change reads each id's own value
        values = change(lower)[ids]  # [k]
        if edit.allowed is not None:
            values = values.masked_fill(~edit.allowed[ids], float("-inf"))
        if bool(values.isnan().any()):
            return None
        return ids, values, others

    def _exact(self, states: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """[n, cap] float32: each row's first counts[r] candidates' logits, the layer's own outputs bit for bit
        (`screen.c`'s `specula_screen_exact`), for states [n, E] and ids [n, cap] int32 (counts [n] int32; a row
        with none is left unwritten)."""
        states, ids, counts = states.float().contiguous(), ids.contiguous(), counts.contiguous()
        exact = torch.empty(ids.shape, dtype=torch.float32)
        library().specula_screen_exact(self.head.packed.data_ptr(), states.data_ptr(), ids.data_ptr(),
                                       counts.data_ptr(), ids.shape[0], ids.shape[1], self.head.in_features,
                                       exact.data_ptr())
        return exact

    def masked_argmax(self, state: torch.Tensor, approx: torch.Tensor, allowed: torch.Tensor | None) -> int:
        """The first id holding the maximum of `head(state)` over the `allowed` ids (state [E] float32,
        approx [V]: the copy's logits of it, allowed [V] bool), exactly: a grammar's greedy token, what
        `head(state).masked_fill(~allowed, -inf).argmax()` gives (None: every id allowed). The same bound as
        `argmax`, the largest lower end taken over the allowed ids only."""
        return int(self._decide(state.float().view(1, -1).contiguous(), approx.view(1, -1).contiguous(),
                                None if allowed is None else allowed.view(1, -1))[0])

    def _decide(self, states: torch.Tensor, approx: torch.Tensor, allowed: torch.Tensor | None,
                terms: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """LongTensor [n]: each row's exact argmax (over its `allowed` ids [n, V] bool, where given),
        from the copy's logits approx [n, V] of states [n, E] (and their `row_terms`, where the caller has them):
        the candidates and the first maximal of their float32 logits from the layer's own rows, in one C call
        (`screen.c`'s `specula_screen_decide`), or the whole row where the screen cannot decide."""
        n, vocab = states.shape[0], self.head.out_features
        states, approx = states.float().contiguous(), approx.contiguous()  # the C call reads their memory
        l1, xs = terms if terms is not None else row_terms(states, self.kind)  # [n] each
        mask = None if allowed is None else allowed.to(torch.uint8).contiguous()  # [n, V]
        out = torch.empty(n, dtype=torch.long)
        if library().specula_screen_decide(approx.data_ptr(), self.slack.data_ptr(), l1.data_ptr(), self.hw1.data_ptr(),
                                           xs.data_ptr(), None if mask is None else mask.data_ptr(), n, vocab,
                                           CANDIDATE_CAP, self.head.packed.data_ptr(), states.data_ptr(),
                                           self.head.in_features, out.data_ptr(), torch.get_num_threads()) < 0:
            raise MemoryError(f"the screen could not allocate its candidates ({n} x {CANDIDATE_CAP})")
        whole = [r for r, top in enumerate(out.tolist()) if top < 0]
        if whole:  # a value not finite, nothing allowed, or too many candidates
            logits = self.head.into(states[whole].contiguous(), torch.empty((len(whole), vocab), dtype=torch.float32))
            if allowed is not None:
                logits = logits.masked_fill(~allowed[whole], float("-inf"))
            out[whole] = logits.argmax(dim=1)
        return out


class ScreenedPass:
    """A verification pass's logits [T, V] kept as its final states [T, E] and the screen's int8 logits
    (in the pass, so their time is the pass's); every row's argmax is taken through the screen the first
    time it is asked for (a row a grammar masks or penalties change asks for its own instead:
    `ScreenedLogits.exact_argmax`), and the float32 logits are computed once, for every row, the first
    time anything else is asked of them."""

    def __init__(self, states: torch.Tensor, screen: OutputScreen) -> None:
        self.states = states.clone().float().contiguous()  # [T, E]: its own, whatever the decoder reuses later
        self.screen = screen
        self.approx, self._terms = screen.approx_and_terms(self.states)  # [T, V]; (L, xs') [T] each, or None
        self._argmax: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None

    @property
    def argmax(self) -> torch.Tensor:
        """LongTensor [T]: every row's exact argmax (computed once)."""
        if self._argmax is None:
            self._argmax = self.screen.decide(self.states, self.approx, self._terms)
        return self._argmax

    @property
    def has_logits(self) -> bool:
        """Whether the float32 logits were computed."""
        return self._logits is not None

    def logits(self) -> torch.Tensor:
        """The float32 logits [T, V] (computed once)."""
        if self._logits is None:
            self._logits = self.screen.head(self.states).float()
        return self._logits

    def rows(self, start: int, stop: int) -> "ScreenedLogits":
        """One sequence's rows start .. stop - 1 of the pass."""
        return ScreenedLogits(self, start, stop)


class ScreenedLogits:
    """One sequence's rows [n, V] of a `ScreenedPass`, shaped like the logits tensor for the rules
    (`specula.verify.Rows`): `argmax(-1)` is the pass's exact one; indexing, `full`, `float` and
    `topk` read the float32 logits (computed then)."""

    def __init__(self, screened: ScreenedPass, start: int, stop: int) -> None:
        self.screened = screened
        self.start, self.stop = start, stop

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.stop - self.start, self.screened.screen.head.out_features))

    @property
    def device(self) -> torch.device:
        return self.screened.states.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def dim(self) -> int:
        return 2

    def __len__(self) -> int:
        return self.stop - self.start

    def full(self) -> torch.Tensor:
        """The float32 logits [n, V]."""
        return self.screened.logits()[self.start: self.stop]

    def __getitem__(self, index) -> torch.Tensor:
        return self.full()[index]

    def float(self) -> torch.Tensor:
        return self.full()

    def topk(self, k: int, dim: int = -1):
        return self.full().topk(k, dim=dim)

    def argmax(self, dim: int = -1) -> torch.Tensor:
        """LongTensor [n]: every row's argmax, the float32 logits' exactly."""
        if dim not in (-1, 1):
            raise ValueError("ScreenedLogits.argmax works along the vocabulary (dim=-1)")
        return self.screened.argmax[self.start: self.stop]

    def exact_argmax(self, row: int, edit: RowEdit) -> int | None:
        """Row `row`'s argmax as the row sources above change and mask it (`TreeRows.exact_argmax`), exactly,
        with no float32 logits computed (`OutputScreen.edited_argmax`); None where the whole row must say
        (or its float32 logits were computed: the sources above then transform the row)."""
        screened = self.screened
        if edit.change is None and edit.allowed is None:
            return int(self.argmax()[row])
        if screened.has_logits:
            return None
        r = self.start + row
        return screened.screen.edited_argmax(screened.states[r], screened.approx[r], edit)

    def exact_top(self, row: int, edit: RowEdit, top_k: int, within: float,
                  ranks_every_id: bool = False) -> Kept | None:
        """Row `row`'s ids a truncated sample can keep, with their exact values as the row sources above change and
        mask them, and for top-p over every id bounds on the others' (`TreeRows.exact_top`, `OutputScreen.edited_top`),
        with no float32 logits computed; None where the whole row must say (or its float32 logits were computed)."""
        screened = self.screened
        if screened.has_logits:
            return None
        r = self.start + row
        return screened.screen.edited_top(screened.states[r], screened.approx[r], edit, top_k, within, ranks_every_id)

    def draft_top_k(self, k: int) -> torch.Tensor:
        """LongTensor [n, k]: each row's k best ids for a drafter to learn from (token recycling):
        the screen's int8 logits' unless the float32 logits were computed (a drafter's choice needs
        no exactness; no second pass for it), by `kernels.top_k_ids` (a C scan: 4-5 us a row of SmolLM2's
        49,152 ids, against 30-90 for torch's top-k)."""
        rows = self.full() if self.screened.has_logits else self.screened.approx[self.start: self.stop]
        return top_k_ids(rows, k)

    def draft_top_k_into(self, row: int, out) -> None:
        """`draft_top_k(k)[row]` written into out (numpy int32 [k], C-contiguous: token recycling's matrix row) by
        one C call on the row's own memory (no tensor made: a step that verified no draft paid 0.1 ms of torch
        and numpy glue for it, run cold after each pass)."""
        screened, vocab = self.screened, self.screened.approx.shape[1]
        source = screened.logits() if screened.has_logits else screened.approx
        if not 0 <= row < self.stop - self.start or not 0 < len(out) <= vocab:
            raise ValueError(f"draft_top_k_into: row {row} of {self.stop - self.start}, k {len(out)} of {vocab}")
        if library().specula_topk_ids_i32(source.data_ptr() + 4 * (self.start + row) * vocab, vocab, len(out),
                                          out.ctypes.data):
            raise MemoryError("draft_top_k_into: no memory for a top-k's scratch")

