"""Heads shipped with specula for the embedded models, installed like the models themselves.

The files live in the package (`specula/data/heads/`, float16 safetensors, trained by
`specula train` on specula's own prompts: docs/training.md). `specula models install ALIAS`
verifies each against its sha256 here and copies it into $SPECULA_CACHE/heads/ALIAS/KIND.safetensors
(atomically); `--method eagle` / `eagle3` / `medusa` / `hydra` then find it with no flag
(and `fusion` takes the installed eagle3 head, else the eagle one; `--head none`: none).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specula.errors import HeadFileError
from specula.paths import atomic_path, cache_dir, file_lock, remove_stale_temps

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "data" / "heads"
MAX_SHIPPED_BYTES = 30_000_000
"""A shipped head file is at most this big (float16, or int8 matrices where float16 is bigger:
scripts/ship_head.py)."""


@dataclass(frozen=True)
class ShippedHead:
    alias: str
    """Embedded model the head was trained for."""
    kind: str
    """eagle, eagle3, medusa or hydra."""
    file: str
    """File name under specula/data/heads/."""
    sha256: str
    """Checksum verified at install."""


SHIPPED: tuple[ShippedHead, ...] = (
    # specula train --target smollm2-135m --kind eagle --epochs 10 (docs/training.md); float16
    ShippedHead("smollm2-135m", "eagle", "smollm2-135m-eagle.safetensors",
                "5a5201e50bf9740e1169686c06d85fb62a242ae23f28abbc0ca751d8cbd9ffe2"),
    # D=specula/data/training/smollm2-135m; specula train --target smollm2-135m --kind eagle3
    #   --backend hf --device cuda --dtype float32 --padded-rows 2048 --batch-size 64 --ttt-steps 3
    #   --data $D/magpie-{general,math,code,writing,explain,howto}.jsonl $D/context.jsonl
    #          $D/magpie2-{general,math,code,writing,explain,howto}.jsonl $D/context2.jsonl $D/context-copy.jsonl
    #          $D/context3.jsonl $D/magpie3-{code,explain,general,howto,math,writing}.jsonl $D/magpie4-general.jsonl
    #   --max-new-tokens 128 --epochs 3 (31,040 prompts written by the model or built from its
    #   answers, answered by it; trained on an H200; docs/training.md "The eagle3 head on 31,040
    #   prompts"), then fine-tuned on the CPU: specula train --target smollm2-135m --kind eagle3
    #   --init-head <that head> --draft-vocab 16384 --data $D/translate.jsonl $D/replay-general.jsonl
    #   $D/replay-magpie4.jsonl --max-new-tokens 128 --epochs 2 --lr 2e-4 --ttt-steps 3 --batch-size 8
    #   (1,758 prompts: translations SmolLM2 mostly copies, and earlier prompts replayed; its draft
    #   vocabulary grown to the 12,324 tokens the corpora hold; docs/training.md "A head that copies
    #   what it is asked to translate"), then fine-tuned again: the same command with --init-head
    #   installed, $D/questions.jsonl before the three files and --max-prompt-tokens 1536 (2,747
    #   prompts, 989 of them short factual questions; 13,831 tokens; docs/training.md "Short factual
    #   questions"), then fine-tuned again: the same command with --copy-ngram 3, $D/context-qwen.jsonl
    #   after translate.jsonl and --time-budget 40 (3,347 prompts; copy hints learned from zero, by
    #   session 70's code: no copy_gain, the hint's weights at --lr; docs/training.md "Copy hints"),
    #   then fine-tuned again: the same command with --copy-lr-scale 30 (the default now; the hint's
    #   gain learned at 30 times --lr; docs/training.md "SmolLM2's copy hints with their gain");
    #   float16
    ShippedHead("smollm2-135m", "eagle3", "smollm2-135m-eagle3.safetensors",
                "7ad1f97521764aa5fe75a5fd2171c5290bb93367a01c05704f28f9f42c283ce2"),
    # specula train --target qwen2.5-coder-0.5b --kind eagle3 --backend hf --device cuda --dtype bfloat16
    #   --padded-rows 2048 --batch-size 64 --ttt-steps 3 --max-new-tokens 128 --epochs 3
    #   --data $(ls $D/{magpie,context}*.jsonl | grep -v context-long) (the 31,040 prompts of SmolLM2's
    #   head, answered by Qwen2.5-Coder-0.5B; trained on an H100; docs/training.md "The 0.5B head on
    #   31,040 prompts"); float16
    ShippedHead("qwen2.5-coder-0.5b", "eagle3", "qwen2.5-coder-0.5b-eagle3.safetensors",
                "c0febddbb9c9aeae336735c7bd88254932fa399ac9f0cc23696d4663762fd834"),
    # specula train --target qwen2.5-coder-1.5b --kind eagle3 --backend hf --device cuda --dtype bfloat16
    #   --intermediate-size 2048 --num-kv-heads 4 --padded-rows 2048 --batch-size 64 --ttt-steps 3
    #   --max-new-tokens 128 --epochs 3 --time-budget 8.1 --no-feature-cache --answers <the 0.5B's answers>
    #   --data $(ls $D/{magpie,context}*.jsonl | grep -v context-long) (the 31,040 prompts of SmolLM2's
    #   head, answered by Qwen2.5-Coder-0.5B, the same tokenizer; 2.24 of 3 epochs fit; trained on an
    #   H100; docs/training.md "The 1.5B head on 31,040 prompts"), then fine-tuned on the CPU:
    #   specula train --target qwen2.5-coder-1.5b --kind eagle3 --init-head <that head> --draft-vocab 16384
    #   --data $D/translate.jsonl $D/replay-general.jsonl $D/replay-magpie4.jsonl --answers <the 1.5B's own
    #   answers: data/answers/qwen2.5-coder-1.5b unpacked, and its answers to translate.jsonl>
    #   --max-new-tokens 128 --epochs 2 --lr 2e-4 --ttt-steps 3 --batch-size 8 --time-budget 60 (1,758
    #   prompts; docs/training.md "The 1.5B's head fine-tuned on translations it answered"), then
    #   fine-tuned again from that head: the same command with --init-head installed --copy-ngram 3
    #   --copy-lr-scale 30, /tmp/ctxq400.jsonl (the first 400 lines of $D/context-qwen.jsonl) before
    #   the three files, its answers (`--stop-after answers`) added to --answers, --max-prompt-tokens
    #   1536 --length-groups --time-budget 42 (2,158 prompts; copy hints with their gains;
    #   docs/training.md "Copy hints that were never learned"); then its draft vocabulary extended from
    #   16,384 to 32,768 tokens, not trained further: the same command with --init-head installed
    #   --draft-vocab 32768 --vocab-from /tmp/ans15 (data/answers/qwen2.5-coder-1.5b unpacked: the tokens
    #   the 1.5B writes across its 31,040 answers and their prompts) --epochs 0 (docs/training.md
    #   "The 1.5B's draft vocabulary doubled"); int8 matrices (float16 would be 53 MB)
    ShippedHead("qwen2.5-coder-1.5b", "eagle3", "qwen2.5-coder-1.5b-eagle3.safetensors",
                "4640c97577744683c0101101eefb82e873302f0bbb9e9c0e0528f658c3bd4084"),
)
"""Every shipped head."""


def installed_path(alias: str, kind: str) -> Path:
    return cache_dir("heads", alias, f"{kind}.safetensors")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def install_heads(alias: str) -> list[Path]:
    """Verify and install the shipped heads of `alias` (none: []); already-installed, verified
    files are kept."""
    paths = []
    for shipped in (s for s in SHIPPED if s.alias == alias):
        dest = installed_path(alias, shipped.kind)
        if dest.is_file() and _sha256(dest) == shipped.sha256:
            paths.append(dest)
            continue
        src = PACKAGE_DIR / shipped.file
        if not src.is_file() or _sha256(src) != shipped.sha256:
            raise HeadFileError(f"the shipped head {src} is missing or does not match its sha256; reinstall specula "
                                "(pip install --force-reinstall specula) or train one with `specula train`")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(f"heads-{alias}"):  # installs of one target's heads take turns: sweeping is safe
            remove_stale_temps(dest)  # what a killed install left
            with atomic_path(dest) as tmp:
                shutil.copyfile(src, tmp)
        paths.append(dest)
    return paths


def ship_head(src: str | os.PathLike, alias: str, out_dir: str | os.PathLike | None = None
              ) -> tuple[ShippedHead, Path]:
    """Write the trained head file `src` as the shipped head of `alias`: out_dir (default the
    package's `PACKAGE_DIR`) / ALIAS-KIND.safetensors, float16, or with int8 matrices (per-row
    float16 scales, head file format 2) where float16 would exceed `MAX_SHIPPED_BYTES`. The file
    is sized in a temporary sibling and renamed into place, so a head too big even as int8 raises
    `HeadFileError` and leaves the file already there as it was; a head made for another target
    is refused the same way. Returns the `ShippedHead` entry for `SHIPPED` and the file written."""
    import torch

    from specula.drafters.heads.file import read_head, save_head

    head = read_head(src)
    made_for = head.target.get("name")
    if made_for != alias:
        raise HeadFileError(f"{src} was trained for {made_for!r}, not {alias!r}: ship it as {made_for!r} or train "
                            f"one with `specula train --target {alias}`")
    out = Path(out_dir) if out_dir is not None else PACKAGE_DIR
    out.mkdir(parents=True, exist_ok=True)
    dest = out / f"{alias}-{head.config.kind}.safetensors"
    with tempfile.TemporaryDirectory(dir=out, prefix=".ship-") as tmp:
        trial = Path(tmp) / dest.name
        for dtype in (torch.float16, torch.int8):
            save_head(trial, head, dtype=dtype)
            size = trial.stat().st_size
            if size <= MAX_SHIPPED_BYTES:
                break
        else:
            raise HeadFileError(f"{src} takes {size} bytes even with int8 matrices, over {MAX_SHIPPED_BYTES}: train "
                                "a narrower head (--intermediate-size, --num-kv-heads) or a smaller --draft-vocab")
        os.replace(trial, dest)
    return ShippedHead(alias, head.config.kind, dest.name, _sha256(dest)), dest


def default_head(target_spec: str | None, kind: str) -> Path | None:
    """The installed head of `kind` for an embedded model alias, or None."""
    if not target_spec:
        return None
    from specula.models.registry import get_embedded

    model = get_embedded(target_spec)
    if model is None:
        return None
    path = installed_path(model.alias, kind)
    return path if path.is_file() else None
