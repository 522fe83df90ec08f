"""Turn a model name into a loaded model and tokenizer, and check that a draft fits a target.

A model spec is one of, in this order of precedence:

* an embedded alias (`specula models list`), loaded from its converted cache directory;
* a path to a `.gguf` file (dequantised by transformers at load: slow for big models);
* a path to a local Hugging Face directory (`config.json` + weights), or to a directory holding
  exactly one `.gguf` file;
* a Hugging Face hub id (`org/name`) already in the local hub cache; nothing is downloaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from specula.errors import ConfigError, IncompatibleModelsError, ModelNotFoundError, SpeculaError
from specula.models.registry import EMBEDDED_MODELS, EmbeddedModel, get_embedded

if TYPE_CHECKING:
    import torch

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
        return ResolvedModel(spec, "gguf", directory, gguf_file=ggufs[0])
    found = f"{len(ggufs)} .gguf files" if ggufs else "no .gguf file"
    raise ModelNotFoundError(
        f"{spec!r} is a directory without config.json and with {found}; give a Hugging Face model directory "
        f"or the path of one .gguf file"
    )


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


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of: {', '.join(_DTYPES)}")
    return getattr(torch, dtype)


def load_model(
    spec: str | ResolvedModel, *, dtype: str | torch.dtype = "float32", attn_implementation: str = "auto",
    quantize: str = "none", linear_kernel: str = "auto", device: str | torch.device = "cpu",
) -> tuple[Any, Any]:
    """Load `(model, tokenizer)` for a model spec (see `resolve`), offline.

    The model is in eval mode with gradients disabled (use it under `torch.inference_mode()`).
    `quantize="int8"` swaps its linear layers for batch-invariant int8 ones (`specula.models.quantize`);
    `attn_implementation="auto"` then picks batch-invariant attention (`specula.models.attention`).
    `linear_kernel="auto"` runs a float32 CPU model's linears through oneDNN with prepacked weights
    (`specula.models.prepack`); "aten" keeps `F.linear`.
    `device` (a resolved `torch.device` or its name): weights are loaded straight onto it (no float32
    copy on the host for a bfloat16 CUDA model).
    Only local files are read; loading errors become `SpeculaError`s naming the spec."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specula.models.attention import transformers_name
    from specula.models.device import check_cpu_only
    from specula.models.prepack import prepack_model, resolve_linear_kernel
    from specula.models.quantize import check_quantize, quantize_model

    device = torch.device(device)
    check_quantize(quantize)
    if quantize != "none":
        check_cpu_only(f"--quantize {quantize}", device, "use --quantize none (bfloat16 is the default on CUDA)")
    attn_name = transformers_name(attn_implementation, quantize)
    resolved = spec if isinstance(spec, ResolvedModel) else resolve(spec)
    torch_dtype = _torch_dtype(dtype)
    # checked before the (slow) load
    kernel = resolve_linear_kernel(linear_kernel, dtype=torch_dtype, device=device.type, quantize=quantize)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if resolved.gguf_file is not None:
        kwargs["gguf_file"] = str(resolved.gguf_file)
    if device.type != "cpu":
        kwargs["device_map"] = {"": str(device)}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(resolved.path), dtype=torch_dtype, attn_implementation=attn_name, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(str(resolved.path), **kwargs)
    except ImportError as exc:
        raise SpeculaError(f"loading {resolved.name} needs a missing package: {exc}") from exc
    except (OSError, ValueError, KeyError) as exc:
        raise SpeculaError(f"could not load model {resolved.spec!r} from {resolved.path}: {exc}") from exc
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

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; choose one of: {', '.join(BACKENDS)}")

    def resolved(self) -> tuple["torch.device", "torch.dtype"]:
        """(device, dtype) this config means on this machine (checked: a `ConfigError` names the fix)."""
        from specula.models.device import resolve_device, resolve_dtype

        device = resolve_device(self.device)
        return device, resolve_dtype(self.dtype, device)


BACKENDS = ("auto", "native", "hf")
"""Values of `--backend` / `LoadConfig.backend`."""


def _architecture(resolved: ResolvedModel) -> str:
    """The model class a spec loads as, read from its config alone (no weights)."""
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"local_files_only": True}
    if resolved.gguf_file is not None:
        kwargs["gguf_file"] = str(resolved.gguf_file)
    try:
        config = AutoConfig.from_pretrained(str(resolved.path), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise SpeculaError(f"could not read the config of {resolved.spec!r} from {resolved.path}: {exc}") from exc
    named = getattr(config, "architectures", None)
    if named:
        return named[0]
    # A config read from a .gguf names no class: the one AutoModelForCausalLM builds for its model type.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""), "")


def load_backend(spec: str, config: LoadConfig = LoadConfig(), name: str = "model") -> tuple[Any, Any]:
    """Load a model (alias, local dir, .gguf file or cached hub id) as a backend
    (`specula.models.base.TargetModel`) + its tokenizer. EOS ids: the model's and the tokenizer's.

    The native backend is built from the Hugging Face model's weights (q|k|v and gate|up fused),
    then given the configured kernels; the Hugging Face model itself is dropped and reloaded only if
    a caller asks for `reference_model()` (the bench's peers)."""
    from specula.models.attention import resolve_attention
    from specula.models.hf import HFCausalLM, eos_ids_of
    from specula.models.native import ARCHITECTURES

    device, dtype = config.resolved()
    resolved = spec if isinstance(spec, ResolvedModel) else resolve(spec)
    backend = config.backend
    if backend != "hf":
        arch = _architecture(resolved)
        if arch not in ARCHITECTURES:
            if backend == "native":
                raise ConfigError(f"--backend native runs {', '.join(ARCHITECTURES)}; {resolved.name} is "
                                  f"{arch or 'another architecture'}: use --backend hf")
            backend = "hf"
    kwargs = dict(dtype=dtype, attn_implementation=config.attn_implementation, quantize=config.quantize,
                  linear_kernel="auto" if config.linear_kernel == "specula" else config.linear_kernel, device=device)
    if backend == "hf":
        model, tokenizer = load_model(resolved, **kwargs)
        return HFCausalLM(model, name=f"{name} {resolved.spec}", eos_token_ids=eos_ids_of(model, tokenizer)), tokenizer
    return _load_native(resolved, config, name, kwargs, resolve_attention(config.attn_implementation, config.quantize))


def _load_native(resolved: ResolvedModel, config: LoadConfig, name: str, kwargs: dict, attention: str):
    import torch

    from specula.models.device import check_cpu_only
    from specula.models.hf import eos_ids_of
    from specula.models.native import NativeCausalLM, NativeDecoder, configure
    from specula.models.prepack import resolve_linear_kernel
    from specula.models.quantize import check_quantize

    device, dtype = kwargs["device"], kwargs["dtype"]
    check_quantize(config.quantize)
    if config.quantize != "none":
        check_cpu_only(f"--quantize {config.quantize}", device, "use --quantize none (bfloat16 is the default on CUDA)")
    kernel = resolve_linear_kernel(config.linear_kernel, dtype=dtype, device=device.type, quantize=config.quantize,
                                   native=True)
    model, tokenizer = load_model(resolved, dtype=dtype, attn_implementation="sdpa", quantize="none",
                                  linear_kernel="aten", device=device)
    eos = eos_ids_of(model, tokenizer)
    model_id = str(getattr(model.config, "_name_or_path", "")) or resolved.name
    with torch.no_grad():
        decoder = NativeDecoder.from_hf(model)
    del model  # the decoder holds what it needs; the peers' model is reloaded on demand
    configure(decoder, kernel, config.quantize, attention)
    backend = NativeCausalLM(decoder, name=f"{name} {resolved.spec}", eos_token_ids=eos,
                             reference=lambda: load_model(resolved, **kwargs)[0], model_id=model_id)
    return backend, tokenizer


SELF_DRAFT = "self"
"""`--draft self`: the target's own weights as the draft, quantized (`--draft-quantize`, int8 by default)."""
AUTO_DRAFT = "auto"
"""`--draft auto` (the default): the target's embedded companion draft, else `self`, where a draft
can pay (see `auto_draft`), else none."""
SELF_DRAFT_MIN_PARAMETERS = 1_000_000_000
"""Targets from this size get a model draft by default: below it, a draft token costs too large a
share of a target step on CPU (measured: SmolLM2-135M int8 12 ms against 24 ms float32)."""
DRAFT_METHODS = ("fusion", "draft-model", "draft-tree")
AUTO_DRAFT_QUANTIZE = "int8"
"""How `--draft auto` quantizes the draft it picks (a draft needs speed and agreement, not exactness)."""


def auto_draft(method: str, target: Any, target_name: str | None = None) -> str | None:
    """What `--draft auto` means for `method` on a loaded target, on CPU, for targets of >= 1B
    parameters: the embedded draft registered for the target (`EmbeddedModel.draft`) when it is
    installed, else `self`; None otherwise. Measured on Qwen2.5-Coder-1.5B (4 prompts off
    Spec-Bench, 64 tokens, 2 threads): the 0.5B int8 draft 1.79x plain decoding with 5-token chains
    (1.76x in `fusion`), the int8 self-draft 1.52x (1.26x in `fusion`): its token costs 0.33 of a
    target step against ~0.1 for the 0.5B, and its higher agreement does not make up for it."""
    from specula.models.install import is_valid_conversion
    from specula.models.registry import get_embedded

    if method not in DRAFT_METHODS or target.device.type != "cpu":
        return None
    if target.num_parameters < SELF_DRAFT_MIN_PARAMETERS:
        return None
    embedded = get_embedded(target_name) if target_name else None
    companion = get_embedded(embedded.draft) if embedded is not None and embedded.draft else None
    if companion is not None and is_valid_conversion(companion):
        return companion.alias
    return SELF_DRAFT


def load_draft(spec: str, target_tokenizer: Any, target: Any, config: LoadConfig = LoadConfig(),
               target_name: str | None = None, quantize: str | None = None, skip_layers: str | None = None) -> Any:
    """Load a draft backend and check that it can propose tokens for `target` (same tokenizer,
    `check_compatible`); raises `IncompatibleModelsError` naming the difference.

    `spec` "self" loads the target's own weights again (`target_name` is the target's spec; the
    converted cache is reused, nothing is converted twice), quantized by `quantize` (default int8:
    the draft needs no exactness, only speed and agreement). `quantize` applies to the draft only;
    the target keeps its own dtype and kernels. `spec` "skip" is the target itself with decoder
    sub-layers skipped (`skipping.LayerSkipDraft`; `skip_layers` fixes the set, else it is searched)."""
    from dataclasses import replace

    from specula.models.quantize import check_quantize
    from specula.models.skipping import SKIP_DRAFT, layer_skip_draft

    if spec == SKIP_DRAFT:
        return layer_skip_draft(target, skip_layers, quantize)
    if skip_layers is not None:
        raise ConfigError("--skip-layers applies to --draft skip only (the target drafting with layers skipped); "
                          "add --draft skip or drop --skip-layers")

    if spec == SELF_DRAFT:
        if target_name is None:
            raise ConfigError("a self-draft needs the target's model name")
        quantize = check_quantize(quantize or "int8")
        if quantize == "none":
            raise ConfigError("--draft self with --draft-quantize none would draft with the target itself; "
                              "use --draft-quantize int8 (or another --draft model)")
        draft, _ = load_backend(target_name, replace(config, quantize=quantize), "self-draft")
        return draft
    if quantize is not None:
        config = replace(config, quantize=check_quantize(quantize))
    draft, draft_tokenizer = load_backend(spec, config, "draft")
    check_compatible(target_tokenizer, draft_tokenizer, target.reference_model(), draft.reference_model(),
                     target_name=target_name or target.name, draft_name=spec)
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
) -> VocabCheck:
    """Check that a draft can propose tokens for a target; raise `IncompatibleModelsError` if not.

    Required: the token<->id maps agree on every id both tokenizers have (one may have extra ids
    at the end, e.g. added special tokens), the bos/eos/pad ids are equal, and each model's output
    layer covers the shared range (output layers are often padded past the tokenizer, e.g. Qwen2.5's
    151936 logits for 151665 tokens; that padding is allowed to differ)."""
    t_name = _label(target_tokenizer, target_model, target_name, "target")
    d_name = _label(draft_tokenizer, draft_model, draft_name, "draft")
    pair = f"target {t_name} and draft {d_name}"
    t_ids = _id_to_token(target_tokenizer.get_vocab())
    d_ids = _id_to_token(draft_tokenizer.get_vocab())
    t_size = max(t_ids, default=-1) + 1
    d_size = max(d_ids, default=-1) + 1
    shared = min(t_size, d_size)
    differing = [i for i in range(shared) if t_ids.get(i) != d_ids.get(i)]
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
    t_logits, d_logits = _logit_width(target_model), _logit_width(draft_model)
    for name, width, tokens in ((t_name, t_logits, t_size), (d_name, d_logits, d_size)):
        if width is not None and width < min(tokens, shared):
            raise IncompatibleModelsError(
                f"{pair}: {name} has {width} logits, fewer than the {shared} ids of the shared vocabulary"
            )
    return VocabCheck(shared, t_size, d_size, t_logits, d_logits)


# --------------------------------------------------------------------------- prompts


def apply_chat_template(tokenizer: Any, prompt: str | Sequence[Mapping[str, str]], raw: bool = False) -> list[int]:
    """Token ids for a prompt.

    A string is wrapped as one user message in the tokenizer's chat template (with the
    generation prompt) when the tokenizer has one, unless `raw`; without a template, or with
    `raw=True`, the string is encoded as is (with the tokenizer's usual special tokens). A list
    of `{"role", "content"}` messages always goes through the chat template."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, str):
        if raw or not has_template:
            return list(tokenizer.encode(prompt))
        messages: list[Mapping[str, str]] = [{"role": "user", "content": prompt}]
    else:
        messages = list(prompt)
        if raw:
            raise ConfigError("a raw prompt must be a string, not a list of chat messages")
        if not has_template:
            raise ConfigError("this tokenizer has no chat template; pass the prompt as a string (raw text)")
        for message in messages:
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise ConfigError(f"chat messages must be {{'role': ..., 'content': ...}} mappings, got {message!r}")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_prompt(tokenizer: Any, prompt: str | Sequence[Mapping[str, str]] | Sequence[int], raw: bool = False) -> list[int]:
    """Token ids of any prompt: text (chat template applied unless `raw`), chat messages, or token ids
    (checked against nothing but being integers). The one place prompts become ids."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ConfigError("the prompt is empty: give some text")
        return apply_chat_template(tokenizer, prompt, raw=raw)
    prompt = list(prompt)
    if not prompt:
        raise ConfigError("the prompt is empty: give some text, at least one message, or token ids")
    if isinstance(prompt[0], Mapping):
        return apply_chat_template(tokenizer, prompt, raw=raw)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ConfigError("a prompt list must hold token ids (integers) or chat messages ({'role', 'content'})")
    return [int(t) for t in prompt]
