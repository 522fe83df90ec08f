"""The head file: one safetensors file, checked before anything is loaded.

Tensors: the head's parameters and `d2t` ([V_draft] long: draft token -> target token id, the
exact mapping back from the reduced vocabulary). Parameters are float (float32 as trained,
float16 as shipped) or, in format 2, matrices as int8 with one float16 scale per row under
`scale.<name>` (symmetric, row maximum -> 127; a head only drafts, so this costs no exactness:
`save_head(dtype=torch.int8)`, used where float16 would exceed the shipped size limit); reading
gives float tensors either way (int8 matrices as float32). Metadata key `specula_head`: JSON with the
format version, the `HeadConfig`, the target it was trained for (name, logit width, hidden size,
and a fingerprint: a few values of its output head, so another model of the same shape is
refused) and the training record (data, steps, time, held-out acceptance). Writes are atomic.

A file that is missing, truncated, not a head, or made for another target raises `HeadFileError`
with one line naming the fix (the CLI exits 2); nothing is loaded in that case.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specula.drafters.heads.config import HeadConfig
from specula.errors import HeadFileError

FORMAT = 1
INT8_FORMAT = 2
"""Files holding int8 matrices (`scale.` tensors); an older specula refuses them by this number
instead of loading int8 values as weights."""
READ_FORMATS = (FORMAT, INT8_FORMAT)
META_KEY = "specula_head"
FINGERPRINT_IDS = tuple(range(0, 64, 8))
"""Output-head rows sampled for the fingerprint (their first 8 values each)."""
FINGERPRINT_TOLERANCE = 0.25
"""Largest distance between a target's fingerprint and the one a head records, relative to the
recorded one's length, for the head to count as made for that target (quantized kernels move it)."""


@dataclass
class HeadFile:
    """A head's weights and what it was made for."""

    config: HeadConfig
    state: dict[str, torch.Tensor]
    """Parameters of the head module (float)."""
    d2t: torch.Tensor
    """[V_draft] long: target token id of each draft token."""
    target: dict[str, Any]
    """name, vocab_size, hidden_size, fingerprint."""
    training: dict[str, Any] = field(default_factory=dict)
    """How it was trained (free-form: data, steps, seconds, acceptance)."""


def fingerprint(target) -> list[float]:
    """A few values of the target's output head (`FeatureModel.output_rows`)."""
    ids = torch.tensor([i for i in FINGERPRINT_IDS if i < target.vocab_size])
    return [round(float(v), 5) for v in target.output_rows(ids)[:, :8].float().flatten()]


def target_record(target, name: str) -> dict[str, Any]:
    return {"name": name, "vocab_size": int(target.vocab_size), "hidden_size": int(target.hidden_size),
            "fingerprint": fingerprint(target)}


def save_head(path: str | os.PathLike, head: HeadFile, dtype: torch.dtype = torch.float32) -> Path:
    """Write atomically (a temporary sibling renamed over `path`). `dtype`: of the parameters;
    torch.int8 stores every matrix as int8 rows with float16 scales (format 2) and the rest
    (norms, biases) as float16."""
    from safetensors.torch import save_file

    from specula.models.quantize import quantize_rows
    from specula.paths import atomic_path

    int8 = dtype == torch.int8
    tensors = {}
    for k, v in head.state.items():
        if int8 and v.dim() == 2:
            q, scale = quantize_rows(v)  # [R, C] int8, [R]
            tensors[f"head.{k}"], tensors[f"scale.{k}"] = q, scale.to(torch.float16)
        else:
            tensors[f"head.{k}"] = v.detach().to(torch.float16 if int8 else dtype)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    tensors["d2t"] = head.d2t.to(torch.long).contiguous()
    meta = {"format": INT8_FORMAT if int8 else FORMAT, "config": head.config.to_dict(), "target": head.target,
            "training": head.training}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(meta)})
    return path


def _fix(path: Path) -> str:
    return (f"re-create it with `specula train` (or `specula models install` for a shipped head), or pass "
            f"another file than {path} as head=FILE")


def read_head(path: str | os.PathLike) -> HeadFile:
    """Read and check a head file on its own (format, shapes, mapping); `HeadFileError` otherwise."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if path.is_dir():
        raise HeadFileError(f"head file {path} is a directory; pass the head file in it (`specula train --out "
                            f"DIR` writes DIR/KIND.safetensors, e.g. DIR/eagle3.safetensors)")
    if not path.is_file():
        raise HeadFileError(f"head file {path} does not exist; {_fix(path)}")
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, UnicodeDecodeError) as exc:
        raise HeadFileError(f"head file {path} is truncated or corrupted ({str(exc).splitlines()[0][:80]}); "
                            f"{_fix(path)}") from None
    meta_text = metadata.get(META_KEY)
    if meta_text is None:
        raise HeadFileError(f"{path} is a safetensors file but not a specula head (no '{META_KEY}' metadata); {_fix(path)}")
    try:
        meta = json.loads(meta_text)
        if meta.get("format") not in READ_FORMATS:
            raise HeadFileError(f"{path} has head format {meta.get('format')}, this specula reads "
                                f"{' and '.join(map(str, READ_FORMATS))}; {_fix(path)}")
        config = HeadConfig.from_dict(meta["config"])
        target = dict(meta["target"])
    except (KeyError, TypeError, ValueError) as exc:
        raise HeadFileError(f"{path} has unreadable head metadata ({exc}); {_fix(path)}") from None
    d2t = tensors.pop("d2t", None)
    if d2t is None or d2t.dim() != 1 or len(d2t) != config.draft_vocab:
        raise HeadFileError(f"{path}: its draft vocabulary mapping is missing or not {config.draft_vocab} long; {_fix(path)}")
    if d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool:  # 2.5 would read as 2: a token twice
        raise HeadFileError(f"{path}: its draft vocabulary mapping holds {d2t.dtype} values, not token ids; "
                            f"{_fix(path)}")
    if int(d2t.min()) < 0 or int(d2t.max()) >= config.target_vocab or len(set(d2t.tolist())) != len(d2t):
        raise HeadFileError(f"{path}: its draft vocabulary maps outside 0..{config.target_vocab - 1} or twice; {_fix(path)}")
    state = {k.removeprefix("head."): v for k, v in tensors.items() if k.startswith("head.")}
    for name, scale in ((k.removeprefix("scale."), v) for k, v in tensors.items() if k.startswith("scale.")):
        w = state.get(name)
        if w is None or w.dtype != torch.int8 or scale.shape != w.shape[:1]:
            raise HeadFileError(f"{path}: its scale for {name} has no int8 matrix of {len(scale)} rows; {_fix(path)}")
        state[name] = w.float() * scale.float()[:, None]
    if any(v.dtype == torch.int8 for v in state.values()):
        raise HeadFileError(f"{path}: an int8 matrix has no scale; {_fix(path)}")
    bad = next((k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
    if bad is not None:  # a float head would draft nothing, an int8 one garbage: silently slower either way
        raise HeadFileError(f"{path}: its weight {bad} holds NaN or infinite values; {_fix(path)}")
    return HeadFile(config, state, d2t, target, meta.get("training", {}))


def check_target(head: HeadFile, target, path: str | os.PathLike, target_name: str) -> None:
    """The head was made for this target: same logit width, hidden size and output head."""
    made = head.target
    fix = f"train one for it with `specula train --target {target_name}` or pass the head made for {made.get('name')}"
    if made.get("vocab_size") != target.vocab_size or head.config.target_vocab != target.vocab_size:
        raise HeadFileError(f"head {path} was made for {made.get('name')} (vocabulary {made.get('vocab_size')}), "
                            f"not {target_name} (vocabulary {target.vocab_size}); {fix}")
    if made.get("hidden_size") != target.hidden_size:
        raise HeadFileError(f"head {path} was made for {made.get('name')} (hidden size {made.get('hidden_size')}), "
                            f"not {target_name} (hidden size {target.hidden_size}); {fix}")
    ours = torch.tensor(fingerprint(target))
    theirs = torch.tensor(made.get("fingerprint", []), dtype=torch.float32)
    # relative L2 distance: another model's rows are as far as their own length (about 1.4 apart),
    # the same rows through int4 kernels 0.11 (Qwen2.5-Coder; a value's error reaches 8% of the
    # largest there, refused by the 2% a value this check once allowed), int8 0.01
    if ours.shape != theirs.shape or float((ours - theirs).norm()) > FINGERPRINT_TOLERANCE * float(theirs.norm()):
        raise HeadFileError(f"head {path} was made for {made.get('name')}, whose output head differs from "
                            f"{target_name}'s; {fix}")
