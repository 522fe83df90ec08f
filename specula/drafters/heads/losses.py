"""The losses of head training, shared by `specula train` and online distillation.

Self-distillation: every target is the target's own distribution, softmax(lm_rows @ f) of the
feature the target computed at the predicted position, restricted to the draft vocabulary (as
EAGLE-3 restricts the target's logits). EAGLE adds EAGLE-1's smooth-L1 feature regression and
EAGLE-3's training-time test (`ttt_mask`, `eagle_outputs`); Medusa / Hydra heads learn each
offset (`offset_outputs`).

HASS's harmonized objective distillation (Zhang et al., ICLR 2025; HArmonizedSS/HASS
`train/main_hass.py`, `compute_loss`) adds `topk_weight` x the same cross-entropy over the target's
`topk` most likely tokens only (`topk_ce`): a drafting tree keeps the head's few best children, so
ranking the target's top tokens right matters more than the tail. Off by default.

EAGLE-3 (`eagle3`) reads the target's layer inputs (`inputs`, fused by the head) and has no
feature regression: its output is not a target feature.

A batch is a dict of padded tensors: tokens [B, T + 1] long, feats [B, T + 1, E] (the target's
final-normed features: the distributions distilled, and the input of eagle / medusa / hydra),
inputs [B, T + 1, k E] (eagle3 only: the target's inputs of its feature layers), emb
[B, T + 1, E], valid [B, T + 1] bool (the row exists); for a head with copy hints (`copy_ngram`),
hint_emb [B, T + 1, E] and hint_len [B, T + 1] long: row r's copy hint, over the whole sequence
before it (`heads.copy.sequence_hints`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specula.drafters.heads.config import AUTOREGRESSIVE
from specula.drafters.heads.runtime import TrainedHead


@dataclass(frozen=True)
class LossConfig:
    """The loss's knobs (a `TrainConfig` carries the same names)."""

    ttt_steps: int = 2
    """eagle: training-time-test steps (1 = teacher forcing only)."""
    ttt_decay: float = 0.8
    """eagle: weight of step j is ttt_decay ** j."""
    feature_loss: float = 1.0
    """eagle: weight of the smooth-L1 feature regression."""
    noise: float = 0.0
    """eagle: half-width of the uniform noise added to input features."""
    topk: int = 10
    """Tokens of the target's distribution the top-k term reads (HASS: 10)."""
    topk_weight: float = 0.0
    """Weight of the top-k term beside the full cross-entropy (HASS fine-tunes with 1.0; 0 = off)."""


def ttt_mask(t: int, j: int) -> torch.Tensor:
    """Bool [T, (j + 1) T]: step j's row i sees step-0 rows <= i - j and step-k rows i - j + k
    (k = 1 .. j; its own is k = j): the keys a depth-j draft row sees at inference."""
    blocks = [torch.ones((t, t), dtype=torch.bool).tril(-j)]
    for k in range(1, j + 1):
        blocks.append(torch.eye(t, dtype=torch.bool).roll(k - j, dims=1).tril(k - j) if k < j
                      else torch.eye(t, dtype=torch.bool))
    mask = torch.cat(blocks, dim=1)
    mask[:j, :] = False
    mask[torch.arange(min(j, t)), j * t + torch.arange(min(j, t))] = True  # rows without context see themselves
    return mask


def _row_ce(p: torch.Tensor, logq: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Per row, -sum p log q over the vocabulary, or over the k tokens p ranks highest; p, logq:
    [..., V] -> [...]."""
    if k is None:
        return -(p * logq).sum(-1)
    top = p.topk(min(k, p.shape[-1]), dim=-1).indices  # [..., k]
    return -(p.gather(-1, top) * logq.gather(-1, top)).sum(-1)


def _masked_mean(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (rows * mask).sum() / mask.sum().clamp_min(1)


def soft_ce(logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked rows of -sum p log softmax(logits); logits, p: [..., V], mask: [...]."""
    return _masked_mean(_row_ce(p, F.log_softmax(logits.float(), -1)), mask)


def topk_ce(logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """Mean over masked rows of -sum over the k tokens p ranks highest of p log softmax(logits)
    (HASS's top-k distillation loss); logits, p: [..., V], mask: [...]."""
    return _masked_mean(_row_ce(p, F.log_softmax(logits.float(), -1), k), mask)


def distill(logits: torch.Tensor, p: torch.Tensor, mask: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """The distillation term of one output: `soft_ce`, plus `cfg.topk_weight` x `topk_ce` (one
    log-softmax for both)."""
    logq = F.log_softmax(logits.float(), -1)  # [..., V]
    rows = _row_ce(p, logq)
    if cfg.topk_weight > 0:
        rows = rows + cfg.topk_weight * _row_ce(p, logq, cfg.topk)
    return _masked_mean(rows, mask)


def eagle_outputs(head: TrainedHead, b: dict, steps: int, noise: float, gen: torch.Generator | None
                  ) -> list[torch.Tensor]:
    """The head's outputs [B, T, E] of each training-time-test step (step 0: teacher forcing); the
    input feature of pair i is f_i (eagle) or the fusion of the target's layer inputs at i (eagle3)."""
    module = head.module
    eagle3 = head.kind == "eagle3"
    emb, feats = b["emb"][:, 1:], b["inputs" if eagle3 else "feats"][:, :-1]  # pair i = (f_i, x_{i+1})
    bsz, t, _ = emb.shape
    if noise > 0 and gen is not None and not eagle3:  # EAGLE-1's noise; EAGLE-3 has none
        feats = feats + ((torch.rand(feats.shape, generator=gen) - 0.5) * 2 * noise).to(feats.device)
    feats = module.fuse_features(feats.to(head.dtype))  # a drafting head may be bfloat16 (`runtime.drafting_dtype`)
    pos = torch.arange(t, device=emb.device)[None].expand(bsz, t)
    copy = None
    if head.config.copy_ngram:  # the same hints at every step: a depth-j row's token and text are pair i's
        if "hint_len" not in b:
            raise ValueError("a head with copy hints needs the batch's hint_emb and hint_len (trainer.batch with "
                             "copy_ngram)")
        copy = module.copy_term(b["hint_emb"][:, 1:].to(head.dtype), b["hint_len"][:, 1:])  # [B, T, E]
    outs, keys, values = [], None, None
    inp = feats
    for j in range(steps):
        mask = ttt_mask(t, j).to(emb.device)[None] if j else None
        out, (k, v) = module(emb, inp, pos, None if keys is None else (keys, values), mask, copy=copy)
        keys = k if keys is None else torch.cat([keys, k], 2)
        values = v if values is None else torch.cat([values, v], 2)
        outs.append(out)
        inp = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1].detach()], dim=1)  # step j+1 feeds g_{i-1}
    return outs


def loss_of(head: TrainedHead, b: dict, cfg: LossConfig, gen: torch.Generator | None) -> torch.Tensor:
    """The batch's loss (see the module docstring); `gen` draws the feature noise (None: none)."""
    feats, valid = b["feats"], b["valid"]
    if head.kind in AUTOREGRESSIVE:
        target = feats[:, 1:]  # [B, T, E]: f_{i+1}
        p = torch.softmax(head.target_logits(target), -1)  # [B, T, V_draft]
        total = torch.zeros((), device=feats.device)
        for j, out in enumerate(eagle_outputs(head, b, cfg.ttt_steps, cfg.noise, gen)):
            mask = valid[:, 1:].clone()
            mask[:, :j] = False
            loss = distill(head.logits(out), p, mask, cfg)
            if cfg.feature_loss > 0 and head.kind == "eagle":
                l1 = F.smooth_l1_loss(out, target, reduction="none").mean(-1)
                loss = loss + cfg.feature_loss * (l1 * mask).sum() / mask.sum().clamp_min(1)
            total = total + cfg.ttt_decay ** j * loss
        return total
    total = torch.zeros((), device=feats.device)
    for k, out, mask in offset_outputs(head, b):
        p = torch.softmax(head.target_logits(feats[:, 1 + k:]), -1)
        total = total + distill(head.logits(out), p, mask, cfg)
    return total


def offset_outputs(head: TrainedHead, b: dict):
    """Medusa / Hydra: (k, predicted features [B, T - k, E] of x_{t+2+k} from f_t, valid rows)."""
    feats, emb, valid = b["feats"].to(head.dtype), b["emb"], b["valid"]
    t1 = feats.shape[1]
    module = head.module
    for k in range(head.config.num_offsets):
        n = t1 - 1 - k  # rows t = 0 .. n - 1 have x_{t+1+k} and f_{t+1+k}
        if n <= 0:
            break
        f = feats[:, :n]
        if head.kind == "medusa":
            out = module(f, range(k, k + 1))[..., 0, :]
        else:
            embs = torch.stack([emb[:, 1 + m: 1 + m + n] for m in range(k + 1)], dim=2)  # [B, n, k + 1, E]
            out = module.forward_one(k, f, embs)
        yield k, out, valid[:, 1 + k: 1 + k + n]
