"""Hugging Face `model.generate` peers, run in the same process on the same model objects.

    hf:greedy               plain greedy (or sampling) `generate`
    hf:assisted             `assistant_model=draft` with the assistant's default schedule
                            (transformers: 20 tokens, "constant", confidence threshold 0.4)
    hf:assisted-heuristic   the same with num_assistant_tokens_schedule="heuristic"
                            (state persists across calls, as in transformers)
    hf:prompt-lookup        `prompt_lookup_num_tokens=10`

Every peer gets an explicit `GenerationConfig`: the same max_new_tokens and EOS ids as the
specula methods, and neutral processors (no repetition penalty), so a checkpoint's
generation_config.json cannot change what is compared. Peers are not required to match plain
decoding token for token (their identical fraction is reported anyway).
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from typing import Iterator, Literal, Sequence

import torch
from transformers import LogitsProcessorList

from specula.models.device import sync_device
from specula.bench.methods import MethodOutput
from specula.errors import ConfigError
from specula.models.hf import context_window
from specula.models.loading import NO_DRAFT, DraftInfo
from specula.models.attention import causal_prefill
from specula.sampling import SamplingParams

PEERS = ("hf:greedy", "hf:assisted", "hf:assisted-heuristic", "hf:prompt-lookup")
"""All peer names, in report order."""
NEEDS_DRAFT = frozenset({"hf:assisted", "hf:assisted-heuristic"})
PROMPT_LOOKUP_TOKENS = 10
"""`prompt_lookup_num_tokens` of hf:prompt-lookup."""
HF_BASELINE = "hf:greedy"
"""The peer `speedup_vs_hf` is measured against."""


def parse_compare(value: str | None, has_draft: bool) -> list[str]:
    """`--compare hf` -> every Hugging Face peer that applies (assisted ones need --draft);
    `llamacpp` / `llamacpp:prompt-lookup` -> llama.cpp peers (`specula.bench.llamacpp`); or a comma
    list of peer names."""
    from specula.bench.llamacpp import LLAMACPP_PEERS, check_available

    if not value:
        return []
    names: list[str] = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        if item == "hf":
            names.extend(p for p in PEERS if has_draft or p not in NEEDS_DRAFT)
            continue
        if item in LLAMACPP_PEERS:
            check_available()  # the install command, before any model loads
            names.append(item)
            continue
        if item not in PEERS:
            raise ConfigError(f"unknown peer {item!r} for --compare; use hf (all) or some of: "
                              f"{', '.join([*PEERS, *LLAMACPP_PEERS])}")
        if item in NEEDS_DRAFT and not has_draft:
            raise ConfigError(f"peer {item} needs a draft model: pass --draft MODEL")
        names.append(item)
    return list(dict.fromkeys(names))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence transformers' per-call advice (it would break the progress bar)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


class HFPeer:
    """One `model.generate` configuration."""

    kind: Literal["hf"] = "hf"
    lossless = False

    def __init__(self, name: str, model, eos_token_ids: Sequence[int], assistant=None, tokenizer=None,
                 assistant_info: DraftInfo = NO_DRAFT) -> None:
        self.tokenizer = tokenizer
        """The target's tokenizer, for prompts with a constraint (llguidance reads it)."""
        if name not in PEERS:
            raise ConfigError(f"unknown peer {name!r}; choose from: {', '.join(PEERS)}")
        if name in NEEDS_DRAFT and assistant is None:
            raise ConfigError(f"peer {name} needs a draft model: pass assistant= (the draft's model object)")
        self.name = name
        self.model = model
        self.context_window = context_window(model.config)
        """The model's context window (its config's), which `generate` does not keep to by itself."""
        self.eos = sorted(int(e) for e in eos_token_ids)
        self.assistant = assistant if name in NEEDS_DRAFT else None
        self.assistant_info = assistant_info
        """The assistant model as loaded (its name and quantization; `LoadReport.draft`)."""
        self.draft = assistant_info if self.assistant is not None else NO_DRAFT
        """The draft model it drafts with: its assistant's `assistant_info`, or `NO_DRAFT`."""
        # Each assisted peer keeps its own copy of the assistant's generation config (the heuristic
        # schedule writes its state there), swapped in for its calls only.
        self._assistant_config = None
        if self.assistant is not None:
            self._assistant_config = copy.deepcopy(self.assistant.generation_config)
            if name == "hf:assisted-heuristic":
                self._assistant_config.num_assistant_tokens_schedule = "heuristic"

    def fresh(self) -> "HFPeer":
        """The same peer as new (a bench round's methods are built afresh): an assisted peer's
        heuristic schedule, learned in its calls, starts over."""
        return HFPeer(self.name, self.model, self.eos, self.assistant, self.tokenizer, self.assistant_info)

    def generation_config(self, params: SamplingParams):
        """The explicit config: same budget and EOS rule as specula, neutral processors."""
        from transformers import GenerationConfig

        sampling = not params.greedy
        cfg = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.min_new_tokens,
            do_sample=sampling,
            num_beams=1,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            eos_token_id=[] if params.ignore_eos else list(self.eos),
            pad_token_id=self.eos[0] if self.eos else None,
        )
        if sampling:
            cfg.temperature = params.temperature
            cfg.top_k = params.top_k  # 0 disables, as in specula
            cfg.top_p = params.top_p
            cfg.typical_p = 1.0
            cfg.min_p = params.min_p
        if self.name == "hf:prompt-lookup":
            cfg.prompt_lookup_num_tokens = PROMPT_LOOKUP_TOKENS
        return cfg

    @contextlib.contextmanager
    def _assistant_state(self) -> Iterator[dict]:
        """For the call: the target's own generation config set aside (transformers fills every
        field the explicit config leaves unset from it: suppress_tokens, bad_words_ids, ...), and
        the assistant's swapped for this peer's copy."""
        from transformers import GenerationConfig

        saved_target = self.model.generation_config
        self.model.generation_config = GenerationConfig()
        saved = self.assistant.generation_config if self.assistant is not None else None
        if self.assistant is not None:
            self.assistant.generation_config = self._assistant_config
        try:
            yield {} if self.assistant is None else {"assistant_model": self.assistant}
        finally:
            self.model.generation_config = saved_target
            if self.assistant is not None:
                self.assistant.generation_config = saved

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, constraint=None) -> MethodOutput:
        if params.stop:
            raise ConfigError("Hugging Face peers do not take stop strings in the bench; drop stop= from the "
                              "SamplingParams")
        cfg = self.generation_config(params)
        if constraint is not None:
            if self.tokenizer is None:
                raise ConfigError("a constrained Hugging Face peer needs the target's tokenizer")
            extra_processors = {"logits_processor": LogitsProcessorList(
                [GrammarLogitsProcessor(constraint, self.tokenizer, len(prompt_ids), self.eos)])}
        else:
            extra_processors = {}
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # [1, prompt]
        mask = torch.ones_like(input_ids)
        if not params.greedy and params.seed is not None:
            torch.manual_seed(params.seed)
        with _quiet(), self._assistant_state() as extra, torch.inference_mode():
            sync_device(device)
            t0 = time.perf_counter()
            with causal_prefill():  # batch-invariant attention (int8): prefill and candidate checks on sdpa
                out = self.model.generate(input_ids, attention_mask=mask, generation_config=cfg, **extra,
                                          **extra_processors)  # [1, prompt + new]
            sync_device(device)
            seconds = time.perf_counter() - t0
        return MethodOutput(out[0, input_ids.shape[1]:].tolist(), seconds, None)

    def memory_bytes(self) -> int | None:
        return None


class GrammarLogitsProcessor:
    """The constraint as a Hugging Face logits processor (llguidance's matcher, the same grammar
    specula masks with): forbidden tokens at -inf. It re-syncs the matcher to the ids it is
    called with (rolling back what they no longer hold), so assisted generation, which scores
    candidate positions that may be rejected, gets the mask of each position."""

    def __init__(self, constraint, tokenizer, prompt_len: int, eos_token_ids: Sequence[int]) -> None:
        self.constraint, self.tokenizer, self.prompt_len = constraint, tokenizer, prompt_len
        self.eos = list(eos_token_ids)
        self._matcher = None
        self._consumed: list[int] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from llguidance import LLMatcher

        from specula.constraints import grammar_tokenizer
        from specula.constraints.matcher import unpack_bitmask

        vocab = scores.shape[-1]
        if self._matcher is None:
            self._matcher = LLMatcher(grammar_tokenizer(self.tokenizer, vocab, self.eos), self.constraint.grammar_text())
        ids = input_ids[0, self.prompt_len:].tolist()
        common = 0
        while common < min(len(ids), len(self._consumed)) and ids[common] == self._consumed[common]:
            common += 1
        if len(self._consumed) > common:
            self._matcher.rollback(len(self._consumed) - common)
            del self._consumed[common:]
        for tok in ids[common:]:
            if self._matcher.is_stopped() or not self._matcher.consume_token(tok):
                break
            self._consumed.append(tok)
        allowed = unpack_bitmask(self._matcher.compute_bitmask(), vocab).to(scores.device)  # [vocab]
        return scores.masked_fill(~allowed, float("-inf"))


def build_peers(names: Sequence[str], model, eos_token_ids: Sequence[int], assistant=None, tokenizer=None,
                assistant_info: DraftInfo = NO_DRAFT) -> list[HFPeer]:
    """Peers on the target's (and draft's) model objects (`tokenizer`: for constrained prompts;
    `assistant_info`: the assistant as loaded, the assisted peers' `draft`)."""
    return [HFPeer(name, model, eos_token_ids, assistant, tokenizer, assistant_info) for name in names]
