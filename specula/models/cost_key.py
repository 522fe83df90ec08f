"""The one schema of a backend's `cost_key()`: what the latency of its forward passes depends on.

The planner caches cost curves (`planner/cost.py`, `planner/batch_cost.py`) under a hash of this
key, so both backends build it here: a field added to one backend only would split the caches of
the models it runs, and a field added here reaches every backend. `cost_key()` returns
`CostKey.as_dict()`: the same keys as before the schema existed, so curves cached then still apply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from specula.models.device import cpu_model
from specula.models.linears import quantization_of
from specula.models.prepack import linear_kernel_of

BackendName = Literal["hf", "native"]


@dataclass(frozen=True)
class CostKey:
    """What a forward pass's latency depends on (one backend, as loaded, on this machine)."""

    model: str
    """The model's id (its path or hub name; the backend's short name when it has none)."""
    arch: str
    """Its architecture (the transformers class, or the native config's architecture)."""
    layers: int | None
    """Decoder layers (None where the config does not say)."""
    hidden: int | None
    """Hidden size (None where the config does not say)."""
    backend: BackendName
    """Which backend runs it."""
    dtype: str
    """Activation dtype, as `str(torch.dtype)`."""
    device: str
    """Where it runs, as `str(torch.device)`."""
    threads: int
    """torch's intra-op threads when the key was taken."""
    torch: str
    """torch's version."""
    quantize: str
    """The linears' quantization (`linears.quantization_of`: "none", "int8", "int4", "w8")."""
    attention: str | None
    """The attention implementation."""
    linear_kernel: str
    """The linears' kernel (`prepack.linear_kernel_of`: "aten", "onednn", "specula-<kind>-<isa>-<build>")."""
    shape: tuple[int | None, int | None, int | None] | None = None
    """(vocabulary, MLP width, KV heads): with `layers` and `hidden` the shape of the passes, so
    another model saved at the same path reads its own curve (None: left out of the key)."""
    cpu: str | None = None
    """The CPU's name where the passes run on it (a cache copied to, or shared with, another machine
    is timed afresh there: the curve's shape follows the CPU's vector units); None on a GPU."""
    cuda_graphs: bool | None = None
    """Whether passes replay captured CUDA graphs; None (left out of the key) where the backend
    has no graph path."""
    gpu: str | None = None
    """The GPU's name on CUDA; None (left out of the key) elsewhere."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("shape", "cpu", "cuda_graphs", "gpu")
    """Fields left out of `as_dict` when None (keys taken before they existed stay the same)."""

    def as_dict(self) -> dict[str, Any]:
        """The key as `TargetModel.cost_key()` returns it."""
        key = dataclasses.asdict(self)
        for name in self.OPTIONAL:
            if key[name] is None:
                del key[name]
        return key


def cost_key_of(weights: nn.Module, *, model: str, arch: str, layers: int | None, hidden: int | None,
                backend: BackendName, dtype: torch.dtype, device: torch.device, attention: str | None,
                shape: tuple[int | None, int | None, int | None] | None = None,
                cuda_graphs: bool | None = None) -> dict[str, Any]:
    """A backend's `cost_key()`: what it says about itself, plus what the schema reads the same way
    for every backend (the kernels and quantization of the module holding the `weights`, torch's
    threads and version, the GPU's name)."""
    return CostKey(
        model=model, arch=arch, layers=layers, hidden=hidden, shape=shape, backend=backend, dtype=str(dtype),
        device=str(device),
        threads=torch.get_num_threads(), torch=torch.__version__, quantize=quantization_of(weights),
        attention=attention, linear_kernel=linear_kernel_of(weights), cuda_graphs=cuda_graphs,
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        cpu=cpu_model() if device.type == "cpu" else None,
    ).as_dict()
