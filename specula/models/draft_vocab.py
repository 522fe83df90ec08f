"""A draft model's output layer over the most frequent tokens only (FR-Spec, Zhao et al. 2025).

A draft's output layer is a large share of its pass where the vocabulary is large: Qwen2.5's
151,936 rows are 136 MB of the int8 0.5B's ~500 MB. A draft needs no exactness, so it may score
only the K tokens that text uses most (a shipped ranking, `specula/data/vocab/`): its output layer
becomes K rows of the same kind (int8 kernel rows stay int8 rows, bit for bit the same logits), and
every other token's logit is -inf, so the draft never proposes it and its q gives it probability 0.
The target still verifies over its whole vocabulary, and the acceptance rules take whatever q the
draft proposed from, so the output is unchanged (greedy: token for token; sampled: the same law).
The rare tokens a draft's sequences read (a prompt's names, which a summary or an answer copies)
are scored from then on too (`SubsetOutput.see`, float32 rows beside the kept ones): without them
the 0.5B's chains broke at every copied name (Spec-Bench rag, translation: 3.7 -> 2.8 and 2.4 ->
1.8 tokens a step).

`--draft-vocab auto` (the default) restricts a native-backend draft to `DEFAULT_SIZE` tokens where a
ranking ships for its tokenizer and its vocabulary is more than twice that; `full` keeps every row; a number K
restricts to the K most frequent (a ranking must ship for the tokenizer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from specula.errors import ConfigError
from specula.models.device import serial_cpu_ops

AUTO = "auto"
FULL = "full"
DEFAULT_SIZE = 32768
"""Rows `auto` keeps: FR-Spec's best size for 128k-token vocabularies; 99.7% of the Qwen ranking's
counted tokens (`specula/data/vocab/README.md`)."""
RANKINGS = Path(__file__).resolve().parent.parent / "data" / "vocab"
"""The shipped token rankings: one JSON file per tokenizer (`TokenRanking`)."""


@dataclass(frozen=True)
class TokenRanking:
    """Token ids of one tokenizer, most frequent first, as counted over a corpus (no benchmark in it)."""

    tokenizer_fingerprint: str
    """`specula.datastore.tokenizers.tokenizer_fingerprint` of the tokenizer the ids belong to."""
    vocab_size: int
    """The tokenizer's id range (`specula.datastore.tokenizers.vocab_size`)."""
    ranked: tuple[int, ...]
    """Every counted token id, most frequent first."""
    source: str
    """What was counted (the file's `source` entry)."""
    path: Path
    """The ranking's file."""


def check_draft_vocab(option: Any) -> str | int:
    """`auto`, `full` or a row count >= 2 (a string of digits from the command line too); else a
    ConfigError naming the choices."""
    if option in (None, AUTO):
        return AUTO
    if option == FULL:
        return FULL
    text = str(option).strip()
    if text.isdigit() and int(text) >= 2:
        return int(text)
    raise ConfigError(f"draft vocabulary {option!r} is not one of: auto, full, or a number of tokens >= 2 "
                      f"(e.g. {DEFAULT_SIZE})")


def read_ranking(path: str | Path) -> TokenRanking:
    """A ranking file (JSON: tokenizer_fingerprint, vocab_size, source, ranked); a broken one is a
    ConfigError naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        ranked = tuple(int(i) for i in data["ranked"])
        ranking = TokenRanking(str(data["tokenizer_fingerprint"]), int(data["vocab_size"]), ranked,
                               str(data.get("source", "")), path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"token ranking {path} cannot be read ({e}); reinstall specula or pass "
                          'draft_vocab="full"') from e
    if not ranked or min(ranked) < 0 or max(ranked) >= ranking.vocab_size or len(set(ranked)) != len(ranked):
        raise ConfigError(f"token ranking {path} holds ids outside 0..{ranking.vocab_size - 1} or repeats; "
                          'reinstall specula or pass draft_vocab="full"')
    return ranking


def rank_tokens(sequences: Any) -> list[int]:
    """Every id in `sequences` (iterables of ids), most frequent first (ties: the smaller id first)."""
    from collections import Counter

    counts: Counter = Counter()
    for seq in sequences:
        counts.update(int(i) for i in seq)
    return [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def write_ranking(path: str | Path, tokenizer: Any, name: str, ranked: list[int], source: str, counted: int) -> Path:
    """Write a ranking file for `tokenizer` (called `name` there; atomically); `counted`: the tokens
    the counts came from."""
    from specula.datastore.tokenizers import tokenizer_fingerprint, vocab_size
    from specula.paths import atomic_write_text

    data = {"format": 1, "tokenizer": name, "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": vocab_size(tokenizer), "source": source, "counted_tokens": counted, "ranked_tokens": len(ranked)}
    text = json.dumps(data, indent=1)[:-2] + ',\n "ranked": [' + ",".join(map(str, ranked)) + "]\n}\n"
    return atomic_write_text(path, text)


def ranking_for(tokenizer: Any, root: Path | None = None) -> TokenRanking | None:
    """The ranking in `root` (default: the shipped ones, `RANKINGS`) of `tokenizer` (same id<->token
    map), or None."""
    from specula.datastore.tokenizers import tokenizer_fingerprint, vocab_size

    root = RANKINGS if root is None else root
    vocab = tokenizer.get_vocab()  # 0.15 s for 152k tokens: read once
    size = vocab_size(tokenizer, vocab)
    candidates = [read_ranking(p) for p in sorted(root.glob("*.json"))] if root.is_dir() else []
    candidates = [r for r in candidates if r.vocab_size == size]
    if not candidates:
        return None
    fingerprint = tokenizer_fingerprint(tokenizer, vocab)  # 0.3 s for 152k tokens: only when a size matches
    return next((r for r in candidates if r.tokenizer_fingerprint == fingerprint), None)


def draft_vocabulary(ranking: TokenRanking, size: int, always: Any = ()) -> torch.Tensor:
    """The `size` most frequent ids of `ranking` and the ids in `always` (end-of-sequence and other
    special tokens), sorted: [k] long."""
    if size > len(ranking.ranked):
        raise ConfigError(f"draft_vocab={size}: the ranking {ranking.path.name} orders {len(ranking.ranked)} "
                          f"tokens; pass at most {len(ranking.ranked)}, or full")
    ids = set(ranking.ranked[:size]) | {int(i) for i in always if 0 <= int(i) < ranking.vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


MAX_CONTEXT_TOKENS = 16384
"""Tokens outside the ranking a cut output layer adds as it sees them in its contexts (then no more)."""


class SubsetOutput(nn.Module):
    """An output layer that computes only rows `ids` of a model's head (`rows`: a linear of the head's
    own kind over those rows), and the rows of the rare tokens its sequences read (`see`, up to
    `MAX_CONTEXT_TOKENS`, float32, read by `reader`); every other logit is -inf."""

    def __init__(self, rows: nn.Module, ids: torch.Tensor, vocab_size: int,
                 reader: Callable[[torch.Tensor], torch.Tensor] | None = None, source: nn.Module | None = None) -> None:
        super().__init__()
        self.rows = rows
        self.source = source  # the full head where `reader` reads it (untied): kept, and counted as weights
        self.register_buffer("ids", ids.to(torch.long))  # [k], sorted
        self.out_features, self.in_features = vocab_size, int(rows.in_features)
        # Shape only (no storage): callers read `lm_head.weight.shape` for the logit width.
        self.weight = torch.empty(self.out_features, self.in_features, device="meta")
        self._reader = reader
        self._scored = torch.zeros(vocab_size, dtype=torch.bool)  # [V]: kept or added
        self._scored[self.ids.cpu()] = True
        self.register_buffer("context_ids", torch.zeros(0, dtype=torch.long, device=self.ids.device))  # [m]
        self.register_buffer("context_rows", torch.zeros(0, self.in_features, device=self.ids.device))  # [m, E]

    def see(self, tokens) -> None:
        """Score from now on the tokens of `tokens` outside the draft vocabulary (a draft's context)."""
        room = MAX_CONTEXT_TOKENS - len(self.context_ids)
        if self._reader is None or room <= 0:
            return
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        ids = ids[(ids >= 0) & (ids < self.out_features)]
        new = torch.unique(ids[~self._scored[ids]])[:room]  # [m'] sorted
        if not len(new):
            return
        with torch.inference_mode(False), torch.no_grad():
            rows = self._reader(new).detach().float().to(self.context_rows.device)  # [m', E]
        self._scored[new] = True
        self.context_ids = torch.cat([self.context_ids, new.to(self.context_ids.device)])
        self.context_rows = torch.cat([self.context_rows, rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., E]
        kept = self.rows(x)  # [..., k]
        with serial_cpu_ops():  # a row of the whole vocabulary between two kernel calls
            out = kept.new_full((*kept.shape[:-1], self.out_features), float("-inf"))  # [..., V]
            out.index_copy_(-1, self.ids.to(kept.device), kept)
            if len(self.context_ids):
                extra = x.float() @ self.context_rows.t()  # [..., m]
                out.index_copy_(-1, self.context_ids.to(kept.device), extra.to(out.dtype))
        return out

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise ConfigError("this model's output layer scores a draft vocabulary only (draft_vocab): its rows "
                          'cannot serve a trained head; load the model with draft_vocab="full"')

    def extra_repr(self) -> str:
        return f"{len(self.ids)} of {self.out_features} rows (draft vocabulary), {len(self.context_ids)} from contexts"


def _rows_like(head: nn.Module, ids: torch.Tensor, reader: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A linear of `head`'s kind over its rows `ids` [k] (read by `reader` as [k, E]): each kept row's
    logits are the full head's bit for bit (specula's kernels cut their packed rows out,
    `KernelLinear.take_rows`; int8 layers quantize each row alone)."""
    from specula.models.native.kernels import KernelLinear
    from specula.models.prepack import OneDNNLinear
    from specula.models.quantize import RowInt8Linear

    if getattr(head, "bias", None) is not None:
        raise ConfigError('draft_vocab: this draft\'s output layer has a bias; pass draft_vocab="full"')
    if isinstance(head, KernelLinear):
        return head.take_rows(ids)
    rows = reader(ids)  # [k, E], the head's rows as it holds them
    lin = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    lin.weight = nn.Parameter(rows.detach().clone(), requires_grad=False)
    if isinstance(head, RowInt8Linear):
        return RowInt8Linear(lin)
    if isinstance(head, OneDNNLinear):
        return OneDNNLinear(lin)
    if type(head) is nn.Linear:
        return lin
    raise ConfigError(f"draft_vocab: a {type(head).__name__} output layer cannot be cut to a draft vocabulary; "
                      'pass draft_vocab="full"')


def restrict_output(model: Any, ids: torch.Tensor) -> None:
    """Make backend `model` (native or hf) score only tokens `ids` [k] (its other logits -inf), in place."""
    with torch.inference_mode(False), torch.no_grad():
        head = model.output_layer()
        reader = _row_reader(model, head)
        rows = _rows_like(head, ids, reader)
        # rare rows: from the embedding where the head holds the embedding's rows, up to quantization (the
        # full head can go), else from the full head, kept (and counted) for that
        shared = model.tied_output or _holds_embedding(model, reader)
        model.set_output_layer(SubsetOutput(rows, ids.to(model.device), int(model.vocab_size),
                                            model.embed_tokens if shared else reader, None if shared else head))


def _holds_embedding(model: Any, reader: Callable[[torch.Tensor], torch.Tensor], sample: int = 64) -> bool:
    """Whether the output head's rows are the input embedding's, up to quantization, on `sample` rows
    spread over the vocabulary (cosine >= 0.99 and norms within 2% on every one): a model converted
    untied from tied weights. The GGUFs of Qwen2.5-Coder-0.5B and -1.5B carry both, quantized apart
    (cosine 0.9985 on the 0.5B); a draft needs no exactness, so its rare rows may come from the
    embedding and its full int8 head (136 MB) can go. The 0.5B in int4 (the default draft) keeps
    its full head: its rows are 0.987-0.993 from the embedding's (64 sampled, session 97)."""
    n = int(model.vocab_size)
    ids = torch.linspace(0, n - 1, min(sample, n)).long()  # [s]
    head = reader(ids).float().cpu()  # [s, E]
    embed = model.embed_tokens(ids).float().cpu()  # [s, E]
    cos = torch.nn.functional.cosine_similarity(head, embed, dim=1)  # [s]
    ratio = head.norm(dim=1) / embed.norm(dim=1).clamp_min(1e-12)  # [s]
    return bool((cos >= 0.99).all() and ((ratio - 1).abs() <= 0.02).all())


def _row_reader(model: Any, head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """Reads rows [k, E] of `model`'s full output head for ids [k], also after the head is cut: the
    embedding's where they are tied (the full head can go), else `head`'s own (`linears.head_rows`;
    it is kept for that). fbgemm int8 rows are read dequantized (`head_rows` reads them through the
    head, activation quantization included, and quantized again they would not give back the same
    int8 rows)."""
    from specula.models.linears import head_rows

    if hasattr(head, "dequantized_rows"):
        return head.dequantized_rows
    if model.tied_output:
        return model.output_rows
    return lambda ids: head_rows(head, ids, model.dtype, model.device)


def apply_draft_vocab(draft: Any, tokenizer: Any, option: Any = AUTO, always: Any = ()) -> dict | None:
    """Restrict `draft`'s output layer as `option` says (`check_draft_vocab`); returns what was done
    ({"size", "of", "ranking"}) or None (full vocabulary). `always`: ids kept whatever their rank
    (the target's end-of-sequence tokens; the tokenizer's special tokens are kept too). An explicit
    size needs a shipped ranking for the tokenizer and a backend that can cut its output layer (else
    a ConfigError)."""
    option = check_draft_vocab(option)
    if option == FULL or (option == AUTO and 2 * DEFAULT_SIZE > int(draft.vocab_size)):
        return None  # auto: a small vocabulary has little to save
    from specula.models.native.backend import NativeCausalLM

    supported = hasattr(draft, "set_output_layer") and hasattr(draft, "output_rows")
    if option == AUTO and not isinstance(draft, NativeCausalLM):
        return None  # auto cuts specula's own backend only: the hf backend is the reference (and a peer's assistant)
    if not supported:
        raise ConfigError(f"draft_vocab={option}: the {type(draft).__name__} backend cannot cut its output layer; "
                          'use the native or hf backend, or draft_vocab="full"')
    ranking = ranking_for(tokenizer)
    if ranking is None:
        if option == AUTO:
            return None
        raise ConfigError(f"draft_vocab={option}: no token ranking ships for this tokenizer "
                          f"({', '.join(p.name for p in sorted(RANKINGS.glob('*.json'))) or 'none'} in {RANKINGS}); "
                          'pass draft_vocab="full"')
    size = min(DEFAULT_SIZE, len(ranking.ranked)) if option == AUTO else option
    ids = draft_vocabulary(ranking, size, [*(getattr(tokenizer, "all_special_ids", None) or []), *always])
    restrict_output(draft, ids)
    return {"size": len(ids), "of": int(draft.vocab_size), "ranking": ranking.path.name}
