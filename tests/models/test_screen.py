"""The output screen (`specula.models.native.screen`): a greedy argmax through an int8 copy of the float32
output layer is the float32 layer's exactly (near-ties across the int8 rounding, exact ties, rows past the
candidate cap, non-finite states), and a native target's greedy steps take it, with outputs unchanged
for every method, packed batches, sampling, logprobs and penalties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from tiny import SPECULATIVE_PROMPTS, perturbed_copy, reference_greedy, tiny_model
from specula.drafters import make_drafter, make_drafters
from specula.engine import SpeculativeDecoder
from specula.models.base import forward_trees
from specula.models.native import NativeCausalLM, NativeDecoder, configure, kernels
from specula.models.native import screen as screen_module
from specula.models.native.kernels import KernelLinear
from specula.models.native.screen import (CANDIDATE_CAP, SCREEN_MAX_ROWS, W8_SCREEN_MAX_ROWS, OutputScreen,
                                         ScreenedLogits, row_terms, screen_rows)
from specula.sampling import SamplingParams
from specula.tree import TokenTree
from specula.tree_rows import RowEdit, draft_top_k, draft_top_k_into

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"specula's CPU kernels cannot run here: {kernels.unavailable_reason()}")


def f32_layer(weight: torch.Tensor) -> KernelLinear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight.data = weight.float().contiguous()
    return KernelLinear(lin, "f32")


def near_tie_head(vocab: int = 2000, width: int = 96, seed: int = 0) -> torch.Tensor:
    """[vocab, width] weights where many rows are another row plus a change below the int8 step (and
    some rows exact copies): the int8 copy often orders such pairs the other way round."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, width, generator=g)
    base = torch.randint(0, vocab, (vocab // 2,), generator=g)
    w[vocab // 2:] = w[base] + torch.randn(vocab - vocab // 2, width, generator=g) * 1e-3
    w[-10:] = w[3]  # exact ties with row 3: the first index wins
    return w


@pytest.mark.parametrize("kind", ["i8", "w8"])
def test_screen_argmax_is_the_float32_layers_where_the_int8_copy_disagrees(kind):
    w = near_tie_head()
    head = f32_layer(w)
    screen = OutputScreen(head, kind)
    g = torch.Generator().manual_seed(1)
    states = torch.randn(600, w.shape[1], generator=g)
    states[:100] = w[torch.randint(0, len(w), (100,), generator=g)]  # rows aimed at a near-tied pair
    states[100:110] = w[3]  # aimed at the exact ties
    exact = head(states).argmax(-1)
    got, approx = screen.argmax_and_approx(states)
    assert torch.equal(got, exact)
    assert (approx.argmax(-1) != exact).sum() >= 5  # the int8 logits alone would be wrong on these rows
    assert (exact[100:110] == 3).all()


@pytest.mark.parametrize("kind", ["i8", "w8"])
def test_screen_argmax_is_exact_where_large_inputs_coarsen_the_rows_int8_codes(kind):
    """A row's int8 codes step by its largest |x| / 127: large inputs (a final state's few large channels) make
    that step coarse, and the residual row's codes (`screen_rows`) take up what it leaves. Near-tied pairs aimed
    at with such rows: the screen's int8 logits alone pick another token on some, the screen the float32 layer's
    token on all."""
    w = near_tie_head(vocab=1600, width=128, seed=7)
    head = f32_layer(w)
    screen = OutputScreen(head, kind)
    g = torch.Generator().manual_seed(8)
    states = w[torch.randint(0, len(w), (300,), generator=g)] + torch.randn(300, w.shape[1], generator=g) * 0.01
    states[:, 5] = torch.linspace(-60.0, 60.0, 300)  # the largest input
    states[:, 10:34] *= 12.0  # more large inputs
    logits = head(states)  # [300, V]
    got, approx = screen.argmax_and_approx(states)
    assert torch.equal(got, logits.argmax(-1))
    assert (approx.argmax(-1) != logits.argmax(-1)).sum() >= 5


def test_the_screens_logits_are_a_rows_and_its_residuals_through_the_int8_copy():
    """Each row goes through the int8 copy twice: itself and its residual after the codes the kernel quantizes it
    by; a row of exact codes has no residual, and a residual is at most half a step."""
    w = torch.randn(300, 64, generator=torch.Generator().manual_seed(2))
    screen = OutputScreen(f32_layer(w), "i8")
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)) * 3
    x[4] = torch.arange(-32.0, 32.0) / 8  # multiples of 1/8 ...
    x[4, 0] = 127 / 8  # ... whose largest |x| is 127 of them: the kernel's step, so every input is an exact code
    both, xs, _, _ = screen_rows(x)
    d = both[len(x):]  # [5, E]: each row's residual
    assert torch.equal(d[4], torch.zeros(64)) and xs[4] == 1 / 8
    assert (d.abs() <= xs[:, None] / 2 * (1 + 2.0 ** -10)).all() and (d[:4] != 0).any(dim=1).all()
    both = screen.approx(torch.cat([x, d]))  # [10, V]
    assert torch.equal(screen.approx_logits(x), both[:5] + both[5:])  # added across the kernels' threads
    for n in (1, 2):  # added on the calling thread
        assert torch.equal(screen.approx_logits(x[:n]), both[:n] + both[5: 5 + n])
    L, step = row_terms(x)
    assert torch.equal(step, d.abs().amax(1) / 127 + xs * 2.0 ** -21)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_screens_rows_and_terms_in_c_are_their_torch_definitions(rows):
    """`screen_rows` (one C call a pass) gives what the torch ops it replaced gave: the residual `x - xs * q` in
    float32 bit for bit (q: integer codes within +-127), the step `max |d| / 127 + xs 2^-21` bit for bit, and L =
    `(sum |x| + E xs' ROOM / 2) (1 + 2^-20)` in double within one float32 step (its sum's order differs); a row
    with an infinite or NaN input gets an L that is not finite (so it is computed whole)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    x[0, 3] = 40.0  # one large input, as a final state's few channels are
    both, xs, L, step = screen_rows(x)
    d = both[rows:]
    assert torch.equal(both[:rows], x)
    q = ((x - d) / xs[:, None]).round()  # [n, E]: the codes
    assert (q.abs() <= 127).all() and torch.equal(d, x - xs[:, None] * q)
    assert torch.equal(step, d.abs().amax(1) / 127 + xs * 2.0 ** -21)
    total = x.double().abs().sum(dim=1) + x.shape[1] * step.double() * (0.5 * screen_module.ROOM)
    expected = (total * (1 + 2.0 ** -20)).float()
    assert ((L - expected).abs() <= torch.finfo(torch.float32).eps * expected).all()
    assert (L > x.double().abs().sum(dim=1)).all()
    for bad in (float("inf"), float("nan")):
        y = x.clone()
        y[-1, 7] = bad
        assert not math.isfinite(float(screen_rows(y)[2][-1]))


@pytest.mark.parametrize("kind", ["i8", "w8"])
def test_the_bound_holds_and_is_nearly_reached_where_the_weights_codes_all_lean_one_way(kind):
    """Weights each 0.499 of a step from their code, leaning one way, and rows whose signs follow the lean in one
    column: that column's screen logit is off by nearly the bound's weights term (`slack * L`); the bound holds on
    every id, and the argmax is the float32 layer's."""
    vocab, width, step = 300, 96, 2.0 ** -7
    g = torch.Generator().manual_seed(4)
    lean = torch.randint(0, 2, (vocab, width), generator=g).float() * 2 - 1  # [V, E] +-1
    w = step * (torch.randint(-100, 101, (vocab, width), generator=g).float() + 0.499 * lean)
    w[:, 0] = 127 * step  # each column's largest |w|: its scale is exactly `step`
    lean[:, 0] = 1.0
    head = f32_layer(w)
    screen = OutputScreen(head, kind)
    aimed = torch.arange(0, vocab, vocab // 20)  # [20]
    states = lean[aimed] * (0.5 + torch.rand(len(aimed), width, generator=g) * 1.5)  # signs follow the lean
    logits, approx = head(states), screen.approx_logits(states)
    L, xs = row_terms(states, kind)
    bound = screen.slack * L[:, None] + screen.hw1 * xs[:, None] + approx.abs() * 2.0 ** -20  # [20, V]
    err = (logits - approx).abs()
    assert (err <= bound).all()
    rows = torch.arange(len(aimed))
    assert (err[rows, aimed] >= 0.97 * bound[rows, aimed]).all()  # within 3% of the bound
    assert torch.equal(screen.argmax(states), logits.argmax(-1))


def test_the_activations_term_alone_holds_the_bound_where_every_residual_leans_with_the_weights():
    """i8 rows whose own int8 codes and scale are exact (`xs` 2^-3, the residual's step `xs2` 2^-12) and whose every
    other input is its residual's code plus 0.496 of a step, leaning with the weight it meets, on weights that are
    their codes exactly (+-127 steps): the screen's logit is then off by nearly `hw1 * xs'` alone, more than the
    weights' term `slack * L` allows, so the bound holds only through its `hw1` term (and within 3% of it); the
    argmax is still the float32 layer's."""
    vocab, width, step = 32, 4096, 2.0 ** -7
    g = torch.Generator().manual_seed(6)
    signs = torch.randint(0, 2, (vocab, width), generator=g).float() * 2 - 1  # [V, E]
    head = f32_layer(127 * step * signs)  # every weight its code exactly; each row's scale `step`
    screen = OutputScreen(head, "i8")
    aimed = torch.arange(0, vocab, vocab // 8)  # [8]
    xs, xs2 = 2.0 ** -3, 2.0 ** -12
    codes = torch.randint(0, 4, (len(aimed), width), generator=g).float()  # the residuals' codes, 0..3
    states = xs2 * (codes + (0.5 - 2.0 ** -8) * signs[aimed])  # [8, E]: under xs / 2, so their own codes are 0
    states[:, 0] = 127 * xs  # the row's largest input: its scale is exactly xs, its residual 0
    states[:, 1] = 127 * xs2  # the residual's largest: its step is exactly xs2
    both, row_xs, _, _ = screen_rows(states)
    d = both[len(states):]
    assert torch.equal(row_xs, torch.full((len(aimed),), xs)) and torch.equal(d[:, 1], states[:, 1])
    logits, approx = head(states), screen.approx_logits(states)
    L, xs_ = row_terms(states, "i8")
    weights_term = screen.slack * L[:, None]  # [8, V]
    bound = weights_term + screen.hw1 * xs_[:, None] + approx.abs() * 2.0 ** -20
    err = (logits - approx).abs()
    assert (err <= bound).all()
    rows = torch.arange(len(aimed))
    assert (err[rows, aimed] > weights_term[rows, aimed] + approx[rows, aimed].abs() * 2.0 ** -20).all()
    assert (err[rows, aimed] >= 0.97 * screen.hw1[aimed] * xs_).all()
    assert torch.equal(screen.argmax(states), logits.argmax(-1))


def test_the_screens_argmax_keeps_the_id_that_only_the_activations_term_keeps():
    """One row built as above against id 0 (its residuals lean with id 0's weights, so id 0's int8 logit is low by
    nearly `hw1 * xs'`) and id 1 set just under id 0 in float32 (its residuals' errors mostly cancel): the int8 logits
    rank id 1 first by more than twice the weights' term, so only the `hw1` term keeps id 0 a candidate in the C
    pass (`specula_screen_top`) and in the edited rows' (`_edited_candidates`); the argmax is id 0, the float32
    layer's."""
    vocab, width, step = 16, 4096, 2.0 ** -7
    g = torch.Generator().manual_seed(7)
    signs = torch.randint(0, 2, (vocab, width), generator=g).float() * 2 - 1  # [V, E]
    xs, xs2 = 2.0 ** -3, 2.0 ** -12
    state = xs2 * (torch.randint(0, 4, (1, width), generator=g).float() + (0.5 - 2.0 ** -8) * signs[:1])  # [1, E]
    state[0, 0], state[0, 1] = 127 * xs, 127 * xs2  # the row's scale xs, its residual's step xs2 (exactly)
    w = 127 * step * signs  # [V, E]: codes exactly, each row's scale `step`
    w[0, 0], w[2:, 0] = 64 * step, -127 * step  # id 0 on top of ids 2.. by 191 steps of x's largest input
    w[1, 0] = 0.0
    first = f32_layer(w)(state)[0]  # [V]: id 1 without its largest input's term
    below = float(first[0] - first[1]) / (127 * xs * step)  # id 0 over id 1, in steps of that term
    w[1, 0] = (math.ceil(below) - 1) * step  # id 1 under id 0 by less than one such step
    head = f32_layer(w)
    screen = OutputScreen(head, "i8")
    logits, approx = head(state)[0], screen.approx_logits(state)[0]  # [V] each
    L, xs_ = row_terms(state, "i8")
    assert logits.argmax() == 0 and 0 < logits[0] - logits[1] <= 127 * xs * step
    assert approx[1] - approx[0] > 2 * float(screen.slack[:2].max() * L[0])  # the int8 logits rank id 1 first
    assert torch.equal(screen.argmax(state), torch.tensor([0]))
    halved = RowEdit(None, lambda row: row * 0.5)  # every id changed (the edited path's own bound, in torch)
    assert screen.edited_argmax(state[0], approx, halved) == 0


@pytest.mark.parametrize("kind", ["i8", "w8"])
def test_masked_argmax_is_the_float32_layers_over_the_allowed_ids(kind):
    """A grammar's greedy token through the screen: near-tied rows, masks that keep or drop the
    winner, a mask that allows nothing (torch's argmax of an all -inf row: id 0)."""
    w = near_tie_head(vocab=1200, width=64, seed=4)
    head = f32_layer(w)
    screen = OutputScreen(head, kind)
    g = torch.Generator().manual_seed(5)
    states = w[torch.randint(0, len(w), (60,), generator=g)] * 2
    logits = head(states)
    approx = screen.argmax_and_approx(states)[1]
    whole = []  # rows the screen gave up on and computed whole
    into = head.into
    head.into = lambda rows, out: (whole.append(len(rows)), into(rows, out))[1]
    wrong = 0
    for r in range(len(states)):
        for allowed in (torch.rand(len(w), generator=g) < 0.5, torch.ones(len(w), dtype=torch.bool),
                        logits[r] < logits[r].max()):
            want = int(logits[r].masked_fill(~allowed, float("-inf")).argmax())
            assert screen.masked_argmax(states[r], approx[r], allowed) == want
            wrong += int(approx[r].masked_fill(~allowed, float("-inf")).argmax()) != want
    assert wrong >= 3  # the int8 logits alone would pick another token on these
    assert not whole  # every one decided by its candidates
    assert screen.masked_argmax(states[0], approx[0], torch.zeros(len(w), dtype=torch.bool)) == 0
    assert whole == [1]  # nothing allowed: the whole row (torch's argmax of -inf everywhere)


@pytest.mark.parametrize("kind", ["i8", "w8"])
@pytest.mark.parametrize("rows", [1, 3, W8_SCREEN_MAX_ROWS, 17, SCREEN_MAX_ROWS])
def test_screen_argmax_over_any_number_of_rows(rows, kind):
    w = near_tie_head(vocab=1500, width=64, seed=rows)
    head = f32_layer(w)
    screen = OutputScreen(head, kind)
    states = w[torch.randint(0, len(w), (rows,), generator=torch.Generator().manual_seed(rows))] * 3
    assert torch.equal(screen.argmax(states), head(states).argmax(-1))


@pytest.mark.parametrize("width", [96, 577])
def test_the_candidates_logits_are_the_layers_bits(width):
    """`specula_screen_exact` computes each candidate's logit as the float32 layer's own output, bit for bit
    (the one FMA chain over the inputs); rows with none (-1: computed whole) are not written."""
    g = torch.Generator().manual_seed(width)
    head = f32_layer(torch.randn(700, width, generator=g))
    states = torch.randn(5, width, generator=g) * 3  # [n, E]
    want = head(states)  # [n, V]
    cap = 40
    counts = torch.tensor([-1, 1, 2, 17, cap], dtype=torch.int32)
    ids = torch.stack([torch.randperm(700, generator=g)[:cap].sort().values for _ in range(5)]).to(torch.int32)
    got = torch.full((5, cap), float("nan"))
    kernels.library().specula_screen_exact(head.packed.data_ptr(), states.data_ptr(), ids.data_ptr(),
                                           counts.data_ptr(), 5, cap, width, got.data_ptr())
    for r, k in enumerate(counts.tolist()):
        k = max(k, 0)
        ref = want[r, ids[r, :k].long()]
        assert torch.equal(got[r, :k].view(torch.int32), ref.view(torch.int32)), r
        assert got[r, k:].isnan().all(), r


def test_a_row_with_one_candidate_is_decided_without_reading_the_layers_rows(monkeypatch):
    """The one id whose interval reaches the largest lower end holds the maximum: no float32 logit is computed
    for it; rows with several candidates compute theirs (`specula_screen_exact`'s sums inside the C decision, which
    returns how many rows did), alone and beside lone ones."""
    w = near_tie_head(vocab=1500, width=64, seed=9)
    head = f32_layer(w)
    screen = OutputScreen(head)
    g = torch.Generator().manual_seed(10)
    states = torch.cat([torch.randn(150, 64, generator=g) * 4,  # clear winners, most of them
                        w[torch.randint(len(w) // 2, len(w), (50,), generator=g)]])  # aimed at near ties
    exact = head(states).argmax(-1)
    lib, calls = kernels.library(), []
    real = lib.specula_screen_decide

    def counted(*args):
        calls.append(real(*args))  # rows whose candidates' float32 logits were computed
        return calls[-1]

    monkeypatch.setattr(lib, "specula_screen_decide", counted)
    several = []  # the rows that computed float32 logits alone
    for r in range(len(states)):
        calls.clear()
        assert int(screen.argmax(states[r: r + 1])[0]) == int(exact[r]), r
        assert calls in ([0], [1])
        if calls == [1]:
            several.append(r)
    assert 20 <= len(several) <= len(states) - 50  # both kinds of rows were met
    calls.clear()
    assert torch.equal(screen.argmax(states), exact)
    assert calls == [len(several)]  # one call for the whole pass
    calls.clear()
    lone = [r for r in range(len(states)) if r not in several]
    assert torch.equal(screen.argmax(states[lone]), exact[lone])
    assert calls == [0]


def test_rows_past_the_candidate_cap_and_non_finite_rows_are_computed_whole():
    w = torch.randn(CANDIDATE_CAP + 400, 32, generator=torch.Generator().manual_seed(2))
    w[: CANDIDATE_CAP + 50] = w[7]  # one row repeated past the cap: every copy is a candidate
    head = f32_layer(w)
    screen = OutputScreen(head)
    states = torch.stack([w[7], torch.full((32,), float("nan")), w[-1],
                          torch.full((32,), float("inf")), torch.full((32,), 1e36)])
    assert torch.equal(screen.argmax(states), head(states).argmax(-1))

    approx = screen.approx_logits(states.contiguous())
    edit = RowEdit(change=lambda row: row * 0.5)  # a change: through `_edited_candidates`
    for r in (1, 3, 4):  # a NaN, an infinite or an overflowing interval: only the whole row can say
        assert screen.edited_argmax(states[r], approx[r], edit) is None, r
        assert screen.edited_top(states[r], approx[r], edit, 5, math.inf) is None, r
        assert screen.edited_top(states[r], approx[r], edit, 0, math.inf, ranks_every_id=True) is None, r
    assert screen.edited_argmax(states[2], approx[2], edit) == int(head(states[2:3]).argmax())


def native(model) -> NativeCausalLM:
    decoder = configure(NativeDecoder.from_hf(model), "specula", "none", "sdpa")
    return NativeCausalLM(decoder, "native", eos_token_ids=[])


@pytest.fixture
def screened(monkeypatch):
    """Every float32 output layer screened (the tiny models' are below `SCREEN_MIN_WEIGHTS`); the
    number of screened passes."""
    monkeypatch.setattr(screen_module, "SCREEN_MIN_WEIGHTS", 0)
    monkeypatch.setattr(screen_module, "TOP_SCREEN_MIN_WEIGHTS", 0)
    calls = []
    real = OutputScreen.approx_and_terms
    monkeypatch.setattr(OutputScreen, "approx_and_terms",
                        lambda self, states: (calls.append(states.shape[0]), real(self, states))[1])
    return calls


def test_argmax_only_passes_return_screened_rows_of_the_exact_logits(screened):
    model = tiny_model("qwen2", seed=3, vocab=400)
    target = native(model)
    assert target.lazy_logits
    def items():
        seqs = [target.new_sequence() for _ in range(2)]
        for seq, prompt in zip(seqs, SPECULATIVE_PROMPTS):
            seq.prefill(prompt, logits="none")
        return [(seqs[0], 9, TokenTree.chain([4, 5])), (seqs[1], 11, TokenTree.chain([6]))]

    lazy = forward_trees(target, items(), argmax_only=True)
    plain = forward_trees(target, items())
    assert all(isinstance(rows, ScreenedLogits) for rows in lazy) and screened == [5]
    for rows in lazy:  # one screened pass for both: before any float32 row of it is computed
        approx = rows.screened.approx[rows.start: rows.stop]  # [n + 1, V]: the int8 copy's logits
        top = draft_top_k(rows, 3)  # the int8 logits' own
        assert not rows.screened.has_logits
        assert torch.equal(approx.gather(1, top), approx.topk(3).values)  # (equal values may swap ids)
        for r in range(len(rows)):  # each row in place, as draft_top_k ranks it (one C call, no tensor)
            out = np.full(3, -1, dtype=np.int32)
            draft_top_k_into(rows, r, out)
            assert out.tolist() == top[r].tolist() and not rows.screened.has_logits
        with pytest.raises(ValueError, match=f"row {len(rows)} of {len(rows)}"):
            draft_top_k_into(rows, len(rows), np.zeros(3, dtype=np.int32))
    for rows, logits in zip(lazy, plain):
        assert torch.equal(rows.argmax(-1), logits.argmax(-1))
        assert rows.shape == logits.shape and len(rows) == len(logits)
        assert torch.equal(rows[0], logits[0]) and torch.equal(rows.full(), logits)  # bit for bit
        assert torch.equal(draft_top_k(rows, 3), rows.topk(3).indices)  # exact once the logits are computed
        out = np.zeros(3, dtype=np.int32)
        draft_top_k_into(rows, len(rows) - 1, out)
        assert out.tolist() == rows.topk(3).indices[-1].tolist()
    seq = target.new_sequence()
    seq.prefill(SPECULATIVE_PROMPTS[0], logits="none")
    big = [(seq, 9, TokenTree.chain(list(range(2, 2 + SCREEN_MAX_ROWS))))]
    assert isinstance(forward_trees(target, big, argmax_only=True)[0], torch.Tensor)  # too many rows to pay
    for kind, takes in (("i8", True), ("w8", False)):  # more rows than a w8 copy pays for, fewer than an i8's
        target._screen = OutputScreen(target.decoder.lm_head, kind)
        seq = target.new_sequence()
        seq.prefill(SPECULATIVE_PROMPTS[0], logits="none")
        mid = [(seq, 9, TokenTree.chain(list(range(2, 2 + W8_SCREEN_MAX_ROWS + 2))))]
        assert isinstance(forward_trees(target, mid, argmax_only=True)[0], ScreenedLogits) == takes


def test_the_copy_is_i8_where_the_kernels_run_avx512_and_w8_on_avx2_alone():
    """Two int8 rows (VNNI) cost less than one w8 row; on AVX2's `maddubs` they cost more from 4 rows on."""
    head = f32_layer(torch.randn(100, 32))
    before = kernels.isa()
    try:
        for name in ("avx2", "avx512"):
            ran = kernels.set_isa(name)  # the CPU's best where it lacks `name`
            screen = OutputScreen(head)
            assert screen.kind == ("w8" if ran == "avx2" else "i8")
            assert screen.max_rows == (W8_SCREEN_MAX_ROWS if ran == "avx2" else SCREEN_MAX_ROWS)
    finally:
        kernels.set_isa(before)


@pytest.mark.parametrize("method", ["none", "prompt-lookup", "token-recycling", "draft-model", "fusion"])
def test_greedy_output_through_the_screen_equals_plain_greedy(screened, method):
    model = tiny_model("llama", seed=5, vocab=300)
    target = native(model)
    draft = native(perturbed_copy(model)) if method in ("draft-model", "fusion") else None
    drafters = make_drafters(method, target=target, draft=draft, num_draft_tokens=3 if draft is not None else None)
    dec = SpeculativeDecoder(target, drafters, eos_token_ids=[])
    dec.generate([3, 4, 5], SamplingParams(max_new_tokens=4))  # the planner's timing passes (screened too)
    screened.clear()
    for prompt in SPECULATIVE_PROMPTS:
        out = dec.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert out.token_ids == reference_greedy(model, prompt, 24), (method, prompt)
    assert screened  # the steps went through the screen


def test_packed_batch_through_the_screen_equals_each_alone(screened):
    model = tiny_model("qwen2", seed=6, vocab=300)
    dec = SpeculativeDecoder(native(model), make_drafter("prompt-lookup"), eos_token_ids=[])
    dec.generate([3, 4, 5], SamplingParams(max_new_tokens=4))  # the planner's timing passes (screened too)
    screened.clear()
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompts = [*SPECULATIVE_PROMPTS, [7, 8, 9, 7, 8]]
    sessions = [dec.start(p, params) for p in prompts]
    while not all(s.finished for s in sessions):
        dec.step([s for s in sessions if not s.finished])
    for prompt, s in zip(prompts, sessions):
        assert s.generated == reference_greedy(model, prompt, 20)
    assert any(rows > 1 for rows in screened)  # packed passes of several sessions went through the screen


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=16, temperature=0.8, seed=3, ignore_eos=True),
    SamplingParams(max_new_tokens=16, logprobs=2, ignore_eos=True),
])
def test_requests_that_read_whole_rows_are_unchanged(monkeypatch, params):
    model = tiny_model("qwen2", seed=7, vocab=300)
    outs = []
    for floor in (0, 1 << 40):  # screened, not
        monkeypatch.setattr(screen_module, "SCREEN_MIN_WEIGHTS", floor)
        dec = SpeculativeDecoder(native(model), make_drafter("prompt-lookup"), eos_token_ids=[1])
        out = dec.generate(SPECULATIVE_PROMPTS[0], params)
        outs.append((out.token_ids, out.logprobs))
    assert outs[0] == outs[1]


def near_tie_rows(n: int, seed: int):
    """A screened near-tie layer and n rows for it, half of them a row of the layer (its near-tied pairs'):
    (weights [V, E], the float32 layer, its screen, states [n, E], the screen's int8 logits [n, V], the float32
    logits [n, V], the generator, for the test's further draws)."""
    w = near_tie_head()
    head = f32_layer(w)
    screen = OutputScreen(head)
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(n, w.shape[1], generator=g)
    states[: n // 2] = w[torch.randint(0, len(w), (n // 2,), generator=g)]
    _, approx = screen.argmax_and_approx(states)
    return w, head, screen, states, approx, head(states), g

def plain_edit(logits: torch.Tensor, edit) -> int:
    """What the row sources compute over a whole row of float32 logits [V]: `edit.change`, the mask, argmax."""
    row = logits if edit.change is None else edit.change(logits.clone())
    if edit.allowed is not None:
        row = row.masked_fill(~edit.allowed, float("-inf"))
    return int(row.argmax())


def test_edited_argmax_is_the_whole_rows_under_penalties_and_masks():
    """Penalties change some ids' logits (the bias's, the prompt's, the output's) and masks leave ids out:
    the screen's argmax is the whole float32 row's under both, on rows aimed at near-tied pairs, with exact
    ties between a changed and an unchanged id, and with every id changed."""
    from collections import Counter

    from specula.penalties import penalize

    w, head, screen, states, approx, logits, g = near_tie_rows(120, seed=4)
    vocab = len(w)
    cases = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.7),
             SamplingParams(frequency_penalty=0.5, presence_penalty=-0.4), SamplingParams(logit_bias={3: 0.0, 7: 5.0})]
    changed_won = 0
    for r in range(len(states)):
        params = cases[r % len(cases)]
        top = logits[r].topk(6).indices.tolist()
        output = Counter(top[:2] + [int(torch.randint(0, vocab, (1,), generator=g))])
        prompt = set(top[2:4])
        ids = {t for t, _ in params.logit_bias} | prompt | set(output)  # what the penalties change
        edit = RowEdit(None, lambda row, o=output, p=prompt, s=params: penalize(row, o, p, s))
        if r % 3 == 0:
            allowed = torch.rand(vocab, generator=g) < 0.5
            allowed[top[1]] = True
            edit = edit.masked(allowed)
        want = plain_edit(logits[r], edit)
        assert screen.edited_argmax(states[r], approx[r], edit) == want, r
        changed_won += want in ids
    assert changed_won >= 5  # the changed ids' own logits decided some rows
    # An exact tie between changed id 3 (bias 0) and its copies at the end (unchanged): the first wins.
    edit = RowEdit(None, lambda row: penalize(row, Counter(), set(), cases[3]))
    row = screen.argmax_and_approx(w[3:4])[1][0]
    assert screen.edited_argmax(w[3], row, edit) == plain_edit(head(w[3:4])[0], edit) == 3
    edit = RowEdit(None, lambda row: penalize(row, Counter(), set(), SamplingParams(logit_bias={5: 0.0})))
    tied = screen.edited_argmax(w[-1], row, edit)
    assert tied == plain_edit(head(w[-1:])[0], edit) == 3
    every = RowEdit(None, lambda row: row * 0.5)  # every id changed
    assert screen.edited_argmax(states[0], approx[0], every) == plain_edit(logits[0], every)


def both_ways(monkeypatch, method: str, params: SamplingParams, drafted: tuple[str, ...]):
    """Each of `SPECULATIVE_PROMPTS`' outputs under `params` with the screen and without (a fresh decoder each
    way, its planner's timing passes run first; a draft model for the methods in `drafted`): (outputs [screened,
    not], whether each float32 logits computation was the pass's first, the edited argmaxes taken, the unedited
    argmaxes the screened decoder took after its timing passes). A truncated sample's kept ids through the screen
    (`OutputScreen.edited_top`) count as edited argmaxes."""
    model = tiny_model("qwen2", seed=7, vocab=300)
    draft = perturbed_copy(model) if method in drafted else None
    computed, edited, unedited = [], [], []
    real_logits, real_edited, real_top, real_decide = (screen_module.ScreenedPass.logits, OutputScreen.edited_argmax,
                                                       OutputScreen.edited_top, OutputScreen.decide)
    monkeypatch.setattr(screen_module.ScreenedPass, "logits",
                        lambda self: (computed.append(not self.has_logits), real_logits(self))[1])
    monkeypatch.setattr(OutputScreen, "edited_argmax", lambda self, *a: (edited.append(1), real_edited(self, *a))[1])
    monkeypatch.setattr(OutputScreen, "edited_top", lambda self, *a: (edited.append(1), real_top(self, *a))[1])
    monkeypatch.setattr(OutputScreen, "decide", lambda self, *a: (unedited.append(1), real_decide(self, *a))[1])
    outs, screened_unedited = [], []
    for floor in (0, 1 << 40):  # screened, not
        monkeypatch.setattr(screen_module, "SCREEN_MIN_WEIGHTS", floor)
        monkeypatch.setattr(screen_module, "TOP_SCREEN_MIN_WEIGHTS", floor)
        target = native(model)
        drafters = make_drafters(method, target=target, draft=None if draft is None else native(draft),
                                 num_draft_tokens=3 if draft is not None else None)
        dec = SpeculativeDecoder(target, drafters, eos_token_ids=[1])
        dec.generate([3, 4, 5], SamplingParams(max_new_tokens=2))  # the planner's timing passes (plain argmax)
        unedited.clear()
        outs.append([dec.generate(prompt, params).token_ids for prompt in SPECULATIVE_PROMPTS])
        if floor == 0:
            screened_unedited = list(unedited)
    return outs, computed, edited, screened_unedited


@pytest.mark.parametrize("method", ["none", "prompt-lookup", "fusion"])
@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=20, repetition_penalty=1.3, ignore_eos=True),
    SamplingParams(max_new_tokens=20, repetition_penalty=0.8, ignore_eos=True),
    SamplingParams(max_new_tokens=20, frequency_penalty=0.7, presence_penalty=0.3, logit_bias={9: 2.0},
                   ignore_eos=True),
    SamplingParams(max_new_tokens=20, min_new_tokens=12),
])
def test_greedy_steps_with_penalties_and_min_tokens_take_the_screen(monkeypatch, method, params):
    """Greedy requests with penalties, a logit bias or a min_new_tokens mask output what they output without
    the screen, and their steps take each row's argmax through it (edited by the penalties and masks) with no
    float32 logits computed."""
    outs, computed, edited, unedited = both_ways(monkeypatch, method, params, drafted=("fusion",))
    if not params.min_new_tokens:  # (past min_new_tokens a row is not edited)
        assert not unedited  # no row's unedited argmax was taken for nothing
    assert outs[0] == outs[1]
    assert edited and not any(computed)  # the screened steps' argmax came through the edits, no logits computed
    if params.min_new_tokens:
        assert all(len(out) >= params.min_new_tokens for out in outs[0])


def test_packed_batch_of_edited_and_plain_greedy_requests_through_the_screen(screened):
    """A packed pass of greedy requests with a repetition penalty, a logit bias and penalties, a
    min_new_tokens mask and none, and seeded samples at a temperature, truncated by top-k, top-p and min-p, and by
    top-p over every id: each request outputs what it outputs alone without the screen."""
    model = tiny_model("qwen2", seed=6, vocab=300)
    kinds = [SamplingParams(max_new_tokens=18, repetition_penalty=1.4, ignore_eos=True),
             SamplingParams(max_new_tokens=18, frequency_penalty=0.9, logit_bias={7: 3.0}, ignore_eos=True),
             SamplingParams(max_new_tokens=18, min_new_tokens=14),
             SamplingParams(max_new_tokens=18, ignore_eos=True),
             SamplingParams(max_new_tokens=18, temperature=0.9, seed=2, ignore_eos=True),
             SamplingParams(max_new_tokens=18, temperature=1.1, top_k=30, top_p=0.9, min_p=0.02, seed=3,
                            ignore_eos=True),
             SamplingParams(max_new_tokens=18, temperature=0.6, top_p=0.8, seed=5, ignore_eos=True)]
    prompts = [*SPECULATIVE_PROMPTS, [7, 8, 9, 7, 8], [5, 6, 5, 6, 5], [9, 10, 11, 9, 10], [4, 3, 4, 3, 2],
               [6, 7, 6, 8]]
    assert len(prompts) == len(kinds)
    dec = SpeculativeDecoder(native(model), make_drafter("prompt-lookup"), eos_token_ids=[1])
    dec.generate([3, 4, 5], SamplingParams(max_new_tokens=4))  # the planner's timing passes
    screened.clear()
    sessions = [dec.start(p, kinds[i % len(kinds)]) for i, p in enumerate(prompts)]
    while not all(s.finished for s in sessions):
        dec.step([s for s in sessions if not s.finished])
    assert any(rows > 1 for rows in screened)  # packed passes of several sessions went through the screen
    screen_module.SCREEN_MIN_WEIGHTS = 1 << 40  # (the fixture restores it) alone, not screened
    alone = SpeculativeDecoder(native(model), make_drafter("prompt-lookup"), eos_token_ids=[1])
    for i, (prompt, s) in enumerate(zip(prompts, sessions)):
        assert s.generated == alone.generate(prompt, kinds[i % len(kinds)]).token_ids, i


def test_the_race_in_logit_form_through_the_screen_is_the_whole_rows():
    """A request sampled at a temperature alone takes the race in logit form (logits / T - log E): the screen's
    edited argmax is the whole float32 row's race on near-tied rows, at several temperatures and with a mask;
    and it is `race_token`'s sample of the softmax (the two forms agree away from float32 near ties)."""
    from specula.sampling import gumbel_of, position_noise, race_scores, race_token

    w, _, screen, states, approx, logits, g = near_tie_rows(90, seed=5)
    agree = 0
    for r in range(len(states)):
        temperature = (0.3, 0.7, 1.0, 1.6)[r % 4]
        noise = position_noise(9, r, len(w))
        edit = RowEdit(None, lambda row, t=temperature, n=noise: race_scores(row, t, gumbel_of(n)))
        if r % 3 == 0:
            edit = edit.masked(torch.rand(len(w), generator=g) < 0.5)
        want = plain_edit(logits[r], edit)
        assert screen.edited_argmax(states[r], approx[r], edit) == want, r
        if edit.allowed is None:
            agree += want == race_token(torch.softmax(logits[r] / temperature, -1), noise)
    assert agree >= 55  # of 60: the softmax's race picks the same token


def test_a_truncated_race_through_the_screen_is_the_whole_rows(monkeypatch):
    """top-k (top-p within it), min-p and top-p over every id raced over the kept ids the screen gives
    (`OutputScreen.edited_top`, their exact values, and for top-p over every id bounds on the others') pick the whole
    float32 row's token on near-tied rows, under penalties and masks; a mask that
    leaves fewer ids than top-k gives them all (top-p ranks them all); a min-p that reaches more ids than
    `TOP_CANDIDATE_CAP` leaves the row to the whole layer."""
    from collections import Counter

    from specula.penalties import penalize
    from specula.sampling import position_noise, truncated_race

    w, _, screen, states, approx, logits, g = near_tie_rows(120, seed=6)
    cases = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.2, top_k=30, top_p=0.8),
             SamplingParams(temperature=0.9, min_p=0.3),
             SamplingParams(temperature=1.0, top_k=20, top_p=0.95, min_p=0.1, repetition_penalty=1.3),
             SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.1, top_p=0.6, min_p=0.05)]
    screened, nucleus = 0, 0
    for r in range(len(states)):
        params = cases[r % len(cases)]
        noise = position_noise(11, r, len(w))
        top = logits[r].topk(4).indices.tolist()
        edit = RowEdit(None, lambda row, o=Counter(top[:2]), s=params: penalize(row, o, set(), s))
        if r % 3 == 0:
            allowed = torch.rand(len(w), generator=g) < (0.5 if r % 2 else 0.005)  # the second: fewer ids than top-k
            allowed[top[1]] = True
            edit = edit.masked(allowed)
        row = edit.change(logits[r].clone())
        if edit.allowed is not None:
            row = row.masked_fill(~edit.allowed, float("-inf"))
        want = truncated_race(None, row, noise, params)
        got = screen.edited_top(states[r], approx[r], edit, params.top_k, params.kept_within, params.ranks_every_id)
        ids, values, rest = got if got is not None else (None, None, None)
        assert (rest is not None) == (got is not None and params.ranks_every_id)  # bounds for top-p over every id
        token = None if got is None else truncated_race(ids, values, noise[ids], params, rest)
        if token is not None:
            assert token == want, r
            screened += 1
            nucleus += params.ranks_every_id
    assert screened >= 100 and nucleus >= 25  # of 120 rows, 40 of them top-p over every id
    wide = SamplingParams(temperature=2.0, min_p=1e-6)  # a flat row, every id within reach: past the candidate cap
    flat = (states[:1] * 0.02).contiguous()
    monkeypatch.setattr(screen_module, "TOP_CANDIDATE_CAP", 256)  # (the layer's 2,000 ids are under 2,048)
    assert screen.edited_top(flat[0], screen.approx_logits(flat)[0], RowEdit(), wide.top_k, wide.kept_within) is None


@pytest.mark.parametrize("kind", ["i8", "w8"])
def test_a_truncated_samples_kept_ids_in_one_c_pass_are_the_torch_steps(monkeypatch, kind):
    """`edited_top` with an edit that changes no value (a mask or nothing) takes its kept ids from one C pass over the
    row (`specula_screen_top`): the ids, their exact values and the other ids' bounds are the torch steps' ones
    (`_edited_candidates` with `top_floor`), bit for bit, on near-tied rows, for top-k, top-k with top-p, min-p, top-p
    over every id and a top-k past the vocabulary, with no mask, a mask of half the ids and one leaving fewer ids than
    top-k; a mask of every id, a state not finite and a row past the cap leave the row whole on both paths."""
    w, head, _, states, _, _, g = near_tie_rows(84, seed=8)
    screen = OutputScreen(head, kind)
    approx = screen.approx_logits(states)
    cases = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.2, top_k=30, top_p=0.8),
             SamplingParams(temperature=0.9, min_p=0.3), SamplingParams(temperature=0.8, top_p=0.9),
             SamplingParams(temperature=1.0, top_k=20, top_p=0.95, min_p=0.1),
             SamplingParams(temperature=1.0, top_k=len(w) + 5)]
    kinds = set()

    def both(r: int, allowed, params: SamplingParams):
        top_k, within = ((screen_module.NUCLEUS_CANDIDATES, math.inf) if params.ranks_every_id
                         else (params.top_k, params.kept_within))
        fast = screen.edited_top(states[r], approx[r], RowEdit(allowed), params.top_k, params.kept_within,
                                 params.ranks_every_id)
        slow = screen._edited_candidates(states[r], approx[r], RowEdit(allowed), screen_module.top_floor(top_k, within),
                                         screen_module.TOP_CANDIDATE_CAP, params.ranks_every_id)
        return fast, slow

    for r in range(len(states)):
        params = cases[r % len(cases)]
        allowed = None if r % 3 == 0 else torch.rand(len(w), generator=g) < (0.5 if r % 3 == 1 else 0.004)
        fast, slow = both(r, allowed, params)
        assert fast is not None and slow is not None, r
        assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]), r
        assert fast[0].dtype == torch.long and bool((fast[0][1:] > fast[0][:-1]).all())
        assert (fast[2] is None) == (slow[2] is None) == (not params.ranks_every_id), r
        if fast[2] is not None:
            assert torch.equal(fast[2][0], slow[2][0]) and torch.equal(fast[2][1], slow[2][1]), r
        kinds.add((params.ranks_every_id, allowed is not None and int(allowed.sum()) < 30, len(fast[0]) > 1))
    assert (False, True, True) in kinds and (True, False, True) in kinds  # few allowed ids; top-p's bounds
    nothing = torch.zeros(len(w), dtype=torch.bool)
    assert both(0, nothing, cases[0]) == (None, None)
    bad = states[1].clone()
    bad[3] = float("nan")
    nan_row = screen.approx_logits(bad.view(1, -1))[0]
    assert screen.edited_top(bad, nan_row, RowEdit(), 5, math.inf) is None
    flat = (states[:1] * 0.02).contiguous()  # every id within reach of a min-p of 1e-6 at T 2: past a cap of 256
    wide = SamplingParams(temperature=2.0, min_p=1e-6)
    monkeypatch.setattr(screen_module, "TOP_CANDIDATE_CAP", 256)  # (the layer's 2,000 ids are under 2,048)
    assert screen.edited_top(flat[0], screen.approx_logits(flat)[0], RowEdit(), 0, wide.kept_within) is None


def test_truncated_samples_take_an_i8_copy_from_the_screens_own_size_and_a_w8_copy_from_a_larger_one(monkeypatch):
    """On an i8 copy the screen gives a truncated sample's kept ids on every layer it screens (session 138: one C
    pass a row, SmolLM2's truncated samples faster through it); on a w8 copy (AVX2 alone), and for top-p over every
    id on either, only from `TOP_SCREEN_MIN_WEIGHTS` weights."""
    monkeypatch.setattr(screen_module, "SCREEN_MIN_WEIGHTS", 1000)
    monkeypatch.setattr(screen_module, "TOP_SCREEN_MIN_WEIGHTS", 4000)
    small, large = f32_layer(torch.randn(50, 32)), f32_layer(torch.randn(200, 32))  # 1,600 and 6,400 weights
    for kind, top_small in (("i8", True), ("w8", False)):
        monkeypatch.setattr(screen_module, "default_kind", lambda kind=kind: kind)
        assert OutputScreen.fits(small) and OutputScreen.fits(large) and OutputScreen.fits(large, top=True)
        assert OutputScreen.fits(small, top=True) == top_small
        assert OutputScreen.fits(large, top=True, nucleus=True) and not OutputScreen.fits(small, top=True, nucleus=True)
        assert OutputScreen(small).kind == kind
    assert not OutputScreen.fits(f32_layer(torch.randn(20, 32)), top=True)  # 640 weights: not screened at all


@pytest.mark.parametrize("method", ["none", "prompt-lookup", "draft-model", "fusion"])
@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
    SamplingParams(max_new_tokens=20, temperature=1.2, seed=5, repetition_penalty=1.3, logit_bias={9: 2.0},
                   ignore_eos=True),
    SamplingParams(max_new_tokens=20, temperature=1.0, seed=7, min_new_tokens=12),
    SamplingParams(max_new_tokens=20, temperature=0.9, seed=4, top_k=12, ignore_eos=True),
    SamplingParams(max_new_tokens=20, temperature=1.1, seed=6, top_k=40, top_p=0.8, min_p=0.05, repetition_penalty=1.2,
                   ignore_eos=True),
    SamplingParams(max_new_tokens=20, temperature=1.0, seed=8, min_p=0.1, min_new_tokens=12),
    SamplingParams(max_new_tokens=20, temperature=0.5, seed=9, top_p=0.8, ignore_eos=True),
    SamplingParams(max_new_tokens=20, temperature=0.6, seed=10, top_p=0.7, min_p=0.05, presence_penalty=0.8,
                   min_new_tokens=12),
])
def test_sampled_steps_at_a_temperature_alone_take_the_screen(monkeypatch, method, params):
    """Requests sampled at a temperature alone or truncated by top-k (top-p within it), min-p or top-p over every id
    (with penalties, a logit bias or a min_new_tokens mask too) output what they output without the screen, and their
    steps race each row through it (`OutputScreen.edited_argmax`, `OutputScreen.edited_top`) with no float32 logits
    computed; top-p over every id, where the bounds on the ids left out leave its nucleus open, computes that row
    (the tiny model's rows are flat: 5 of 34-40 rows at T 0.5-0.6)."""
    outs, computed, edited, _ = both_ways(monkeypatch, method, params, drafted=("draft-model", "fusion"))
    assert outs[0] == outs[1]
    if params.ranks_every_id:
        assert edited and 3 * sum(computed) < len(edited)  # most rows decided through the screen
    else:
        assert edited and not any(computed)  # every race came through the screen, no logits computed
    model = tiny_model("qwen2", seed=7, vocab=300)
    plain = SpeculativeDecoder(native(model), make_drafters("none", target=native(model)), eos_token_ids=[1])
    assert outs[0] == [plain.generate(prompt, params).token_ids for prompt in SPECULATIVE_PROMPTS]


def test_sampled_requests_with_logprobs_are_not_screened(monkeypatch, screened):
    """logprobs read whole rows: their steps compute the float32 logits; a temperature alone takes the screen, and
    top-k with top-p and top-p over every id take it through an i8 copy, and through a w8 copy (AVX2 alone) where
    the output layer is large enough for their candidates to pay (`TOP_SCREEN_MIN_WEIGHTS`)."""
    model = tiny_model("qwen2", seed=7, vocab=300)
    dec = SpeculativeDecoder(native(model), make_drafter("prompt-lookup"), eos_token_ids=[])
    dec.generate([3, 4, 5], SamplingParams(max_new_tokens=2))  # the planner's timing passes
    screened.clear()
    dec.generate(SPECULATIVE_PROMPTS[0], SamplingParams(max_new_tokens=8, temperature=0.8, logprobs=1, seed=1,
                                                        ignore_eos=True))
    assert not screened
    truncated = [SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=1, ignore_eos=True),
                 SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)]
    for params in (SamplingParams(max_new_tokens=8, temperature=0.8, seed=1, ignore_eos=True), *truncated):
        screened.clear()
        dec.generate(SPECULATIVE_PROMPTS[0], params)
        assert screened, params
    monkeypatch.setattr(screen_module, "default_kind", lambda: "w8")  # AVX2 alone
    screen_module.TOP_SCREEN_MIN_WEIGHTS = 1 << 40  # (the fixture restores it) a layer too small for their candidates
    for params in truncated:
        screened.clear()
        dec.generate(SPECULATIVE_PROMPTS[0], params)
        assert not screened, params


def test_decide_reads_strided_rows_as_their_values():
    """`decide` hands its rows' memory to C: rows given as a strided view are decided by their values (the
    float32 layer's argmax), as contiguous ones."""
    w = near_tie_head(vocab=700, width=64, seed=11)
    head = f32_layer(w)
    screen = OutputScreen(head)
    g = torch.Generator().manual_seed(12)
    wide = torch.randn(40, 128, generator=g) * 3
    states = wide[:, ::2]  # [40, 64], not contiguous
    assert not states.is_contiguous()
    approx = screen.approx_logits(states.contiguous())
    assert torch.equal(screen.decide(states, approx), head(states.contiguous()).argmax(-1))
