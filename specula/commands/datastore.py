"""`specula datastore`: build, inspect and time REST retrieval datastores.

    specula datastore build --tokenizer smollm2-135m --from ~/code --out code.specds
    specula datastore info code.specds
    specula datastore bench code.specds
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from specula.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("datastore", help="build and inspect REST retrieval datastores",
                       description="Token datastores with a suffix array, for `--method rest --datastore FILE`.")
    dsub = p.add_subparsers(dest="datastore_command", metavar="ACTION", parser_class=type(p))
    dsub.required = True

    b = dsub.add_parser("build", help="tokenize a corpus and write a datastore (atomic)",
                        description="Tokenize text files, directories (recursive, by extension) or JSONL/JSON "
                                    "records (`text`, or `conversations`/`messages` with `content`/`value`), "
                                    "suffix-sort the ids and write one memory-mappable file.")
    b.add_argument("--tokenizer", required=True, metavar="MODEL",
                   help="model whose tokenizer to use: embedded alias, model or tokenizer directory, .gguf, cached hub id")
    b.add_argument("--from", dest="sources", nargs="+", required=True, metavar="PATH", help="corpus files or directories")
    b.add_argument("--out", required=True, metavar="FILE", help="datastore file to write (replaced atomically)")
    b.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="stop after N tokens, separators included (at least 2; default: all)")
    b.add_argument("--ext", action="append", default=None, metavar=".EXT",
                   help="file extension read when walking directories (repeatable; default .py .txt .md .rst .jsonl .json)")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.add_argument("--json", action="store_true", help="print the build report as JSON")
    b.set_defaults(handler=run_build)

    i = dsub.add_parser("info", help="print a datastore's header (and check its checksums)")
    i.add_argument("file")
    i.add_argument("--no-verify", action="store_true", help="skip the checksum pass over the arrays")
    i.add_argument("--json", action="store_true")
    i.set_defaults(handler=run_info)

    q = dsub.add_parser("bench", help="time retrieval queries on a datastore",
                        description="Times the rest drafter's per-step query on contexts cut from the datastore "
                                    "itself (always match) and on random ids (no match: every suffix length searched).")
    q.add_argument("file")
    q.add_argument("--queries", type=int, default=500, help="queries of each kind (default 500)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=run_bench)


def run_build(args: argparse.Namespace) -> int:
    from specula.commands.common import flags_in_errors
    from specula.datastore.build import DEFAULT_EXTENSIONS, BuildConfig, build_datastore, check_build
    from specula.models.loading import load_tokenizer
    from specula.paths import format_bytes

    exts = tuple(e if e.startswith(".") else f".{e}" for e in args.ext) if args.ext else DEFAULT_EXTENSIONS
    with flags_in_errors(args, ["max_tokens", "out"]):  # the library names BuildConfig's max_tokens, build's out=
        config = BuildConfig(max_tokens=args.max_tokens, extensions=exts, progress=not args.quiet)
        files = check_build(args.sources, args.out, config)  # a bad corpus or --out before the tokenizer's load
        tokenizer = load_tokenizer(args.tokenizer)
        report = build_datastore(tokenizer, args.sources, args.out, config, files=files)
    if args.json:
        print(json.dumps({"path": str(report.path), "file_bytes": report.file_bytes, "n_tokens": report.header.n_tokens,
                          "n_documents": report.header.n_documents, "files_read": report.files_read,
                          "files_skipped": report.files_skipped, "tokenize_seconds": report.tokenize_seconds,
                          "sort_seconds": report.sort_seconds, "write_seconds": report.write_seconds}))
        return 0
    print(f"wrote {report.path}: {report.header.n_tokens:,} tokens from {report.header.n_documents:,} documents "
          f"({report.files_read} files read, {report.files_skipped} skipped), {format_bytes(report.file_bytes)}; "
          f"tokenize {report.tokenize_seconds:.1f}s, sort {report.sort_seconds:.1f}s, write {report.write_seconds:.1f}s")
    return 0


def run_info(args: argparse.Namespace) -> int:
    from specula.datastore.format import describe, load_datastore
    from specula.paths import format_bytes

    store = load_datastore(args.file, verify=not args.no_verify)
    info = describe(store.header)
    info["file_bytes"] = store.path.stat().st_size
    info["checksums"] = "skipped" if args.no_verify else "ok"
    if args.json:
        print(json.dumps(info))
        return 0
    for key, value in info.items():
        shown = format_bytes(value) if key == "file_bytes" else value
        print(f"{key:22s} {shown}")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    import numpy as np

    from specula.datastore.format import load_datastore
    from specula.drafters.base import DraftBudget, DraftContext
    from specula.drafters.rest import RestDrafter
    from specula.sampling import SamplingParams, make_generator

    if args.queries < 1:
        raise ConfigError("--queries must be >= 1")
    store = load_datastore(args.file)
    drafter = RestDrafter(store)
    rng = np.random.default_rng(args.seed)
    n = len(store)
    if n < 64:
        raise ConfigError(f"datastore {args.file!r} has only {n} tokens; too small to time")
    windows = [store.tokens[s : s + 32].astype(np.int64) for s in rng.integers(0, n - 32, args.queries)]
    inside = [w[: int(np.argmax(w == store.separator))] if (w == store.separator).any() else w for w in windows]
    kinds = {
        "from datastore": [w[-16:] for w in inside if len(w) >= 2],
        "random ids": [rng.integers(0, store.vocab_size, 16) for _ in range(args.queries)],
    }
    params, budget = SamplingParams(), DraftBudget(max_nodes=64, max_depth=10)
    results = {}
    for kind, contexts in kinds.items():
        times, nodes = [], []
        for context in contexts:
            ctx = DraftContext(context.tolist(), 0, params, budget, make_generator(0))
            t0 = time.perf_counter()
            tree = drafter.propose(ctx).tree
            times.append(time.perf_counter() - t0)
            nodes.append(len(tree))
        if not times:  # no window of two tokens or more inside a document (a store of one-word documents)
            results[kind] = {"queries": 0}
            continue
        ms = np.array(times) * 1e3
        results[kind] = {"queries": len(ms), "mean_ms": round(float(ms.mean()), 3),
                         "p50_ms": round(float(np.percentile(ms, 50)), 3),
                         "p99_ms": round(float(np.percentile(ms, 99)), 3), "mean_nodes": round(float(np.mean(nodes)), 1)}
    if args.json:
        print(json.dumps({"file": args.file, "n_tokens": n, "results": results}))
        return 0
    print(f"{args.file}: {n:,} tokens", file=sys.stderr)
    for kind, r in results.items():
        if not r["queries"]:
            print(f"{kind:15s} 0 queries: no context of two tokens or more inside a document", file=sys.stderr)
            continue
        print(f"{kind:15s} {r['queries']} queries: mean {r['mean_ms']} ms, p50 {r['p50_ms']} ms, "
              f"p99 {r['p99_ms']} ms, {r['mean_nodes']} nodes per tree")
    return 0
