"""One request's grammar state, advanced over committed tokens only, and what it tells a step.

    GrammarState(constraint, tokenizer, vocab)
      .forced(max_n)          tokens the grammar alone decides from here (exactly one allowed)
      .allowed_tree(tree)     the nodes whose path the grammar allows (drafts it forbids go)
      .masked(logits, tree)   the target's logits with forbidden tokens at -inf, row by row
      .commit(tokens)         the step's emitted tokens (the only call that moves the state)

The state moves only in `commit`; everything else consumes a path's tokens on the llguidance
matcher and rolls them back before returning, so after any step the matcher equals a fresh one fed
the committed tokens.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Sequence

import torch

from specula.constraints.spec import Constraint, ConstraintError
from specula.tree import TokenTree
from specula.tree_rows import RowEdit, TreeRows

_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict[tuple, Any]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()



def grammar_tokenizer(tokenizer, vocab: int, eos_token_ids: Sequence[int] = ()):
    """llguidance's view of a Hugging Face fast tokenizer for logits of width `vocab`, ending a
    complete match with any of `eos_token_ids` (default: the tokenizer's EOS). Built once per
    tokenizer: about 0.3 s for SmolLM2, 1.5 s for Qwen."""
    import llguidance.hf

    key = (vocab, tuple(sorted(int(e) for e in eos_token_ids)))
    with _LOCK:
        per_vocab = _TOKENIZERS.setdefault(tokenizer, {})
        llt = per_vocab.get(key)
        if llt is None:
            try:
                llt = per_vocab[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab,
                                                                    eos_token=list(key[1]) or None)
            except ValueError as exc:
                raise ConstraintError(f"constraints need a fast (tokenizer.json) byte-level or byte-fallback "
                                      f"tokenizer; this one cannot be used: {exc}") from None
        return llt


def check_constraint(constraint: Constraint, tokenizer, vocab: int, eos_token_ids: Sequence[int] = ()) -> str:
    """The grammar text of `constraint` checked against the tokenizer: ConstraintError (with the
    library's reason) when it cannot be compiled."""
    from llguidance import LLMatcher

    grammar = constraint.grammar_text()
    is_error, messages = LLMatcher.validate_grammar_with_warnings(
        grammar, grammar_tokenizer(tokenizer, vocab, eos_token_ids))
    if is_error:
        raise ConstraintError(f"cannot compile the {constraint.label}: {' '.join(' '.join(messages).split())}")
    return grammar


def unpack_bitmask(bitmask: bytes, vocab: int) -> torch.Tensor:
    """llguidance's bitmask (32 tokens per int32, low bit first) -> bool [vocab]."""
    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32)  # [ceil(vocab / 32)]
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
    return bits.flatten()[:vocab].bool()


class GrammarState:
    """The grammar matcher of one request (see the module docstring)."""

    def __init__(self, constraint: Constraint, tokenizer, vocab: int, eos_token_ids: Sequence[int] = ()) -> None:
        from llguidance import LLMatcher

        self.constraint = constraint
        self.vocab = vocab
        # One end for llguidance and for `ended`: without the decoder's EOS ids llguidance ends a match
        # with the tokenizer's EOS, which `commit` then took for an ordinary token (EOS twice)
        eos = [int(e) for e in eos_token_ids]
        if not eos and getattr(tokenizer, "eos_token_id", None) is not None:
            eos = [int(tokenizer.eos_token_id)]
        self._llt = grammar_tokenizer(tokenizer, vocab, eos)
        self._grammar = check_constraint(constraint, tokenizer, vocab, eos)
        self._matcher = LLMatcher(self._llt, self._grammar)
        if self._matcher.is_error():
            raise ConstraintError(f"cannot compile the {constraint.label}: {self._matcher.get_error()}")
        self._matcher.compute_bitmask()  # llguidance finds a language with no text in it here
        if self._matcher.is_stopped() and not self._matcher.is_accepting():
            raise ConstraintError(f"the {constraint.label} matches no text this tokenizer can write: "
                                  "check it (a rule that never ends, a character class with nothing in it)")
        self.eos_token_ids = frozenset(eos)
        self._tokens: list[int] = []  # the committed tokens (a matcher that met a dead end is rebuilt from them)
        self.committed = 0
        """Tokens committed so far."""
        self.ended = False
        """An end-of-sequence token was committed: the output is over (what follows it in a step,
        kept only when EOS is ignored, is cut)."""
        self.mask_seconds = 0.0
        """Time spent computing masks (reported as the constraint's overhead)."""

    # ------------------------------------------------------------------ the committed state
    def commit(self, tokens: Sequence[int]) -> list[int]:
        """Advance over a step's emitted tokens (every one the grammar allowed: the target's
        distribution was masked); returns those that belong to the output: all of them, or up to
        the end-of-sequence token that closed a complete match (`ended`). A token the grammar
        refuses is a bug of the caller: RuntimeError."""
        kept: list[int] = []
        for tok in (int(t) for t in tokens):
            if self.ended:
                break
            kept.append(tok)
            if self._matcher.is_stopped():  # a complete match allows only EOS, and it ends the output
                if not self._matcher.is_accepting():  # a dead end's mask allows EOS alone too
                    raise self._dead_end()
                self.ended = True
                break
            if self._matcher.validate_tokens([tok]) != 1:
                if self.mask()[tok]:  # its own mask allowed it: the bytes the grammar forces after it are unwritable
                    self._matcher.consume_token(tok)  # (for the library's reason)
                    raise self._dead_end()
                raise RuntimeError(f"the grammar refused committed token {tok}: {self._matcher.get_error()}")
            if not self._matcher.consume_token(tok):
                raise RuntimeError(f"the grammar refused committed token {tok}: {self._matcher.get_error()}")
            self._tokens.append(tok)
            self.committed += 1
            self.ended = tok in self.eos_token_ids
        return kept

    def _dead_end(self) -> ConstraintError:
        """The error of a constraint that cannot go on: the text it needs next (e.g. a character of a
        JSON schema's pattern or enum) has no tokens in this tokenizer. llguidance finds that only on
        the way, and its masks allow a token that starts such a branch even where another branch
        could be written (`(bQ|a)` with no token for "Q": a model that prefers "b" ends here); the
        output so far does not match, so it is an error, not a stop."""
        reason = self._matcher.get_error().split("<state>")[0].strip() if self._matcher.is_error() else ""
        reason = " ".join(reason.split()) if " " in reason.strip() else ""  # a bare stop code says nothing
        return ConstraintError(f"the {self.constraint.label} cannot be completed after {self.committed} tokens: "
                               "the text it needs next cannot be written with this tokenizer's tokens (the branch "
                               "the output took needs characters the tokenizer has no token for); check the "
                               f"constraint's characters{f' ({reason})' if reason else ''}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more but the end of the sequence."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (it may still go on)."""
        return self._matcher.is_accepting()

    def mask(self) -> torch.Tensor:
        """bool [vocab]: the tokens allowed next."""
        import time

        t0 = time.perf_counter()
        out = unpack_bitmask(self._matcher.compute_bitmask(), self.vocab)
        self.mask_seconds += time.perf_counter() - t0
        return out

    def state_bitmask(self) -> bytes:
        """The raw next-token bitmask (tests compare states with it)."""
        return self._matcher.compute_bitmask()

    # ------------------------------------------------------------------ scratch walks
    def _enter(self, tokens: Sequence[int]) -> bool:
        """Consume a path's tokens (to be undone with `_leave(len(tokens))`); False (nothing
        consumed) when the grammar refuses one of them."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return True
        if self._matcher.validate_tokens(tokens) != len(tokens):
            return False
        if not self._matcher.consume_tokens(tokens):  # validated, then a dead end on the way (what its
            self._rebuild()  # bytes force is unwritable): refused, as committing them would be
            return False
        return True

    def _leave(self, n: int) -> None:
        if not n or self._matcher.rollback(n):
            return
        if not self._matcher.is_error():
            raise RuntimeError(f"the grammar could not roll back {n} tokens: {self._matcher.get_error()}")
        # A drafted path led to a dead end (text this tokenizer cannot write: the mask there allowed EOS
        # alone, as plain decoding would find it on committing that path)
        self._rebuild()

    def _rebuild(self) -> None:
        """A matcher at the committed state again, after a scratch walk met an error (llguidance's
        matcher neither rolls back nor resets out of one): a new one replays the committed tokens."""
        from llguidance import LLMatcher

        self._matcher = LLMatcher(self._llt, self._grammar)
        if self._tokens and not self._matcher.consume_tokens(self._tokens):
            raise RuntimeError(f"the grammar could not replay its committed tokens: {self._matcher.get_error()}")

    def forced(self, max_n: int) -> list[int]:
        """Up to `max_n` tokens the grammar alone decides from here: at each, exactly one token is
        allowed, so the masked target emits it with probability 1 (an EOS the grammar forces ends
        the chain)."""
        out: list[int] = []
        while len(out) < max_n and not self._matcher.is_stopped():
            allowed = self.mask().nonzero()
            if allowed.numel() != 1 or not self._matcher.consume_token(int(allowed[0])):
                break
            out.append(int(allowed[0]))
        self._leave(len(out))
        return out

    def allowed_tree(self, tree: TokenTree) -> list[int]:
        """The nodes (ascending, ancestor-closed) whose every token on the path from the root the
        grammar allows."""
        keep: list[int] = []
        ok = [False] * len(tree)
        for i, par in enumerate(tree.parents):
            if par >= 0 and not ok[par]:
                continue
            path = tree.tokens_of(tree.path_to(i))
            if self._enter(path):
                self._leave(len(path))
                ok[i] = True
                keep.append(i)
        return keep

    def masked(self, logits: torch.Tensor, tree: TokenTree) -> "MaskedLogits":
        """logits [n + 1, vocab] of a tree's pass, with each row masked by the grammar state at its
        node (lazily: rules touch few rows)."""
        return MaskedLogits(self, logits, tree)


class MaskedLogits(TreeRows):
    """A tree's target logits with the grammar applied: `rows[r]` is logits[r] with the tokens
    the grammar forbids after node r - 1 at -inf ([vocab]); `argmax(-1)` is the masked argmax of
    every row a greedy walk can reach (-1 elsewhere: no child matches it). The whole mask is
    computed for a row (tens of microseconds): llguidance's `validate_tokens` accepts some tokens
    its mask excludes, and the mask is what defines the constrained law."""

    def __init__(self, state: GrammarState, logits: torch.Tensor, tree: TokenTree) -> None:
        super().__init__(logits, tree)
        self.state = state

    def _edit(self, row: int, edit: RowEdit) -> RowEdit:
        """`edit` with the grammar's mask of row `row` (`TreeRows.exact_argmax`: a screened greedy
        pass takes the masked argmax with no float32 logits computed)."""
        allowed = self._allowed(row)
        return edit if allowed is None else edit.masked(allowed)

    def _allowed(self, row: int) -> torch.Tensor | None:
        """The ids the grammar allows after row `row`'s path ([vocab] bool), or None where the path
        leaves the grammar (the row is not masked: `_row`)."""
        path = self.path_tokens(row)
        if not self.state._enter(path):
            return None
        try:
            return self.state.mask().to(self.logits.device)  # [vocab] bool
        finally:
            self.state._leave(len(path))

    def _row(self, row: int) -> torch.Tensor:
        allowed = self._allowed(row)
        if allowed is None:
            # Under a node the grammar forbids (a sampled draft keeps its draws): the node has p = 0
            # under its parent's mask, so no rule reaches this row; `full()` still builds it.
            return self.logits[row]
        return self.logits[row].masked_fill(~allowed, float("-inf"))
