"""A prompt's prefill, whole or in chunks (chunked prefill).

All of the prompt but its last token (the first step's root) runs causally into the session's cache, after
the tokens a prefix cache copied there. `PromptPrefill.run` runs the next `max_tokens` of them, so a server
can run a long prompt a chunk at a time between the decode steps of the requests already running, which
would otherwise wait for the whole prompt (vLLM's chunked prefill). Where the backend's rows are row
invariant (the native CPU kernels), a prompt prefilled in chunks leaves the same keys, values and hidden
states, bit for bit, as one pass over it (tested), so the output is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specula.logprobs import PROMPT_CHUNK, TokenLogprob, token_logprobs
from specula.models.base import FeatureRequest, TargetSequence


@dataclass
class PromptPrefill:
    """The part of a prompt still to be run into a sequence's cache, and what its passes returned so far."""

    tokens: list[int]
    """The prompt after what the cache held at the start (its last token is the first root and is not run)."""
    hidden: FeatureRequest = False
    """The hidden states the drafters read (False: none)."""
    cached: torch.Tensor | None = None
    """The hidden states of the tokens a prefix cache copied ([cached tokens, k E]), or None."""
    top_logprobs: int | None = None
    """The request's `prompt_logprobs` (None: not asked). Then every row's logits are kept, in passes of at
    most `PROMPT_CHUNK` tokens, and each token's logprob is read from the row before it."""
    done: int = 0
    """Tokens of `tokens` run so far."""
    passes: int = 0
    """Passes run so far."""
    states: list[torch.Tensor] = field(default_factory=list)
    """Hidden states of the passes so far, each [rows, k E] (only with `hidden`)."""
    entries: list[TokenLogprob | None] = field(default_factory=lambda: [None])
    """The prompt's logprobs so far (None for the first token; only with `top_logprobs`)."""

    @property
    def remaining(self) -> int:
        """Tokens still to run."""
        return len(self.tokens) - 1 - self.done

    @property
    def finished(self) -> bool:
        """Every token has run (a prompt with none to run after one empty pass)."""
        return self.remaining == 0 and self.passes > 0

    def run(self, seq: TargetSequence, max_tokens: int | None = None) -> None:
        """Run the next `max_tokens` tokens (None: all that remain) into `seq`'s cache. A prompt with nothing to
        run still makes one empty pass, which gives the hidden states' shape."""
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        end = self.done + (self.remaining if max_tokens is None else min(max_tokens, self.remaining))
        if end == self.done and not self.finished:
            self._pass(seq, [])
        while self.done < end:
            n = end - self.done if self.top_logprobs is None else min(end - self.done, PROMPT_CHUNK)
            ids = self.tokens[self.done: self.done + n]
            logits = self._pass(seq, ids)
            if self.top_logprobs is not None:  # logits [n, vocab]: row j decides tokens[done + j + 1]
                self.entries += token_logprobs(logits, self.tokens[self.done + 1: self.done + 1 + n], self.top_logprobs)
            self.done += n

    def _pass(self, seq: TargetSequence, ids: Sequence[int]) -> torch.Tensor | None:
        self.passes += 1
        mode = "none" if self.top_logprobs is None else "all"
        out = seq.prefill(ids, logits=mode, hidden=self.hidden) if self.hidden else seq.prefill(ids, logits=mode)
        if not self.hidden:
            return out
        logits, states = out
        self.states.append(states)
        return logits

    def features(self) -> torch.Tensor | None:
        """The hidden states of the tokens in the cache ([len(prompt) - 1, k E] once finished), the copied prefix's
        first; None where no drafter reads them."""
        if not self.hidden or not self.states:
            return self.cached if self.hidden else None
        ran = self.states[0] if len(self.states) == 1 else torch.cat(self.states)
        return ran if self.cached is None else torch.cat([self.cached, ran])
