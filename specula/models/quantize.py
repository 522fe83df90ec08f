"""CPU int8 execution for a loaded model: every `nn.Linear` becomes a batch-invariant int8 linear.

Why not `torch.ao.quantization.quantize_dynamic`: its fbgemm kernel quantizes the activations
with ONE scale computed over the whole input `[tokens, hidden]`, so the logits of a token depend
on the other tokens in the same forward pass. Verifying 8 draft tokens at once then gives other
numbers than decoding them one at a time, and speculative output would drift from plain decoding
of the same quantized model. (It is also deprecated: importing `torch.ao.quantization` warns
"deprecated and will be removed"; torchao's replacement `quantize_` runs eagerly on CPU at about
10x the float32 latency, see docs/cpu.md.)

`RowInt8Linear` keeps fbgemm's fast int8 GEMM but makes each row's quantization its own:

* weights: int8, symmetric, one scale per output channel (packed once for fbgemm);
* activations: each row is divided by its own absolute maximum (so it spans [-1, 1]), and one
  constant pad row `[1, -1, 0, ...]` is appended, so the per-tensor range fbgemm computes is
  always exactly [-1, 1] whatever the other rows hold; the output row is multiplied back by the
  row's scale. Integer accumulation is exact and every float step is elementwise, so each output
  row is bit-identical to running that row alone (tested), which is what lossless tree
  verification needs.

Only the linears are batch invariant here. Attention and norms stay float, whose tiny
batch-size-dependent rounding (1e-6) could move an activation across an int8 rounding boundary
(a whole step: a row's absmax / 127), so an int8 model also needs batch-invariant attention
(`specula.models.attention`, chosen automatically by `attn_implementation="auto"`): with both,
every tree row is bit for bit a one-token step, and speculative output equals plain decoding
of the int8 model on real models too (docs/cpu.md).

Embeddings and norms stay in the model's dtype; the output layer (`lm_head`) is quantized too
unless listed in `skip` (it is a fifth of the FLOPs of Qwen2.5-1.5B).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import nn

from specula.errors import ConfigError
from specula.models.linears import linear_weight, replace_linears

QUANTIZE_OPTIONS = ("none", "int8", "int4")
"""Values of `--quantize` / `LoadConfig.quantize`. int4 (4-bit weights, a scale per 64 inputs, int8
activations) runs on specula's CPU kernels only (`check_int4_kernel`); meant for drafts."""

_TINY = 1e-12  # floor of a row's scale, so an all-zero row stays zero instead of dividing by 0


def check_quantize(option: str) -> str:
    """`option` if it is a known quantization, else a `ConfigError` naming the choices."""
    if option not in QUANTIZE_OPTIONS:
        raise ConfigError(f"unknown quantization {option!r}; choose one of: {', '.join(QUANTIZE_OPTIONS)}")
    if option == "int8" and "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ConfigError(f'quantize="{option}" needs PyTorch\'s fbgemm int8 kernels (x86 CPU); use quantize="none"')
    return option


def check_int4_kernel(option: str, kernel: str | None) -> None:
    """A `ConfigError` when `option` is int4 and the linears would not run on specula's CPU kernels
    (`kernel`: the resolved linear kernel, None for the Hugging Face backend), the only ones with 4-bit
    weights."""
    if option == "int4" and kernel != "specula":
        where = "the transformers backend" if kernel is None else f'linear_kernel="{kernel}"'
        raise ConfigError('quantize="int4" runs on specula\'s CPU kernels only (backend="native" on CPU, a Llama / '
                          f'Qwen2 / Mistral model, float32), not on {where}; use quantize="int8"')


def row_scales(w: torch.Tensor) -> torch.Tensor:
    """[R, C] float -> [R] float32: symmetric int8 scales, each row's maximum -> 127."""
    return (w.detach().float().abs().amax(dim=1) / 127.0).clamp_min(_TINY)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] float -> ([R, C] int8, [R] float32 scales `row_scales`): w ~= q * scale[:, None]."""
    scale = row_scales(w)  # [R]
    q = torch.round(w.detach().float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] float -> ([R, C'] int8 in -7..7, [R, C' / group] float32 scales): symmetric 4-bit values,
    each run of `group` inputs scaled by its own maximum -> 7, C' = C rounded up to `group` (zeros
    padded): w ~= q * scale repeated over each group (the i4 kernels, `KernelLinear(kind="i4")`)."""
    rows, cols = w.shape
    padded = -(-cols // group) * group
    x = torch.zeros((rows, padded), dtype=torch.float32)
    x[:, :cols] = w.detach().float()
    x = x.view(rows, padded // group, group)  # [R, groups, group]
    scale = (x.abs().amax(dim=2) / 7.0).clamp_min(_TINY)  # [R, groups]
    q = torch.round(x / scale[:, :, None]).clamp_(-7, 7).to(torch.int8)
    return q.view(rows, padded), scale


def per_channel_int8(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric per-output-channel int8 quantization of a `[out, in]` weight (a qint8 tensor)."""
    w = weight.detach().float()  # [out, in]
    scale = row_scales(w)  # [out]
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized-tensor creation warns it is deprecated; fbgemm packing needs it
        warnings.filterwarnings("ignore", message=".*quantized tensor creation.*", category=UserWarning)
        return torch.quantize_per_channel(w, scale.double(), zero, 0, torch.qint8)


class RowInt8Linear(nn.Module):
    """`nn.Linear` with int8 per-channel weights and int8 per-row dynamic activations (see module doc)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        weight = linear_weight(linear)  # [out, in]
        self.out_features, self.in_features = weight.shape
        if weight.device.type != "cpu":
            raise ConfigError('int8 quantization runs on CPU only; load the model on CPU or use quantize="none"')
        self._packed = torch.ops.quantized.linear_prepack(per_channel_int8(weight), None)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        # Shape only (no storage): callers read `lm_head.weight.shape` for the logit width.
        self.weight = torch.empty(self.out_features, self.in_features, device="meta")
        pad = torch.zeros(1, self.in_features)  # [1, in]: pins fbgemm's per-tensor range to [-1, 1]
        pad[0, 0], pad[0, -1] = 1.0, -1.0
        self.register_buffer("_pad", pad, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in]
        rows = x.reshape(-1, self.in_features).float()  # [n, in]
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(_TINY)  # [n, 1]
        unit = torch.cat([rows / scale, self._pad])  # [n + 1, in], every value in [-1, 1]
        out = torch.ops.quantized.linear_dynamic(unit, self._packed, True)[:-1] * scale  # [n, out]
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    @property
    def memory_bytes(self) -> int:
        """Bytes of the packed int8 weight."""
        return self.in_features * self.out_features

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[k] long -> [k, in] float32: the weight rows (output features) `ids` dequantized, exactly as
        packed (quantized again per row, they give back the same int8 rows)."""
        weight = torch.ops.quantized.linear_unpack(self._packed)[0]  # [out, in] qint8, per channel
        return weight.dequantize()[ids.to(torch.long).cpu()]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row"


def quantize_model(model: nn.Module, option: str = "int8", *, skip: Iterable[str] = ()) -> nn.Module:
    """Apply `option` to `model` in place and return it.

    `"int8"` swaps every `nn.Linear` and transformers `Conv1D` (but those whose qualified name is in `skip`, e.g.
    `"lm_head"`) for a `RowInt8Linear`; `"none"` changes nothing."""
    check_int4_kernel(check_quantize(option), None)
    if option == "none":
        return model
    return replace_linears(model, RowInt8Linear, skip=skip)

