"""The shape of a trained head, and the reduced draft vocabulary it predicts over."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, get_args

from specula.errors import ConfigError

HeadKind = Literal["eagle", "medusa", "hydra"]
HEAD_KINDS: tuple[str, ...] = get_args(HeadKind)


@dataclass(frozen=True)
class HeadConfig:
    """Everything needed to rebuild a head's modules (stored in the head file)."""

    kind: HeadKind
    """eagle: one decoder layer over [embedding(token) ; feature] (EAGLE-1/2); medusa: one residual
    SiLU block per offset; hydra: one MLP per offset over [feature ; embeddings of the tokens
    drafted before]."""
    hidden_size: int
    """E: the target's hidden size (features, embeddings)."""
    target_vocab: int
    """The target's logit width: draft token ids map into 0 .. target_vocab - 1."""
    draft_vocab: int
    """Tokens the head predicts over (the reduced vocabulary, EAGLE-3 style); = len(d2t)."""
    num_heads: int = 0
    """eagle: attention heads of its decoder layer."""
    num_kv_heads: int = 0
    """eagle: key/value heads."""
    head_dim: int = 0
    """eagle: width of one attention head."""
    intermediate_size: int = 0
    """eagle: MLP width of its decoder layer."""
    rms_norm_eps: float = 1e-6
    """eagle: epsilon of its RMSNorm."""
    rope_theta: float = 10000.0
    """eagle: RoPE base of its attention (positions = pair index in the sequence)."""
    num_offsets: int = 4
    """medusa / hydra: heads, head i predicting the token i + 1 steps after the root (deepest draft
    level); eagle drafts autoregressively and ignores it."""

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ConfigError(f"head kind must be one of {', '.join(HEAD_KINDS)}, got {self.kind!r}")
        if self.draft_vocab < 2 or self.draft_vocab > self.target_vocab:
            raise ConfigError(f"draft_vocab must be in 2..{self.target_vocab}, got {self.draft_vocab}")
        if self.kind == "eagle" and (self.num_heads < 1 or self.num_kv_heads < 1 or self.head_dim < 2
                                     or self.num_heads % self.num_kv_heads or self.intermediate_size < 1):
            raise ConfigError("an eagle head needs num_heads (a multiple of num_kv_heads), num_kv_heads, an even "
                              "head_dim and intermediate_size")
        if self.kind != "eagle" and self.num_offsets < 1:
            raise ConfigError(f"num_offsets must be >= 1, got {self.num_offsets}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        return cls(**d)
