"""A GGUF model's float32 weights as exact 8-bit codes, for the `c8` kernel kind (`kernels/linear_codes.c`).

Why: a decoding step on the CPU streams every weight of the model from memory, and a float32 weight is 4
bytes; the embedded models' float32 weights are their GGUF blocks dequantised (`models install`), so each
is w = (a * q) + b with q a small integer and a, b float32 values shared by 16 or 32 inputs of one row.
Held as those codes, a weight is 1.25-1.5 bytes, and the `c8` kernels rebuild it bit for bit before the
same multiply-adds as `f32`: every output is f32's exactly, decoding reads a quarter of the bytes.

The checkpoint's weights went through transformers' loader (names mapped, Llama's query and key rows
permuted, the native decoder's fusions and rotary reorder after that), so codes are matched to a weight by
content, row by row: each GGUF matrix of a known block type is dequantised once and its rows hashed; a
weight's rows are looked up by their hashes, their codes gathered, and the weight rebuilt from them and
compared bit for bit. A weight any of whose rows is not found, or whose rebuild differs anywhere, gets no
codes (it stays `f32`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

SPAN = 16
"""Values per (a, b) pair in `Codes` (Q6_K's scales; the other types' 32-value runs are two spans)."""


class Codes(NamedTuple):
    """A weight [out, in] as codes: w = (a * q) + b per value, two float32 roundings."""

    q: torch.Tensor
    """[out, in] int8."""
    a: torch.Tensor
    """[out, in / SPAN] float32."""
    b: torch.Tensor
    """[out, in / SPAN] float32."""

    def rebuild(self) -> torch.Tensor:
        """The float32 weight [out, in] the codes stand for (torch's product and sum: two roundings)."""
        a = self.a.repeat_interleave(SPAN, dim=1)
        b = self.b.repeat_interleave(SPAN, dim=1)
        return (a * self.q.float()) + b

    def group(self) -> int:
        """Inputs per (a, b) pair the kernels can take: 32 where every pair of spans shares them, else 16."""
        def pairs_alike(t: torch.Tensor) -> bool:
            return torch.equal(t[:, 0::2].view(torch.int32), t[:, 1::2].view(torch.int32))

        return 2 * SPAN if self.a.shape[1] % 2 == 0 and pairs_alike(self.a) and pairs_alike(self.b) else SPAN

    def grouped(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(a, b, group) as `specula_pack_codes` takes them: one pair per `group()` inputs."""
        g = self.group()
        step = g // SPAN
        return self.a[:, ::step].contiguous(), self.b[:, ::step].contiguous(), g


OUTSIDE = frozenset({"token_embd.weight", "output.weight"})
"""GGUF matrices never looked at: the embedding and the output layer (which `OutputScreen` reads as it is)."""


def _row_hashes(rows: torch.Tensor, salt: torch.Tensor, chunk: int = 1 << 22) -> list[int]:
    """rows [n, k] float32 -> n int64 hashes of their bits (a sum of bits times odd salts, wrapping), in
    chunks of about `chunk` values (the int64 products of a whole matrix would be 8 bytes a weight)."""
    n, k = rows.shape
    step = max(1, chunk // max(1, k))
    bits = rows.view(torch.int32)
    return [h for r in range(0, n, step) for h in (bits[r: r + step].to(torch.int64) * salt[:k]).sum(dim=1).tolist()]


class GgufCodes:
    """Codes for the weights of one GGUF file (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        from specula.models.native.kernels import library

        self.path = Path(path)
        self._lib = library()
        self._reader = gguf.GGUFReader(str(self.path))
        self._salt = torch.randint(1, 2 ** 62, (1 << 16,), generator=torch.Generator().manual_seed(0)) * 2 + 1
        self._tensors: list[Any] = []
        self._where: dict[int, tuple[int, int]] = {}  # row hash -> (tensor, row)
        self._codes: dict[int, Codes] = {}
        for t in self._reader.tensors:
            kind = int(t.tensor_type)
            if len(t.shape) != 2 or self._lib.specula_gguf_block_bytes(kind) <= 0 or t.name in OUTSIDE:
                continue
            inp = int(t.shape[0])  # GGUF shapes list the inputs first
            if inp % SPAN or inp > len(self._salt):
                continue
            index = len(self._tensors)
            self._tensors.append(t)
            for row, h in enumerate(_row_hashes(self._dequantized(t), self._salt)):
                self._where.setdefault(h, (index, row))

    def _blocks(self, t: Any) -> tuple[np.ndarray, int, int]:
        kind = int(t.tensor_type)
        data = np.ascontiguousarray(t.data).reshape(-1)
        values = self._lib.specula_gguf_block_values(kind)
        return data, int(t.n_elements) // values, kind

    def _dequantized(self, t: Any) -> torch.Tensor:
        data, blocks, kind = self._blocks(t)
        out = torch.empty((int(t.shape[1]), int(t.shape[0])), dtype=torch.float32)
        if self._lib.specula_gguf_dequantize(data.ctypes.data, out.data_ptr(), blocks, kind, torch.get_num_threads()):
            raise ValueError(f"{self.path.name}: tensor {t.name} has a block type the kernels do not know")
        return out

    def _tensor_codes(self, index: int) -> Codes:
        if index not in self._codes:
            t = self._tensors[index]
            data, blocks, kind = self._blocks(t)
            out, inp = int(t.shape[1]), int(t.shape[0])
            q = torch.empty((out, inp), dtype=torch.int8)
            a = torch.empty((out, inp // SPAN), dtype=torch.float32)
            b = torch.empty((out, inp // SPAN), dtype=torch.float32)
            self._lib.specula_gguf_codes(data.ctypes.data, q.data_ptr(), a.data_ptr(), b.data_ptr(), blocks, kind,
                                         torch.get_num_threads())
            self._codes[index] = Codes(q, a, b)
        return self._codes[index]

    def lookup(self, weight: torch.Tensor) -> Codes | None:
        """The codes of weight [out, in] (float32), or None where some row has none or the rebuild is not
        the weight bit for bit."""
        weight = weight.detach()
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % SPAN \
                or weight.shape[1] > len(self._salt):
            return None
        weight = weight.contiguous()
        found = [self._where.get(h) for h in _row_hashes(weight, self._salt)]
        if any(f is None for f in found):
            return None
        parts = []
        for index in dict.fromkeys(i for i, _ in found):
            codes = self._tensor_codes(index)
            if codes.q.shape[1] != weight.shape[1]:
                return None
            parts.append((index, codes))
        q = torch.empty(weight.shape, dtype=torch.int8)
        a = torch.empty((weight.shape[0], weight.shape[1] // SPAN), dtype=torch.float32)
        b = torch.empty_like(a)
        for index, codes in parts:
            mine = torch.tensor([r for r, (i, _) in enumerate(found) if i == index])
            rows = torch.tensor([row for i, row in found if i == index])
            q[mine], a[mine], b[mine] = codes.q[rows], codes.a[rows], codes.b[rows]
        result = Codes(q, a, b)
        if not torch.equal(result.rebuild().view(torch.int32), weight.view(torch.int32)):
            return None
        return result

    def release(self) -> None:
        """Drop the decoded codes and the file's map (once every weight is packed)."""
        self._codes.clear()
        self._where.clear()
        self._tensors.clear()
        self._reader = None


CODES_ENV = "SPECULA_WEIGHT_CODES"
"""`0` (false, off, no) turns c8 layers off (every float32 weight packed as f32: the same outputs, 4 bytes a
weight); on by default (`models.device.env_switch`)."""


def codes_source(resolved: Any) -> Path | None:
    """The GGUF whose blocks a model's float32 weights are, for c8 layers: a GGUF file given as the model, or
    an embedded model's verified GGUF (`models install`); None for any other model, or with
    `SPECULA_WEIGHT_CODES=0`. An embedded model's GGUF whose stamp no longer matches (a cache moved or copied
    elsewhere) is hashed again once here: read without the hash, its layers had silently run as float32 weights,
    the 1.5B's plain decoding twice as slow. Where no verified GGUF is found the load says so (one line)."""
    from specula.models.device import env_switch

    if not env_switch(CODES_ENV):
        return None
    if getattr(resolved, "gguf_file", None) is not None:
        return Path(resolved.gguf_file)
    embedded = getattr(resolved, "embedded", None)
    if embedded is None:
        return None
    from specula.models.install import verified_gguf

    found = verified_gguf(embedded, rehash=True, progress=True)
    if found is None:
        print(f"note: no verified GGUF of {embedded.alias} here: its layers run as float32 weights, not as their "
              f"codes (plain decoding up to twice as slow); `specula models install {embedded.alias}` brings it back",
              file=sys.stderr)
    return found
