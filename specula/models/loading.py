"""Turn a model name into a loaded model and tokenizer, and check that a draft fits a target.

A model spec is one of, in this order of precedence:

* an embedded alias (`specula models list`), loaded from its converted cache directory;
* a path to a `.gguf` file (dequantised by transformers at load: slow for big models);
* a path to a local Hugging Face directory (`config.json` + weights), or to a directory holding
  exactly one `.gguf` file;
* a Hugging Face hub id (`org/name`) already in the local hub cache; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

from specula.errors import (ConfigError, IncompatibleModelsError, ModelNotFoundError, SpeculaError, keywords_renamed,
                            reworded)
from specula.models.registry import EMBEDDED_MODELS, EmbeddedModel, get_embedded
from specula.prompts import apply_chat_template, encode_prompt  # noqa: F401  (re-exported: their old home)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from specula.models.base import TargetModel

Kind = Literal["embedded", "directory", "gguf", "hub"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_DTYPES = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model spec points, before anything is loaded."""

    spec: str
    """The string the user gave."""
    kind: Kind
    """How it was understood: embedded alias, local HF directory, GGUF file, or cached hub id."""
    path: Path
    """The directory passed to `from_pretrained` (for a GGUF: the directory holding the file)."""
    gguf_file: Path | None = None
    """The GGUF file, for kind `"gguf"`; None otherwise."""
    embedded: EmbeddedModel | None = None
    """The registry entry, for kind `"embedded"`."""

    @property
    def file_id(self) -> str:
        """The GGUF file's path ("" for a directory): the cost key's model id, since a GGUF's
        config names only its directory, which may hold several models."""
        return str(self.gguf_file) if self.gguf_file is not None else ""

    @property
    def name(self) -> str:
        """Short name for messages and reports."""
        if self.embedded is not None:
            return self.embedded.alias
        if self.kind == "hub":
            return self.spec
        return (self.gguf_file or self.path).name


@dataclass(frozen=True)
class VocabCheck:
    """Result of `check_compatible`: the id range both models agree on."""

    shared_size: int
    """Ids `0 .. shared_size-1` denote the same tokens in both tokenizers."""
    target_tokens: int
    """Number of ids in the target tokenizer (including added tokens)."""
    draft_tokens: int
    """Number of ids in the draft tokenizer (including added tokens)."""
    target_logits: int | None
    """Width of the target's output layer (vocabulary padded for efficiency), if a model was given."""
    draft_logits: int | None
    """Width of the draft's output layer, if a model was given."""


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith((".", "~", os.sep))
        or (os.altsep is not None and os.altsep in spec)
        or spec.lower().endswith(".gguf")
        or (os.sep in spec and not _HUB_ID.match(spec))
    )


def _from_directory(spec: str, directory: Path) -> ResolvedModel:
    if (directory / "config.json").is_file():
        return ResolvedModel(spec, "directory", directory)
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) == 1:
        _check_whole_gguf(spec, ggufs[0])
        return ResolvedModel(spec, "gguf", directory, gguf_file=ggufs[0])
    if ggufs and all(SPLIT_GGUF.search(g.name) for g in ggufs):
        _check_whole_gguf(spec, ggufs[0])
    found = f"{len(ggufs)} .gguf files" if ggufs else "no .gguf file"
    raise ModelNotFoundError(
        f"{spec!r} is a directory without config.json and with {found}; give a Hugging Face model directory "
        f"or the path of one .gguf file"
    )


def _check_whole_gguf(spec: str, path: Path) -> None:
    """Refuse one part of a split GGUF: transformers would read that part alone and give every
    weight in the others random values."""
    if SPLIT_GGUF.search(path.name):
        raise ModelNotFoundError(f"{spec!r} is one part of a split GGUF ({path.name}), which transformers cannot "
                                 f"load whole; merge the parts first: llama-gguf-split --merge {path.name} merged.gguf")


def _hub_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of `repo_id` in the Hugging Face cache, or None (never downloads)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return None


def _not_found(spec: str) -> ModelNotFoundError:
    aliases = ", ".join(EMBEDDED_MODELS)
    return ModelNotFoundError(
        f"model {spec!r} is not an embedded alias, a local path, or a Hugging Face id in the local cache, and "
        f"this machine cannot download from the hub; use an embedded model ({aliases}; install with "
        f"`specula models install <alias>`) or the path of a local model directory or .gguf file"
    )


def resolve(spec: str) -> ResolvedModel:
    """Decide what `spec` names (see the module docstring), without loading anything.

    Raises `ModelNotFoundError` -- for an embedded alias that is not converted yet, with the
    exact `specula models install <alias>` command to run."""
    spec = str(spec).strip()
    if not spec:
        raise ConfigError("empty model name")
    embedded = get_embedded(spec)
    if embedded is not None and not _looks_like_path(spec):
        from specula.models.install import install_command, is_valid_conversion, model_dir_path

        directory = model_dir_path(embedded.alias)
        if not is_valid_conversion(embedded, directory):
            raise ModelNotFoundError(
                f"embedded model {embedded.alias} is not installed (or not converted yet); run: "
                f"{install_command(embedded.alias)}"
            )
        return ResolvedModel(spec, "embedded", directory, embedded=embedded)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{spec!r} is a file but not a .gguf; give a .gguf file or a model directory")
        _check_whole_gguf(spec, path)
        return ResolvedModel(spec, "gguf", path.resolve().parent, gguf_file=path.resolve())
    if path.is_dir():
        return _from_directory(spec, path.resolve())
    if _looks_like_path(spec):
        raise ModelNotFoundError(f"no such file or directory: {spec!r}")
    if _HUB_ID.match(spec):
        snapshot = _hub_snapshot(spec)
        if snapshot is not None:
            resolved = _from_directory(spec, snapshot)
            return ResolvedModel(spec, "hub", resolved.path, gguf_file=resolved.gguf_file)
    raise _not_found(spec)


SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
"""llama.cpp's split GGUF parts (`model-00001-of-00003.gguf`): transformers reads one file only."""


def _damaged_types() -> tuple[type[BaseException], ...]:
    """What reading a truncated or damaged model file raises besides OSError / ValueError: the GGUF
    reader's struct.error, safetensors' SafetensorError."""
    import struct

    from safetensors import SafetensorError

    return (struct.error, SafetensorError)


def _damaged(resolved: ResolvedModel, exc: BaseException) -> SpeculaError:
    """A one-line error for a model file that could not be read, naming the fix."""
    if resolved.embedded is not None:
        from specula.models.install import install_command

        fix = f"delete {resolved.path} and run {install_command(resolved.embedded.alias)}"
    else:
        fix = "copy or download it again"
    return SpeculaError(f"the model files of {resolved.spec!r} ({resolved.gguf_file or resolved.path}) are "
                        f"truncated or damaged ({type(exc).__name__}: {str(exc)[:160]}); {fix}")


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of: {', '.join(_DTYPES)}")
    return getattr(torch, dtype)


def check_tokenizer_files(resolved: ResolvedModel) -> None:
    """SpeculaError unless the model has a tokenizer to load: a GGUF holds its own; a model directory
    needs a tokenizer's files beside config.json. Checked before the weights load: found by
    transformers afterwards, the user waited for the weights and read a 5-line message."""
    if resolved.gguf_file is None and not any((resolved.path / name).is_file() for name in TOKENIZER_FILES):
        raise SpeculaError(f"model {resolved.spec!r} has no tokenizer files in {resolved.path} (none of "
                           f"{', '.join(TOKENIZER_FILES[:3])}, ...): copy the model's tokenizer files next to "
                           "its config.json")


def load_tokenizer(spec: str | ResolvedModel) -> PreTrainedTokenizerBase:
    """The tokenizer of a model spec (see `resolve`), or of a directory holding only tokenizer files,
    offline; loading errors become `SpeculaError`s."""
    from transformers import AutoTokenizer

    if not isinstance(spec, ResolvedModel):
        directory = Path(spec).expanduser()
        if directory.is_dir() and not (directory / "config.json").is_file() and any(
                (directory / name).is_file() for name in TOKENIZER_FILES):
            spec = ResolvedModel(spec, "directory", directory.resolve())
    resolved = spec if isinstance(spec, ResolvedModel) else resolve(spec)
    check_tokenizer_files(resolved)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if resolved.gguf_file is not None:
        kwargs["gguf_file"] = str(resolved.gguf_file)
    else:
        if (added := added_tokens_of(resolved.path)) is not None:
            kwargs["added_tokens_decoder"] = added
        if (stand_in := config_stand_in(resolved.path)) is not None:
            kwargs["config"] = stand_in
    try:
        if resolved.gguf_file is not None and any((resolved.path / n).is_file() for n in TOKENIZER_FILES):
            return _gguf_tokenizer_alone(resolved.gguf_file)
        return AutoTokenizer.from_pretrained(str(resolved.path), **kwargs)
    except ImportError as exc:
        raise SpeculaError(f"loading {resolved.name} needs a missing package: {exc}") from exc
    except _damaged_types() as exc:
        raise _damaged(resolved, exc) from exc
    except (OSError, ValueError, KeyError) as exc:
        if resolved.embedded is not None:  # files specula wrote: damaged since, not a kind it cannot read
            raise _damaged(resolved, exc) from exc
        raise SpeculaError(f"could not load the tokenizer of {resolved.spec!r} from {resolved.path}: {exc}") from exc


def _gguf_tokenizer_alone(gguf: Path) -> PreTrainedTokenizerBase:
    """The tokenizer a GGUF holds, read from a folder holding only a link to it: beside the GGUF,
    transformers prefers another model's tokenizer files to the GGUF's own."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="specula-gguf-") as folder:
        link = Path(folder) / gguf.name
        link.symlink_to(gguf)
        return AutoTokenizer.from_pretrained(folder, gguf_file=link.name, local_files_only=True)


ADDED_TOKENS_HEAD = 1 << 20
"""Characters of `tokenizer.json` `added_tokens_of` reads (its added tokens come before the vocabulary)."""
_ADDED_TOKENS_KEY = re.compile(r'"added_tokens"\s*:\s*')


def added_tokens_of(directory: Path) -> dict[int, dict[str, Any]] | None:
    """The added tokens of the directory's `tokenizer.json` as `added_tokens_decoder` ({id: AddedToken
    fields}), read from the file's head; None (transformers then reads them itself) unless the
    directory holds `tokenizer.json` and a `tokenizer_config.json` without `added_tokens_decoder`,
    and no `special_tokens_map.json` or `added_tokens.json`.

    Where a tokenizer config has no `added_tokens_decoder` (transformers 5 writes none),
    transformers parses all of `tokenizer.json` (11 MB for Qwen2.5) once more just to read its
    `added_tokens`, which the tokenizers library writes right after `version`, `truncation` and
    `padding`. Given them, it builds the same tokenizer (tested) 0.5 s sooner on the 2-core machine."""
    import json

    config, file = directory / "tokenizer_config.json", directory / "tokenizer.json"
    if not (config.is_file() and file.is_file()) or any(
            (directory / name).exists() for name in ("special_tokens_map.json", "added_tokens.json")):
        return None
    try:
        if "added_tokens_decoder" in json.loads(config.read_text(encoding="utf-8")):
            return None
        with open(file, encoding="utf-8") as f:
            text = f.read(ADDED_TOKENS_HEAD)
        key = _ADDED_TOKENS_KEY.search(text)
        if key is None or not isinstance(json.loads(text[:key.start()] + '"": 0}'), dict):  # a top-level key
            return None
        tokens, _ = json.JSONDecoder().raw_decode(text, key.end())
        added = {}
        for token in tokens:
            fields = dict(token)
            index = fields.pop("id")
            if type(index) is not int or not isinstance(fields.get("content"), str):
                return None
            added[index] = fields
        return added
    except (OSError, ValueError, TypeError, KeyError):
        return None


def config_stand_in(directory: Path) -> SimpleNamespace | None:
    """What `AutoTokenizer.from_pretrained` reads of a model's config, read from `config.json` as
    JSON: its `model_type`, `tokenizer_class`, `model_name` where set, and `_name_or_path` (the
    directory, as `AutoConfig` sets it); passed as `config`, it spares transformers building the
    config. None (transformers reads the config itself) unless the tokenizer config names its
    class and neither file names remote code, and the config's model type is one transformers knows.

    Why: `AutoTokenizer` builds the model's config only to choose the tokenizer's class, and for a
    `tokenizer_config.json` naming its class it reads only those attributes, and whether the
    config's class is mapped to a tokenizer (a stand-in's is not; the named class then decides, as
    it does for transformers' own classes). Building a `LlamaConfig` imports transformers'
    model-loading code and `torch.distributed.tensor`: 2.3 s of every SmolLM2 start on the 2-core
    machine. The tokenizer is the same (tested against transformers' own load)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from specula.paths import read_json_object

    tokenizer_config = read_json_object(directory / "tokenizer_config.json")
    config = read_json_object(directory / "config.json")
    if tokenizer_config is None or config is None:
        return None
    model_type, named_class = config.get("model_type"), tokenizer_config.get("tokenizer_class")
    if (not isinstance(named_class, str) or not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES
            or "auto_map" in tokenizer_config or "auto_map" in config):
        return None
    facts = {"model_type": model_type, "_name_or_path": str(directory),
             "tokenizer_class": config.get("tokenizer_class")}
    if "model_name" in config:
        facts["model_name"] = config["model_name"]
    return SimpleNamespace(**facts)


def config_shape(spec: str) -> SimpleNamespace | None:
    """A model's `hidden_size`, `num_layers` and `vocab_size` as its `config.json` gives them, without
    loading it: for checks of what is built on the model (a new head's shape) made before its load.
    None where there is no such file (a `.gguf`) or it lacks one of them; a model that cannot be
    found raises as `resolve` does, which its load would too."""
    from specula.paths import read_json_object

    resolved = resolve(spec)
    config = None if resolved.gguf_file is not None else read_json_object(resolved.path / "config.json")
    if config is None:
        return None
    facts = {"hidden_size": config.get("hidden_size"), "num_layers": config.get("num_hidden_layers"),
             "vocab_size": config.get("vocab_size")}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in facts.values()):
        return None
    return SimpleNamespace(**facts)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")
"""The files a Hugging Face tokenizer is read from (the chat template, which does not change ids, aside)."""


def _resolved_or_none(spec: str) -> ResolvedModel | None:
    try:
        return resolve(spec)
    except SpeculaError:
        return None


def same_tokenizer_files(a: ResolvedModel | None, b: ResolvedModel | None) -> bool:
    """Whether two model directories hold byte-identical tokenizer files (then their tokenizers map
    ids and special tokens identically and one loaded tokenizer serves both). False for GGUF files
    (their tokenizer is inside the weights file), when either directory has none of the files, and
    for a missing model (None)."""
    if a is None or b is None or a.gguf_file is not None or b.gguf_file is not None:
        return False
    if a.path == b.path:
        return True
    found = False
    for name in TOKENIZER_FILES:
        fa, fb = a.path / name, b.path / name
        if fa.is_file() != fb.is_file():
            return False
        if not fa.is_file():
            continue
        if fa.stat().st_size != fb.stat().st_size or fa.read_bytes() != fb.read_bytes():
            return False
        found = True
    return found


def load_model(
    spec: str | ResolvedModel, *, dtype: str | torch.dtype = "float32", attn_implementation: str = "auto",
    quantize: str = "none", linear_kernel: str = "auto", device: str | torch.device = "cpu",
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `(model, tokenizer)` for a model spec (see `resolve`), offline.

    The model is in eval mode with gradients disabled (use it under `torch.inference_mode()`).
    `quantize="int8"` swaps its linear layers for batch-invariant int8 ones (`specula.models.quantize`);
    `attn_implementation="auto"` then picks batch-invariant attention (`specula.models.attention`).
    `linear_kernel="auto"` runs a float32 CPU model's linears through oneDNN with prepacked weights
    (`specula.models.prepack`); "aten" keeps `F.linear`.
    `device` (a resolved `torch.device` or its name): weights are loaded straight onto it (no float32
    copy on the host for a bfloat16 CUDA model).
    `tokenizer`: an already loaded tokenizer to return instead of loading the model's (one known to
    be the same, see `same_tokenizer_files`).
    Only local files are read; loading errors become `SpeculaError`s naming the spec."""
    import torch
    from transformers import AutoModelForCausalLM

    from specula.models.attention import transformers_name
    from specula.models.device import check_cpu_only
    from specula.models.prepack import prepack_model, resolve_linear_kernel
    from specula.models.quantize import check_int4_kernel, check_quantize, quantize_model

    device = torch.device(device)
    check_int4_kernel(check_quantize(quantize), None)
    if quantize != "none":
        check_cpu_only(f'quantize="{quantize}"', device, 'use quantize="none" (bfloat16 is the default on CUDA)')
    attn_name = transformers_name(attn_implementation, quantize)
    resolved = spec if isinstance(spec, ResolvedModel) else resolve(spec)
    if tokenizer is None:
        check_tokenizer_files(resolved)
    torch_dtype = _torch_dtype(dtype)
    # checked before the (slow) load
    kernel = resolve_linear_kernel(linear_kernel, dtype=torch_dtype, device=device.type, quantize=quantize)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if resolved.gguf_file is not None:
        kwargs["gguf_file"] = str(resolved.gguf_file)
    if device.type != "cpu":
        kwargs["device_map"] = {"": str(device)}
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(resolved.path), dtype=torch_dtype, attn_implementation=attn_name, output_loading_info=True, **kwargs
        )
    except ImportError as exc:
        raise SpeculaError(f"loading {resolved.name} needs a missing package: {exc}") from exc
    except _damaged_types() as exc:
        raise _damaged(resolved, exc) from exc
    except (OSError, ValueError, KeyError) as exc:
        raise SpeculaError(f"could not load model {resolved.spec!r} from {resolved.path}: {exc}") from exc
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers fills them with random values and says so only in a log table
        raise SpeculaError(f"model {resolved.spec!r} lacks {len(missing)} of its weights (e.g. {missing[0]}): the "
                           "checkpoint is incomplete (a part of a split file, or a damaged copy); give the whole "
                           "model")
    if tokenizer is None:
        tokenizer = load_tokenizer(resolved)
    model.eval()
    model.requires_grad_(False)
    quantize_model(model, quantize)
    prepack_model(model, kernel)
    return model, tokenizer


@dataclass(frozen=True)
class LoadConfig:
    """How models are loaded."""

    dtype: str = "auto"
    """Weights dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16 (CUDA)."""
    device: str = "auto"
    """auto (the first CUDA device PyTorch sees, else the CPU), cpu, cuda or cuda:N."""
    attn_implementation: str = "auto"
    """Attention kernel: sdpa, eager, batch_invariant (each query row computed alone, bitwise equal to a
    one-token step), or auto = batch_invariant when quantize is int8, else sdpa."""
    quantize: str = "none"
    """none, or int8: int8 linear layers with per-row activation scales on CPU (fbgemm), for target and
    draft alike. Lossless relative to the int8 model: its linears and (with attn auto) its attention are
    bitwise batch invariant, so tree logits equal one-token logits bit for bit. It changes the model
    itself (perplexity and agreement with float32 in docs/cpu.md)."""
    linear_kernel: str = "auto"
    """Float linear layers: onednn (weights prepacked once for oneDNN; on CPU several times cheaper for
    the few rows decoding and verification pass, docs/cpu.md), aten (`F.linear`), or auto = onednn for a
    float32 model on CPU without quantize, else aten."""
    backend: str = "auto"
    """native (specula's own Llama / Qwen2 / Mistral decoder: static KV cache, fused projections, low
    per-step overhead), hf (any Hugging Face causal LM), or auto = native where the architecture is
    supported, else hf."""
    prepared_cache: str = "on"
    """on: a model prepared for specula's CPU kernels (fused, quantized, packed: the native backend's
    default on CPU) is written once under `$SPECULA_CACHE/prepared` and memory-mapped by later loads
    (`specula.models.prepared`, docs/cache.md); off: prepare it in memory on every load."""

    def __post_init__(self) -> None:
        from specula.models.prepared import check_prepared_cache

        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; choose one of: {', '.join(BACKENDS)}")
        check_prepared_cache(self.prepared_cache)

    def resolved(self) -> tuple["torch.device", "torch.dtype"]:
        """(device, dtype) this config means on this machine (checked: a `ConfigError` names the fix)."""
        from specula.models.device import resolve_device, resolve_dtype

        if self.backend == "hf" and self.linear_kernel == "specula":
            raise ConfigError('linear_kernel="specula" is specula\'s own kernels, which run on backend="native"; '
                              'with backend="hf" use linear_kernel auto, onednn or aten')
        device = resolve_device(self.device)
        return device, resolve_dtype(self.dtype, device)


BACKENDS = ("auto", "native", "hf")
"""Values of `--backend` / `LoadConfig.backend`."""


def hf_only_architecture(spec: str | ResolvedModel) -> str | None:
    """`spec`'s architecture where only the Hugging Face backend runs it (`backend="auto"` loads it there), read from
    its config, no weights (`_architecture`); None where the native backend's: what a caller may refuse before the
    load. A native architecture may still fall back to hf for a config its kernels lack (`NativeUnsupported`, found
    while loading)."""
    from specula.models.native import ARCHITECTURES

    arch = _architecture(spec if isinstance(spec, ResolvedModel) else resolve(spec))
    return None if arch in ARCHITECTURES else arch or "another architecture"


def _architecture(resolved: ResolvedModel) -> str:
    """The model class a spec loads as, read from its config alone (no weights): the first of a
    `config.json`'s `architectures`, read as JSON; otherwise (a .gguf, or a config naming no class)
    through transformers' `AutoConfig`.

    Why not always `AutoConfig`: building a `LlamaConfig` imports transformers' model-loading code
    and with it `torch.distributed.tensor`, 2.3 s of every SmolLM2 start on the 2-core machine (its
    prepared model then loads in 0.2 s and never reads the config)."""
    named = _named_architectures(resolved)
    if named:
        return named[0]
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"local_files_only": True}
    if resolved.gguf_file is not None:
        kwargs["gguf_file"] = str(resolved.gguf_file)
    try:
        config = AutoConfig.from_pretrained(str(resolved.path), **kwargs)
    except _damaged_types() as exc:
        raise _damaged(resolved, exc) from exc
    except (OSError, ValueError, KeyError) as exc:
        if resolved.embedded is not None:
            raise _damaged(resolved, exc) from exc
        raise SpeculaError(f"could not read the config of {resolved.spec!r} from {resolved.path}: {exc}") from exc
    named = getattr(config, "architectures", None)
    if named:
        return named[0]
    # A config read from a .gguf names no class: the one AutoModelForCausalLM builds for its model type.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""), "")


def _named_architectures(resolved: ResolvedModel) -> list[str] | None:
    """The `architectures` of the model directory's `config.json` when it names them as a list of
    strings; None for a .gguf, or a config that is missing, unreadable or names none (transformers
    then reads it, and words its errors)."""
    from specula.paths import read_json_object

    if resolved.gguf_file is not None:
        return None
    config = read_json_object(resolved.path / "config.json")
    named = config.get("architectures") if config is not None else None
    if isinstance(named, list) and named and all(isinstance(name, str) for name in named):
        return named
    return None


def load_backend(spec: str | ResolvedModel, config: LoadConfig = LoadConfig(), name: str = "model", *,
                 tokenizer: PreTrainedTokenizerBase | None = None, report: dict[str, Any] | None = None,
                 ) -> tuple[TargetModel, PreTrainedTokenizerBase]:
    """Load a model (alias, local dir, .gguf file or cached hub id) as a backend
    (`specula.models.base.TargetModel`) + its tokenizer. EOS ids: the model's and the tokenizer's.

    The native backend is built from the Hugging Face model's weights (q|k|v and gate|up fused),
    then given the configured kernels; the Hugging Face model itself is dropped and reloaded only if
    a caller asks for `reference_model()` (the bench's peers). A model prepared for specula's CPU
    kernels is cached on disk and memory-mapped by the next load (`config.prepared_cache`,
    `specula.models.prepared`).

    `tokenizer`: a loaded tokenizer known to be this model's (`same_tokenizer_files`), returned
    instead of loading it again. `report`, if given, receives `seconds` (this load), `prepared`
    (the prepared cache's outcome: hit, built, rebuilt, unsaved, off; None when not used) and `quantize`
    (its linears': none, int8, int4)."""
    from specula.models.attention_names import resolve_attention
    from specula.models.device import cuda_graphs_asker
    from specula.models.native import ARCHITECTURES, NativeUnsupported

    start = time.perf_counter()
    device, dtype = config.resolved()
    asker = cuda_graphs_asker()  # set_cuda_graphs(True) or SPECULA_CUDA_GRAPHS=1: refused where it cannot run
    check_graphs_device(device, config.device, asker)
    resolved = spec if isinstance(spec, ResolvedModel) else resolve(spec)
    if tokenizer is None:
        check_tokenizer_files(resolved)
    backend = config.backend
    if backend != "hf":
        arch = _architecture(resolved)
        if arch not in ARCHITECTURES:
            if backend == "native":
                raise ConfigError(f'backend="native" runs {", ".join(ARCHITECTURES)}; {resolved.name} is '
                                  f'{arch or "another architecture"}: use backend="hf"')
            backend = "hf"
    kwargs = dict(dtype=dtype, attn_implementation=config.attn_implementation, quantize=config.quantize,
                  linear_kernel="auto" if config.linear_kernel == "specula" else config.linear_kernel, device=device)
    outcome = None
    if backend != "hf":
        try:
            loaded, tokenizer, outcome = _load_native(resolved, config, name, kwargs,
                                                      resolve_attention(config.attn_implementation, config.quantize),
                                                      tokenizer)
        except NativeUnsupported as exc:
            if backend == "native":
                raise
            # auto: the architecture is the native backend's, this config of it is not (a sliding
            # window, dynamic or long RoPE, another activation, a head size its kernels lack)
            why = str(exc).removesuffix('; use backend="hf"')  # the advice is what auto does: not repeated
            print(f"note: {resolved.name} runs on the Hugging Face backend ({why})", file=sys.stderr, flush=True)
            backend = "hf"
    if backend == "hf":
        from specula.models.hf import HFCausalLM, eos_ids_of

        check_graphs_backend(config.backend, device, resolved.name, asker)
        model, tokenizer = load_model(resolved, **kwargs, tokenizer=tokenizer)
        loaded = HFCausalLM(model, name=f"{name} {resolved.spec}", eos_token_ids=eos_ids_of(model, tokenizer),
                            model_id=resolved.file_id)
    if report is not None:
        report.update(seconds=time.perf_counter() - start, prepared=outcome, quantize=config.quantize)
    return loaded, tokenizer


def check_graphs_device(device: "torch.device", asked: str, asker: str | None) -> None:
    """Refuse CUDA graphs asked for (`asker`: `device.cuda_graphs_asker`, e.g. `set_cuda_graphs(True)`, named as the
    caller wrote it) on a run off CUDA (`device`, resolved from the config's `asked`): every pass ran eagerly without
    a word. The command line refuses `--cuda-graphs` so, before any load (`commands.common.load_config`)."""
    if asker is None or device.type == "cuda":
        return
    from specula.models.device import cuda_graphs_unasked

    raise ConfigError(f"{asker} asks for CUDA graphs of the native backend's passes on a CUDA device, and this run is "
                      f'on {device.type} (device="{asked}"); {cuda_graphs_unasked(asker)}, or pass device="cuda" on a '
                      "machine with a GPU")


def check_graphs_backend(asked: str, device: "torch.device", model: str, asker: str | None) -> None:
    """Refuse CUDA graphs asked for (`asker`: `device.cuda_graphs_asker`, e.g. `set_cuda_graphs(True)`, named as the
    caller wrote it) on a CUDA device for a model that runs on the Hugging Face backend, which has no graph path:
    every pass ran eagerly without a word. `asked`: the backend the config asked for (hf: the advice names
    native; auto chose hf because the native decoder cannot run the model)."""
    if asker is None or device.type != "cuda":
        return
    from specula.models.device import cuda_graphs_unasked

    native = ', or use backend="native"' if asked == "hf" else ""
    raise ConfigError(f'{asker} asks for CUDA graphs, which only the native backend has, and {model} runs on '
                      f'backend="hf"; {cuda_graphs_unasked(asker)}{native}')


def _load_native(resolved: ResolvedModel, config: LoadConfig, name: str, kwargs: dict, attention: str,
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 ) -> tuple[TargetModel, PreTrainedTokenizerBase, str | None]:
    """(backend, tokenizer, prepared-cache outcome or None when the kernels are not specula's)."""
    import torch

    from specula.models.device import check_cpu_only
    from specula.models.native import NativeCausalLM, NativeDecoder, configure
    from specula.models.native.codes import GgufCodes, codes_source
    from specula.models.prepack import resolve_linear_kernel
    from specula.models.quantize import check_int4_kernel, check_quantize

    device, dtype = kwargs["device"], kwargs["dtype"]
    check_quantize(config.quantize)
    if config.quantize != "none":
        check_cpu_only(f'quantize="{config.quantize}"', device,
                       'use quantize="none" (bfloat16 is the default on CUDA)')
    kernel = resolve_linear_kernel(config.linear_kernel, dtype=dtype, device=device.type, quantize=config.quantize,
                                   native=True)
    check_int4_kernel(config.quantize, kernel)

    def prepare(empty=None) -> tuple[Any, dict[str, Any]]:
        """The decoder prepared for `kernel` and its marker facts; `empty` makes the packed weights
        of specula's kernels (the prepared cache's entry file; default `torch.empty`)."""
        from specula.models.hf import eos_ids_of

        nonlocal tokenizer
        model, tokenizer = load_model(resolved, dtype=dtype, attn_implementation="sdpa", quantize="none",
                                      linear_kernel="aten", device=device, tokenizer=tokenizer)
        facts = {"eos_token_ids": sorted(eos_ids_of(model, tokenizer)),
                 "model_id": str(getattr(model.config, "_name_or_path", "")) or resolved.name}
        with torch.no_grad():
            decoder = NativeDecoder.from_hf(model)
        del model  # the decoder holds what it needs; the peers' model is reloaded on demand
        codes = GgufCodes(gguf) if gguf is not None else None
        configure(decoder, kernel, config.quantize, attention, empty=empty, codes=codes)
        if codes is not None:
            codes.release()
        return decoder, facts

    gguf = codes_source(resolved) if kernel == "specula" and config.quantize == "none" and dtype == torch.float32 \
        else None

    outcome = None
    if kernel == "specula":
        from specula.models.prepared import load_or_prepare, prepared_key

        entry = kernel if gguf is None else f"{kernel}-c8"  # its own entry: `SPECULA_WEIGHT_CODES=0` keeps both
        key = prepared_key(resolved, dtype=str(dtype), quantize=config.quantize, kernel=entry, codes=gguf)
        decoder, facts, outcome = load_or_prepare(
            resolved, key, quantize=config.quantize, kernel=entry, prepare=prepare, mode=config.prepared_cache,
            label=f"{resolved.name} ({name})")
        if tokenizer is None:
            tokenizer = load_tokenizer(resolved)
    else:
        decoder, facts = prepare()
    # the bench's Hugging Face peers run this model on transformers, which has no 4-bit linears here:
    # an int4 model's reference is its int8 self, the nearest they can run
    reference_kwargs = {**kwargs, "tokenizer": tokenizer,
                        "quantize": "int8" if config.quantize == "int4" else config.quantize}
    backend = NativeCausalLM(decoder, name=f"{name} {resolved.spec}", eos_token_ids=facts["eos_token_ids"],
                             reference=lambda: load_model(resolved, **reference_kwargs)[0],
                             model_id=resolved.file_id or facts["model_id"])
    return backend, tokenizer, outcome


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size so far (`getrusage` ru_maxrss), in bytes; None where
    the platform does not report it."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # Linux reports KiB


def process_age_seconds() -> float | None:
    """Seconds since this process started (Linux `/proc`; None elsewhere): the wait a user saw,
    interpreter start-up and imports included."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return max(0.0, uptime - int(fields[19]) / ticks)  # field 22 of stat: start time in clock ticks


@dataclass(frozen=True)
class DraftInfo:
    """The draft model a method drafts with (`LoadReport.draft`, the bench's `methods[].draft`)."""

    model: str | None = None
    """As `--draft` named it (`auto` resolved: an alias, a directory, a `.gguf`; `self`: the target's own
    weights), or None: no draft model (none loaded, a method that drafts without one, `--draft skip`)."""
    quantize: str | None = None
    """How its linears are quantized (none, int8, int4), or None: no draft model, or not known."""

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "quantize": self.quantize}

    def label(self) -> str:
        """"qwen2.5-coder-0.5b (int4)", "self (int8)", "none" (no draft model)."""
        if self.model is None:
            return "none"
        return self.model + (f" ({self.quantize})" if self.quantize not in (None, "none") else "")


NO_DRAFT = DraftInfo()
"""No draft model."""


@dataclass(frozen=True)
class LoadReport:
    """Where the time of `api.load` went, and the memory it left behind (`specula generate` prints
    it, the bench records it)."""

    target_seconds: float
    """Loading the target backend (and its tokenizer)."""
    draft_seconds: float
    """Loading the draft backend (0 without a draft model)."""
    other_seconds: float
    """Everything else `load` did: choosing the draft, the trained head, the drafters, the planner
    (whose cost curve is read from its cache, or timed on the first run with this target)."""
    total_seconds: float
    """The whole `load` call."""
    peak_rss_bytes: int | None
    """The process's peak resident set size when loading ended (ru_maxrss: file-backed pages of
    memory-mapped weights count too)."""
    target_prepared: str | None = None
    """The prepared-model cache's outcome for the target (`specula.models.prepared`): hit, built,
    rebuilt, unsaved, off; None when the target's kernels are not cached."""
    draft_prepared: str | None = None
    """The same for the draft; None also without a draft model."""
    process_seconds: float | None = None
    """Seconds since the process started when loading ended (interpreter and imports included)."""
    draft_vocab: dict[str, Any] | None = None
    """The draft's cut output layer (`models.draft_vocab.apply_draft_vocab`: size, of, ranking), or
    None (every token scored, or no draft model)."""
    draft: DraftInfo = NO_DRAFT
    """The draft model loaded and its quantization (`NO_DRAFT`: none)."""

    def to_dict(self) -> dict[str, Any]:
        return {"target_s": round(self.target_seconds, 3), "draft_s": round(self.draft_seconds, 3),
                "other_s": round(self.other_seconds, 3), "total_s": round(self.total_seconds, 3),
                "process_s": None if self.process_seconds is None else round(self.process_seconds, 3),
                "peak_rss_bytes": self.peak_rss_bytes, "target_prepared": self.target_prepared,
                "draft_prepared": self.draft_prepared, "draft_vocab": self.draft_vocab, "draft": self.draft.to_dict()}

    def summary(self) -> str:
        """One line: 'loaded in 3.2 s (target 1.9 s [prepared: hit], draft 0.6 s [hit], other 0.7 s); ...'."""
        from specula.paths import format_bytes

        def part(label: str, seconds: float, prepared: str | None) -> str:
            return f"{label} {seconds:.1f} s" + (f" [prepared: {prepared}]" if prepared else "")

        parts = [part("target", self.target_seconds, self.target_prepared)]
        if self.draft_seconds or self.draft_prepared:
            parts.append(part("draft", self.draft_seconds, self.draft_prepared))
            if self.draft_vocab:
                parts[-1] += f" [vocabulary: {self.draft_vocab['size']} of {self.draft_vocab['of']} tokens]"
        parts.append(f"other {self.other_seconds:.1f} s")
        line = f"loaded in {self.total_seconds:.1f} s ({', '.join(parts)})"
        if self.process_seconds is not None:
            line += f", {self.process_seconds:.1f} s since start"
        return line + f"; peak RSS {format_bytes(self.peak_rss_bytes)}"


SELF_DRAFT = "self"
"""`--draft self`: the target's own weights as the draft, quantized (`--draft-quantize`, int8 by default)."""


def load_draft(spec: str, target_tokenizer: Any, target: Any, config: LoadConfig = LoadConfig(),
               target_name: str | None = None, quantize: str | None = None,
               report: dict[str, Any] | None = None, vocab: Any = "auto") -> Any:
    """Load a draft backend and check that it can propose tokens for `target` (same tokenizer,
    `check_compatible`: vocabularies, special tokens, and the logit widths of the two backends; no
    Hugging Face model is loaded for it); raises `IncompatibleModelsError` naming the difference. A
    draft whose tokenizer files are byte-identical to the target's (`same_tokenizer_files`) shares
    the target's loaded tokenizer. `report`: as for `load_backend`.

    `spec` "self" loads the target's own weights again (`target_name` is the target's spec; the
    converted cache is reused, nothing is converted twice), quantized by `quantize` (default int8:
    the draft needs no exactness, only speed and agreement). `quantize` applies to the draft only;
    the target keeps its own dtype and kernels. (`--draft skip` loads no draft: the target drafts
    for itself, `models.skipping.check_draft_skip`.)

    `vocab` (`models.draft_vocab`): "auto" (default) scores only the 32k most frequent tokens where a
    ranking ships for the tokenizer and the vocabulary is large (the draft's output layer cut to
    those rows, FR-Spec; outputs unchanged), "full" every token, or a number of tokens; what was
    done goes to `report["vocab"]`."""
    from dataclasses import replace

    from specula.models.draft_vocab import check_draft_vocab
    from specula.models.quantize import check_quantize
    from specula.models.skipping import SKIP_DRAFT

    if spec == SKIP_DRAFT:
        raise ConfigError('draft="skip" is the target itself with layers skipped, not a draft model to load; '
                          "pass it to specula.api.load")
    vocab = check_draft_vocab(vocab)  # a bad value fails here, before any slow load
    if spec == SELF_DRAFT:
        if target_name is None:
            raise ConfigError("a self-draft needs the target's model name")
        quantize = check_quantize(quantize or "int8")
        check_self_draft_device(config.resolved()[0])
        if quantize == "none":
            raise ConfigError('draft="self" with draft_quantize="none" would draft with the target itself; '
                              'use draft_quantize="int8" (or another draft model)')
        draft, _ = load_backend(target_name, replace(config, quantize=quantize), "self-draft",
                                tokenizer=target_tokenizer, report=report)
        return _cut_vocab(draft, target_tokenizer, target, vocab, report)
    if quantize is not None:
        config = replace(config, quantize=check_quantize(quantize))
    resolved = resolve(spec)
    shared = target_name is not None and same_tokenizer_files(_resolved_or_none(target_name), resolved)
    draft, draft_tokenizer = load_backend(resolved, config, "draft", tokenizer=target_tokenizer if shared else None,
                                          report=report)
    check_compatible(target_tokenizer, draft_tokenizer, target_name=target_name or target.name, draft_name=spec,
                     target_logits=target.vocab_size, draft_logits=draft.vocab_size)
    return _cut_vocab(draft, target_tokenizer, target, vocab, report)


SELF_DRAFT_ELSEWHERE = 'draft="skip" (the target drafting with layers skipped) or another draft model (draft=MODEL)'
"""What drafts off the CPU where `draft="self"` cannot (`check_self_draft_device`'s advice to `api.load`'s callers)."""


def check_self_draft_device(device: "torch.device", named: str = f'draft="{SELF_DRAFT}"',
                            instead: str = SELF_DRAFT_ELSEWHERE) -> None:
    """A self-draft is the target's weights quantized, and quantization runs on CPU only: on another device a
    ConfigError names what drafts there instead (before the advice of quantize's own check, `quantize="none"`,
    which a self-draft refuses: it would draft with the target itself). `named`: the self-draft as its caller asked
    for it; `instead`: what that caller can draft with there (`specula bench --assistant self`: another model)."""
    if device.type != "cpu":
        raise ConfigError(f"{named} drafts with the target's weights quantized, which runs on CPU only, not on "
                          f"{device}; there use {instead}")


DRAFT_QUANTIZE = {"quantize": "draft_quantize"}
"""`load_draft`'s keyword for the draft's own quantization: {its name: `api.load`'s (`--draft-quantize`)}."""


def draft_quantize_named(spec: str, quantize: str | None) -> contextlib.AbstractContextManager:
    """A context in which the errors of `load_draft(spec, ..., quantize=quantize)` name the draft's quantization as
    `api.load` and the commands take it (`draft_quantize="int4"`, `--draft-quantize int4`) where they wrote
    `load_draft`'s keyword (`quantize="int4"`): when the draft has a quantization of its own (given, or a
    self-draft's int8), not the one it shares with the target (`LoadConfig.quantize`, which they name as such)."""
    if spec != SELF_DRAFT and quantize is None:
        return contextlib.nullcontext()
    return reworded(lambda message: keywords_renamed(message, DRAFT_QUANTIZE))


def _cut_vocab(draft: Any, tokenizer: Any, target: Any, vocab: Any, report: dict[str, Any] | None) -> Any:
    """`draft` with its output layer cut to its draft vocabulary (`models.draft_vocab`), noted in `report`."""
    from specula.models.draft_vocab import apply_draft_vocab

    done = apply_draft_vocab(draft, tokenizer, vocab, always=getattr(target, "eos_token_ids", ()))
    if report is not None and done is not None:
        report["vocab"] = done
    return draft


# --------------------------------------------------------------------------- compatibility


def _logit_width(model: Any) -> int | None:
    if model is None:
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None:
        return int(weight.shape[0])
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return int(size) if size is not None else None


def _label(tokenizer: Any, model: Any, given: str | None, default: str) -> str:
    if given:
        return given
    for obj in (model, tokenizer):
        name = getattr(getattr(obj, "config", obj), "name_or_path", None) or getattr(obj, "name_or_path", None)
        if name:
            return str(name)
    return default


def _id_to_token(vocab: Mapping[str, int]) -> dict[int, str]:
    return {int(i): t for t, i in vocab.items()}


def check_compatible(
    target_tokenizer: Any,
    draft_tokenizer: Any,
    target_model: Any = None,
    draft_model: Any = None,
    *,
    target_name: str | None = None,
    draft_name: str | None = None,
    target_logits: int | None = None,
    draft_logits: int | None = None,
) -> VocabCheck:
    """Check that a draft can propose tokens for a target; raise `IncompatibleModelsError` if not.

    Required: the token<->id maps agree on every id both tokenizers have (one may have extra ids
    at the end, e.g. added special tokens), the bos/eos/pad ids are equal, and each model's output
    layer covers the shared range (output layers are often padded past the tokenizer, e.g. Qwen2.5's
    151936 logits for 151665 tokens; that padding is allowed to differ). The output widths are
    `target_logits` / `draft_logits` when given (a backend's `vocab_size`), else read off the models.
    One tokenizer object passed as both is compatible with itself (its vocabulary is not compared)."""
    t_name = _label(target_tokenizer, target_model, target_name, "target")
    d_name = _label(draft_tokenizer, draft_model, draft_name, "draft")
    pair = f"target {t_name} and draft {d_name}"
    t_ids = _id_to_token(target_tokenizer.get_vocab())
    d_ids = t_ids if draft_tokenizer is target_tokenizer else _id_to_token(draft_tokenizer.get_vocab())
    t_size = max(t_ids, default=-1) + 1
    d_size = max(d_ids, default=-1) + 1
    shared = min(t_size, d_size)
    differing = [] if d_ids is t_ids else [i for i in range(shared) if t_ids.get(i) != d_ids.get(i)]
    if differing:
        examples = ", ".join(f"id {i}: {t_ids.get(i)!r} vs {d_ids.get(i)!r}" for i in differing[:3])
        raise IncompatibleModelsError(
            f"{pair} have different vocabularies ({len(differing)} of {shared} shared ids differ, e.g. {examples}); "
            f"a draft must use the target's tokenizer"
        )
    special = []
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        t_val, d_val = getattr(target_tokenizer, attr, None), getattr(draft_tokenizer, attr, None)
        if t_val != d_val:
            special.append(f"{attr.removesuffix('_token_id')} {t_val} vs {d_val}")
    if special:
        raise IncompatibleModelsError(f"{pair} have different special tokens ({'; '.join(special)})")
    t_logits = target_logits if target_logits is not None else _logit_width(target_model)
    d_logits = draft_logits if draft_logits is not None else _logit_width(draft_model)
    for name, width, tokens in ((t_name, t_logits, t_size), (d_name, d_logits, d_size)):
        if width is not None and width < min(tokens, shared):
            raise IncompatibleModelsError(
                f"{pair}: {name} has {width} logits, fewer than the {shared} ids of the shared vocabulary"
            )
    return VocabCheck(shared, t_size, d_size, t_logits, d_logits)


_MOVED = {"DRAFT_METHODS": "specula.methods (MethodSpec.draft_model)", "auto_draft": "specula.draft_choice.auto_draft",
          "AUTO_DRAFT": "specula.draft_choice.AUTO_DRAFT", "AUTO_DRAFT_QUANTIZE": "specula.draft_choice.AUTO_DRAFT_QUANTIZE",
          "SELF_DRAFT_MIN_PARAMETERS": "specula.draft_choice.SELF_DRAFT_MIN_PARAMETERS"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        raise AttributeError(f"specula.models.loading.{name} moved: use {_MOVED[name]}")
    raise AttributeError(f"module 'specula.models.loading' has no attribute {name!r}")
