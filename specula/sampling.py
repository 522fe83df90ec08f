"""Sampling parameters and the processed target distribution `p`.

Every acceptance rule preserves exactly the distribution returned by `probabilities`
(temperature, then top-k, then top-p, as Hugging Face `generate` applies them).
Temperature 0 means greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specula.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is processed and when to stop."""

    temperature: float = 0.0
    """0 = greedy (argmax); > 0 divides the logits before softmax."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (1.0 = off)."""
    seed: int | None = None
    """Seed of the random generator used by sampling rules (None = nondeterministic)."""
    max_new_tokens: int = 128
    """Hard limit on generated tokens; never overshot, even mid-draft."""
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Stop strings: generation ends once the decoded output contains one (it is kept)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks with a fixed budget)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}; use 0 for greedy decoding")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable it")
        if self.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop the tokens whose cumulative mass (ascending) stays within 1 - top_p; always keep the top one.
        drop_sorted = cum <= (1.0 - params.top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen
