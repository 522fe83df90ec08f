"""A disk cache of prepared models: a native decoder with its weights already fused, quantized and
packed for specula's CPU kernels, so a second load is a memory map instead of seconds of copying,
quantizing and reordering.

Why: preparing a model for the kernels (`native.NativeDecoder.from_hf`, then `native.configure`)
reads every float32 weight, concatenates the fused projections, quantizes (int8 drafts,
`--quantize int8`) and reorders each weight into the kernels' blocked layout. On the 2-core
development machine that took ~13 s for Qwen2.5-Coder-1.5B in float32 (3 s fusing, 10 s packing)
and ~9 s for the int8 0.5B draft, on every run, with the float32 weights, their fused copies and
the packed result alive at once (docs/cache.md). A prepared entry holds the result as one tensor
file (`models.tensor_file`) that is mapped back without copying: pages are read on first use and,
being file-backed, can be shared with other processes and dropped by the kernel under memory
pressure. Pages the page cache has lost are read back while loading (`page_cache.prefetch`), so the
first timed generation does not pay for storage reads (a cold 1.5B entry had made `--compare`
report 0.85x for ~2x).

The first load writes the entry while it prepares (`build_entry`): the kernels pack each weight
straight into a writable mapping of the entry's file, so the packed weights are placed once, in
the page cache, and never sit in anonymous memory. (Packing into memory and then `torch.save`
took the float32 1.5B 20 s + 20-30 s, with 6.2 GiB of packed weights anonymous at the peak.)

Layout: `$SPECULA_CACHE/prepared/<model>-<where>.<quantize>-<kernel>/` with `weights.bin` (the
decoder's state dict plus the rotary frequencies) and `prepared.json`, written last, holding the
key, the decoder's shape, the packed linears' kinds and the weights file's size and mtime. One
entry per model, quantization and kernel: a key that no longer matches (model files replaced,
specula's kernel or decoder code changed, another torch) is rebuilt in place, so old entries do
not pile up; entries whose model path is gone are removed whenever another entry is written
(`remove_orphans`).

The key holds everything that changes the prepared weights: the model files' identity (name, size,
mtime of every file the model directory holds), dtype, quantization, kernel, a hash of the code
that prepares them (decoder, kernels, this module's format version) and the torch version. An
entry whose marker is missing or unreadable, whose key differs, whose weights file has another
size or mtime than recorded, or that is not a whole tensor file is rebuilt (with a note on
stderr); a half-written entry never appears under the final name (`paths.atomic_dir`).

Only decoders whose linears all run on specula's kernels (`--backend native`, `--linear-kernel
auto|specula`) are cached; the oneDNN and fbgemm layouts are opaque objects without a stable file
format, and those loads stay as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from specula.errors import CacheNotWritable, ConfigError
from specula.models.page_cache import prefetch
from specula.paths import (atomic_dir, cache_dir, disk_usage, file_lock, read_json_object, remove_dir,
                           remove_stale_temps)

if TYPE_CHECKING:
    import torch

    from specula.models.loading import ResolvedModel
    from specula.models.native import NativeDecoder

PREPARED_FORMAT = 2
"""Bump when the entry layout changes: older entries then no longer match and are rebuilt (2: a
`tensor_file` written while packing, instead of a `torch.save` archive written after it)."""
WEIGHTS = "weights.bin"
MARKER = "prepared.json"
PREPARED_CACHE = ("on", "off")
"""Values of `--prepared-cache` / `LoadConfig.prepared_cache`: on = use (and write) an entry for every
model prepared for specula's kernels; off = prepare in memory on every load, read and write nothing."""
_ROPE_KEY = "__inv_freq__"
_NOTE_BYTES = 256 << 20
"""A prefetch reading at least this much from storage is noted on stderr (it explains a slow load)."""
_CODE_FILES = ("native/__init__.py", "native/model.py", "native/codes.py", "native/kernels/packing.py",
               "native/kernels/pack.c", "native/kernels/layout.h", "native/kernels/gguf.c", "quantize.py")
"""The code that decides the prepared weights (relative to `specula/models`): hashed into the key
(`quantize.py`: the int8 and int4 values; `kernels/packing.py`: the layouts each kernel kind takes).
Not the kernels that read them (linear.c, `kernels/__init__.py`): changing those keeps users'
prepared entries."""

Outcome = Literal["hit", "built", "rebuilt", "unsaved", "off", "unsupported"]


def check_prepared_cache(option: str) -> str:
    """`option` if it is a known `--prepared-cache` value, else a `ConfigError` naming the choices."""
    if option not in PREPARED_CACHE:
        raise ConfigError(f"unknown prepared-cache mode {option!r}; choose one of: {', '.join(PREPARED_CACHE)}")
    return option


def prepared_root() -> Path:
    """`$SPECULA_CACHE/prepared`: every prepared entry lives under it."""
    return cache_dir("prepared")


@functools.cache
def code_hash() -> str:
    """Hash of the source files that decide how weights are fused, quantized and packed."""
    base = Path(__file__).resolve().parent
    digest = hashlib.sha256(f"format {PREPARED_FORMAT}".encode())
    for rel in _CODE_FILES:
        path = base / rel
        digest.update(rel.encode())
        digest.update(path.read_bytes() if path.is_file() else b"<missing>")
    return digest.hexdigest()[:16]


def _stat(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def source_identity(resolved: ResolvedModel) -> dict[str, Any]:
    """What identifies the model's files: the GGUF file for a GGUF, else every regular file of the
    model directory (weights, config, generation config, tokenizer), each by size and mtime."""
    if resolved.gguf_file is not None:
        return {"path": str(resolved.gguf_file), "files": {resolved.gguf_file.name: _stat(resolved.gguf_file)}}
    files = {p.name: _stat(p) for p in sorted(resolved.path.iterdir()) if p.is_file() and not p.name.startswith(".")}
    return {"path": str(resolved.path), "files": files}


def prepared_key(resolved: ResolvedModel, *, dtype: str, quantize: str, kernel: str,
                 codes: Path | None = None) -> dict[str, Any]:
    """Everything that changes a prepared model (see the module docstring); `codes`: the GGUF whose
    codes its c8 layers hold (`native.codes`), or None."""
    import torch

    return {
        "codes": None if codes is None else {"path": str(codes), **_stat(codes)},
        "format": PREPARED_FORMAT,
        "source": source_identity(resolved),
        "dtype": str(dtype).removeprefix("torch."),
        "quantize": quantize,
        "kernel": kernel,
        "code": code_hash(),
        "torch": str(torch.__version__),
    }


def entry_dir(resolved: ResolvedModel, *, quantize: str, kernel: str) -> Path:
    """The entry of this model, quantization and kernel (one per combination; see the module doc)."""
    where = hashlib.sha256(str(resolved.gguf_file or resolved.path).encode()).hexdigest()[:8]
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in resolved.name)
    return prepared_root() / f"{name}-{where}.{quantize}-{kernel}"


# --------------------------------------------------------------------------- what a decoder holds


def _kernel_linears(decoder: torch.nn.Module) -> dict[str, dict[str, Any]] | None:
    """{qualified name: kind and shape} of the decoder's kernel linears, or None when some module
    is not one a prepared entry can hold (another kernel, unexpected layers)."""
    from torch import nn

    from specula.models.native.kernels import KernelLinear
    from specula.models.native.model import Layer, NativeDecoder

    linears: dict[str, dict[str, Any]] = {}
    for name, module in decoder.named_modules():
        if isinstance(module, KernelLinear):
            linears[name] = {"kind": module.kind, "in": module.in_features, "out": module.out_features}
        elif not isinstance(module, (NativeDecoder, Layer, nn.ModuleList, nn.Embedding)):
            return None
    return linears or None


def cacheable(decoder: torch.nn.Module) -> bool:
    """Whether `decoder` can be written as a prepared entry (every linear on specula's kernels)."""
    from specula.models.native.ops import CpuKernelOps

    return isinstance(getattr(decoder, "ops", None), CpuKernelOps) and _kernel_linears(decoder) is not None


class EntryNotWritten(Exception):
    """The entry could not be written (`error`: a full disk, a read-only cache); the model was
    prepared all the same (`decoder`, `extra`), its weights in memory or in the unlinked file."""

    def __init__(self, error: OSError, decoder: NativeDecoder, extra: dict[str, Any]) -> None:
        super().__init__(str(error))
        self.error, self.decoder, self.extra = error, decoder, extra


def build_entry(path: Path, key: dict[str, Any], prepare) -> tuple[NativeDecoder, dict[str, Any], bool]:
    """Prepare the model into the entry at `path`, atomically. `prepare(empty)` -> (decoder, extra
    marker facts) packs every weight straight into the entry's weights file (`empty` is
    `TensorFileWriter.empty`: the packed bytes are placed once, in the page cache, never in anonymous
    memory); the rest of the decoder's state is copied in after, then the marker is written last.

    Returns (decoder, extra with "prepare_seconds", written): written False when the decoder is not
    cacheable (nothing kept). Raises `EntryNotWritten` when writing failed (the model prepared in
    memory if the entry could not even be started); the preparing's own errors propagate."""
    from specula.models.tensor_file import TensorFileWriter

    stage = "start"  # -> "prepare" while `prepare` runs -> "write" after it
    decoder = extra = None
    try:
        remove_stale_temps(path)
        with atomic_dir(path) as tmp, TensorFileWriter(tmp / WEIGHTS) as writer:
            stage = "prepare"
            decoder, extra = _timed(prepare, writer.empty)
            stage = "write"
            linears = _kernel_linears(decoder)
            if linears is None or not cacheable(decoder):
                raise _Uncacheable
            state = dict(decoder.state_dict())
            state[_ROPE_KEY] = decoder.inv_freq
            for name, tensor in state.items():
                writer.add(name, tensor)
            writer.finish()
            buffers = {name: sorted(k.rsplit(".", 1)[1] for k in state if k.rsplit(".", 1)[0] == name)
                       for name in linears}
            marker = {
                "format": PREPARED_FORMAT,
                "key": key,
                "config": dataclasses.asdict(decoder.cfg),
                "rope_scaling": float(decoder.rope_scaling),
                "num_parameters": int(decoder.num_parameters),
                "invariant": bool(decoder.invariant),
                "linears": {name: {**info, "buffers": buffers[name]} for name, info in linears.items()},
                "weights": _stat(tmp / WEIGHTS),
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                **extra,
            }
            (tmp / MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    except _Uncacheable:
        return decoder, extra, False
    except OSError as exc:
        if stage == "prepare":  # reading the model failed, not writing the entry
            raise
        if stage == "start":
            decoder, extra = _timed(prepare)
        raise EntryNotWritten(exc, decoder, extra) from exc
    return decoder, extra, True


def _timed(prepare, *args) -> tuple[NativeDecoder, dict[str, Any]]:
    """`prepare(*args)` with "prepare_seconds" added to its marker facts."""
    start = time.perf_counter()
    decoder, extra = prepare(*args)
    return decoder, {**extra, "prepare_seconds": round(time.perf_counter() - start, 3)}


class _Uncacheable(Exception):
    """Raised inside `build_entry`'s atomic directory so that nothing of it is kept."""


class StaleEntry(Exception):
    """A prepared entry that cannot be used (the message says why); it is rebuilt."""


def read_marker(path: Path) -> dict[str, Any] | None:
    """The parsed marker of the entry at `path`, or None when absent or unreadable."""
    return read_json_object(path / MARKER)


def load_entry(path: Path, key: dict[str, Any]) -> tuple[NativeDecoder, dict[str, Any]]:
    """The decoder stored at `path` (weights memory-mapped) and its marker; `StaleEntry` when the
    entry is absent, for another key, incomplete or damaged."""
    import torch

    from specula.models.native import NativeConfig, NativeDecoder
    from specula.models.native.kernels import KernelLinear
    from specula.models.native.ops import CpuKernelOps
    from specula.models.tensor_file import map_tensors

    if not path.is_dir():
        raise StaleEntry("absent")
    marker = read_marker(path)
    if marker is None:
        raise StaleEntry("its marker is missing or unreadable")
    if marker.get("format") != PREPARED_FORMAT or marker.get("key") != key:
        raise StaleEntry("it was prepared from other files, code or settings")
    weights = path / WEIGHTS
    if not weights.is_file() or _stat(weights) != marker.get("weights"):
        raise StaleEntry(f"{WEIGHTS} is missing or was modified after it was written")
    _bring_into_memory(weights)
    try:
        state = map_tensors(weights)  # TensorFileError (a ValueError) for a file that is not a whole one
        cfg = NativeConfig(**marker["config"])
        inv_freq = state.pop(_ROPE_KEY)
        with torch.device("meta"):
            decoder = NativeDecoder(cfg, torch.zeros(cfg.head_dim // 2), float(marker["rope_scaling"]))
        for name, info in marker["linears"].items():
            parent_name, _, child = name.rpartition(".")
            parent = decoder.get_submodule(parent_name) if parent_name else decoder
            buffers = {b: torch.empty(state[f"{name}.{b}"].shape, dtype=state[f"{name}.{b}"].dtype, device="meta")
                       for b in info["buffers"]}
            setattr(parent, child, KernelLinear.from_packed(info["kind"], int(info["in"]), int(info["out"]),
                                                            buffers["packed"], buffers.get("scale"), buffers.get("bias")))
        decoder.load_state_dict(state, strict=True, assign=True)
        num_parameters, invariant = int(marker["num_parameters"]), bool(marker["invariant"])
    except (RuntimeError, OSError, KeyError, TypeError, ValueError) as exc:
        raise StaleEntry(f"it could not be read ({type(exc).__name__}: {str(exc)[:200]})") from exc
    decoder.inv_freq = inv_freq
    decoder.num_parameters = num_parameters
    decoder.invariant = invariant
    decoder.ops = CpuKernelOps()
    return decoder.eval().requires_grad_(False), marker


def orphans(root: Path | None = None) -> list[Path]:
    """Entries under `root` (default `prepared_root()`) whose model no longer exists: the file or
    directory their marker names as the source is gone (a deleted local model, a test's temporary
    one). Entries without a readable marker are not judged (they are rebuilt when their model loads)."""
    root = prepared_root() if root is None else root
    if not root.is_dir():
        return []
    # a name starting with "." is an atomic writer's temporary (`paths.remove_stale_temps` sweeps those)
    return [entry for entry in sorted(root.iterdir()) if not entry.name.startswith(".") and _orphaned(entry)]


def _orphaned(entry: Path) -> bool:
    """Whether the entry directory's marker names a source model that no longer exists."""
    if not entry.is_dir():
        return False
    source = ((read_marker(entry) or {}).get("key") or {}).get("source")
    where = source.get("path") if isinstance(source, dict) else None
    return isinstance(where, str) and bool(where) and not Path(where).exists()


def remove_orphans(keep: Path | None = None) -> list[tuple[str, int]]:
    """Delete `orphans()` (but `keep`), each under its entry's lock so no writer of it races the
    removal (the empty lock file stays: deleting it would let a process waiting on it and one
    arriving later hold the lock at once); returns (name, bytes) of what was removed. Called after a new
    entry is written: the moment the cache grows, so entries of models that are gone do not pile up."""
    removed = []
    for entry in orphans():
        if keep is not None and entry == keep:
            continue
        with file_lock(f"prepared-{entry.name}"):
            if not _orphaned(entry):  # gone, or its model came back, while waiting
                continue
            size = disk_usage(entry)
            remove_dir(entry)
        removed.append((entry.name, size))
    return removed


def _note_removed(removed: list[tuple[str, int]]) -> None:
    if removed:
        total = sum(size for _, size in removed)
        names = ", ".join(name for name, _ in removed[:5]) + (f" and {len(removed) - 5} more" if len(removed) > 5 else "")
        print(f"note: removed {len(removed)} prepared model(s) whose model files are gone ({total / 1e9:.2f} GB): "
              f"{names}", file=sys.stderr, flush=True)


def _bring_into_memory(weights: Path) -> None:
    """Read the mapped weights' pages that the page cache lacks now, while loading, rather than in
    the first timed forward pass (`page_cache`); a large read is noted on stderr."""
    start = time.perf_counter()
    read = prefetch(weights)
    if read is not None and read >= _NOTE_BYTES:
        print(f"note: read {read / 1e9:.1f} GB of {weights.parent.name}/{WEIGHTS} from storage "
              f"({time.perf_counter() - start:.1f} s; it was not in the page cache)", file=sys.stderr, flush=True)


def load_or_prepare(resolved: ResolvedModel, key: dict[str, Any], *, quantize: str, kernel: str,
                    prepare, mode: str = "on", label: str | None = None,
                    ) -> tuple[NativeDecoder, dict[str, Any], Outcome]:
    """The prepared decoder for `resolved`: from its entry when valid, else `prepare()` ->
    (decoder, extra marker facts) and, unless `mode` is "off", written as the entry and mapped
    back from it (so the first run holds one copy of the weights, as later runs do).

    Returns (decoder, marker facts (eos ids, model id, ...), outcome): hit, built, rebuilt (the entry
    was unusable), unsaved (writing failed, e.g. a full disk: noted on stderr, the load goes on),
    off, or unsupported (the decoder's kernels have no entry format)."""
    check_prepared_cache(mode)
    if mode == "off":
        decoder, extra = prepare()
        return decoder, extra, "off"
    path = entry_dir(resolved, quantize=quantize, kernel=kernel)
    label = label or resolved.name
    try:
        decoder, marker = load_entry(path, key)
        return decoder, marker, "hit"
    except StaleEntry:
        pass
    with contextlib.ExitStack() as stack:
        try:  # a process preparing the same entry finishes first
            stack.enter_context(file_lock(f"prepared-{path.name}"))
        except CacheNotWritable as exc:  # a read-only cache: prepared in memory, as when the entry cannot be written
            print(f"note: could not write the prepared {label} ({exc}); it is prepared again next time",
                  file=sys.stderr, flush=True)
            decoder, extra = prepare()
            return decoder, extra, "unsaved"
        decoder, marker, outcome = _prepare_locked(path, key, quantize, prepare, label)
    if outcome in ("built", "rebuilt"):  # the cache grew: drop what belongs to models that are gone
        _note_removed(remove_orphans(keep=path))
    return decoder, marker, outcome


def _prepare_locked(path: Path, key: dict[str, Any], quantize: str, prepare, label: str,
                    ) -> tuple[NativeDecoder, dict[str, Any], Outcome]:
    try:  # again: another process may have written it while this one waited for the lock
        decoder, marker = load_entry(path, key)
        return decoder, marker, "hit"
    except StaleEntry as exc:
        reason = str(exc)
    existed = reason != "absent"
    if existed:
        print(f"note: the prepared {label} ({path}) is unusable: {reason}; preparing it again",
              file=sys.stderr, flush=True)
    else:
        weights = "float32" if quantize == "none" else quantize
        print(f"preparing {label} for specula's kernels ({weights}; once, cached in {path})...",
              file=sys.stderr, flush=True)
    try:
        decoder, extra, saved = build_entry(path, key, prepare)
    except EntryNotWritten as exc:
        print(f"note: could not write the prepared {label} to {path} ({exc.error}); it is prepared again next time",
              file=sys.stderr, flush=True)
        return exc.decoder, exc.extra, "unsaved"
    if not saved:
        return decoder, extra, "unsupported"
    outcome: Outcome = "rebuilt" if existed else "built"
    try:  # the entry just written, memory-mapped: its pages are in the page cache already, and the
        # prepared copy in this process's own memory is freed (a second copy of every weight)
        mapped, marker = load_entry(path, key)
    except StaleEntry as exc:
        print(f"note: the prepared {label} just written to {path} cannot be read back ({exc}); using it from memory",
              file=sys.stderr, flush=True)
        return decoder, extra, outcome
    del decoder
    return mapped, marker, outcome
