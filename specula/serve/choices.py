"""A response's choices as their chunks arrive, in the endpoint's wire shape (no I/O).

`ChoiceState` turns one choice's `StreamChunk`s into the (text, logprobs object) pieces a response
carries (the prompt first under `echo`), and, for a chat request whose tool_choice parses the output,
into (content, tool call deltas, logprobs object) deltas (`ChoiceState.deltas`, `specula.serve.tool_calls`);
`CollectedResponse` gathers a whole non-streamed response from a job's events. The HTTP server
(streamed and not) and `specula run-batch` share them.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

from specula.api import StreamChunk
from specula.serve import protocol
from specula.serve.protocol import GenerationRequest, ResponseIds
from specula.serve.tool_calls import ToolCallOutput, join_tool_calls
from specula.serve.worker import ChoiceChunk, Started
from specula.stats import GenerationStats
from specula.token_bytes import TokenBytes


def summed(stats: list[GenerationStats]) -> GenerationStats:
    """One choice's stats, or the sum of several (a response's `speculative_decoding`)."""
    return functools.reduce(GenerationStats.merge, stats)


def cached_prompt_tokens(stats: list[GenerationStats], prompts: int) -> int:
    """Prompt tokens the response read from the prefix cache, each prompt counted once, as `usage` counts its
    tokens: the fewest any of its `n` choices read (choice i decodes prompt i // n; the first to start
    prefills what the cache lacks, and the others copy it from that one)."""
    n = len(stats) // prompts
    return sum(min(s.cached_tokens for s in stats[i * n: (i + 1) * n]) for i in range(prompts))


class LogprobsFormatter:
    """One choice's logprobs objects, in the endpoint's shape, chunk after chunk."""

    def __init__(self, gen: GenerationRequest, token_bytes: TokenBytes) -> None:
        self.token_bytes = token_bytes
        self.completions = protocol.CompletionLogprobs(token_bytes) if gen.endpoint == "completions" else None

    def add(self, token_ids: Sequence[int], entries: Sequence) -> dict[str, Any]:
        if self.completions is not None:
            return self.completions.add(token_ids, entries)
        return protocol.chat_logprobs(entries, self.token_bytes)


class ChoiceState:
    """One choice of a response as its chunks arrive: what each adds (the prompt first under
    `echo`), and its end."""

    def __init__(self, gen: GenerationRequest, started: Started, index: int, tokenizer: Any,
                 token_bytes: TokenBytes | None) -> None:
        """`tokenizer` is read only to echo a prompt given as token ids, `token_bytes` only for
        logprobs (either may be None when the request needs none)."""
        self.index = index
        source = gen.prompts[index // gen.n] if gen.echoes_prompt else None
        self.prompt_ids = started.prompts[index // gen.n]
        self.echo = None if source is None else (
            source if isinstance(source, str) else tokenizer.decode(list(self.prompt_ids), skip_special_tokens=True))
        self.formatter = LogprobsFormatter(gen, token_bytes) if gen.logprobs is not None else None
        self.tool_output = ToolCallOutput.for_request(gen.tool_use)
        """Splits the text into content and tool calls (None: the text is all content)."""
        self.first = True
        self.stats: GenerationStats | None = None

    @property
    def done(self) -> bool:
        return self.stats is not None

    @property
    def finish_reason(self) -> str:
        reason = (self.stats.finish_reason if self.stats is not None else "") or "length"
        return reason if self.tool_output is None else self.tool_output.finish_reason(reason)

    def take(self, chunk: StreamChunk) -> list[tuple[str, dict[str, Any] | None]]:
        """The (text, logprobs object or None) pieces to send for `chunk`."""
        pieces: list[tuple[str, Sequence[int], Sequence]] = []
        if self.first:
            self.first = False
            if self.echo is not None:
                prompt = chunk.prompt_logprobs
                pieces.append((self.echo, self.prompt_ids if prompt is not None else (), prompt or ()))
        if chunk.text or (self.formatter is not None and chunk.token_ids):  # stop strings are already cut
            pieces.append((chunk.text, chunk.token_ids, chunk.logprobs or ()))
        if chunk.finished:
            self.stats = chunk.stats
        return [(text, self.formatter.add(ids, entries) if self.formatter is not None else None)
                for text, ids, entries in pieces]

    def deltas(self, chunk: StreamChunk) -> list[tuple[str, list[dict[str, Any]], dict[str, Any] | None]]:
        """The (content, tool call deltas, logprobs object) deltas to send for `chunk`: `take`'s pieces, their
        text parsed for tool calls where the request's tool_choice asks (text that may start a tool call
        waits for the next chunk; a piece whose text all waits still sends its logprobs), and what was
        waiting once the choice ends."""
        pieces = self.take(chunk)
        if self.tool_output is None:
            return [(text, [], lp) for text, lp in pieces]
        out = [(*self.tool_output.feed(text), lp) for text, lp in pieces]
        if self.done:
            out.append((*self.tool_output.finish(), None))
        return [(text, calls, lp) for text, calls, lp in out if text or calls or lp is not None]


class CollectedResponse:
    """A non-streamed response gathered from a job's `ChoiceChunk`s (after its `Started`)."""

    def __init__(self, gen: GenerationRequest, started: Started, tokenizer: Any,
                 token_bytes: TokenBytes | None) -> None:
        self.gen = gen
        self.started = started
        self.choices = [ChoiceState(gen, started, i, tokenizer, token_bytes) for i in range(started.choices)]
        self._texts: list[list[str]] = [[] for _ in self.choices]
        self._tool_calls: list[list[dict[str, Any]]] = [[] for _ in self.choices]
        self._logprobs: list[list[dict[str, Any]]] = [[] for _ in self.choices]

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices)

    def add(self, event: ChoiceChunk) -> None:
        for text, calls, lp in self.choices[event.index].deltas(event.chunk):
            self._texts[event.index].append(text)
            self._tool_calls[event.index] += calls
            if lp is not None:
                self._logprobs[event.index].append(lp)

    def body(self, ids: ResponseIds) -> dict[str, Any]:
        """The response object (every choice finished)."""
        results = [protocol.ChoiceResult(c.index, "".join(self._texts[c.index]), c.finish_reason,
                                         (protocol.join_logprobs(self._logprobs[c.index]) or c.formatter.add((), ()))
                                         if c.formatter is not None else None,
                                         join_tool_calls(self._tool_calls[c.index]), self.gen.chat_echo,
                                         self.gen.role)
                   for c in self.choices]
        each = [c.stats for c in self.choices]
        stats = summed(each)
        return protocol.completion_body(ids, results, self.started.prompt_tokens, stats.new_tokens, stats,
                                        cached_prompt_tokens(each, len(self.started.prompts)))
