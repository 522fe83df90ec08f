"""Medusa and Hydra heads: several next-next-token predictors on the target's last feature.

Medusa (FasterDecoding/Medusa `medusa/model/medusa_model.py`, `ResBlock` and `MedusaModel`): head
i is a residual SiLU block `x + SiLU(W x + b)` with W initialised to zero, read by the target's
shared, frozen output head ("version 2" of that file: one shared head rather than per-head
copies). On the feature f_t of position t (which the target's own head turns into x_{t+1}, the
root), head i predicts x_{t+2+i}: the draft level i + 1. Siblings at a level are the head's top-k,
independent of the path.

Hydra (zankner/Hydra `hydra/model/hydra_heads/mlp_head.py`): head i is conditioned on the tokens
before it: its input is [f_t ; e(x_{t+1}) ; ... ; e(x_{t+1+i})] (the root's embedding and those
of the i drafted ancestors), an MLP with a learned linear residual projection, then the shared
output head. Hydra++'s prefix-attention layer and teacher loss: the loss is ours anyway
(self-distillation against the target's distribution); the prefix layer is left out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specula.drafters.heads.config import HeadConfig


class MedusaHeads(nn.Module):
    """`num_offsets` residual blocks on one feature (see the module docstring)."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(cfg.num_offsets))

    def reset_parameters(self, generator: torch.Generator) -> None:
        """Weights zero (each head starts as the target's own next-token head), biases small."""
        with torch.no_grad():
            for block in self.blocks:
                block.weight.zero_()
                block.bias.normal_(0.0, 0.01, generator=generator)

    def forward(self, feat: torch.Tensor, offsets: range | None = None) -> torch.Tensor:
        """feat: [..., E] -> predicted features [..., K, E] of offsets (default all heads)."""
        blocks = self.blocks if offsets is None else [self.blocks[i] for i in offsets]
        return torch.stack([feat + F.silu(block(feat)) for block in blocks], dim=-2)


class HydraHeads(nn.Module):
    """`num_offsets` MLP heads, head i over [feature ; i + 1 token embeddings] (module docstring)."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e = cfg.hidden_size
        self.proj = nn.ModuleList(nn.Linear((i + 2) * e, e, bias=False) for i in range(cfg.num_offsets))
        self.mlp = nn.ModuleList(nn.Linear((i + 2) * e, e) for i in range(cfg.num_offsets))

    def reset_parameters(self, generator: torch.Generator) -> None:
        """Residual projections start as the feature's identity, MLPs near zero."""
        e = self.cfg.hidden_size
        with torch.no_grad():
            for proj, mlp in zip(self.proj, self.mlp):
                proj.weight.normal_(0.0, 0.02 / proj.weight.shape[1] ** 0.5, generator=generator)
                proj.weight[:, :e] += torch.eye(e)
                mlp.weight.normal_(0.0, 0.02, generator=generator)
                mlp.bias.zero_()

    def forward_one(self, index: int, feat: torch.Tensor, embs: torch.Tensor) -> torch.Tensor:
        """Head `index` on feat [..., E] and the embeddings [..., index + 1, E] of the root and the
        drafted ancestors: the predicted feature [..., E]."""
        x = torch.cat([feat, embs.flatten(-2)], dim=-1)  # [..., (index + 2) E]
        return self.proj[index](x) + F.silu(self.mlp[index](x))
