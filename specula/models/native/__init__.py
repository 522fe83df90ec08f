"""specula's own decoder for Llama / Qwen2 / Mistral models (static KV cache, fused projections),
behind the same `TargetModel` protocol as the Hugging Face backend (`--backend auto|native|hf`)."""

from specula.models.native.backend import NativeCausalLM, NativeSequence
from specula.models.native.model import ARCHITECTURES, NativeConfig, NativeDecoder


def supports(model) -> bool:
    """Whether the native decoder reproduces this Hugging Face model."""
    from specula.errors import ConfigError

    try:
        NativeConfig.from_hf(model.config, type(model).__name__)
    except ConfigError:
        return False
    return True


__all__ = ["ARCHITECTURES", "NativeCausalLM", "NativeConfig", "NativeDecoder", "NativeSequence", "supports"]
