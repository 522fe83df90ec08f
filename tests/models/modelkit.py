"""Helpers and fixtures for the model tests: a private cache, fake PyPI packages, tiny models and
tokenizers. (A uniquely named module, imported by `conftest.py` and the tests: `conftest` itself is
ambiguous with `tests/conftest.py` on sys.path.)

Nothing here touches the network or the real `~/.cache/specula`: `SPECULA_CACHE` points into
`tmp_path`, installed-package metadata and `pip` are replaced by an in-memory fake index.
"""

from __future__ import annotations

import hashlib
import itertools
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pytest

from specula.models import install as install_mod
from specula.models import registry
from specula.models.registry import EmbeddedModel, Part


@dataclass
class FakeDist:
    """Just enough of `importlib.metadata.Distribution` for `specula.models.install`."""

    name: str
    version: str
    root: Path
    files: list[PurePosixPath]

    def locate_file(self, path: object) -> Path:
        return self.root / str(path)


@dataclass
class FakeIndex:
    """A fake PyPI (what pip can install) plus a fake site-packages (what is installed)."""

    root: Path
    published: dict[tuple[str, str], dict[str, bytes]] = field(default_factory=dict)
    installed: dict[str, FakeDist] = field(default_factory=dict)
    pip_calls: list[list[str]] = field(default_factory=list)
    pip_error: str | None = None

    def publish(self, name: str, version: str, files: dict[str, bytes]) -> None:
        self.published[(name, version)] = files

    def install_now(self, name: str, version: str) -> FakeDist:
        files = self.published[(name, version)]
        root = self.root / "site-packages" / f"{name}-{version}"
        for rel, data in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
        dist = FakeDist(name, version, root, [PurePosixPath(rel) for rel in files])
        self.installed[name] = dist
        return dist

    def distribution(self, name: str) -> FakeDist | None:
        return self.installed.get(name)

    def run_pip(self, args: list[str], *, progress: bool) -> subprocess.CompletedProcess[str]:
        self.pip_calls.append(list(args))
        if self.pip_error is not None:
            return subprocess.CompletedProcess(args, 1, "", f"ERROR: {self.pip_error}\n")
        for requirement in (a for a in args if "==" in a):
            name, version = requirement.split("==")
            if (name, version) not in self.published:
                return subprocess.CompletedProcess(
                    args, 1, "", f"ERROR: No matching distribution found for {requirement}\n"
                )
            self.install_now(name, version)
        return subprocess.CompletedProcess(args, 0, "", "")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty specula cache (`SPECULA_CACHE`)."""
    root = tmp_path / "specula-cache"
    monkeypatch.setenv("SPECULA_CACHE", str(root))
    return root


@pytest.fixture
def fake_index(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> FakeIndex:
    """Installed-package metadata and pip replaced by an in-memory index."""
    index = FakeIndex(tmp_path / "fake-pypi")
    monkeypatch.setattr(install_mod, "_distribution", index.distribution)
    monkeypatch.setattr(install_mod, "_run_pip", index.run_pip)
    return index


ModelFactory = Callable[..., EmbeddedModel]


@pytest.fixture
def make_model(fake_index: FakeIndex, monkeypatch: pytest.MonkeyPatch) -> ModelFactory:
    """`make_model(alias, chunks, packages=None, sha256=None)`: publish `chunks` (the parts of a
    file, in order) as fake packages and register an embedded model made of them.

    `packages[i]` names the package carrying chunk i (default: one package per chunk), so several
    parts can live in one package."""

    def factory(
        alias: str,
        chunks: list[bytes],
        packages: list[str] | None = None,
        sha256: str | None = None,
        version: str = "1.0",
    ) -> EmbeddedModel:
        packages = packages or [f"{alias}-part{i + 1}" for i in range(len(chunks))]
        files: dict[str, dict[str, bytes]] = {}
        parts = []
        for i, (chunk, package) in enumerate(zip(chunks, packages, strict=True)):
            rel = f"{package.replace('-', '_')}/data/part{i + 1:02d}.bin"
            files.setdefault(package, {})[rel] = chunk
            parts.append(Part(package, version, rel))
        for package, content in files.items():
            fake_index.publish(package, version, content)
        blob = b"".join(chunks)
        model = EmbeddedModel(
            alias=alias,
            display_name=f"Fake {alias}",
            hf_name=f"fake/{alias}",
            parameters=1000,
            role="target",
            parts=tuple(parts),
            sha256=sha256 or hashlib.sha256(blob).hexdigest(),
            gguf_filename=f"{alias}.gguf",
            size_bytes=len(blob),
            quantization="F32",
        )
        monkeypatch.setitem(registry.EMBEDDED_MODELS, alias, model)
        return model

    return factory


def fake_converter(gguf: Path, out: Path) -> dict[str, object]:
    """Stands in for the transformers conversion: the GGUF's bytes as the one tensor of the 'weights'
    (`fake_weights` reads them back)."""
    import torch
    from safetensors.torch import save_file

    save_file({"gguf": torch.frombuffer(bytearray(gguf.read_bytes()), dtype=torch.uint8)}, str(out / "model.safetensors"))
    (out / "config.json").write_text("{}\n")
    return {"parameters": 1, "max_abs_logit_diff": 0.0}


def fake_weights(directory: Path) -> bytes:
    """The GGUF bytes `fake_converter` wrote into `directory`."""
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))["gguf"].numpy().tobytes()


# --------------------------------------------------------------------------- tiny real models


def _byte_alphabet() -> list[str]:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import bytes_to_unicode

    spelling = bytes_to_unicode()
    return [spelling[b] for b in range(256)]


QUANTIZED_GGUF_TYPES = ("Q8_0", "Q5_0", "Q4_1", "Q4_K", "Q6_K")
"""The block types of the embedded models' GGUFs, which `write_tiny_gguf(quantized=True)` cycles
through for the matrices."""
GGUF_HALF_OFFSETS = {"Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
"""Byte offsets of the float16 fields (scales, minimums) in a block of each of those types."""


def random_gguf_blocks(qtype_name: str, count: int, rng: np.random.Generator,
                       halves: Callable[[int], np.ndarray]) -> np.ndarray:
    """`count` blocks of `qtype_name` [count, block bytes] uint8: random quants, each float16 field
    from `halves(count)` (float16 [count])."""
    import gguf

    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype_name]][1]
    blocks = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)
    for offset in GGUF_HALF_OFFSETS[qtype_name]:
        blocks[:, offset : offset + 2] = halves(count).astype(np.float16).view(np.uint8).reshape(count, 2)
    return blocks


def _quantized(tensor: np.ndarray, qtype_name: str, rng: np.random.Generator) -> tuple[np.ndarray, Any]:
    """`tensor` [rows, cols] as GGUF blocks of `qtype_name` ([rows, row bytes] uint8, the type): gguf-py
    quantizes the types it can; the K types (it only dequantizes them) get random blocks whose
    float16 scales are small and finite."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    if qtype_name not in ("Q4_K", "Q6_K"):
        return gguf.quants.quantize(tensor, qtype), qtype
    rows, cols = tensor.shape
    count = rows * cols // gguf.GGML_QUANT_SIZES[qtype][0]
    blocks = random_gguf_blocks(qtype_name, count, rng, lambda n: 1e-3 * rng.standard_normal(n))
    return blocks.reshape(rows, -1), qtype


def write_tiny_gguf(path: Path, *, tie: bool = True, seed: int = 0, hidden: int = 32, layers: int = 2,
                    quantized: bool = False) -> Path:
    """A tiny random llama-architecture GGUF (float32 tensors, byte-level BPE tokenizer with two
    control tokens and a chat template) that transformers can load with `gguf_file=`. `quantized`:
    its matrices in the block types of `QUANTIZED_GGUF_TYPES`, in turn (`hidden` a multiple of 256;
    the MLP as wide)."""
    import gguf

    rng = np.random.default_rng(seed)
    heads, kv_heads, ffn = 4, 2, hidden if quantized else 64
    kinds = itertools.cycle(QUANTIZED_GGUF_TYPES)
    tokens = [*_byte_alphabet(), "Ġt", "he", "Ġthe", "Ġa", "<|endoftext|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["Ġ t", "h e", "Ġt he", "Ġ a"])
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)
    writer.add_pad_token_id(vocab - 2)
    writer.add_chat_template(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )

    def tensor(*shape: int, base: float = 0.0) -> np.ndarray:
        return (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)

    def matrix(name: str, rows: int, cols: int) -> None:
        if not quantized:
            writer.add_tensor(name, tensor(rows, cols))
            return
        blocks, qtype = _quantized(tensor(rows, cols), next(kinds), rng)
        writer.add_tensor(name, blocks, raw_dtype=qtype)

    head_dim = hidden // heads
    matrix("token_embd.weight", vocab, hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", tensor(hidden, base=1.0))
        matrix(f"blk.{i}.attn_q.weight", hidden, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", tensor(hidden, base=1.0))
        matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_up.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.add_tensor("output_norm.weight", tensor(hidden, base=1.0))
    if not tie:
        matrix("output.weight", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny tied-embedding llama GGUF (see `write_tiny_gguf`)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


def word_tokenizer(words: list[str], *, eos: str = "<eos>", pad: str = "<pad>", bos: str | None = None,
                   name: str = "tiny"):
    """`tiny.word_tokenizer` over `words` with the special tokens the compatibility checks read."""
    import tiny

    special = {"eos_token": eos, "pad_token": pad, "unk_token": words[0]}
    if bos is not None:
        special["bos_token"] = bos
    return tiny.word_tokenizer(words, name=name, **special)
