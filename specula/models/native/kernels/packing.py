"""What decides the bytes of a packed weight: the kernels' layouts (`pack`, `pack_i4`; the C in
`pack.c` and `layout.h`), the int8 rows (`quantize_rows`) and which of them each kernel kind takes
(`pack_weight`). A module of its own because `models.prepared` hashes it into the key of every
prepared entry: an edit elsewhere in the kernels' Python (loading the library, the calls that read
the weights) no longer makes users' prepared models (7 GB for the float32 1.5B) be written again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specula.errors import ConfigError

Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
"""Where a packed weight is made: (shape, dtype) -> an uninitialised contiguous CPU tensor.
`torch.empty` when None; the prepared-model cache passes `TensorFileWriter.empty`, so the
packing writes each weight straight into the entry's file (`models.tensor_file`)."""


def _torch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _library():
    from specula.models.native.kernels import library

    return library()


def pack_weight(weight: torch.Tensor, kind: str,
                empty: Empty | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """weight [out, in] float32 (CPU, contiguous) -> (packed, scale) for `KernelLinear` of `kind`:
    f32 (scale None), w8 / i8 (int8 rows, scale [out]; i8 in quads), i4 (scale [blocks, groups, block]).
    The packed weight is made by `empty`."""
    block = _library().specula_block()
    if kind == "f32":
        return pack(weight, block, empty=empty), None
    if kind == "i4":
        return pack_i4(weight, block, empty=empty)
    q, scale = quantize_rows(weight)  # [out, in] int8, [out]
    return pack(q, block, quads=kind == "i8", empty=empty), scale.contiguous()


def pack(weight: torch.Tensor, block: int, quads: bool = False, empty: Empty | None = None) -> torch.Tensor:
    """The kernels' weight layout (see `linear.c`): weight [out, in] (float32 or int8) ->
    [blocks][in][block] (f32, w8), or [blocks][in / 4][block][4] (i8, `quads`), flat; outputs are
    padded to a multiple of `block` (and inputs of 4 for quads) with zeros. Made by `empty`."""
    weight = weight.contiguous()
    out, inp = weight.shape
    padded_in = (inp + 3) // 4 * 4 if quads else inp
    packed = (empty or _torch_empty)(((out + block - 1) // block * block * padded_in,), weight.dtype)
    lib, threads = _library(), torch.get_num_threads()
    if weight.dtype == torch.float32:
        lib.specula_pack_f32(weight.data_ptr(), packed.data_ptr(), inp, out, threads)
    else:
        lib.specula_pack_i8(weight.data_ptr(), packed.data_ptr(), inp, out, int(quads), threads)
    return packed


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`models.quantize.quantize_rows` (the same bits) in one C pass over each row: weight [out, in]
    float32 -> ([out, in] int8, [out] float32 scales)."""
    q, scale = _quantize(weight, weight.shape[1], 127.0)
    return q, scale.view(-1)


def quantize_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`models.quantize.quantize_groups` (the same bits) in one C pass over each row: weight [R, C]
    float -> ([R, C'] int8 in -7..7, [R, C' / group] float32 scales), C' = C rounded up to `group`."""
    return _quantize(weight, group, 7.0)


def _quantize(weight: torch.Tensor, group: int, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 in groups of `group` inputs, values in +-`limit` (`pack.c`): weight [R, C] ->
    ([R, C'] int8, [R, C' / group] float32 scales), C' = C rounded up to `group` (zero columns)."""
    from specula.models.quantize import _TINY

    weight = weight.detach().float().contiguous()
    if not torch.isfinite(weight).all():  # NaN reached an int8 cast in C (undefined: gcc gave 0)
        raise ConfigError("the model's weights hold NaN or infinite values, which cannot be quantized: the model "
                          "file is damaged or was saved in a dtype too narrow for it; re-convert or re-download it")
    rows, cols = weight.shape
    padded = -(-cols // group) * group
    q = torch.empty((rows, padded), dtype=torch.int8)
    scale = torch.empty((rows, padded // group), dtype=torch.float32)
    _library().specula_quantize_weight_groups(weight.data_ptr(), q.data_ptr(), scale.data_ptr(), rows, cols, group,
                                              limit, _TINY, torch.get_num_threads())
    return q, scale


I4_GROUP = 64
"""i4: inputs per scale group (`layout.h`)."""


def pack_i4(weight: torch.Tensor, block: int, empty: Empty | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] float -> the i4 kernels' operands (`linear_i4.c`): (nibbles [blocks x in64 x
    block / 2] uint8, flat; group scales [blocks, in64 / 64, block] float32), in64 = `in` rounded up to
    64; padding columns have zero weights and scale 1. The nibbles are made by `empty`."""
    q, scale = quantize_groups(weight, I4_GROUP)  # [out, in64] int8, [out, groups]
    out, in64 = q.shape
    blocks = (out + block - 1) // block
    packed = (empty or _torch_empty)((blocks * in64 * block // 2,), torch.uint8)
    _library().specula_pack_i4(q.contiguous().data_ptr(), packed.data_ptr(), in64, out, torch.get_num_threads())
    scales = torch.ones((blocks * block, scale.shape[1]), dtype=torch.float32)
    scales[:out] = scale
    return packed, scales.view(blocks, block, -1).transpose(1, 2).contiguous()


def codes_group_bytes(group: int, block: int) -> int:
    """c8: bytes of one column block's group of `group` inputs (`layout.h`'s `C8_GROUP_BYTES`): a[block] and
    b[block] float32, then q[group][block] int8."""
    return 8 * block + group * block


def pack_codes(q: torch.Tensor, a: torch.Tensor, b: torch.Tensor, group: int, block: int,
               empty: Empty | None = None) -> torch.Tensor:
    """c8 codes (`native.codes.Codes`: q [out, in] int8, a and b [out, in / group] float32, w = (a * q) + b)
    -> the c8 kernels' layout (`pack.c`'s `specula_pack_codes`), uint8, flat: per column block of `block`
    outputs and group of `group` inputs, a[block], b[block] (float32) and q[group][block]. Made by `empty`."""
    out, inp = q.shape
    if inp % group or a.shape != (out, inp // group) or b.shape != a.shape:
        raise ValueError(f"c8 codes of a [{out}, {inp}] weight need a and b of [{out}, {inp // group}] (group {group})")
    blocks = (out + block - 1) // block
    packed = (empty or _torch_empty)((blocks * (inp // group) * codes_group_bytes(group, block),), torch.uint8)
    _library().specula_pack_codes(q.contiguous().data_ptr(), a.contiguous().data_ptr(), b.contiguous().data_ptr(),
                                  packed.data_ptr(), inp, out, group, torch.get_num_threads())
    return packed


def codes_group(packed_bytes: int, in_features: int, out_features: int, block: int) -> int:
    """The group size of a c8 layer from its packed size (`pack_codes`: `codes_group_bytes` / group = 8 block /
    group + block bytes per column block and input)."""
    per = packed_bytes // (-(-out_features // block) * in_features)
    return 8 * block // (per - block)
