"""llama.cpp as a benchmark peer: the very GGUF file the model came from, through llama-cpp-python.

    llamacpp                plain decoding (greedy, or sampling with the same parameters)
    llamacpp:prompt-lookup  llama-cpp-python's `LlamaPromptLookupDecoding` (10 tokens a step)

What a CPU user would run instead of specula. llama-cpp-python is an optional extra: PyPI has it
only as source, and building it compiles llama.cpp (about 15 minutes on the 2-core development
machine): `pip install 'specula[llamacpp]'`. The peer runs the GGUF's own quantized weights
(Q4_1, Q4_K_M), so it is timed, never held to token identity with specula's float32 model.
Prompts are passed as token ids (the GGUF's tokenizer is the one specula converted), and the
KV cache is reset before every generation, as specula's methods start each from scratch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal, Sequence

from specula.bench.methods import MethodOutput
from specula.errors import ConfigError
from specula.models.loading import NO_DRAFT
from specula.sampling import SamplingParams

LLAMACPP_PEERS = ("llamacpp", "llamacpp:prompt-lookup")
"""Peer names accepted by `--compare`."""
PROMPT_LOOKUP_TOKENS = 10
INSTALL_HINT = ("pip install 'specula[llamacpp]' (llama-cpp-python; it compiles llama.cpp, about 15 minutes on a "
                "2-core machine)")


def gguf_of(spec: str) -> Path:
    """The GGUF file a target spec comes from: the embedded model's verified GGUF (assembled for split
    models), or the spec itself when it is a .gguf file."""
    from specula.models.install import assemble, verified_gguf
    from specula.models.registry import get_embedded

    embedded = get_embedded(spec)
    if embedded is not None:
        return verified_gguf(embedded, rehash=False) or assemble(embedded, progress=True)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    raise ConfigError(f"llama.cpp peers run GGUF files: give --target as an embedded alias or a .gguf file "
                      f"(got {spec!r}), or drop llamacpp from --compare")


def check_available() -> None:
    """A `ConfigError` with the install command when llama-cpp-python is missing."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise ConfigError(f"--compare llamacpp needs llama-cpp-python: {INSTALL_HINT}") from None


class LlamaCppPeer:
    """One llama.cpp configuration on a GGUF file."""

    kind: Literal["llamacpp"] = "llamacpp"
    lossless = False
    draft = NO_DRAFT  # prompt lookup drafts without a model

    def __init__(self, name: str, gguf: Path, eos_token_ids: Sequence[int], threads: int | None = None,
                 n_ctx: int = 4096) -> None:
        if name not in LLAMACPP_PEERS:
            raise ConfigError(f"unknown llama.cpp peer {name!r}; choose from: {', '.join(LLAMACPP_PEERS)}")
        check_available()
        from llama_cpp import Llama

        kwargs = {}
        if name == "llamacpp:prompt-lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            # `draft_model` needs the logits of every position kept (logits_all).
            kwargs = {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS),
                      "logits_all": True}
        threads = threads or int(os.environ.get("SPECULA_LLAMACPP_THREADS", 0)) or (os.cpu_count() or 1)
        self.name = name
        self.gguf = Path(gguf)
        self.eos = frozenset(int(e) for e in eos_token_ids)
        self.context_window = n_ctx
        """llama.cpp's context (`n_ctx`): its prompt and output together."""
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         verbose=False, **kwargs)


    def fresh(self) -> "LlamaCppPeer":
        """This peer for a new bench round: the loaded model itself (it learns nothing from its calls)."""
        return self
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, constraint=None) -> MethodOutput:
        if constraint is not None:
            raise ConfigError("the llama.cpp peers do not take constraints in the bench; drop --compare llamacpp "
                              "for --prompts structured")
        if params.stop:
            raise ConfigError("llama.cpp peers do not take stop strings in the bench; drop --stop")
        if params.min_new_tokens:
            raise ConfigError("llama.cpp peers do not take a minimum length in the bench; drop --min-new-tokens")
        llm = self.llm
        sampling = {"temp": 0.0, "top_k": 1} if params.greedy else {
            "temp": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p}
        if not params.greedy and params.seed is not None:
            llm.set_seed(int(params.seed))
        out: list[int] = []
        t0 = time.perf_counter()
        llm.reset()
        for token in llm.generate(list(prompt_ids), repeat_penalty=1.0, reset=True, **sampling):
            out.append(int(token))
            if (token in self.eos and not params.ignore_eos) or len(out) >= params.max_new_tokens:
                break
        return MethodOutput(out, time.perf_counter() - t0, None)

    def memory_bytes(self) -> int | None:
        return None


def build_llamacpp_peers(names: Sequence[str], target_spec: str, eos_token_ids: Sequence[int],
                         threads: int | None = None) -> list[LlamaCppPeer]:
    if not names:
        return []
    check_available()
    gguf = gguf_of(target_spec)
    return [LlamaCppPeer(name, gguf, eos_token_ids, threads) for name in names]
