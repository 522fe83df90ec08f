"""Sampling parameters, the processed distributions `p` and `q`, and the draft samplers.

Every acceptance rule preserves exactly the distribution returned by `probabilities`
(temperature, then top-k, then top-p, as Hugging Face `generate` applies them).
Temperature 0 means greedy decoding. Drafters that sample draw their tree's children with
`sample_iid` or `sample_without_replacement` (the sibling modes the rules in `verify` assume).
"""

from __future__ import annotations

import collections
import hashlib
import math
import numbers
import os
import threading
import warnings
from dataclasses import dataclass, field

import numpy
import torch

from specula.errors import ConfigError
from specula.logprobs import MAX_LOGPROBS
from specula.prompts import is_integer

MIN_TEMPERATURE = 1e-2
"""The lowest temperature above 0 sampled with (vLLM's floor): below it logits / t overflow."""


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is processed and when to stop: temperature, then
    top-k, top-p and min-p, as Hugging Face `generate` applies them (`probabilities`)."""

    temperature: float = 0.0
    """0 = greedy (argmax); > 0 divides the logits before softmax."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off: every token; vLLM's -1 is taken and stored as 0)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (1.0 = off)."""
    min_p: float = 0.0
    """Keep the tokens at least min_p times as likely as the most likely one, after top-p (Hugging
    Face's `MinPLogitsWarper` and its order; 0 = off)."""
    seed: int | None = None
    """Seed of a sampled request (None = nondeterministic): the same seed gives the same output,
    the output of plain sampling with that seed, whatever is drafted. Drafters then propose fixed
    candidates by default (`fixed_drafts`: retrieved and copied tokens, a model's tokens raced with the target's
    noise, `step.DraftContext.coupled_candidate`); a drafter told to draw from
    q (`draft-model` with greedy_proposals=False, `draft-tree`'s sampled tree modes) reproduces
    its output only where the planner does not time it (planner none) and q itself does not
    change between runs (online distillation retrains a head between requests: a later run of
    the same seed draws other drafts; the law holds either way)."""
    max_new_tokens: int = 128
    """Hard limit on generated tokens; never overshot, even mid-draft."""
    min_new_tokens: int = 0
    """The fewest new tokens before the output may end (transformers' `min_new_tokens`, vLLM's
    `min_tokens`): the end-of-sequence token (unless `ignore_eos`) and `stop_token_ids` are masked
    at -inf at the first N positions, and a stop string ends the output only where it ends past
    the first N tokens' text (vLLM's rule; one that starts in it may); the context window still
    ends it. Speculation stays lossless with respect to the masked
    distribution (`specula.min_tokens`)."""
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Stop strings: generation ends once the decoded output contains one; as in OpenAI's API the
    stop string and anything after it are not returned."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks with a fixed budget)."""
    stop_token_ids: tuple[int, ...] = ()
    """More tokens that end the generation where emitted, kept in the output like the end-of-sequence
    token (vLLM's `stop_token_ids`; they stop a request that ignores EOS too). An id outside the model's
    vocabulary is refused when the request starts (it could never stop anything)."""
    logprobs: int | None = None
    """Return each new token's log-probability under the target, with this many of the most likely
    tokens at its position (0: the chosen token's alone; None: no logprobs), as vLLM's `logprobs`:
    the target's raw distribution, before temperature, top-k / top-p and any grammar mask
    (`specula.logprobs`). Outputs do not change."""
    prompt_logprobs: int | None = None
    """The same for the prompt's tokens (the first has none): the prompt is then prefilled in
    chunks whose logits are kept (`specula.logprobs.PROMPT_CHUNK`), as vLLM's `prompt_logprobs`."""
    repetition_penalty: float = 1.0
    """> 1 discourages every token already in the prompt or the output (a positive logit divided by
    it, a negative one multiplied), as Hugging Face's and vLLM's `repetition_penalty`; 1 = off.
    Penalties change the target's distribution: speculation stays lossless with respect to the
    penalised one (`specula.penalties`)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it occurs in the output so far (OpenAI's, -2..2)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output holds so far (OpenAI's, -2..2)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits (OpenAI's `logit_bias`, -100..100; a dict is taken
    too)."""
    kept_special_tokens: tuple[int, ...] = ()
    """Special tokens whose text the output's text keeps: the others decode to nothing (vLLM's default
    `skip_special_tokens`). The server keeps a tool parser's `<tool_call>` tags where the tokenizer makes
    them special (as vLLM's hermes parser keeps special tokens). Tokens and outputs do not change."""

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool:
                value = value.item()  # a 0-dim tensor (a scheduled temperature): the number it holds
                object.__setattr__(self, name, value)
            if not _is_real(value):
                raise ConfigError(f"{name} must be a number, got {value!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}; "
                              "use 0 for greedy decoding")
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / t overflows: vLLM's floor, and its warning
            warnings.warn(f"temperature {self.temperature} is below {MIN_TEMPERATURE}, which is used instead "
                          "(use 0 for greedy decoding)", stacklevel=3)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if not is_integer(self.top_k) or self.top_k < -1:
            raise ConfigError(f"top_k must be an integer >= 1, or 0 or -1 for every token (vLLM's -1), "
                              f"got {self.top_k!r}")
        object.__setattr__(self, "top_k", max(int(self.top_k), 0))  # -1 (vLLM's "every token") as 0
        if self.seed is not None and not (is_integer(self.seed) and -(2**63) <= self.seed < 2**64):
            raise ConfigError(f"seed must be an integer that fits in 64 bits or None, got {self.seed!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable it")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}; use 0 to disable it")
        if self.stop_token_ids is None:  # vLLM's default
            object.__setattr__(self, "stop_token_ids", ())
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise ConfigError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        ids = tuple(self.stop_token_ids)
        if any(not is_integer(t) or t < 0 for t in ids):
            raise ConfigError(f"stop_token_ids must be token ids (integers >= 0), got {list(ids)}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        kept = self.kept_special_tokens
        kept = tuple(kept) if hasattr(kept, "__iter__") and not isinstance(kept, (str, bytes)) else None
        if kept is None or any(not is_integer(t) or t < 0 for t in kept):
            raise ConfigError(f"kept_special_tokens must be a list of token ids (integers >= 0), got "
                              f"{self.kept_special_tokens!r}")
        object.__setattr__(self, "kept_special_tokens", tuple(int(t) for t in kept))
        if not is_integer(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}")
        if not is_integer(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(f"min_new_tokens must be an integer from 0 to max_new_tokens ({self.max_new_tokens}), "
                              f"got {self.min_new_tokens!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))  # None: no stop strings
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop must hold non-empty strings, got {list(self.stop)!r}")
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        if not self.repetition_penalty > 0 or not math.isfinite(self.repetition_penalty):
            raise ConfigError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name} must be between -2 and 2 (0 disables it), got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if not is_integer(token) or token < 0:
                raise ConfigError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not (_is_real(bias) and -100.0 <= bias <= 100.0):
                raise ConfigError(f"logit_bias values must be numbers between -100 and 100, got {bias!r} for "
                                  f"token {token}")
        repeated = sorted(t for t, n in collections.Counter(t for t, _ in self.logit_bias).items() if n > 1)
        if repeated:  # both would be added: a bias past the -100..100 allowed
            raise ConfigError(f"logit_bias names token {repeated[0]} twice; give each token one bias")
        object.__setattr__(self, "logit_bias", tuple((int(t), b) for t, b in self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ConfigError(f"{name} must be an integer from 0 to {MAX_LOGPROBS} (the most likely tokens "
                                  f"returned beside the chosen one) or None, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def races_logits(self) -> bool:
        """The target's token is the race in logit form (`truncated_race`): the argmax of logits / T - log E
        (`race_scores`) over the ids the truncation keeps: every sampled request. At a temperature alone, or
        truncated by top-k (top-p within it) or min-p, the kept ids follow from a few of the row's largest logits;
        top-p over the whole vocabulary also needs its normaliser, which bounds on the other ids' values can pin
        down (`ranks_every_id`). A verification pass's output screen then takes the token without the float32
        logits (`verify.verify_raced_logits`)."""
        return not self.greedy

    @property
    def ranks_every_id(self) -> bool:
        """top-p over the whole vocabulary (no top-k): its nucleus is a prefix of every id ranked, its normaliser a
        sum over them all. A set of ids decides it with bounds on the values of the ids it leaves out
        (`truncated_race`'s `rest`)."""
        return not self.greedy and self.top_p < 1.0 and self.top_k == 0

    @property
    def truncates(self) -> bool:
        """top-k, top-p or min-p leave some ids out of the sampled distribution."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def kept_within(self) -> float:
        """How far below the row's largest logit an id a truncated sample can keep may lie, in logit units with
        room for float32 rounding: T (-log min_p) and a hundredth of T more for min-p; inf without it, or with
        top-p (which ranks every id top-k keeps). What a screen's candidates must reach beside the top k
        (`models.native.screen.OutputScreen.edited_top`, `truncated_race`)."""
        if self.min_p == 0.0 or self.top_p < 1.0:
            return math.inf
        return self.temperature * (0.01 - math.log(self.min_p))

    @property
    def fixed_drafts(self) -> bool:
        """Drafters that may either draw from q or propose fixed candidates propose fixed ones
        (`draft-model`'s default): greedy requests, and seeded ones. With fixed candidates one
        noise vector per output position decides each token (`verify_step`), so a seed reproduces its
        output; with draws from q the output also depends on how many were drawn, which the
        planner's timings decide."""
        return self.greedy or self.seed is not None

    @property
    def penalized(self) -> bool:
        """Penalties or a logit bias change the target's logits (`specula.penalties`)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias))

    def vocabulary_problem(self, vocab: int) -> tuple[str, str] | None:
        """(field, message) for the first token id a field names outside a vocabulary of `vocab` ids
        (`logit_bias`, `stop_token_ids`: a stop id could never be emitted, so never stop anything), or None.
        The engine raises it as a ConfigError, the server as a 400 naming the field."""
        for field, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            outside = [t for t in ids if t >= vocab]
            if outside:
                return field, f"{field} names token {outside[0]}, outside the model's vocabulary of {vocab}"
        return None


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The processed distribution. logits: [..., vocab] -> probs [..., vocab] (float32).

    Greedy (temperature 0) returns the one-hot argmax distribution."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(~nucleus(logits.softmax(-1), params.top_p), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits.softmax(-1)


NUCLEUS_FIRST_K = 256
"""Tokens ranked first by `nucleus`; it ranks 8x more while they hold less than top_p of the mass."""


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool [..., vocab]: the top-p set of `probs` [..., vocab]: a token is kept when the tokens
    ranked above it hold less than `top_p` of the mass (the top one always), as transformers'
    TopPLogitsWarper. Only the `NUCLEUS_FIRST_K` most likely tokens are ranked while they already
    hold `top_p` of the mass (no token below them can be kept), never a sort of the vocabulary:
    a sort over 49k tokens per row cost more than the batched pass it follows."""
    vocab = probs.shape[-1]
    k = min(vocab, NUCLEUS_FIRST_K)
    while True:
        top, order = torch.topk(probs, k, dim=-1)  # descending
        cum = top.cumsum(-1)
        if k == vocab or bool((cum[..., -1] >= top_p).all()):
            break
        k = min(vocab, 8 * k)
    keep_sorted = (cum - top) < top_p  # the mass ranked above each token
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_sorted)


class TargetRows:
    """The processed target distribution `p` of a tree, row by row on demand.

    logits: [n + 1, vocab] raw target logits. `rows[r]` is `probabilities(logits[r], params)`
    ([vocab] float32), computed the first time it is asked for: a sampling rule touches only the
    rows on its path, and processing every row (a sort over the vocabulary for top-p) would cost
    far more than verifying. `shape` and `dim()` are those of the full `[n + 1, vocab]` tensor."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams) -> None:
        self.logits = logits
        self.params = params
        self._rows: dict[int, torch.Tensor] = {}

    @property
    def shape(self) -> torch.Size:
        return self.logits.shape

    def dim(self) -> int:
        return self.logits.dim()

    def __len__(self) -> int:
        return self.logits.shape[0]

    def __getitem__(self, row: int) -> torch.Tensor:
        row = int(row)
        out = self._rows.get(row)
        if out is None:
            out = self._rows[row] = probabilities(self.logits[row], self.params)
        return out


def _is_real(value: object) -> bool:
    """A real number (numpy's scalars too), not a bool or a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def request_seed(seed: int | None) -> int:
    """The seed a request samples with: its own, or a fresh random one."""
    return int(seed) if seed is not None else int.from_bytes(os.urandom(8), "little")


MIN_NOISE = 1e-30
"""The least noise value: a zero would divide 0 by 0 (NaN, which an argmax takes) and a subnormal overflow p / E
in float32; an Exp(1) draw falls below it with probability 1e-30."""
NOISE_CACHE_BYTES = 64 << 20
"""Bytes of positions' noise kept (`position_noise`): 110 positions of 152k tokens, 341 of 49k. A step's drafts and
its verification read the same few positions of each request, and the next step most of them again; a packed
batch of 16 requests reads about a hundred (64 positions, the bound before, drew each one's first position twice)."""
NOISE_WIDTHS = 4096
"""Seeds whose width is remembered (`reserve_noise_width`, `position_noise`), least recently set forgotten first."""
_noise: collections.OrderedDict[tuple[int, int], torch.Tensor] = collections.OrderedDict()
"""(seed, position) -> the widest noise drawn for it, least recently read first (`position_noise`)."""
_widths: collections.OrderedDict[int, int] = collections.OrderedDict()
"""seed -> the widest vocabulary its noise was asked for or reserved at (`reserve_noise_width`)."""
_noise_bytes = 0
"""The bytes `_noise` holds."""
_noise_lock = threading.Lock()


def _widen(seed: int, width: int) -> int:
    """The seed's noise width after a call asks for `width` (under `_noise_lock`)."""
    width = max(width, _widths.get(seed, 0))
    _widths[seed] = width
    _widths.move_to_end(seed)
    while len(_widths) > NOISE_WIDTHS:
        _widths.popitem(last=False)
    return width


def reserve_noise_width(seed: int, width: int) -> None:
    """Draw the seed's noise at least `width` wide from now on (`position_noise`): a sampled request reserves its
    target's vocabulary when it starts, so a drafter that races its first positions over a narrower one (a head's
    draft vocabulary) draws the noise verification then reads, not a prefix drawn again wider (the values do not
    change: a narrower vocabulary's noise is a prefix of a wider one's)."""
    with _noise_lock:
        _widen(seed, width)


def position_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise for output position `position` of a request: float32 [vocab] on the CPU (at least
    `MIN_NOISE`), one independent value per token id, a function of (seed, position) alone: a narrower
    `vocab`'s noise is a prefix of a wider one's (the generator fills the values in order; tested). The
    tensor is shared: read it, never write it. The target's token at the position is the exponential race
    `race_token(p, noise)`, an exact sample of p that does not depend on what was drafted before it, so a
    seed reproduces its output whatever the planner drafted (`specula.verify.verify_deterministic`); a
    drafter's fixed candidate raced with the same noise over its q (`step.DraftContext.coupled_candidate`) is
    the target's token whenever q is close enough to p at that position.

    Each position's noise is drawn once, as wide as the widest its seed has asked for (the target's
    vocabulary once a token was sampled, or from the start where the request reserved it:
    `reserve_noise_width`), and kept for the last positions read (`NOISE_CACHE_BYTES`): a drafter
    that races its candidates positions ahead (narrower, or over a head's draft vocabulary) draws the noise
    the target's verification then reads, rather than a narrower copy of it (0.6 ms a position for 152k)."""
    global _noise_bytes
    with _noise_lock:
        noise = _noise.get((seed, position))
        if noise is None or noise.shape[0] < vocab:
            _noise_bytes -= 0 if noise is None else noise.nbytes
            noise = _draw_noise(seed, position, _widen(seed, vocab))
            _noise[(seed, position)] = noise
            _noise_bytes += noise.nbytes
        _noise.move_to_end((seed, position))
        while _noise_bytes > NOISE_CACHE_BYTES and len(_noise) > 1:
            _noise_bytes -= _noise.popitem(last=False)[1].nbytes
    return noise[:vocab]


def clear_noise_cache() -> None:
    """Forget every position's noise (`position_noise` draws it again, equal)."""
    global _noise_bytes
    with _noise_lock:
        _noise.clear()
        _widths.clear()
        _noise_bytes = 0


def _draw_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """`position_noise` drawn: [vocab] float32 from a generator keyed by (seed, position)."""
    key = int.from_bytes(hashlib.blake2b(f"specula:{seed}:{position}".encode(), digest_size=16).digest(), "little")
    rng = numpy.random.Generator(numpy.random.SFC64(numpy.random.SeedSequence(key)))
    noise = torch.from_numpy(rng.standard_exponential(vocab, dtype=numpy.float32))  # [vocab]: 0.6 ms for 152k
    return noise.clamp_(min=MIN_NOISE)


def race(p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race's values p_i / E_i, in float32 on p's device: p [..., vocab] (need not be normalised),
    noise [..., >= vocab] (its first vocab values, broadcast over p's rows). Their argmax is `race_token`'s; every
    race of p against noise (one row, a device's rows at once, a drafter's frontier) takes them here."""
    return p.float() / noise[..., : p.shape[-1]].to(device=p.device, dtype=torch.float32)


def race_token(p_row: torch.Tensor, noise: torch.Tensor) -> int:
    """The exponential race: argmax_i p_i / E_i over p_row ([vocab], need not be normalised, on any device) with
    E_i ~ Exp(1) i.i.d. (`noise`, [>= vocab]): token i wins with probability p_i / sum(p) exactly (min_j E_j / p_j
    is the first arrival of independent exponential clocks of rates p_j), the Gumbel-max trick in another form;
    computed in float32 (0.1 ms for 152k tokens, against 0.8 in float64: `race`), as `verify.target_tokens`
    computes it on a device. Tokens with p = 0 never win. ValueError for a row with no mass."""
    race_values = race(p_row, noise)  # [vocab]
    token = int(race_values.argmax())
    if not bool(race_values[token] > 0):
        raise ValueError(f"cannot sample from a distribution with no mass (sum = {float(p_row.sum())})")
    return token


def race_scores(logits: torch.Tensor, temperature: float, gumbel: torch.Tensor) -> torch.Tensor:
    """The exponential race in logit form: logits / T + gumbel, gumbel = -log E (`gumbel_of`), elementwise in
    float32 ([..., vocab] float32 -> the same). Its argmax is `race_token`'s of the softmax at T with the same noise
    (log is monotone; the two differ only where float32 rounds a near tie apart). Each id's score is a function of
    its own logit alone, never smaller for a larger one: an output screen maps each id's logit interval through it
    (`models.native.screen.OutputScreen.edited_argmax`), and the screened and whole-row races agree bit for bit."""
    return logits / temperature + gumbel


NUCLEUS_MARGIN = 1e-9
"""Relative room a nucleus decided from bounds on the left-out ids' values keeps on each side of its cut
(`truncated_race`'s `rest`): a float64 sum over the whole row and one over a set of its ids with the rest bounded
differ by about 1e-12 of the mass, so the whole row cuts where the bounded set does."""


def truncated_race(ids: torch.Tensor | None, logits: torch.Tensor, noise: torch.Tensor, params: SamplingParams,
                   rest: tuple[torch.Tensor, torch.Tensor] | None = None) -> int | None:
    """The target's token of a request that `races_logits` with truncation: ids [m] long ascending, some of a row's
    ids (None: all of them), with its logits there [m] float32 (as the row sources change and mask them; -inf:
    masked) and the position's Exp(1) noise there [m] (`position_noise`). The ids must hold every id the truncation
    can keep or rank: the top_k largest logits (ties included; every finite one where they are no more than top_k)
    and every id within `kept_within` of the largest. The whole row always does, and a screened pass's candidates do
    (`models.native.screen.OutputScreen.edited_top`). Which other ids the set holds does not change the token:
    each step reads only the kept ids' values, in an order of their own.

    Over s = logits / T: top-k keeps the ids at or above the k-th largest s; top-p keeps, of those ranked by s, each
    whose higher-ranked ones hold less than top_p of their softmax (and the ids tied with the last kept); min-p
    keeps the ids with exp(s - max s) >= min_p; the token is the first id with the largest s - log E among the
    kept, `race_scores`' race (-log E of the kept ids' noise alone, `gumbel_of`: the whole row's 152k logs took
    0.06 ms). The law is `probabilities`' (top-k, top-p, min-p in that order); where float32 rounds a boundary or a
    near tie otherwise the two may part, as any two implementations' roundings do.

    top-p over every id (`SamplingParams.ranks_every_id`) ranks them all and normalises over them all (in float64,
    `_nucleus_floor`): a set of some ids needs `rest`, (lower [r], upper [r]) float32 bounds of the other ids'
    logits (as changed and masked; -inf: no id, so a whole row's ends with the set's ids at -inf will do), and returns
    None where they leave the nucleus open (its mass could move the cut or one of them could rank within it; the whole
    row then decides). ValueError for a row with no finite logit."""
    s = logits.float() / params.temperature  # [m]
    keep = s > float("-inf")
    finite = int(keep.sum())
    if finite == 0:
        raise ValueError("cannot sample from a row with no finite logit (every token at -inf, or NaN)")
    if 0 < params.top_k < finite:
        keep &= s >= torch.topk(s, params.top_k).values[-1]
    if params.top_p < 1.0 and params.top_k > 0:  # within the top k (every finite id where they are no more than k)
        ranked = s[keep].sort(descending=True).values  # [kept]: the same values whatever else the set holds
        probs = ranked.softmax(0)
        last = int(((probs.cumsum(0) - probs) < params.top_p).sum()) - 1  # the nucleus: a prefix of the ranking
        keep &= s >= ranked[max(last, 0)]
    elif params.top_p < 1.0:  # over every id: `ranks_every_id`
        bounds = None if rest is None else (rest[0].float() / params.temperature, rest[1].float() / params.temperature)
        floor = _nucleus_floor(s, params.top_p, bounds)
        if floor is None:
            return None
        keep &= s >= floor
    if params.min_p > 0.0:
        keep &= (s - s[keep].max()).exp() >= params.min_p
    kept = keep.nonzero().view(-1)  # [k] ascending: a first maximal id is the first in id order
    token = int(kept[int((s[kept] + gumbel_of(noise[kept])).argmax())])  # `race_scores` over the kept ids
    return token if ids is None else int(ids[token])


def _nucleus_floor(s: torch.Tensor, top_p: float, rest: tuple[torch.Tensor, torch.Tensor] | None) -> float | None:
    """The smallest s top-p keeps over a whole row: s [f] float32 (-inf: masked; at least one finite), the row's
    values or some of them, with `rest` = (lower [r], upper [r]) float32 bounds of the others' s. The ids ranked by
    s, each is kept while those ranked above it hold less than top_p of the row's exp(s - max s), summed in float64
    (the top `NUCLEUS_FIRST_K` ranked first, 8x more while they hold less). With `rest` the row's sum lies between
    the set's plus the rest's lower and upper ends' (float64; `NUCLEUS_MARGIN` for the sums' roundings): None where
    the cut moves within those bounds, or where one of the rest could rank above the cut or be the next kept."""
    top_s = float(s.max())
    e = (s.double() - top_s).exp()  # [f]: exp is monotone, so e ranks as s (a masked id's is 0)
    low = high = float(e.sum())
    margin, rest_max = 0.0, float("-inf")
    if rest is not None:  # a set of the row's ids: sums in other orders than the row's, bounds on the others
        margin, rest_max = NUCLEUS_MARGIN, float(rest[1].max()) if rest[1].numel() else float("-inf")
        if rest_max > float("-inf"):
            low += float((rest[0].double() - top_s).exp().sum())
            high += float((rest[1].double() - top_s).exp().sum())
    reach, must = top_p * high * (1.0 + margin), top_p * low * (1.0 - margin)  # kept surely below must, maybe reach
    k = min(len(e), NUCLEUS_FIRST_K)
    while True:
        top, order = torch.topk(e, k)  # descending
        cum = top.cumsum(0)
        if k == len(e) or float(cum[-1]) >= reach:
            break
        k = min(len(e), 8 * k)
    before = cum - top  # [k]: the mass ranked above each id
    kept = int((before < must).sum())  # >= 1: the first has none above it
    if kept != int((before < reach).sum()):
        return None
    floor = float(s[order[kept - 1]])
    # one of the rest ranked above the last kept, or next after it with less than top_p above: the set cannot say
    if rest_max > float("-inf") and (rest_max >= floor or float(cum[kept - 1]) < reach):
        return None
    return floor


def gumbel_of(noise: torch.Tensor) -> torch.Tensor:
    """-log E of Exp(1) noise ([vocab] float32): Gumbel(0, 1) values for `race_scores`."""
    return noise.log().neg_()


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """The request's random generator on `device` (seeded, or from OS entropy when seed is None)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


# ---------------------------------------------------------------------------- draft samplers
def _device(generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device("cpu")


def sample_iid(q_row: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k i.i.d. draws from q_row ([vocab], need not be normalised) -> LongTensor [k]
    (on q_row's device). Pair with sibling mode "iid"."""
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=q_row.device)
    q = q_row.to(device=_device(generator), dtype=torch.float64)  # [vocab]
    return torch.multinomial(q, k, replacement=True, generator=generator).to(q_row.device)


def sample_without_replacement(q_row: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k draws without replacement from q_row ([vocab]) by the Gumbel-top-k trick:
    argtopk(log q + Gumbel), in draw order (the i-th token is distributed as q with the
    first i - 1 removed and renormalised). Returns LongTensor [min(k, |support of q|)] on
    q_row's device: tokens with q = 0 are never drawn. Pair with sibling mode
    "without_replacement"."""
    k = min(int(k), int((q_row > 0).sum()))
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=q_row.device)
    return gumbel_keys(q_row, generator).topk(k).indices.to(q_row.device)


def gumbel_keys(q_row: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """log q + Gumbel(0, 1) noise for q_row ([vocab], need not be normalised): float64
    [vocab] on the generator's device, -inf where q = 0. Its descending order is a sample
    without replacement from q; stochastic beam search also needs the key values."""
    q = q_row.to(device=_device(generator), dtype=torch.float64)  # [vocab]
    u = torch.rand(q.shape, generator=generator, dtype=torch.float64, device=q.device)  # [vocab]
    u.clamp_(min=torch.finfo(torch.float64).tiny)
    return q.log() - (-u.log()).log()
