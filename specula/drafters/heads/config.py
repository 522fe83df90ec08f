"""The shape of a trained head, and the reduced draft vocabulary it predicts over."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, get_args

from specula.drafters.heads.copy import MAX_COPY_NGRAM
from specula.errors import ConfigError

HeadKind = Literal["eagle", "eagle3", "medusa", "hydra"]
HEAD_KINDS: tuple[str, ...] = get_args(HeadKind)


@dataclass(frozen=True)
class HeadConfig:
    """Everything needed to rebuild a head's modules (stored in the head file)."""

    kind: HeadKind
    """eagle: one decoder layer over [embedding(token) ; feature] (EAGLE-1/2); eagle3: the same layer
    over [embedding ; the target's inputs of `feature_layers` fused by one linear layer] (EAGLE-3),
    its output normed before the output head and fed back as the feature of the nodes after it;
    medusa: one residual SiLU block per offset; hydra: one MLP per offset over [feature ;
    embeddings of the tokens drafted before]."""
    hidden_size: int
    """E: the target's hidden size (features, embeddings)."""
    target_vocab: int
    """The target's logit width: draft token ids map into 0 .. target_vocab - 1."""
    draft_vocab: int
    """Tokens the head predicts over (the reduced vocabulary, EAGLE-3 style); = len(d2t)."""
    feature_layers: tuple[int, ...] = ()
    """eagle3: the target layers whose inputs it reads (`models.base.FeatureRequest`; EAGLE-3: 2,
    N / 2, N - 3 of N layers); () for the other kinds, which read the final-normed state."""
    num_heads: int = 0
    """eagle / eagle3: attention heads of its decoder layer."""
    num_kv_heads: int = 0
    """eagle / eagle3: key/value heads."""
    head_dim: int = 0
    """eagle / eagle3: width of one attention head."""
    intermediate_size: int = 0
    """eagle / eagle3: MLP width of its decoder layer."""
    rms_norm_eps: float = 1e-6
    """eagle / eagle3: epsilon of its RMSNorm."""
    rope_theta: float = 10000.0
    """eagle / eagle3: RoPE base of its attention (positions = pair index in the sequence)."""
    num_offsets: int = 4
    """medusa / hydra: heads, head i predicting the token i + 1 steps after the root (deepest draft
    level); eagle / eagle3 draft autoregressively and ignore it."""
    copy_ngram: int = 0
    """eagle / eagle3: each pair also reads its copy hint (`heads.copy`: the token that followed the
    latest earlier occurrence of the 1 .. N tokens ending at its own, at any distance, and the
    match's length), added to its residual stream by `copy_proj` and `copy_len`; 0 = none (every
    head trained before this field)."""

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ConfigError(f"head kind must be one of {', '.join(HEAD_KINDS)}, got {self.kind!r}")
        if self.draft_vocab < 2 or self.draft_vocab > self.target_vocab:
            raise ConfigError(f"draft_vocab must be in 2..{self.target_vocab}, got {self.draft_vocab}")
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))  # JSON gives lists
        if (self.kind == "eagle3") != bool(self.feature_layers) or any(i < 0 for i in self.feature_layers):
            raise ConfigError("an eagle3 head needs feature_layers (the target layers whose inputs it fuses, each "
                              f">= 0); the other kinds take none: got kind {self.kind!r}, feature_layers "
                              f"{list(self.feature_layers)}")
        if self.kind in AUTOREGRESSIVE and (self.num_heads < 1 or self.num_kv_heads < 1 or self.head_dim < 2
                                     or self.num_heads % self.num_kv_heads or self.intermediate_size < 1):
            raise ConfigError(f"an {self.kind} head needs num_heads (a multiple of num_kv_heads), num_kv_heads, an even "
                              "head_dim and intermediate_size")
        if not 0 <= self.copy_ngram <= MAX_COPY_NGRAM or (self.copy_ngram and self.kind not in AUTOREGRESSIVE):
            raise ConfigError(f"copy_ngram must be in 0..{MAX_COPY_NGRAM} and is read by eagle / eagle3 heads only; got "
                              f"{self.copy_ngram} for kind {self.kind!r}")
        if self.kind in ("medusa", "hydra") and self.num_offsets < 1:
            raise ConfigError(f"num_offsets must be >= 1, got {self.num_offsets}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        return cls(**d)


AUTOREGRESSIVE: tuple[str, ...] = ("eagle", "eagle3")
"""Head kinds that draft one level after another through their own decoder layer (any depth);
the others have one head per offset (depth <= num_offsets)."""


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's three feature depths for an N-layer target: the inputs of layers 2, N // 2 and
    N - 3 (SafeAILab/EAGLE `eagle/model/modeling_llama_kv.py`), kept distinct and inside 0 .. N - 1
    on shallow models (the tiny test models)."""
    picks = (min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3))
    return tuple(sorted(set(picks)))


def feature_layers_of(kind: str, num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs a new head of `kind` reads (eagle3: `eagle3_layers`); () for
    the kinds that read the final-normed state."""
    return eagle3_layers(num_layers) if kind == "eagle3" else ()
