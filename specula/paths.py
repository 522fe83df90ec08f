"""Where specula keeps its files, and how it writes them without leaving half-written ones.

Everything specula downloads, converts or measures lives under one cache directory:
`$SPECULA_CACHE` when set, otherwise `~/.cache/specula`. Writers never modify a final path in
place: they write a temporary sibling (same directory, hence same filesystem) and `os.replace`
it over the target once complete, so a reader sees either the old version, the new version, or
nothing -- never a torn file or a half-filled directory. Temporaries left by a killed process are
named `.<target>.tmp-<random>` and can be swept with `remove_stale_temps`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

CACHE_ENV = "SPECULA_CACHE"
"""Environment variable that overrides the cache root."""

_TMP_MARK = ".tmp-"


def cache_root() -> Path:
    """Where the cache is (`$SPECULA_CACHE` or `~/.cache/specula`), unchecked: for help texts."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "specula"


def cache_dir(*parts: str) -> Path:
    """The cache root (`cache_root`), joined with `parts`; a root that is a file is refused.

    Nothing is created; callers `mkdir` what they write into."""
    base = cache_root()
    if base.exists() and not base.is_dir():  # else every command failed its own way (tracebacks among them)
        from specula.errors import CacheNotWritable

        raise CacheNotWritable(f"the cache {str(base)!r} is a file, not a folder; point ${CACHE_ENV} at a directory")
    return base.joinpath(*parts)


def _temp_prefix(target: Path) -> str:
    return f".{target.name}{_TMP_MARK}"


def _fsync_dir(directory: Path) -> None:
    """Persist a rename (best effort: not every platform can open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@functools.cache
def _umask() -> int:
    """The process umask (read once: `os.umask` can only be read by setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _default_mode(path: Path, base: int) -> None:
    """Give a temporary the permissions a plainly created file/dir would have (mkstemp uses 0600)."""
    with contextlib.suppress(OSError):
        os.chmod(path, base & ~_umask())


def default_permissions(path: str | os.PathLike[str]) -> None:
    """Reset a file (0666) or directory (0777) tree to the modes the umask gives new files.

    For files that libraries create with private modes (temporary-file helpers use 0600)."""
    path = Path(path)
    _default_mode(path, 0o777 if path.is_dir() else 0o666)
    if path.is_dir():
        for root, dirs, files in os.walk(path):
            for name in dirs:
                _default_mode(Path(root, name), 0o777)
            for name in files:
                _default_mode(Path(root, name), 0o666)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary file path next to `target`; on normal exit it replaces `target`.

    The caller writes the temporary path however it likes (a library's `save(path)` for
    instance). On an exception the temporary is deleted and `target` is left untouched. The file
    gets the mode a plainly created one would have, also where the library wrote it anew with
    another (safetensors' `save_file` leaves 0600)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=_temp_prefix(target), dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        if tmp.is_file():  # mkstemp's 0600, or a library's own (set after the caller wrote)
            _default_mode(tmp, 0o666)
        os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise
    _fsync_dir(target.parent)


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike[str], mode: str = "wb", **open_kwargs: Any) -> Iterator[IO[Any]]:
    """Open a temporary sibling of `target` for writing; on normal exit, flush, fsync and
    move it over `target`. `mode` must be a write mode ("w", "wb", "x" is not needed)."""
    if "r" in mode or "a" in mode or "+" in mode:
        raise ValueError(f"atomic_file writes a fresh file; mode {mode!r} is not supported")
    with atomic_path(target) as tmp:
        with open(tmp, mode, **open_kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())


def atomic_write_bytes(target: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `target` atomically; returns `target` as a Path."""
    with atomic_file(target, "wb") as handle:
        handle.write(data)
    return Path(target)


def atomic_write_text(target: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `target` atomically; returns `target` as a Path."""
    return atomic_write_bytes(target, text.encode(encoding))


def atomic_write_json(target: str | os.PathLike[str], obj: Any, *, indent: int | None = 2) -> Path:
    """Serialise `obj` as JSON (sorted keys, trailing newline) and write it atomically."""
    return atomic_write_text(target, json.dumps(obj, indent=indent, sort_keys=True) + "\n")


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The JSON object in the file at `path`; None when the file is missing or unreadable, is not
    JSON, or holds something other than an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary directory next to `target`; on normal exit it becomes `target`.

    An existing `target` is replaced (moved aside, then deleted after the swap), so at every
    instant `target` is either the complete old directory or the complete new one. On an
    exception the temporary directory is deleted and `target` is left untouched."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
    _default_mode(tmp, 0o777)
    try:
        yield tmp
        if target.exists() or target.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
            os.replace(target, old / "old")  # a rename: `target` now absent for an instant only
            os.replace(tmp, target)
            _remove(old)
        else:
            os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise
    _fsync_dir(target.parent)


def remove_dir(target: str | os.PathLike[str]) -> None:
    """Delete the directory `target` so that it is whole or absent at every instant: it is renamed
    to a temporary sibling first (one rename), then deleted; a deletion cut short leaves only that
    temporary, which `remove_stale_temps(target)` sweeps."""
    target = Path(target)
    aside = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
    os.replace(target, aside / "old")
    _remove(aside)
    _fsync_dir(target.parent)


@contextlib.contextmanager
def file_lock(name: str) -> Iterator[None]:
    """Hold the exclusive lock `<cache>/locks/<name>.lock` (`flock`) for the block: processes that
    write the same cache entry take turns (so sweeping temporaries is safe). Not POSIX: no lock."""
    from specula.errors import CacheNotWritable

    lock = cache_dir("locks", f"{name}.lock")
    try:
        import fcntl
    except ImportError:
        fcntl = None
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock, "a+b") if fcntl is not None else contextlib.nullcontext()
    except OSError as exc:
        raise CacheNotWritable(f"the cache {str(cache_dir())!r} cannot be written ({exc.strerror or exc}); point "
                               f"${CACHE_ENV} at a writable directory") from exc
    if fcntl is None:
        yield
        return
    with handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def stale_temps(target: str | os.PathLike[str]) -> list[Path]:
    """Temporaries that atomic writers left for `target` (e.g. after a crash or kill -9)."""
    target = Path(target)
    if not target.parent.is_dir():
        return []
    prefix = _temp_prefix(target)
    return sorted(p for p in target.parent.iterdir() if p.name.startswith(prefix))


def remove_stale_temps(target: str | os.PathLike[str]) -> list[Path]:
    """Delete the leftovers `stale_temps(target)` lists; returns what was removed.

    Only call this when no other process may be writing `target` at the same time."""
    removed = stale_temps(target)
    for path in removed:
        _remove(path)
    return removed


def disk_usage(path: str | os.PathLike[str]) -> int:
    """Bytes used by a file, or by all files under a directory (0 when absent).

    Symlinks are not followed."""
    path = Path(path)
    if path.is_symlink():
        return 0
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            file = Path(root, name)
            if not file.is_symlink():
                with contextlib.suppress(FileNotFoundError):
                    total += file.stat().st_size
    return total


def format_bytes(n: int | None) -> str:
    """Human-readable size: 1536 -> '1.5 KiB'; None -> '-'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def check_output(path: str | os.PathLike[str], option: str, kind: str, error: type[Exception] | None = None) -> Path:
    """Refuse an output `path` that cannot be written, before any work: `kind` "dir" (a directory
    made if missing) or "file". Raises `error` (default ConfigError) naming `option` with the path (`_given`: a
    flag, `--out '/x'`, or a keyword, `out='/x'`)."""
    from specula.errors import ConfigError

    error = error or ConfigError
    path = Path(path).expanduser()
    if kind == "dir" and path.exists() and not path.is_dir():
        raise error(f"{_given(option, path)} is a file; give a directory for the outputs")
    if kind == "file" and path.is_dir():
        raise error(f"{_given(option, path)} is a directory; give a file path")
    parent = path if kind == "dir" else path.parent
    while not parent.exists() and parent != parent.parent:  # the first existing ancestor: made later
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"cannot write {_given(option, path)}: {str(parent)!r} is not a writable directory")
    return path


def _given(option: str, path: str | os.PathLike[str]) -> str:
    """An option and its path as a message names them: a flag's (`--out '/x'`), or a keyword's as Python writes it
    (`out='/x'`: `option` "out=")."""
    return f"{option}{str(path)!r}" if option.endswith("=") else f"{option} {str(path)!r}"


def check_not_input(output: str | os.PathLike[str], option: str,
                    inputs: Iterable[tuple[str, str | os.PathLike[str] | None]],
                    error: type[Exception] | None = None) -> None:
    """Refuse, before any work, an `output` file that is one of the `inputs` the command reads (the
    same file, through a link too): writing it would replace that input. `inputs`: (what the input
    is, e.g. "the batch file", its path or None). Raises `error` (default ConfigError) naming `option` (a flag,
    `--out`, or a keyword, `out=`)."""
    from specula.errors import ConfigError

    path = Path(output).expanduser()
    if not path.is_file():  # nothing there that could be read
        return
    for what, source in inputs:
        read = None if source is None else Path(source).expanduser()
        if read is not None and read.is_file() and os.path.samefile(read, path):
            raise (error or ConfigError)(f"{option} would overwrite {what} {str(source)!r} with its output; give "
                                         "another output path")
