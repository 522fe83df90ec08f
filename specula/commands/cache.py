"""`specula cache`: what specula keeps under $SPECULA_CACHE, and clearing what it measured.

    specula cache info [--json]
    specula cache clear [--measured] [--kernels] [--prepared] [--orphans] [--training] [--all]

What is kept is a cache, never a behaviour switch: every entry is rebuilt when missing, and the
measured cost curves are priors that each run corrects from the passes it times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specula.paths import _TMP_MARK, cache_dir, cache_root, disk_usage, file_lock, format_bytes, remove_dir


@dataclass(frozen=True)
class CacheKind:
    """One folder of the cache."""

    folder: str
    """Folder under the cache root."""
    flag: str | None
    """`specula cache clear` option that removes it (None: only by hand; models are not re-downloadable here)."""
    what: str
    """What it holds."""
    lock: str | None = None
    """Prefix of the lock its writers hold per entry (`paths.file_lock(lock + name)`), which
    `clear` takes too; None: entries are single files written atomically, with no lock."""


KINDS = (
    CacheKind("models", None, "converted models (safetensors + config + tokenizer), from `specula models install`"),
    CacheKind("gguf", None, "the assembled, sha256-verified GGUF files the models are converted from"),
    CacheKind("heads", None, "shipped trained heads, installed with their model"),
    CacheKind("cost", "measured", "measured cost curves and packed-pass tables (priors of the planner), per backend"),
    CacheKind("kernels", "kernels", "specula's compiled C kernels, per CPU and compiler", "kernels-"),
    CacheKind("prepared", "prepared",
              "models prepared for specula's kernels (fused, quantized, packed), memory-mapped by later loads", "prepared-"),
    CacheKind("training", "training", "`specula train` corpora and features"),
    CacheKind("locks", None, "install locks (empty when nothing installs)"),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cache", help="show what specula keeps on disk and clear what it measured",
        description=f"specula keeps converted models and derived state under {cache_root()} "
                    "($SPECULA_CACHE moves it). Every entry but the models is rebuilt when missing.",
    )
    sub = parser.add_subparsers(dest="cache_command", metavar="ACTION", parser_class=type(parser))
    parser.set_defaults(handler=show, json=False)  # `specula cache` alone: `specula cache info`
    info = sub.add_parser("info", help="what is kept, and its size (the default)")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(handler=show)
    clear = sub.add_parser("clear", help="remove derived state (default: --measured)")
    for kind in KINDS:
        if kind.flag:
            clear.add_argument(f"--{kind.flag}", action="store_true", help=f"remove {kind.what}")
    clear.add_argument("--orphans", action="store_true",
                       help="remove only the prepared models whose model files are gone (also done whenever a "
                            "model is prepared)")
    clear.add_argument("--all", action="store_true", help="every derived entry above (never the models)")
    clear.set_defaults(handler=clear_cache)


def _size(path: Path) -> int:
    """Bytes under `path`, the folder a symlink names included (files other processes remove
    meanwhile are skipped)."""
    return disk_usage(path.resolve())


LIVE_TEMP_SECONDS = 600
"""A temporary of a folder without locks this recent may belong to a writer still at work."""


def _age_seconds(path: Path) -> float:
    try:
        return time.time() - path.lstat().st_mtime
    except FileNotFoundError:
        return float("inf")


def _entry_name(child: Path) -> str:
    """The entry a cache folder's child belongs to: its own name, or for a writer's temporary
    (`.<name>.tmp-<random>`) the name it will be renamed to."""
    if child.name.startswith(".") and _TMP_MARK in child.name:
        return child.name[1:].split(_TMP_MARK)[0]
    return child.name


def _clear(kind: CacheKind) -> tuple[int, list[str]]:
    """Remove every entry of `kind`'s folder (the folder itself stays, a symlink too), each under
    the lock its writers hold, so an entry being written is removed after it is whole (or its
    temporary after its writer is done with it): (bytes removed, errors)."""
    folder = cache_dir(kind.folder)
    if not folder.is_dir():
        return 0, []
    removed, errors = 0, []
    for child in sorted(folder.iterdir()):
        name = _entry_name(child)
        if not kind.lock and name != child.name and _age_seconds(child) < LIVE_TEMP_SECONDS:
            continue  # a lock-less writer's temporary, maybe still being written: its rename would fail
        lock = file_lock(kind.lock + name) if kind.lock else contextlib.nullcontext()
        with lock:  # a writer's temporary: by now renamed to its entry, which goes too
            for path in dict.fromkeys((child, folder / name)):
                if not path.exists() and not path.is_symlink():
                    continue
                size = disk_usage(path)
                try:
                    if path.is_dir() and not path.is_symlink():
                        remove_dir(path)
                    else:
                        path.unlink()
                except OSError as exc:
                    errors.append(f"{path}: {exc.strerror or exc}")
                    continue
                removed += size
    return removed, errors


def show(args: argparse.Namespace) -> int:
    from specula.models.prepared import orphans

    rows = [{"folder": str(cache_dir(k.folder)), "bytes": _size(cache_dir(k.folder)), "what": k.what,
             "clear_with": f"--{k.flag}" if k.flag else None} for k in KINDS]
    gone = [{"entry": entry.name, "bytes": _size(entry)} for entry in orphans()]
    if args.json:
        print(json.dumps({"root": str(cache_dir()), "entries": rows, "prepared_orphans": gone}, indent=1))
        return 0
    print(f"cache root: {cache_dir()}  ($SPECULA_CACHE)")
    for row, kind in zip(rows, KINDS):
        clear = f"specula cache clear {row['clear_with']}" if row["clear_with"] else "kept"
        print(f"  {kind.folder + '/':11} {format_bytes(row['bytes']):>10}  {kind.what}  [{clear}]")
        if kind.folder == "prepared" and gone:
            print(f"  {'':11} {format_bytes(sum(g['bytes'] for g in gone)):>10}  of it: {len(gone)} prepared "
                  f"model(s) whose model files are gone  [specula cache clear --orphans; also done whenever a "
                  f"model is prepared]")
    return 0


def clear_cache(args: argparse.Namespace) -> int:
    chosen = [k for k in KINDS if k.flag and (args.all or getattr(args, k.flag))]
    if args.orphans and not any(k.flag == "prepared" for k in chosen):
        from specula.models.prepared import remove_orphans

        removed = remove_orphans()
        print(f"removed {len(removed)} prepared model(s) whose model files are gone "
              f"({format_bytes(sum(size for _, size in removed))})"
              + (": " + ", ".join(name for name, _ in removed) if removed else ""))
        if not chosen:
            return 0
    if not chosen:
        chosen = [k for k in KINDS if k.flag == "measured"]
    failed: list[str] = []
    for kind in chosen:
        size, errors = _clear(kind)
        print(f"removed {cache_dir(kind.folder)} ({format_bytes(size)}): {kind.what}")
        failed += errors
    for error in failed:
        print(f"error: could not remove {error}", file=sys.stderr)
    return 1 if failed else 0
