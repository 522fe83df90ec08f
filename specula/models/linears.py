"""Finding and replacing a model's linear layers (shared by the int8 and oneDNN swaps)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from specula.models.file_pages import MappedPages


def is_conv1d(module: nn.Module) -> bool:
    """transformers' GPT-2 style `Conv1D`: a linear layer with its weight stored `[in, out]`."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


def linear_weight(layer: nn.Module) -> torch.Tensor:
    """The weight of an `nn.Linear` or `Conv1D` as `[out, in]` (detached; a view, not a copy)."""
    weight = layer.weight.detach()
    return weight.t() if is_conv1d(layer) else weight  # [out, in]


def head_rows(head: nn.Module, ids: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """[k] long -> [k, in] rows of an output head, the rows it computes logits with: a packed kernel's
    own (`weight_rows`, as the kernel gives them), a plain weight's, else read back through the head
    (head(I) = W^T: a pass over every row, in `dtype` on `device`)."""
    if hasattr(head, "weight_rows"):
        return head.weight_rows(ids.to(torch.long))
    if head.weight.device.type != "meta":
        return linear_weight(head)[ids.to(head.weight.device)]
    with torch.inference_mode():
        eye = torch.eye(int(head.in_features), dtype=dtype, device=device)  # [E, E]
        return head(eye).t()[ids.to(device)]  # [k, E]


def replace_linears(model: nn.Module, make: Callable[[nn.Module], nn.Module], *, skip: Iterable[str] = ()) -> nn.Module:
    """Replace every `nn.Linear` and transformers `Conv1D` of `model` (but those whose qualified name is
    in `skip`) by `make(layer)`, in place; returns `model`."""
    skipped = set(skip)
    # names, not modules: a replaced layer is freed as soon as it is replaced, so a model swapped to
    # packed copies never holds every old weight and every new one at once (the 1.5B's first load
    # peaked at 9.4 GiB of anonymous memory when this list held the modules)
    names = [name for name, mod in model.named_modules()
             if (isinstance(mod, nn.Linear) or is_conv1d(mod)) and name not in skipped]
    mapped = MappedPages()  # a weight read from a mapped checkpoint: its pages are let go once packed
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        setattr(parent, child, make(old))
        mapped.release(linear_weight(old))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes a model's weights occupy as loaded: packed kernels report their own (`memory_bytes`),
    other modules their parameters and buffers (meta placeholders and shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        own = getattr(type(module), "memory_bytes", None)
        if isinstance(own, property):
            total += int(module.memory_bytes)
            continue
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor is None or tensor.device.type == "meta" or tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def quantization_of(model: torch.nn.Module) -> str:
    """"int8" when the model's linears are int8 (`RowInt8Linear`, or specula's i8 kernels), "int4" for
    specula's i4 kernels, "w8" for weight-only int8 kernels, else "none"."""
    from specula.models.native.kernels import KernelLinear
    from specula.models.quantize import RowInt8Linear

    for m in model.modules():
        if isinstance(m, RowInt8Linear) or (isinstance(m, KernelLinear) and m.kind == "i8"):
            return "int8"
        if isinstance(m, KernelLinear) and m.kind == "w8":
            return "w8"
        if isinstance(m, KernelLinear) and m.kind == "i4":
            return "int4"
    return "none"
