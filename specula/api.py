"""The Python API, mirroring `specula generate`.

    import specula
    spec = specula.load("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", method="draft-model")
    out = spec.generate("Write a quicksort in Python.", max_new_tokens=128)
    print(out.text, out.stats.summary())
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from specula.drafters import make_drafter
from specula.engine import EngineConfig, GenerationOutput, SpeculativeDecoder, StreamChunk
from specula.errors import ConfigError
from specula.models.hf import HFCausalLM
from specula.sampling import SamplingParams

Prompt = str | Sequence[dict] | Sequence[int]


@dataclass(frozen=True)
class LoadConfig:
    """How models are loaded."""

    dtype: str = "float32"
    """Weights dtype: float32 or bfloat16."""
    attn_implementation: str = "sdpa"
    """transformers attention kernel: sdpa or eager."""


class Specula:
    """A target (and optional draft) with one method: `generate` / `stream` text or ids."""

    def __init__(self, target: HFCausalLM, tokenizer, method: str = "none", draft: HFCausalLM | None = None,
                 *, engine: EngineConfig = EngineConfig(), **drafter_options) -> None:
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.method = method
        self.drafter = make_drafter(method, target=target, draft=draft, **drafter_options)
        self.decoder = SpeculativeDecoder(target, self.drafter, tokenizer, config=engine)

    def encode(self, prompt: Prompt, raw: bool = False) -> list[int]:
        """Token ids of a prompt: text (chat template applied unless raw), messages, or ids."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ConfigError("the prompt is empty: give some text with --prompt")
            from specula.models.loading import apply_chat_template

            return apply_chat_template(self.tokenizer, prompt, raw=raw)
        prompt = list(prompt)
        if not prompt:
            raise ConfigError("the prompt is empty: give some text or at least one message")
        if isinstance(prompt[0], dict):
            from specula.models.loading import apply_chat_template

            return apply_chat_template(self.tokenizer, prompt, raw=raw)
        return [int(t) for t in prompt]

    def generate(self, prompt: Prompt, *, raw: bool = False, **sampling) -> GenerationOutput:
        """Generate; keyword arguments are `SamplingParams` fields (max_new_tokens, temperature, ...)."""
        return self.decoder.generate(self.encode(prompt, raw), SamplingParams(**sampling))

    def stream(self, prompt: Prompt, *, raw: bool = False, **sampling) -> Iterator[StreamChunk]:
        return self.decoder.stream(self.encode(prompt, raw), SamplingParams(**sampling))


def load_backend(spec: str, config: LoadConfig = LoadConfig(), name: str = "model") -> tuple[HFCausalLM, object]:
    """Load a model (alias, local dir, .gguf file or cached hub id) as a backend + tokenizer."""
    from specula.models.loading import load_model

    model, tokenizer = load_model(spec, dtype=config.dtype, attn_implementation=config.attn_implementation)
    return HFCausalLM(model, name=f"{name} {spec}"), tokenizer


def load(target: str, draft: str | None = None, method: str | None = None,
         config: LoadConfig = LoadConfig(), **drafter_options) -> Specula:
    """Load target (and draft) and build a `Specula`. The method defaults to draft-model when a
    draft is given, else prompt-lookup."""
    if method is None:
        method = "draft-model" if draft else "prompt-lookup"
    target_lm, tokenizer = load_backend(target, config, "target")
    draft_lm = None
    if draft is not None:
        from specula.models.loading import check_compatible

        draft_lm, draft_tok = load_backend(draft, config, "draft")
        check_compatible(tokenizer, draft_tok, target_lm.model, draft_lm.model,
                         target_name=target, draft_name=draft)
    return Specula(target_lm, tokenizer, method, draft_lm, **drafter_options)
