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
    attn_implementation: str = "auto"
    """Attention kernel: sdpa, eager, batch_invariant (each query row computed alone, bitwise equal to a
    one-token step), or auto = batch_invariant when quantize is int8, else sdpa."""
    quantize: str = "none"
    """none, or int8: int8 linear layers with per-row activation scales on CPU (fbgemm), for target and
    draft alike. Lossless relative to the int8 model: its linears and (with attn auto) its attention are
    bitwise batch invariant, so tree logits equal one-token logits bit for bit. It changes the model
    itself (perplexity and agreement with float32 in docs/cpu.md)."""
    linear_kernel: str = "auto"
    """Float linear layers: onednn (weights prepacked once for oneDNN; on CPU several times cheaper for
    the few rows decoding and verification pass, docs/cpu.md), aten (`F.linear`), or auto = onednn for a
    float32 model on CPU without quantize, else aten."""


class Specula:
    """A target (and optional draft) with one method: `generate` / `stream` text or ids."""

    def __init__(self, target: HFCausalLM, tokenizer, method: str = "none", draft: HFCausalLM | None = None,
                 *, engine: EngineConfig = EngineConfig(), **drafter_options) -> None:
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.method = method
        self.decoder = build_decoder(method, target, tokenizer, draft, engine=engine, **drafter_options)
        self.drafter = self.decoder.drafter

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


PLANNED_METHODS = ("fusion",)
"""Methods that always run with the hardware-aware planner (others: with adaptive=True)."""


def build_decoder(method: str, target: HFCausalLM, tokenizer=None, draft: HFCausalLM | None = None, *,
                  engine: EngineConfig = EngineConfig(), planner=None, **drafter_options) -> SpeculativeDecoder:
    """The decoder for a method: its drafter, plus the hardware-aware planner for `fusion` and
    adaptive drafting (pass `planner` to share one, e.g. a planner built on a given cost curve)."""
    drafter = make_drafter(method, target=target, draft=draft, tokenizer=tokenizer, **drafter_options)
    if planner is None and (method in PLANNED_METHODS or drafter_options.get("adaptive")):
        from specula.planner import HardwarePlanner

        planner = HardwarePlanner(target)
    if planner is not None and hasattr(drafter, "set_stop_rule"):
        drafter.set_stop_rule(planner.chain_stop_rule("draft-model"))
    if planner is not None and hasattr(drafter, "set_rate_estimator"):
        drafter.set_rate_estimator(planner.proposal_rate)
    return SpeculativeDecoder(target, drafter, tokenizer, planner=planner, config=engine)


def load_backend(spec: str, config: LoadConfig = LoadConfig(), name: str = "model") -> tuple[HFCausalLM, object]:
    """Load a model (alias, local dir, .gguf file or cached hub id) as a backend + tokenizer."""
    from specula.models.loading import load_model

    model, tokenizer = load_model(spec, dtype=config.dtype, attn_implementation=config.attn_implementation,
                                  quantize=config.quantize, linear_kernel=config.linear_kernel)
    backend = HFCausalLM(model, name=f"{name} {spec}")
    backend.quantization = config.quantize  # part of the planner's cost-cache key
    return backend, tokenizer


def load(target: str, draft: str | None = None, method: str | None = None,
         config: LoadConfig = LoadConfig(), **drafter_options) -> Specula:
    """Load target (and draft) and build a `Specula`. The method defaults to `fusion` (every
    available drafter, sized by the hardware-aware planner)."""
    if method is None:
        method = "fusion"
    target_lm, tokenizer = load_backend(target, config, "target")
    draft_lm = None
    if draft is not None:
        from specula.models.loading import check_compatible

        draft_lm, draft_tok = load_backend(draft, config, "draft")
        check_compatible(tokenizer, draft_tok, target_lm.model, draft_lm.model,
                         target_name=target, draft_name=draft)
    return Specula(target_lm, tokenizer, method, draft_lm, **drafter_options)
