#!/usr/bin/env bash
# Build REST datastores (for `specula generate --method rest --datastore FILE`) from corpora
# that are already on this machine: nothing is downloaded.
#
#   scripts/build_datastores.sh [code|text|all] [--tokenizer MODEL] [--out DIR] [--max-tokens N]
#
# Recipes
#   code  The Python standard library sources of the running interpreter
#         (sysconfig "stdlib": every *.py except site-packages / dist-packages, tests included).
#         License: Python Software Foundation License 2.0 (PSF-2.0).
#         About 31 MB of source, ~10M tokens with the SmolLM2 tokenizer.
#   text  English technical prose: (1) the English manual pages installed under /usr/share/man,
#         sections 1, 5, 7 and 8, rendered to unwrapped plain text with man(1) + col(1) (the Google Cloud
#         CLI's generated gcloud_* pages are left out: thousands of near-identical pages);
#         (2) the Python documentation topics shipped in the stdlib (pydoc_data.topics, the text of
#         `help("topic")`). Licenses: each manual page is under its package's own free license
#         (GPL, LGPL, BSD, MIT, ...; see /usr/share/doc/<package>/copyright); pydoc topics PSF-2.0.
#         This is prose, not chat: no chat corpus is available offline. Rendering needs man-db,
#         groff-base and bsdextrautils (Debian: apt-get install man-db groff-base bsdextrautils).
#
# Neither corpus holds Spec-Bench prompts or answers (MT-bench, WMT14, CNN/DailyMail, Natural
# Questions, GSM8K, DPR): do not add them to a datastore used for Spec-Bench numbers.
#
# Output: DIR/code-<tokenizer>.specds and DIR/text-<tokenizer>.specds
# (DIR defaults to $SPECULA_CACHE/datastores, else ~/.cache/specula/datastores).
set -euo pipefail

recipe=all
tokenizer=smollm2-135m
out="${SPECULA_CACHE:-$HOME/.cache/specula}/datastores"
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    code|text|all) recipe="$1" ;;
    --tokenizer) tokenizer="$2"; shift ;;
    --out) out="$2"; shift ;;
    --max-tokens) extra+=(--max-tokens "$2"); shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1 (see $0 --help)" >&2; exit 2 ;;
  esac
  shift
done
python=${PYTHON:-python}
name=$(basename "$tokenizer")
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

build_code() {
  local stdlib
  stdlib=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
  local sources=()
  while IFS= read -r entry; do sources+=("$entry"); done < <(
    find "$stdlib" -mindepth 1 -maxdepth 1 \( -name site-packages -o -name dist-packages -o -name '__pycache__' \) -prune \
      -o \( -type d -o -name '*.py' \) -print | sort)
  echo "code: Python $("$python" -c 'import sys; print(sys.version.split()[0])') stdlib at $stdlib (${#sources[@]} entries)" >&2
  specula datastore build --tokenizer "$tokenizer" --from "${sources[@]}" --ext .py \
    --out "$out/code-$name.specds" "${extra[@]}"
}

build_text() {
  for tool in man col; do
    command -v "$tool" >/dev/null || { echo "error: $tool not found; apt-get install man-db groff-base bsdextrautils" >&2; exit 2; }
  done
  mkdir -p "$work/man" "$work/pydoc"
  # One plain-text file per page; symlinked pages are aliases of others and are skipped.
  find /usr/share/man/man1 /usr/share/man/man5 /usr/share/man/man7 /usr/share/man/man8 -type f \
      ! -name 'gcloud*' 2>/dev/null | sort > "$work/pages.txt"
  echo "text: rendering $(wc -l < "$work/pages.txt") manual pages ..." >&2
  xargs -a "$work/pages.txt" -P "$(nproc)" -n 50 sh -c '
    for page; do
      base=$(basename "$page"); base=${base%.gz}
      # very wide pages (no hard line wrapping inside paragraphs), indentation dropped
      MANWIDTH=1000 man -l "$page" 2>/dev/null | col -bx | sed -e "s/^ *//" > "$0/$base.txt" || rm -f "$0/$base.txt"
    done' "$work/man"
  "$python" - "$work/pydoc" <<'EOF'
import pathlib, sys
from pydoc_data.topics import topics
root = pathlib.Path(sys.argv[1])
for name, text in sorted(topics.items()):
    (root / f"{name}.txt").write_text(text, encoding="utf-8")
EOF
  specula datastore build --tokenizer "$tokenizer" --from "$work/man" "$work/pydoc" --ext .txt \
    --out "$out/text-$name.specds" "${extra[@]}"
}

case "$recipe" in
  code) build_code ;;
  text) build_text ;;
  all) build_code; build_text ;;
esac
ls -l "$out"/*-"$name".specds >&2
