"""Float32 linears on CPU through oneDNN with prepacked weights: a flatter, cheaper cost curve.

Why: on the development CPU, `F.linear` (MKL sgemm) is slow for the small row counts that
decoding and tree verification use. One 576x49152 output layer (SmolLM2), 1 thread, ms for
1 / 2 / 3 / 4 / 8 rows: `F.linear` 9.9 / 22.8 / 34.2 / 17.9 / 18.9, oneDNN prepacked 7.8 / 8.0 /
6.0 / 5.5 / 7.8; one 1536x8960 MLP linear (Qwen2.5-1.5B), 2 threads: `F.linear` 4.1 / 8.2 / 14.7
/ 8.3 / 7.9, prepacked 2.0 / 2.2 / 2.1 / 1.9 / 2.0 (docs/cpu.md). Verifying a few tokens then
costs about one decoding step instead of two, which is what speculative decoding lives on, and
one decoding step gets cheaper too.

`OneDNNLinear` reorders the weight once into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, batch-size hint 16) and runs
`torch.ops.mkldnn._linear_pointwise`, the same ops PyTorch's own CPU compiler (inductor, with
weight freezing) emits for `nn.Linear`. The original weight is released unless something else
still holds it (a tied input embedding keeps its copy).

Numerics: float32 GEMM rounding, like `F.linear`: a row's output differs from the same row run
alone by ~1e-6 relative (as `F.linear`'s GEMV and GEMM differ), which float32 greedy decoding
does not amplify; speculative output equals plain decoding of the same model on every float32
bench. Not used for int8 (its linears are `quantize.RowInt8Linear`) or other dtypes.
"""

from __future__ import annotations

import torch
from torch import nn

from specula.errors import ConfigError
from specula.models.linears import linear_weight, replace_linears

LINEAR_KERNELS = ("auto", "specula", "onednn", "aten")
"""Values of `--linear-kernel` / `LoadConfig.linear_kernel`. `specula`: specula's own C kernels
(`specula.models.native.kernels`; native backend, CPU, AVX2). `auto`: specula on the native
backend where they run, else onednn for a float32 model on CPU when PyTorch has oneDNN, else aten
(`F.linear`)."""

BATCH_HINT = 16
"""Rows the weight layout is tuned for; measured flat from 1 to 16 rows (1, 4, 16 and 64 tried)."""
MIN_ROWS = 4
"""Passes of fewer rows are padded with zero rows to this many: oneDNN's 4-row GEMM is faster than
its 1-3 row paths on the development CPU (docs/cpu.md), so even one-token decoding steps gain."""


def onednn_available() -> bool:
    """Whether this PyTorch build has the oneDNN (mkldnn) linear ops."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def resolve_linear_kernel(option: str, *, dtype: torch.dtype, device: str, quantize: str,
                          native: bool = False) -> str:
    """The kernel `option` means for a model of this dtype / device / quantization on this backend
    (specula, onednn or aten); a `ConfigError` naming the fix when the one asked for cannot run."""
    if option not in LINEAR_KERNELS:
        raise ConfigError(f"unknown linear kernel {option!r}; choose one of: {', '.join(LINEAR_KERNELS)}")
    from specula.models.native import kernels

    own = dtype == torch.float32 and device == "cpu" and native
    if option == "specula":
        if not own:
            raise ConfigError(f'linear_kernel="specula" runs float32 models on CPU with backend="native" (not '
                              f'{str(dtype).removeprefix("torch.")} on {device}); use linear_kernel="auto"')
        reason = kernels.unavailable_reason()
        if reason is not None:
            raise ConfigError(f'linear_kernel="specula" cannot run here: {reason}; use linear_kernel="onednn"')
        return option
    fits = dtype == torch.float32 and device == "cpu" and quantize == "none"
    if option == "auto":
        if own and kernels.usable():  # a build that fails falls back (said once on standard error)
            return "specula"
        return "onednn" if fits and onednn_available() else "aten"
    if option == "onednn" and not fits:
        raise ConfigError('linear_kernel="onednn" runs float32 models on CPU with quantize="none"; '
                          'use linear_kernel="auto" or linear_kernel="aten"')
    if option == "onednn" and not onednn_available():
        raise ConfigError('linear_kernel="onednn" needs a PyTorch build with oneDNN (mkldnn); use linear_kernel="aten"')
    return option


class OneDNNLinear(nn.Module):
    """`nn.Linear` (float32, CPU) computed by oneDNN from a prepacked weight (see module doc)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        weight = linear_weight(linear)  # [out, in]
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ConfigError('OneDNNLinear takes float32 CPU linears; use linear_kernel="aten" for this model')
        self.out_features, self.in_features = weight.shape
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        # Shape only (no storage): callers read `lm_head.weight.shape` for the logit width.
        self.weight = torch.empty(self.out_features, self.in_features, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in]
        rows = x.reshape(-1, self.in_features)  # [n, in]
        if rows.dtype != torch.float32:
            raise ConfigError(f"OneDNNLinear got {rows.dtype} input; it runs float32 models only")
        n = rows.shape[0]
        if n < MIN_ROWS:
            rows = torch.cat([rows, rows.new_zeros(MIN_ROWS - n, self.in_features)])  # [MIN_ROWS, in]
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self._packed, self.bias, "none", [], "")
        return out[:n].reshape(*x.shape[:-1], self.out_features)  # [..., out]

    @property
    def memory_bytes(self) -> int:
        """Bytes of the weight (float32), as held in oneDNN's blocked layout."""
        return 4 * self.in_features * self.out_features

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN prepacked"


def linear_kernel_of(model: nn.Module) -> str:
    """The linear kernel a loaded model runs: specula's own C kernels ("specula-<kind>-<isa>-<build>":
    a cost curve timed with other kernel code or another instruction set is not this one's), onednn
    (prepacked), or aten."""
    from specula.models.native import kernels
    from specula.models.native.kernels import KernelLinear

    for m in model.modules():
        if isinstance(m, KernelLinear):
            return f"specula-{m.kind}-{kernels.isa()}-{kernels.build_key()[:8]}"
        if isinstance(m, OneDNNLinear):
            return "onednn"
    return "aten"


def prepack_model(model: nn.Module, kernel: str) -> nn.Module:
    """Swap every `nn.Linear` and transformers `Conv1D` of `model` for a `OneDNNLinear` when `kernel` is
    "onednn" (in place; "aten" changes nothing). `kernel` is a resolved value (`resolve_linear_kernel`)."""
    if kernel == "aten":
        return model
    if kernel != "onednn":
        raise ConfigError(f"prepack_model takes a resolved kernel (onednn or aten), got {kernel!r}")
    return replace_linears(model, OneDNNLinear)
