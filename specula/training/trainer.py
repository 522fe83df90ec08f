"""Training a head by self-distillation on cached target features.

Every target is the target's own distribution: the head's logits over its draft vocabulary are
trained towards softmax(lm_rows @ f) of the feature the target itself computed at the predicted
position (soft cross-entropy over the draft vocabulary, the target's logits restricted to it as in
EAGLE-3), so the head learns what the target will accept, not the text. EAGLE heads add EAGLE-1's
feature regression (smooth L1 towards the next feature, `feature_loss`) and uniform noise on the
input features (`noise`, EAGLE-1: U(-0.1, 0.1) at 512 tokens); `ttt_steps` > 1 adds EAGLE-3's
training-time test (after SafeAILab/EAGLE `eagle/traineagle3/cnets.py`): step j feeds the head its
own (detached) output features of step j - 1, and each row attends to the true pairs of its
committed context plus its own earlier-step rows only, exactly what it sees at depth j while
drafting; step j's loss weighs `ttt_decay ** j`.

Medusa head k on f_t learns p(x_{t+2+k}) = softmax(lm_rows @ f_{t+1+k}); Hydra head k also gets
the embeddings of x_{t+1} .. x_{t+1+k} (teacher forcing).

Determinism: one seed fixes the initialisation, the held-out split, the batch order and the noise;
checkpoints (model, optimizer, step, the generator's state) are written atomically every
`checkpoint_every` steps, and a run resumes from one bit for bit.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from specula.drafters.heads.config import AUTOREGRESSIVE, HeadKind
from specula.drafters.heads.losses import LossConfig, eagle_outputs, loss_of, offset_outputs
from specula.drafters.heads.runtime import TrainedHead
from specula.errors import ConfigError
from specula.training.features import FeatureSet


@dataclass(frozen=True)
class TrainConfig:
    """How a head is trained."""

    kind: HeadKind = "eagle"
    """eagle, eagle3, medusa or hydra."""
    draft_vocab: int = 8192
    """Size of the reduced draft vocabulary (the corpus's most frequent tokens)."""
    epochs: float = 4.0
    """Passes over the training sequences (fractions allowed); 0 = none: the starting head is written
    out as it is (with `--init-head`: e.g. its draft vocabulary extended), with the held-out reports."""
    seq_len: int = 256
    """Pairs per training chunk (sequences are cut into chunks of this length)."""
    batch_size: int = 8
    """Chunks per optimizer step."""
    lr: float = 1e-3
    """Peak learning rate (AdamW, betas 0.9 / 0.95, linear warm-up then cosine decay to 10%)."""
    warmup_steps: int = 50
    """Linear warm-up steps."""
    grad_clip: float = 0.5
    """Gradient norm clip."""
    ttt_steps: int = 2
    """eagle: training-time-test steps (1 = plain teacher forcing, EAGLE-1)."""
    ttt_decay: float = 0.8
    """eagle: loss weight of step j is ttt_decay ** j."""
    feature_loss: float = 1.0
    """eagle: weight of the smooth-L1 feature regression next to the cross-entropy."""
    noise: float = 0.1
    """eagle: half-width of the uniform noise on input features at 512 tokens (scaled by 512 / seq_len)."""
    topk_loss: float = 0.0
    """Weight of HASS's top-k distillation term beside the cross-entropy (`losses.topk_ce`: the
    cross-entropy over the target's `topk_loss_k` likeliest tokens; HASS fine-tunes a trained head
    with 1.0 at a low learning rate); 0 = off."""
    topk_loss_k: int = 10
    """Tokens the top-k term reads (HASS: 10)."""
    num_offsets: int = 4
    """medusa / hydra: heads (draft depth)."""
    intermediate_size: int = 0
    """eagle / eagle3: MLP width of the head's decoder layer (0 = 8/3 of the hidden size, Llama's
    ratio); narrower keeps a wide target's head small."""
    num_kv_heads: int = 0
    """eagle / eagle3: key/value heads of its attention (0 = one per query head); fewer (grouped
    queries) keep a wide target's head small."""
    copy_ngram: int = 0
    """eagle / eagle3: the head reads copy hints matching up to this many tokens (`HeadConfig.copy_ngram`;
    0 = none). A fine-tuned head without them gains them at zero weight (`training.run.initial_head`)."""
    copy_lr_scale: float = 30.0
    """Learning rate of the copy hints' vectors (`copy_gain`, `copy_len`: one per match length) over
    `lr`. They start at zero and must grow to the residual stream's scale before the head follows a
    hint, while AdamW moves a weight by about the learning rate a step: at `lr` 2e-4 a fine-tune's 700
    steps left the hint's weights near 0.03 and the head ignored hints that were right where it was
    wrong (docs/training.md, "Copy hints that were never learned"). The hint's projection
    (`copy_proj`, a matrix) keeps `lr`: at 30 times it, its noise swamped the head. 30 made the
    1.5B's shipped head (100 fine-tuned as well, the same held-out and Spec-Bench figures)."""
    holdout: float = 0.05
    """Fraction of sequences held out for the acceptance report."""
    report_sequences: int = 0
    """Held-out sequences the acceptance reports read: a seeded draw of N of the held-out split
    (0 = all of it). The split, and so the training data, stays the same.
    `--time-budget` lowers it when reports over the whole split would take too much of the time
    left (`training.run.REPORT_SHARE`)."""
    max_sequences: int = 0
    """Train on at most this many of the training sequences (a seeded random subset; the held-out
    split is unchanged): data-size studies reuse one cached corpus. 0 = all."""
    eval_depth: int = 5
    """Deepest draft level in the held-out report."""
    seed: int = 0
    """Seeds initialisation, split, batch order and noise."""
    length_groups: bool = False
    """Batches of pieces of like length: each epoch's seeded order is cut into windows of
    `LENGTH_WINDOW` batches, sorted by length inside a window and the batches then shuffled
    (`batch_order`). A batch is padded to its longest piece, so on data of mixed lengths at a long
    `seq_len` this saves most of the padded rows; off (the plain seeded order) by default."""
    checkpoint_every: int = 100
    """Optimizer steps between checkpoints."""
    precision: str = "auto"
    """Matrix products of the training passes: "bfloat16" (autocast; weights, optimizer state and
    the losses stay float32), "float32", or "auto" = bfloat16 on CUDA and on CPUs with AVX512-BF16
    (a SmolLM2 eagle3 step 2.4x faster than in float32 on the 2-core Zen 4 machine), else float32
    (a CPU without bfloat16 units would emulate it, slower)."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "ttt_steps", "num_offsets", "eval_depth", "checkpoint_every",
                     "topk_loss_k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.draft_vocab < 2:  # before answers and features are made, not after (HeadConfig's own check)
            raise ConfigError(f"draft_vocab must be at least 2 (the tokens a head scores), got {self.draft_vocab}")
        self._check_shape()
        if not 0 <= self.epochs < math.inf or not 0 < self.lr < math.inf:
            raise ConfigError(f"epochs={self.epochs!r}, lr={self.lr!r}: epochs must be a finite number >= 0 and lr "
                              "a finite number > 0")
        if not 0 < self.copy_lr_scale < math.inf:  # inf: the copy hints' weights went to NaN, the head was written
            raise ConfigError(f"copy_lr_scale must be a finite number > 0, got {self.copy_lr_scale}")
        if not 0 <= self.topk_loss < math.inf:
            raise ConfigError(f"topk_loss must be a finite number >= 0 (0 = off), got {self.topk_loss}")
        if self.report_sequences < 0:
            raise ConfigError(f"report_sequences must be >= 0 (0 = the whole held-out split), got {self.report_sequences}")
        if self.max_sequences < 0:
            raise ConfigError(f"max_sequences must be >= 0 (0 = all), got {self.max_sequences}")
        if not 0 <= self.holdout < 1:
            raise ConfigError(f"holdout must be in [0, 1), got {self.holdout}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")

    def _check_shape(self) -> None:
        """The shape options: >= 0 (0 = the default shape), copy hints of at most `MAX_COPY_NGRAM` tokens,
        and none of them for a kind that has no decoder layer (medusa / hydra ignored them, or failed
        after the answers and features were made)."""
        from specula.drafters.heads.copy import MAX_COPY_NGRAM

        shape = {name: getattr(self, name) for name in ("intermediate_size", "num_kv_heads", "copy_ngram")}
        for name, value in shape.items():
            if value < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = the default shape), got {value}")
        if self.copy_ngram > MAX_COPY_NGRAM:
            raise ConfigError(f"copy_ngram must be at most {MAX_COPY_NGRAM}, got {self.copy_ngram}")
        given = [name for name, value in shape.items() if value]
        if given and self.kind not in AUTOREGRESSIVE:
            raise ConfigError(f"{given[0]} shapes an eagle / eagle3 head's decoder layer; a {self.kind} head has none: "
                              'drop it (or train kind="eagle3")')


PRECISIONS = ("auto", "float32", "bfloat16")
CHECKPOINT_FILE = "checkpoint.pt"
"""The checkpoint `train_head` keeps (and resumes) in its output folder."""


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype training passes autocast to (None: float32 throughout); see `TrainConfig.precision`."""
    if precision == "auto":
        from specula.models.native.kernels import cpu_has_bf16

        precision = "bfloat16" if device.type == "cuda" or cpu_has_bf16() else "float32"
    return torch.bfloat16 if precision == "bfloat16" else None


# ---------------------------------------------------------------------------- data
def split(fs: FeatureSet, holdout: float, seed: int, max_sequences: int = 0) -> tuple[list[int], list[int]]:
    """(train, held-out) sequence indices, deterministic in seed; the training part cut to the first
    `max_sequences` of the same permutation (0: all), so a smaller set is a subset of a larger one.
    A sequence whose prompt a held-out sequence also has is not trained on (data files repeat
    prompts, and a greedy answer repeats with its prompt: held out on one side and trained on the
    other, it was not held out)."""
    order = torch.randperm(len(fs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = max(1, round(holdout * len(fs))) if holdout > 0 and len(fs) > 1 else 0
    held = {_prompt_key(fs, s) for s in order[:n_eval]}
    train = [s for s in order[n_eval:] if _prompt_key(fs, s) not in held][: max_sequences or None]
    return sorted(train), sorted(order[:n_eval])


def _prompt_key(fs: FeatureSet, s: int) -> bytes:
    """Sequence s's prompt token ids, as bytes."""
    a = int(fs.starts[s])
    return fs.tokens[a:a + int(fs.prompt_lens[s])].to(torch.long).numpy().tobytes()


def split_tokens(fs: FeatureSet, seqs: Sequence[int]) -> torch.Tensor:
    """[n] long: the tokens of sequences `seqs`, one after another."""
    if not len(seqs):
        return fs.tokens[:0]
    return torch.cat([fs.tokens[int(fs.starts[s]):int(fs.starts[s + 1])] for s in seqs])


def chunks(fs: FeatureSet, seqs: list[int], seq_len: int) -> list[tuple[int, int, int]]:
    """(sequence, first row, rows) pieces of at most seq_len + 1 rows (>= 3), consecutive pieces
    sharing one row, so every pair is in exactly one piece (a lone first pair is left out). Cut
    from the end: the last piece ends at the sequence's last row, so the answer (at the end) is
    read with the seq_len pairs before it, as the drafting window reads it; cut from the start, an
    answer after a long prompt lost the passage it copies from to a piece boundary."""
    out = []
    for s in seqs:
        n = int(fs.starts[s + 1] - fs.starts[s])
        for end in reversed(range(n, 2, -seq_len)):
            a = max(0, end - seq_len - 1)
            out.append((s, a, end - a))
    return out


def batch(fs: FeatureSet, pieces: list[tuple[int, int, int]], embed: Callable,
          device: torch.device | str = "cpu", copy_ngram: int = 0) -> dict[str, torch.Tensor]:
    """Padded tensors on `device`: tokens [B, T + 1], feats [B, T + 1, E] (float32), emb [B, T + 1, E],
    valid [B, T + 1] (row exists), output [B, T + 1] (row is the target's own answer); with layer
    features (eagle3) inputs [B, T + 1, k E] (float32); with `copy_ngram` > 0 each row's copy hint
    over its whole sequence, hint_emb [B, T + 1, E] and hint_len [B, T + 1] (`FeatureSet.copy_hints`).
    Gathered on the CPU in the cache's float16 and widened on `device` (half the bytes copied to a
    GPU)."""
    t1 = max(rows for _, _, rows in pieces)
    e = fs.features.shape[1]
    tokens = torch.zeros((len(pieces), t1), dtype=torch.long)
    feats = torch.zeros((len(pieces), t1, e), dtype=fs.features.dtype)
    valid = torch.zeros((len(pieces), t1), dtype=torch.bool)
    output = torch.zeros((len(pieces), t1), dtype=torch.bool)
    inputs = None if fs.inputs is None else torch.zeros((len(pieces), t1, fs.inputs.shape[1]), dtype=fs.inputs.dtype)
    for b, (s, a, rows) in enumerate(pieces):
        toks, fe, plen = fs.sequence(s)
        tokens[b, :rows] = toks[a:a + rows]
        feats[b, :rows] = fe[a:a + rows]
        valid[b, :rows] = True
        output[b, :rows] = torch.arange(a, a + rows) >= plen
        if inputs is not None:
            inputs[b, :rows] = fs.layer_inputs(s)[a:a + rows]
    out = {"tokens": tokens.to(device), "feats": feats.to(device).float(), "emb": embed(tokens).to(device),
           "valid": valid.to(device), "output": output.to(device)}
    if copy_ngram:
        hints = torch.zeros((len(pieces), t1), dtype=torch.long)
        lengths = torch.zeros((len(pieces), t1), dtype=torch.long)
        for b, (s, a, rows) in enumerate(pieces):
            h, n = fs.copy_hints(s, copy_ngram)
            hints[b, :rows], lengths[b, :rows] = h[a:a + rows], n[a:a + rows]
        out |= {"hint_emb": embed(hints).to(device), "hint_len": lengths.to(device)}
    return out if inputs is None else out | {"inputs": inputs.to(device).float()}


LENGTH_WINDOW = 32
"""Batches' worth of pieces sorted by length together under `TrainConfig.length_groups`."""


def batch_order(lengths: list[int], batch_size: int, seed: int, epoch: int, length_groups: bool = False
                ) -> list[int]:
    """Indices of the pieces (of `lengths` rows each) in one epoch's order, to be cut into batches of
    `batch_size` in turn: a seeded permutation (seed * 1000 + epoch), or with `length_groups` the
    same permutation cut into windows of `LENGTH_WINDOW` batches, each window sorted by length (ties
    in permutation order), then its full batches shuffled by the same seed (a short last batch stays
    last). Every piece once an epoch either way; the same epoch gives the same order (resumes)."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    if not length_groups:
        return order
    span = batch_size * LENGTH_WINDOW
    grouped = [i for at in range(0, len(order), span) for i in sorted(order[at:at + span], key=lambda i: lengths[i])]
    batches = [grouped[at:at + batch_size] for at in range(0, len(grouped), batch_size)]
    tail = [batches.pop()] if batches and len(batches[-1]) < batch_size else []
    return [i for b in [batches[k] for k in torch.randperm(len(batches), generator=g).tolist()] + tail for i in b]


def step_counts(fs: FeatureSet, cfg: TrainConfig) -> tuple[int, int]:
    """(optimizer steps per epoch, total steps) of a run."""
    pieces = chunks(fs, split(fs, cfg.holdout, cfg.seed, cfg.max_sequences)[0], cfg.seq_len)
    per_epoch = max(1, math.ceil(len(pieces) / cfg.batch_size))
    return per_epoch, max(1, round(cfg.epochs * per_epoch)) if cfg.epochs > 0 else 0


def loss_config(cfg: TrainConfig) -> LossConfig:
    """The loss knobs of a training run (EAGLE's noise scaled by 512 / seq_len, as EAGLE-1)."""
    return LossConfig(ttt_steps=cfg.ttt_steps, ttt_decay=cfg.ttt_decay, feature_loss=cfg.feature_loss,
                      noise=cfg.noise * 512 / cfg.seq_len, topk=cfg.topk_loss_k, topk_weight=cfg.topk_loss)


# ---------------------------------------------------------------------------- held-out report
@torch.no_grad()
def acceptance_report(head: TrainedHead, fs: FeatureSet, seqs: list[int], cfg: TrainConfig, embed: Callable
                      ) -> dict:
    """Greedy chain acceptance on held-out sequences, on the target's own answers: from every root
    pair c, the depth-d draft (its ancestors the true tokens) must equal x_{c+d+1} for d = 1 ..;
    `mean_accepted_chain` = 1 + mean run of leading matches over every root (depth <= eval_depth),
    plus top-1 accuracy per depth. Teacher forcing along the answer is what greedy verification
    accepts, because the answer is the target's greedy output. `mean_accepted_walk` is what a
    greedy decode with a depth-`eval_depth` chain sees: its roots are only the positions a step
    starts at (the first answer token, then each step's bonus token), so a long accepted run counts
    once, not once per position inside it (the every-root mean reads higher on the same text)."""
    depth = cfg.eval_depth
    runs, hits, counts = [], [0] * depth, [0] * depth
    walk_steps, walk_tokens = 0, 0
    device = head.lm_rows.device if head.lm_rows is not None else torch.device("cpu")
    for piece in chunks(fs, seqs, cfg.seq_len):
        b = batch(fs, [piece], embed, device, head.config.copy_ngram)
        tok, out_mask = b["tokens"][0].cpu(), b["output"][0].cpu()
        t = tok.shape[0] - 1  # pairs
        preds = torch.full((depth, t), -1, dtype=torch.long)  # preds[d - 1, c]: token for x_{c+d+1}
        if head.kind in AUTOREGRESSIVE:
            for j, out in enumerate(eagle_outputs(head, b, min(depth, t), 0.0, None)):
                idx = head.logits(out[0]).argmax(-1).cpu()  # [T]: row i of step j -> x_{i+2}, root pair i - j
                preds[j, : t - j] = head.d2t[idx[j:]]
        else:
            for k, out, _ in offset_outputs(head, b):
                if k < depth:
                    preds[k, : out.shape[1]] = head.d2t[head.logits(out[0]).argmax(-1).cpu()]
        by_root: dict[int, int] = {}
        for c in range(t - 1):
            if not (bool(out_mask[c + 1]) and bool(out_mask[c + 2])):  # a root after the prompt's last token:
                continue  # its first token came from the prefill, never drafted
            run = 0
            for d in range(1, depth + 1):
                pos = c + d + 1
                if pos > t or not bool(out_mask[pos]):
                    break
                ok = int(preds[d - 1, c]) == int(tok[pos])
                if run == d - 1:
                    counts[d - 1] += 1
                    hits[d - 1] += ok
                if not ok:
                    break
                run += 1
            runs.append(run)
            by_root[c] = run
        c = next((c for c in sorted(by_root) if bool(out_mask[c + 1])), None)  # root = an answer token
        while c is not None and c in by_root:
            # the step after root c (x_{c+1} committed) emits its run and a bonus token, none past x_t:
            # a run cut by the piece's end has no bonus
            emitted = min(1 + by_root[c], t - c - 1)
            walk_steps, walk_tokens = walk_steps + 1, walk_tokens + emitted
            c += emitted
    n = max(1, len(runs))
    return {"positions": len(runs), "mean_accepted_chain": round(1 + sum(runs) / n, 3),
            "mean_accepted_walk": round(walk_tokens / max(1, walk_steps), 3),
            "accept_rate_by_depth": [round(h / c, 3) if c else None for h, c in zip(hits, counts)]}


# ---------------------------------------------------------------------------- a time budget
FIT_MARGIN = 0.95
"""Share of the time left a fitted schedule plans to use (`fit_epochs`, `refit_total`)."""


def with_checkpoints(steps_per_second: float, checkpoint_seconds: float | None, every: int) -> float:
    """A steady rate of optimizer steps with a checkpoint's cost added every `every` steps."""
    return 1.0 / (1.0 / steps_per_second + (checkpoint_seconds or 0.0) / every)


def fit_epochs(epochs: float, per_epoch: int, steps_per_second: float, seconds: float) -> float:
    """The epochs, at most `epochs`, whose whole learning-rate schedule runs in `seconds` at the
    measured `steps_per_second`, with a 5% margin (0 when no time is left). Cutting the epochs, not
    stopping part-way, keeps the cosine decay: a run stopped early ends at a high learning rate."""
    if seconds <= 0 or steps_per_second <= 0:
        return 0.0
    return min(epochs, FIT_MARGIN * steps_per_second * seconds / per_epoch)


def probe_steps_per_second(head: TrainedHead, fs: FeatureSet, cfg: TrainConfig, seconds: float) -> float:
    """Optimizer steps per second of `head` on `fs` under `cfg` over a whole run: real steps for
    `seconds` in a scratch directory, timed after their first `WARM_STEPS` (setting up kernels and
    memory is paid once, not per step), with the cost of a checkpoint every `checkpoint_every`
    steps added (the probe's own final checkpoint, timed); the head's weights are restored."""
    import tempfile

    saved = {k: v.detach().clone() for k, v in head.module.state_dict().items()}
    try:
        with tempfile.TemporaryDirectory(prefix="specula-probe-") as scratch:
            rec = train_head(head, fs, replace(cfg, holdout=0.0, checkpoint_every=10**9), Path(scratch),
                             max_seconds=seconds)
    finally:
        head.module.load_state_dict(saved)
        head.module.eval().requires_grad_(False)
    steady = rec["steady_steps_per_second"]
    if not steady:  # too few steps to time past the first ones
        return rec["steps"] / max(rec["seconds"], 1e-6)
    return with_checkpoints(steady, rec["checkpoint_seconds"], cfg.checkpoint_every)


# ---------------------------------------------------------------------------- the loop
WARM_STEPS = 5
"""Steps a run takes before its steady rate is timed (the first ones set up kernels and memory)."""


def refit_total(step: int, steps_per_second: float, seconds_left: float, most: int) -> int:
    """The schedule's length for a run at `step` that goes on at `steps_per_second` and must end in
    `seconds_left`: the steps that fit (`FIT_MARGIN` of the time), at least one more, at most
    `most` (the epochs asked)."""
    fits = step + math.floor(FIT_MARGIN * steps_per_second * max(0.0, seconds_left))
    return max(step + 1, min(most, fits))


REFIT_EVERY = 20
"""Steps between two re-fits of a time-bounded schedule (`train_head`'s `until`)."""


def checkpoint_changes(saved: dict, cfg: TrainConfig) -> dict[str, list]:
    """The settings of a checkpoint (`asdict` of the config it was written with) that differ from
    `cfg`: {field: [saved, now]}. A field the checkpoint lacks (written before the option existed)
    counts at its default, which trains as the code before it did, so such a run still resumes."""
    now, defaults = asdict(cfg), asdict(TrainConfig())
    return {k: [saved.get(k, defaults[k]), v] for k, v in now.items() if saved.get(k, defaults[k]) != v}


def resume_changes(state: dict, cfg: TrainConfig, head: TrainedHead, data: str,
                   features: str | None = None, init: str | None = None) -> dict[str, list]:
    """What keeps a run of `head` with `cfg` on the data of fingerprint `data` (`data_fingerprint`,
    computed once by the caller) and target features of fingerprint `features`
    (`feature_fingerprint`; None: not compared), started from the head file of sha256 `init` (None:
    fresh weights), from resuming the checkpoint `state`: {what: [the checkpoint's, the run's]} over
    the settings (`checkpoint_changes`), the draft vocabulary, the data, the features, the starting
    head and the weights' shapes; empty = the same run's."""
    changes = checkpoint_changes(state.get("config") or {}, cfg)
    if not torch.equal(state["d2t"], head.d2t):
        changes["draft_vocab"] = [f"{len(state['d2t'])} tokens", f"{len(head.d2t)} tokens (another vocabulary)"]
    if state.get("data", data) != data:  # a checkpoint of before the fingerprint: taken on trust, as then
        changes["data"] = [state["data"], f"{data} (other prompts or answers)"]
    if features is not None and state.get("features", features) != features:  # likewise
        changes["features"] = [state["features"], f"{features} (another target's, dtype or quantisation)"]
    if state.get("init") != init:  # a checkpoint of before the field started from fresh weights
        changes["init_head"] = [state.get("init") or "fresh weights", init or "fresh weights"]
    shapes = {k: tuple(v.shape) for k, v in head.module.state_dict().items()}
    if ({k: tuple(v.shape) for k, v in state["module"].items()} != shapes
            or len(state["optimizer"]["param_groups"]) != len(param_groups(head.module, cfg))):
        changes["weights"] = ["another head's (an older specula's, or another size)", "this head's"]
    return changes


def data_fingerprint(fs: FeatureSet) -> str:
    """What a checkpoint was trained on: a hash of the corpus's tokens, sequence bounds and prompt
    lengths (a run on other data never resumes it)."""
    h = hashlib.sha256()
    for t in (fs.tokens, fs.starts, fs.prompt_lens):
        h.update(t.to(torch.long).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def feature_fingerprint(fs: FeatureSet, rows: int = 64) -> str:
    """Which target the features came from: a hash of `rows` rows spread over the corpus (and of
    eagle3's layer inputs there). The same tokens through another target of the same shape and
    tokenizer (a base against an instruct model, another dtype or quantisation) give other rows,
    and its checkpoint must not be resumed."""
    n = fs.tokens.numel()
    h = hashlib.sha256()
    for i in sorted({round(k * (n - 1) / max(1, rows - 1)) for k in range(rows)} if n else ()):
        for t in (fs.features, fs.inputs):
            if t is not None:
                h.update(t[i:i + 1].to(torch.float16).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


COPY_VECTORS = ("copy_gain", "copy_len")
"""A head module's copy-hint vectors (`EagleHead.copy_term`), trained at `TrainConfig.copy_lr_scale`."""


def param_groups(module: torch.nn.Module, cfg: TrainConfig) -> list[dict]:
    """AdamW's parameter groups: the copy hints' vectors at `lr` x `copy_lr_scale`, the rest at `lr`
    (the schedule scales each group's own rate)."""
    copy, rest = [], []
    for name, param in module.named_parameters():
        (copy if name in COPY_VECTORS else rest).append(param)
    return [{"params": rest, "lr": cfg.lr}] + ([{"params": copy, "lr": cfg.lr * cfg.copy_lr_scale}] if copy else [])


def train_head(head: TrainedHead, fs: FeatureSet, cfg: TrainConfig, out_dir: Path, *,
               progress: Callable[[int, float], None] | None = None, max_seconds: float | None = None,
               until: float | None = None, most_steps: int | None = None,
               on_total: Callable[[int], None] | None = None, on_note: Callable[[str], None] | None = None,
               init: str | None = None) -> dict:
    """Train `head` in place (resuming from out_dir/checkpoint.pt when it matches `cfg`); returns
    the training record (steps, seconds, losses, held-out acceptance before and after). A
    checkpoint written with other settings, or on other data (`data_fingerprint`), is not resumed:
    the run starts afresh and replaces it, `on_note` hears a line naming what differs, and the
    record keeps it (`checkpoint_ignored`).

    `until` (`time.monotonic()`): the schedule is re-fitted to end by then every `REFIT_EVERY` steps
    from the run's own steady rate (`refit_total`; at most `most_steps`, default the steps of `cfg`),
    so a probe that misjudged the rate neither cuts the run short nor leaves it at a high learning
    rate; the learning rate follows the cosine over the re-fitted length (flat early, so a re-fit
    moves it little). `on_total(n)` hears each new length. `init`: the sha256 of the head file the
    run started from (`--init-head`; None: fresh weights), kept in the checkpoint so that a run from
    another start never resumes it. `max_seconds` counts this process's training, not the time a
    resumed checkpoint had trained before."""
    from specula.paths import atomic_path

    module = head.module.train().requires_grad_(True)
    embed = head.embed
    device = next(module.parameters()).device
    amp = autocast_dtype(cfg.precision, device)
    train_seqs, eval_seqs = split(fs, cfg.holdout, cfg.seed, cfg.max_sequences)
    held = len(eval_seqs)
    if 0 < cfg.report_sequences < len(eval_seqs):  # the reports' share: a seeded draw (the split is in corpus order)
        pick = torch.randperm(len(eval_seqs), generator=torch.Generator().manual_seed(cfg.seed + 2))
        eval_seqs = sorted(eval_seqs[i] for i in pick[:cfg.report_sequences].tolist())
    pieces = chunks(fs, train_seqs, cfg.seq_len)
    if not pieces and cfg.epochs > 0:  # else a head of fresh weights was written as trained
        raise ConfigError(f"nothing to train on: {len(fs)} answered sequences, {held} held out and "
                          f"{len(fs) - held - len(train_seqs)} more left out as repeats of held-out "
                          f"prompts; give more prompts (or other ones) with data=")
    per_epoch, total_steps = step_counts(fs, cfg)
    most = max(total_steps, most_steps or 0)  # total_steps: re-fitted when `until` is given
    opt = torch.optim.AdamW(param_groups(module, cfg), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, total_steps))))))
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    step, losses, seconds = 0, [], 0.0
    ckpt = out_dir / CHECKPOINT_FILE
    key, data, features = asdict(cfg), data_fingerprint(fs), feature_fingerprint(fs)
    ignored = None
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        changes = resume_changes(state, cfg, head, data, features, init)
        if changes:
            ignored = changes
            if on_note is not None:
                said = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changes.items())
                on_note(f"{ckpt} was written with other settings ({said}): not resumed; training starts afresh "
                        "and replaces it (pass another out= to keep it)")
        else:
            module.load_state_dict(state["module"])
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            gen.set_state(state["generator"])
            step, losses, seconds = state["step"], state["losses"], state["seconds"]
            total_steps = state.get("total_steps", total_steps)
            before = state.get("before")  # measured when the run began (a resumed report kept only "after")
    module.eval()
    if step == 0:
        before = acceptance_report(head, fs, eval_seqs, cfg, embed) if eval_seqs else None
    module.train()
    if progress is not None and step:
        progress(step, losses[-1] if losses else float("nan"))
    t0 = time.perf_counter() - seconds  # the training time of the run, resumed parts included
    t_start = time.perf_counter()  # this process's: what `max_seconds` limits
    begun, warm, last, save_seconds = step, None, None, None  # the steady rate: from the WARM_STEPS-th step on

    def save() -> None:
        nonlocal save_seconds
        t = time.perf_counter()
        with atomic_path(ckpt) as tmp:
            torch.save({"config": key, "data": data, "features": features, "init": init, "d2t": head.d2t,
                        "module": module.state_dict(),
                        "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "generator": gen.get_state(),
                        "step": step, "losses": losses, "seconds": time.perf_counter() - t0,
                        "total_steps": total_steps, "before": before}, tmp)
        save_seconds = time.perf_counter() - t

    stopped_early, refits = False, []
    lengths, order, order_epoch = [rows for _, _, rows in pieces], [], -1
    while step < total_steps:
        epoch, at = divmod(step, per_epoch)
        if epoch != order_epoch:
            order, order_epoch = batch_order(lengths, cfg.batch_size, cfg.seed, epoch, cfg.length_groups), epoch
        group = [pieces[i] for i in order[at * cfg.batch_size:(at + 1) * cfg.batch_size]]
        if not group:
            step += 1
            continue
        with torch.autocast(device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
            loss = loss_of(head, batch(fs, group, embed, device, head.config.copy_ngram), loss_config(cfg), gen)
        if not bool(torch.isfinite(loss)):  # else NaN weights were written as a head (refused when loaded)
            raise ConfigError(f"training diverged at step {step + 1} (loss {loss.item()}); lower lr={cfg.lr!r}; the "
                              "head was not written")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        step += 1
        losses.append(round(loss.item(), 5))
        last = time.perf_counter()
        if step - begun == WARM_STEPS:
            warm = last
        if progress is not None:
            progress(1, losses[-1])
        if until is not None and warm is not None and last > warm and (step - begun - WARM_STEPS) % REFIT_EVERY == 0:
            rate = with_checkpoints((step - begun - WARM_STEPS) / (last - warm), save_seconds, cfg.checkpoint_every)
            fitted = refit_total(step, rate, until - time.monotonic(), most)
            if fitted != total_steps:
                total_steps = fitted
                refits.append((step, fitted))
                if on_total is not None:
                    on_total(fitted)
        if step % cfg.checkpoint_every == 0 or step == total_steps:
            save()
        if max_seconds is not None and time.perf_counter() - t_start > max_seconds:
            save()
            stopped_early = True
            break
    module.eval().requires_grad_(False)
    after = acceptance_report(head, fs, eval_seqs, cfg, embed) if eval_seqs else None
    return {"steps": step, "total_steps": total_steps, "seconds": round(time.perf_counter() - t0, 1),
            "refits": [list(r) for r in refits],
            "stopped_by_time_budget": stopped_early, "first_losses": losses[:5], "last_losses": losses[-5:],
            "steady_steps_per_second": None if warm is None or last <= warm else
            round((step - begun - WARM_STEPS) / (last - warm), 3),
            "checkpoint_seconds": None if save_seconds is None else round(save_seconds, 3),
            "train_sequences": len(train_seqs), "heldout_sequences": len(eval_seqs),
            "heldout_before": before, "heldout_after": after, "config": key, "checkpoint_ignored": ignored,
            "autocast": None if amp is None else str(amp).removeprefix("torch.")}
