"""specula's own CPU kernels (`linear.c`, `ops.c`, `draft.c`, `layers.c`), compiled on first use and loaded with ctypes.

Why: on the 2-core development CPU a decoding step streams the weights once, and what decides
its time is how close the linear layers get to memory bandwidth for 1-16 rows. `F.linear`
(MKL) and prepacked oneDNN reach half of it at best there, and neither is row invariant; these
kernels stream column-blocked weights at close to bandwidth, and each output row is bitwise
independent of the other rows in the call (see `linear.c`), so tree verification computes for
every node exactly what a one-token step computes.

`f32` keeps float32 weights (the model unchanged); `w8` is weight-only int8 with one scale per
output channel (activations stay float32); `i8` int8 weights and activations (`--quantize int8`
on the native backend, int8 drafts); `i4` 4-bit weights with a scale per 64 inputs and int8
activations (`--draft-quantize int4`: a draft at a little over half of i8's weight bytes).

The shared library is built with the system C compiler (`cc`, AVX2 + FMA + OpenMP) into
`$SPECULA_CACHE/kernels/<hash>/`, atomically, once per source version and CPU; a machine without
a compiler or AVX2 gets a clear `ConfigError` when these kernels are asked for (and `auto`
falls back to oneDNN).

Threads: a kernel call splits its work (column blocks, attention rows) over `torch.get_num_threads()`
threads through `pool.c`, where the calling thread works too and waits only for work a helper has
started: a core held by another process slows a step to one thread's speed instead of stalling
every call on an OpenMP barrier (a SmolLM2 step beside a CPU-bound process: 36 ms, against 48 ms
to 1.2 s with OpenMP; 30 ms on one thread).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

from specula.errors import ConfigError
from specula.models.linears import linear_weight
from specula.models.native.kernels.packing import (  # noqa: F401
    I4_GROUP, Empty, codes_group, codes_group_bytes, pack, pack_codes, pack_i4, pack_weight, quantize_groups,
    quantize_rows)

SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "linear_avx512.c", "linear_i4_vnni.c", "linear.c", "linear_amx.c", "ops.c", "linear_i4.c", "head.c", "draft.c",
    "pool.c", "pack.c", "layers.c", "gguf.c", "screen.c", "linear_codes.c", "attention_avx512.c"))
"""The kernels' C sources, the slowest to compile first (`build.compile_shared` starts them in this
order; gcc 12 -O3 on session 94's 2-core EPYC: 50, 24, 7, 2, 1.6, 1.3 s, the rest under 1 s)."""
AVX512_ONLY = frozenset(Path(__file__).with_name(name) for name in ("linear_avx512.c", "linear_i4_vnni.c",
                                                                     "linear_amx.c", "attention_avx512.c"))
"""Sources whose code runs only on a CPU with AVX-512 F/BW/VNNI (`specula_set_isa` picks them at run
time): a CPU without it compiles them at -O0 (`compile_plan`), 2.4 s in all instead of 76."""
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni"})
"""/proc/cpuinfo flags the AVX-512 variants need (`linear_avx512.c`'s `cpu_has_avx512`)."""
HEADERS = tuple(Path(__file__).with_name(name) for name in ("layout.h", "linear.h", "pool.h", "refs.h", "vmath.h"))
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
"""`-ffp-contract=off`: the compiler fuses no multiply-add of its own, so the AVX2 and AVX-512
variants (whose loops it vectorises differently) round every scaling and bias step alike."""
ISA_ENV = "SPECULA_KERNEL_ISA"
"""`auto` (default: AMX where the CPU has AMX-INT8 and the OS grants it, else AVX-512 where the CPU
has F/BW/VNNI, else AVX2), `avx2`, `avx512` (no AMX), or `amx` (an error where either is missing):
which variant of the kernels runs. AMX runs only int8-activation (i8, i4) calls of many rows
(`linear_amx.c`); every variant computes the same bits."""
ISAS = ("avx2", "avx512", "amx")
KINDS = ("f32", "w8", "i8", "i4")
"""The kinds a `KernelLinear` packs from a weight alone."""
CODED = "c8"
"""The kind packed from a weight's exact codes (`native.codes`): f32's outputs from a quarter of its bytes."""


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    return frozenset(_cpu_flags())


def cpu_has_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX512-BF16: oneDNN's `vdpbf16ps` passes, about
    twice float32's speed); without it torch emulates bfloat16, slower than float32."""
    return "avx512_bf16" in cpu_flags()


def unavailable_reason() -> str | None:
    """Why these kernels cannot run here (None when they can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"they need an x86-64 CPU (this is {platform.machine()})"
    if not sys.platform.startswith("linux"):
        return f"their thread pool needs Linux (this is {sys.platform})"
    if not {"avx2", "fma"} <= _cpu_flags():
        return "they need a CPU with AVX2 and FMA"
    cc = c_compiler()
    if not cc or shutil.which(cc[0]) is None:
        named = f"$CC={os.environ['CC']!r}" if os.environ.get("CC") else "cc"
        return f"they are compiled on first use and no C compiler ({named}) was found; install gcc"
    return None


def c_compiler() -> list[str]:
    """The C compiler's command line: `$CC` (a command with arguments, as make reads it) or cc."""
    return shlex.split(os.environ.get("CC") or "cc")


def available() -> bool:
    return unavailable_reason() is None


_BUILD_FAILURE: ConfigError | None = None
"""The error of this process's failed build, raised again instead of building again."""


def usable() -> bool:
    """Whether the kernels run here: `available`, and built (or built now) without error; a build
    that fails says so once, on standard error, and `auto` choices then take torch's paths. Other
    errors (a bad `SPECULA_KERNEL_ISA`) still raise."""
    if not available():
        return False
    try:
        library()
    except ConfigError as exc:
        if exc is not _BUILD_FAILURE:
            raise
        return False
    return True


def openmp_spin_warning(threads: int | None = None) -> str | None:
    """Why this process's kernel calls may run slow, or None: torch was imported before specula
    with neither `GOMP_SPINCOUNT` nor `OMP_WAIT_POLICY` set (`specula.OPENMP_SPIN_UNSET`), so
    torch's OpenMP workers spin libgomp's default ~300,000 rounds after each parallel torch op on
    the core the pool's helper needs (`specula.GOMP_SPINCOUNT`). Measured on the 2-core machine
    (SmolLM2 with its eagle3 head, everyday prompts): a 2-token tree pass right after the head
    drafted took 1.34x a plain step against 1.08x with specula imported first, a 5+ token one
    1.74x against 1.36x. Nothing to say with one thread (`threads`, default torch's)."""
    import specula

    if not specula.OPENMP_SPIN_UNSET or (threads if threads is not None else torch.get_num_threads()) < 2:
        return None
    return ("torch was imported before specula, so torch's OpenMP workers keep their default spin and take the "
            "cores specula's CPU kernels need (tree passes measured 25-30% slower); import specula before torch, "
            "or set GOMP_SPINCOUNT=10000 in the environment before starting Python")


def compile_plan() -> dict[Path, tuple[str, ...]]:
    """Each source's own compiler flags (after `FLAGS`): "-O0" for the AVX-512-only variants where the
    CPU lacks AVX-512 F/BW/VNNI (it never runs them, and they were most of the build); nothing
    otherwise, nor where the CPU's flags cannot be read (the library may then run any variant)."""
    flags = _cpu_flags()
    slow = bool(flags) and not AVX512_FLAGS <= flags
    return {source: ("-O0",) if slow and source in AVX512_ONLY else () for source in SOURCES}


@functools.cache
def build_key() -> str:
    """Hash of the kernels' sources, flags (`compile_plan`'s too), CPU and `$CC` where set: names the
    compiled library (and, in part, the cost curves timed with it: `prepack.linear_kernel_of`). A
    library built by another `$CC` (clang, `-march=native`, a sanitizer whose runtime then aborts
    every process loading it) is never loaded in its place; without `$CC` the key is as before."""
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    plan = " ".join(f"{path.name}:{','.join(extra)}" for path, extra in compile_plan().items() if extra)
    compiler = ("cc=" + shlex.join(c_compiler())).encode() if os.environ.get("CC") else b""
    return hashlib.sha256(source + " ".join(FLAGS).encode() + platform.processor().encode()
                          + plan.encode() + compiler).hexdigest()[:16]


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernels (built on first use, then cached on disk)."""
    from specula.paths import cache_dir

    global _BUILD_FAILURE
    reason = unavailable_reason()
    if reason is not None:
        raise ConfigError(f'specula\'s CPU kernels cannot run here: {reason}; use linear_kernel="onednn" or '
                          'linear_kernel="aten"')
    choice = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", *ISAS):  # before a build of a minute
        raise ConfigError(f"{ISA_ENV}={choice!r} is not a kernel ISA; use auto, avx2, avx512 or amx")
    if _BUILD_FAILURE is not None:
        raise _BUILD_FAILURE
    target = cache_dir("kernels", build_key()) / "libspecula_kernels.so"
    if not target.exists():
        try:
            _build(target)
        except ConfigError as exc:
            _BUILD_FAILURE = exc
            print(f"warning: {exc}", file=sys.stderr)
            raise
    lib = ctypes.CDLL(str(target))
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.specula_pack_f32.argtypes = [ptr, ptr, i32, i32, i32]
    lib.specula_pack_i8.argtypes = [ptr, ptr, i32, i32, i32, i32]
    lib.specula_pack_i4.argtypes = [ptr, ptr, i32, i32, i32]
    lib.specula_quantize_weight_groups.argtypes = [ptr, ptr, ptr, i32, i32, i32, ctypes.c_float, ctypes.c_float,
                                                   i32]
    lib.specula_gguf_dequantize.argtypes = [ptr, ptr, ctypes.c_int64, i32, i32]
    lib.specula_gguf_dequantize.restype = i32
    lib.specula_gguf_codes.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int64, i32, i32]
    lib.specula_gguf_codes.restype = i32
    lib.specula_gguf_block_bytes.argtypes = [i32]
    lib.specula_gguf_block_bytes.restype = i32
    lib.specula_gguf_block_values.argtypes = [i32]
    lib.specula_gguf_block_values.restype = i32
    lib.specula_linear_f32.argtypes = [ptr, ptr, ptr, ptr, i32, i32, i32, i32]
    lib.specula_linear_w8.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32]
    lib.specula_linear_i8.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32]
    lib.specula_linear_i4.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32]
    lib.specula_linear_c8.argtypes = [ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32]
    lib.specula_linear_c8.restype = i32
    lib.specula_pack_codes.argtypes = [ptr, ptr, ptr, ptr, i32, i32, i32, i32]
    for kind in KINDS:
        getattr(lib, f"specula_linear_{kind}").restype = i32
    lib.specula_block.restype = i32
    f32 = ctypes.c_float
    lib.specula_add_rms_norm.argtypes = [ptr, ptr, ptr, f32, ptr, i32, i32, i32]
    lib.specula_rope_write.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, i32]
    lib.specula_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, i32, f32, i32]
    lib.specula_silu_mul.argtypes = [ptr, ptr, i32, i32, i32]
    lib.specula_topk_probs.argtypes = [ptr, i32, i32, i32, ptr, ptr]
    lib.specula_topk_ids.argtypes = [ptr, i32, i32, i32, ptr, ptr]
    lib.specula_topk_ids_i32.argtypes = [ptr, i32, i32, ptr]
    lib.specula_topk_ids_i32.restype = i32
    lib.specula_screen_pack.argtypes = [ptr, ptr, ptr, ptr, i32, i32, f32, i32, i32]
    lib.specula_screen_rows.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i32, ctypes.c_double]
    lib.specula_screen_rows.restype = i32
    lib.specula_screen_add_halves.argtypes = [ptr, i32, i32, i32]
    lib.specula_screen_decide.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, ptr, ptr, i32, ptr, i32]
    lib.specula_screen_decide.restype = i32
    lib.specula_screen_exact.argtypes = [ptr, ptr, ptr, ptr, i32, i32, i32, ptr]
    lib.specula_screen_top.argtypes = [ptr, ptr, ptr, f32, f32, ptr, i32, i32, ctypes.c_double, ptr, i32, ptr, ptr,
                                       ptr, ptr]
    lib.specula_screen_top.restype = i32
    lib.specula_quantize_rows.argtypes = [ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32]
    lib.specula_decoder_pass.argtypes = [ptr, ptr, i32, i32, i32, ptr, ptr, f32, ptr, ptr, ptr, i32, i32, i32, i32,
                                         i32, f32, ptr, ctypes.c_long, ptr, i32, ptr, ptr, i32]
    lib.specula_decoder_pass.restype = i32
    lib.specula_head_pass_seqs.argtypes = [ptr] * 9 + [i32] + [ptr] * 5 + [i32, i32]
    lib.specula_head_pass_seqs.restype = i32
    lib.specula_pool_workers.restype = i32
    lib.specula_set_isa.argtypes = [i32]
    lib.specula_set_several_block_items.argtypes = [i32]
    lib.specula_set_several_block_items.restype = i32
    lib.specula_set_isa.restype = i32
    lib.specula_isa.restype = i32
    level = lib.specula_set_isa(2 if choice == "auto" else ISAS.index(choice))
    if choice != "auto" and level < ISAS.index(choice):
        fallback = "avx512" if choice == "amx" and ISAS[level] == "avx512" else "avx2"
        raise ConfigError(f"{ISA_ENV}={choice} but {_missing(choice)}; use auto or {fallback}")
    return lib


def _build(target: Path) -> None:
    """Compile the library at `target`, one process at a time per library (`paths.file_lock`): a
    process that waited finds it built; object folders a killed build left are swept first."""
    from specula.models.native.kernels.build import build_jobs, compile_shared, remove_stale_builds
    from specula.paths import file_lock

    with file_lock(f"kernels-{target.parent.name}"):
        if target.exists():
            return
        remove_stale_builds(target.parent)
        jobs = min(build_jobs(), len(SOURCES))
        plan = compile_plan()
        print(f"compiling specula's CPU kernels (once, up to a minute; {jobs} sources at a time)...",
              file=sys.stderr, flush=True)
        start = time.perf_counter()
        order = sorted(SOURCES, key=lambda path: bool(plan[path]))  # the unoptimised ones last: they are quick
        compile_shared(order, target, cc=c_compiler(), flags=FLAGS, jobs=jobs, source_flags=plan)
        print(f"compiled specula's CPU kernels in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def _missing(name: str) -> str:
    """Why the variant `name` cannot run here."""
    if name == "avx512" or not AVX512_FLAGS <= _cpu_flags():
        return "this CPU lacks AVX-512 F/BW/VNNI"
    if not {"amx_tile", "amx_int8"} <= _cpu_flags():
        return "this CPU lacks AMX-INT8"
    return "the OS did not grant this process the AMX tile state (Linux 5.16 or later grants it)"


def isa() -> str:
    """Which variant of the kernels runs: "amx" (AVX-512, and int8 calls of many rows on AMX tiles),
    "avx512" (AVX-512 F/BW/VNNI), or "avx2"; the most the CPU has unless `SPECULA_KERNEL_ISA` says."""
    return ISAS[library().specula_isa()]


def set_isa(name: str) -> str:
    """Run the "avx2", "avx512" or "amx" variant from now on (for A/B runs and the tests that prove
    they compute the same bits); a variant the CPU lacks falls back to the next one down. Returns the
    variant in force."""
    if name not in ISAS:
        raise ConfigError(f"unknown kernel ISA {name!r}; choose avx2, avx512 or amx")
    library().specula_set_isa(ISAS.index(name))
    return isa()


def set_several_block_items(on: bool | None) -> bool:
    """Whether the few-row calls of c8, i8 and i4 run items of several column blocks (True) or of one
    (False) from now on; None: as the CPU's vendor says (one on AMD, `linear.h`'s `several_block_items`).
    For A/B runs and the tests that prove the bits do not change. Returns the choice in force."""
    return bool(library().specula_set_several_block_items(-1 if on is None else int(on)))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class KernelLinear(nn.Module):
    """`nn.Linear` on specula's CPU kernels: float32 (`f32`), weight-only int8 (`w8`), int8 weights and
    activations (`i8`), 4-bit weights with int8 activations (`i4`), or float32 held as exact 8-bit codes
    (`c8`: a GGUF model's weights, `native.codes`; every output f32's bit for bit), packed once; float32
    inputs and outputs; each output row bitwise independent of the others."""

    def __init__(self, linear: nn.Module, kind: str = "f32", empty: Empty | None = None, codes=None) -> None:
        """`empty` makes the packed weight (default `torch.empty`; the prepared-model cache's writes
        it into the entry's file); `codes`: the weight's `native.codes.Codes` (kind c8 only)."""
        super().__init__()
        if kind not in (*KINDS, CODED):
            raise ConfigError(f"unknown kernel kind {kind!r}; choose one of: {', '.join((*KINDS, CODED))}")
        if (kind == CODED) != (codes is not None):
            raise ValueError("a c8 KernelLinear is made from its weight's codes, and only it takes codes")
        weight = linear_weight(linear).float().contiguous()  # [out, in]
        if weight.device.type != "cpu":
            raise ConfigError('specula\'s CPU kernels run on CPU; use device="cpu" or another linear_kernel')
        self.kind = kind
        self.out_features, self.in_features = weight.shape
        if codes is not None:
            if tuple(codes.q.shape) != tuple(weight.shape):
                raise ValueError(f"codes of {tuple(codes.q.shape)} for a weight of {tuple(weight.shape)}")
            a, b, group = codes.grouped()
            packed, scale = pack_codes(codes.q, a, b, group, library().specula_block(), empty), None
        else:
            packed, scale = pack_weight(weight, kind, empty)
        self.register_buffer("scale", scale)
        self.register_buffer("packed", packed)
        bias = getattr(linear, "bias", None)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        # Shape only (no storage): callers read `lm_head.weight.shape` for the logit width.
        self.weight = torch.empty(self.out_features, self.in_features, device="meta")

    @classmethod
    def from_packed(cls, kind: str, in_features: int, out_features: int, packed: torch.Tensor,
                    scale: torch.Tensor | None, bias: torch.Tensor | None = None) -> KernelLinear:
        """A layer around already packed buffers (what the constructor would make; nothing packed):
        a prepared entry's memory-mapped weights, or rows cut out of another layer (`take_rows`)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.kind = kind
        layer.out_features, layer.in_features = out_features, in_features
        layer.register_buffer("scale", scale)
        layer.register_buffer("packed", packed)
        layer.register_buffer("bias", bias)
        layer.weight = torch.empty(out_features, in_features, device="meta")
        return layer

    def take_rows(self, ids: torch.Tensor) -> KernelLinear:
        """A layer of output rows `ids` [k] alone (a draft vocabulary's head), cut out of the packed
        layout: the packed values and scales are those that packing these rows alone makes (every
        kind quantizes each row by itself), so each kept output is this layer's bit for bit, with no
        row unpacked or quantized again."""
        ids = ids.to(torch.long).cpu()
        if self.kind == "c8":  # the output layer, the only one cut so, is never c8 (`native.codes.OUTSIDE`)
            raise ValueError("take_rows: a c8 layer's rows are not cut out of its codes")
        block = library().specula_block()
        kept = blocks_of(self._packed_rows(ids), block, 0x88 if self.kind == "i4" else 0)  # [k', steps, lanes]
        packed = kept.view(-1, block, *kept.shape[1:]).transpose(1, 2).contiguous().view(-1)  # [k'/block][steps][block][lanes]
        scale = self.scale
        if self.kind == "i4":  # [blocks, groups, block] -> [k', groups] -> [k' / block, groups, block]
            rows = blocks_of(scale[ids // block, :, ids % block], block, 1.0)
            scale = rows.view(-1, block, rows.shape[1]).transpose(1, 2).contiguous()
        elif scale is not None:  # [out]: one per row, unpadded
            scale = scale[ids].contiguous()
        bias = None if self.bias is None else self.bias[ids].contiguous()
        return KernelLinear.from_packed(self.kind, self.in_features, len(ids), packed, scale, bias)

    @property
    def group(self) -> int:
        """c8: inputs per code group (from the packed size, `packing.codes_group`)."""
        return codes_group(self.packed.numel(), self.in_features, self.out_features, library().specula_block())

    def _c8_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """c8: weight rows `ids` [k] rebuilt from their codes: [k, in] float32, bit for bit the weights."""
        block, group = library().specula_block(), self.group
        pair_bytes = codes_group_bytes(0, block)  # a[block], b[block] before each group's codes
        groups = self.in_features // group
        grid = self.packed.view(-1, groups, codes_group_bytes(group, block))  # [blocks, groups, bytes]
        sel = grid[ids // block]  # [k, groups, bytes]
        pairs = sel[:, :, :pair_bytes].contiguous().view(torch.float32).view(len(ids), -1, 2, block)
        col = (ids % block)[:, None]
        a = pairs[:, :, 0, :].gather(2, col[:, :, None].expand(-1, pairs.shape[1], 1))[..., 0]  # [k, groups]
        b = pairs[:, :, 1, :].gather(2, col[:, :, None].expand(-1, pairs.shape[1], 1))[..., 0]
        q = sel[:, :, pair_bytes:].contiguous().view(torch.int8).view(len(ids), -1, group, block)
        q = q.gather(3, col[:, :, None, None].expand(-1, q.shape[1], group, 1))[..., 0]  # [k, groups, group]
        return ((a[:, :, None] * q.float()) + b[:, :, None]).reshape(len(ids), -1)

    def _packed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The packed values of output rows `ids` [k] (long, CPU): [k, steps, lanes], out of the layout
        [blocks][steps][block][lanes] (f32 / w8: an input per step, one lane; i8: an input quad per
        step, 4 lanes; i4: 8 inputs per step, 4 bytes of two nibbles)."""
        block = library().specula_block()
        lanes = 1 if self.kind in ("f32", "w8") else 4
        if self.kind == "i4":
            steps = -(-self.in_features // I4_GROUP) * I4_GROUP // 8
        else:
            steps = (-(-self.in_features // 4) * 4 if self.kind == "i8" else self.in_features) // lanes
        return self.packed.view(-1, steps, block, lanes)[ids // block, :, ids % block, :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in]
        rows = x.reshape(-1, self.in_features).float().contiguous()  # [n, in]
        out = self.into(rows, torch.empty((rows.shape[0], self.out_features), dtype=torch.float32))  # [n, out]
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def into(self, rows: torch.Tensor, out: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """out [n, out] = this layer of rows [n, in], both float32 and contiguous (unchecked: the
        drafting loop's preallocated buffers), on `threads` threads (None: torch's); returns out."""
        n = rows.shape[0]
        lib, threads = library(), threads or torch.get_num_threads()
        if self.kind == "f32":
            status = lib.specula_linear_f32(rows.data_ptr(), self.packed.data_ptr(), _ptr(self.bias), out.data_ptr(),
                                            n, self.in_features, self.out_features, threads)
        elif self.kind == "c8":
            status = lib.specula_linear_c8(rows.data_ptr(), self.packed.data_ptr(), _ptr(self.bias), out.data_ptr(),
                                           n, self.in_features, self.out_features, self.group, threads)
        else:
            fn = getattr(lib, f"specula_linear_{self.kind}")
            status = fn(rows.data_ptr(), self.packed.data_ptr(), self.scale.data_ptr(), _ptr(self.bias), out.data_ptr(),
                        n, self.in_features, self.out_features, threads)
        if status != 0:
            raise MemoryError(f"specula's {self.kind} kernel could not allocate its packed or quantized rows "
                              f"({n} x {self.in_features})")
        return out

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[k] long -> [k, in] float32: the weight rows (output features) `ids` as the kernel holds them
        (int8 kinds: dequantized), read out of the packed layout without unpacking the rest (a
        152k-row output head read back whole took 4 s and 1 GB)."""
        ids = ids.to(torch.long).cpu()
        if self.kind == "c8":
            return self._c8_rows(ids)
        grid = self._packed_rows(ids)  # [k, steps, lanes]
        if self.kind == "i4":  # 4 bytes a step: inputs 8s + j (low nibbles) and 8s + 4 + j (high); scales per 64
            block = library().specula_block()
            groups = self.scale.shape[1]
            lo, hi = (grid & 15).to(torch.int8) - 8, (grid >> 4).to(torch.int8) - 8  # [k, steps, 4] each
            rows = torch.cat([lo, hi], dim=2).reshape(len(ids), groups, I4_GROUP).float()  # [k, groups, 64]
            rows = rows * self.scale[ids // block, :, ids % block][:, :, None]
            return rows.reshape(len(ids), -1)[:, : self.in_features]
        rows = grid.reshape(len(ids), -1)[:, : self.in_features].float()  # [k, in]
        return rows if self.scale is None else rows * self.scale[ids][:, None]

    @property
    def memory_bytes(self) -> int:
        scale = self.scale.numel() * 4 if self.kind == "i4" else 0  # i4's group scales: 1/8 of its nibbles
        return self.packed.numel() * self.packed.element_size() + scale

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, specula {self.kind}"


def blocks_of(rows: torch.Tensor, block: int, fill: float) -> torch.Tensor:
    """rows [k, ...] padded with `fill` to a whole number of blocks of `block` rows (what the packing
    writes past the last row: zero weights, i4's nibble 8 and scale 1)."""
    extra = -len(rows) % block
    if not extra:
        return rows
    return torch.cat([rows, rows.new_full((extra, *rows.shape[1:]), fill)])


def _top_k(fn: str, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """draft.c's `fn` (`specula_topk_probs` or `specula_topk_ids`) over logits [n, V] (float32, CPU; 0 < k <= V):
    its float32 [n, k] output and the indices [n, k] long."""
    logits = logits.contiguous()
    n, v = logits.shape
    if not 0 < k <= v or logits.dtype != torch.float32:
        raise ValueError(f"{fn.removeprefix('specula_')}: float32 logits and 0 < k <= {v}, got k={k}, {logits.dtype}")
    values = torch.empty((n, k), dtype=torch.float32)
    idx = torch.empty((n, k), dtype=torch.long)
    getattr(library(), fn)(logits.data_ptr(), n, v, k, idx.data_ptr(), values.data_ptr())
    return values, idx


def top_k_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest logits of [n, V] (float32, CPU; k <= V), best first (ties: the lower
    index first): (probabilities [n, k], the softmax e^(l - logsumexp(row)) of each; indices [n, k]
    long). One single-threaded C pass per row (`draft.c`): the drafting loop's children without a
    torch top-k and logsumexp over [n, V] (on the 2-core machine right after a kernel call, 0.3-0.6
    ms for 8 rows of 8,192)."""
    return _top_k("specula_topk_probs", logits, k)


def top_k_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """LongTensor [n, k]: each row's k largest logits' indices of [n, V] (float32, CPU; 0 < k <= V), best
    first (ties: the lower index first; NaN never picked). One single-threaded C scan per row (`draft.c`)
    that looks at a lane only where a vector beats the k-th best so far: what token recycling learns
    from each verified row (SmolLM2's 49,152 ids, top 8: 88 us a row with torch's top-k on the 2-core
    machine)."""
    return _top_k("specula_topk_ids", logits, k)[1]


def apply_kernels(model: nn.Module, kind: str, *, skip=(), empty: Empty | None = None, codes=None) -> nn.Module:
    """Swap every linear layer of `model` for a `KernelLinear` of `kind` (in place), each packed
    weight made by `empty` (default `torch.empty`). `codes` (f32 only: a `native.codes.GgufCodes`): each
    weight it has exact codes for is a c8 layer instead (bit for bit the same outputs)."""
    from specula.models.linears import replace_linears

    def make(lin: nn.Module) -> KernelLinear:
        found = codes.lookup(linear_weight(lin).float()) if codes is not None and kind == "f32" else None
        return KernelLinear(lin, "c8", empty, codes=found) if found is not None else KernelLinear(lin, kind, empty)

    return replace_linears(model, make, skip=skip)
