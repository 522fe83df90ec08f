"""specula's own decoder for Llama / Qwen2 / Mistral models (static KV cache, fused projections),
behind the same `TargetModel` protocol as the Hugging Face backend (`--backend auto|native|hf`)."""

from specula.models.native.backend import NativeCausalLM, NativeSequence
from specula.models.native.model import ARCHITECTURES, NativeConfig, NativeDecoder, NativeUnsupported


def supports(model) -> bool:
    """Whether the native decoder reproduces this Hugging Face model."""
    from specula.models.native.model import rope_inverse_frequencies

    try:
        NativeConfig.from_hf(model.config, type(model).__name__)
        rope_inverse_frequencies(model.config)
    except NativeUnsupported:
        return False
    return True


def configure(decoder: NativeDecoder, kernel: str, quantize: str, attention: str, *, empty=None,
              codes=None) -> NativeDecoder:
    """Give a decoder its kernels (in place): `kernel` "specula" = specula's C kernels for every
    linear layer (float32, or weight-only int8 with `quantize="int8"`) and every other op
    (row-invariant: tree rows are bitwise one-token steps); otherwise PyTorch ops with `kernel`'s
    linears ("onednn" prepacked or "aten"), `quantize` ("int8": fbgemm per-row int8) and
    batch-invariant attention when `attention` says so. `empty` makes the packed weights of
    specula's kernels (`kernels.Empty`; default `torch.empty`); `codes` (a `codes.GgufCodes`, float32
    only): the weights it holds exact codes for run as c8 layers (the same outputs, a quarter of the
    bytes)."""
    from specula.models.native.kernels import apply_kernels
    from specula.models.native.ops import CpuKernelOps, kernel_attention_fits
    from specula.models.prepack import prepack_model
    from specula.models.quantize import quantize_model

    if kernel == "specula":
        cfg = decoder.cfg
        if not kernel_attention_fits(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim):
            raise NativeUnsupported(f"specula's attention kernel takes head_dim <= 256 in multiples of 8 and at most 64 "
                              f"query heads per KV head (this model: head_dim {cfg.head_dim}, "
                              f'{cfg.num_heads // cfg.num_kv_heads} per KV head); use linear_kernel="onednn"')
        apply_kernels(decoder, {"none": "f32", "int8": "i8", "int4": "i4", "w8": "w8"}[quantize], empty=empty,
                      codes=codes if quantize == "none" else None)
        decoder.ops = CpuKernelOps()
        return decoder
    quantize_model(decoder, quantize)
    decoder.invariant = attention == "batch_invariant"
    prepack_model(decoder, kernel)
    return decoder


__all__ = ["ARCHITECTURES", "NativeCausalLM", "NativeConfig", "NativeDecoder", "NativeSequence", "NativeUnsupported",
           "configure", "supports"]
