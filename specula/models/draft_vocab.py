"""A draft model's output layer over the most frequent tokens only (FR-Spec, Zhao et al. 2025).

A draft's output layer is a large share of its pass where the vocabulary is large: Qwen2.5's
151,936 rows are 136 MB of the int8 0.5B's ~500 MB. A draft needs no exactness, so it may score
only the K tokens that text uses most (a shipped ranking, `specula/data/vocab/`): its output layer
becomes K rows of the same kind (int8 kernel rows stay int8 rows, bit for bit the same logits), and
every other token's logit is -inf, so the draft never proposes it and its q gives it probability 0.
The target still verifies over its whole vocabulary, and the acceptance rules take whatever q the
draft proposed from, so the output is unchanged (greedy: token for token; sampled: the same law).
Tokens the ranking leaves out can still be proposed by the other drafters (prompt lookup copies
them from the context).

`--draft-vocab auto` (the default) restricts a native-backend draft to `DEFAULT_SIZE` tokens where a
ranking ships for its tokenizer and its vocabulary is more than twice that; `full` keeps every row; a number K
restricts to the K most frequent (a ranking must ship for the tokenizer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specula.errors import ConfigError

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
        raise ConfigError(f"token ranking {path} cannot be read ({e}); reinstall specula or pass --draft-vocab full") \
            from e
    if not ranked or min(ranked) < 0 or max(ranked) >= ranking.vocab_size or len(set(ranked)) != len(ranked):
        raise ConfigError(f"token ranking {path} holds ids outside 0..{ranking.vocab_size - 1} or repeats; "
                          "reinstall specula or pass --draft-vocab full")
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
    size = vocab_size(tokenizer)
    candidates = [read_ranking(p) for p in sorted(root.glob("*.json"))] if root.is_dir() else []
    candidates = [r for r in candidates if r.vocab_size == size]
    if not candidates:
        return None
    fingerprint = tokenizer_fingerprint(tokenizer)  # ~0.5 s for 152k tokens: only when a size matches
    return next((r for r in candidates if r.tokenizer_fingerprint == fingerprint), None)


def draft_vocabulary(ranking: TokenRanking, size: int, always: Any = ()) -> torch.Tensor:
    """The `size` most frequent ids of `ranking` and the ids in `always` (end-of-sequence and other
    special tokens), sorted: [k] long."""
    if size > len(ranking.ranked):
        raise ConfigError(f"--draft-vocab {size}: the ranking {ranking.path.name} orders {len(ranking.ranked)} "
                          f"tokens; pass at most {len(ranking.ranked)}, or full")
    ids = set(ranking.ranked[:size]) | {int(i) for i in always if 0 <= int(i) < ranking.vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


class SubsetOutput(nn.Module):
    """An output layer that computes only rows `ids` of a model's head (`rows`: a linear of the head's
    own kind over those rows); every other logit is -inf."""

    def __init__(self, rows: nn.Module, ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.rows = rows
        self.register_buffer("ids", ids.to(torch.long))  # [k], sorted
        self.out_features, self.in_features = vocab_size, int(rows.in_features)
        # Shape only (no storage): callers read `lm_head.weight.shape` for the logit width.
        self.weight = torch.empty(self.out_features, self.in_features, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., E]
        kept = self.rows(x)  # [..., k]
        out = kept.new_full((*kept.shape[:-1], self.out_features), float("-inf"))  # [..., V]
        return out.index_copy_(-1, self.ids.to(kept.device), kept)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise ConfigError("this model's output layer scores a draft vocabulary only (--draft-vocab): its rows "
                          "cannot serve a trained head; load the model with --draft-vocab full")

    def extra_repr(self) -> str:
        return f"{len(self.ids)} of {self.out_features} rows (draft vocabulary)"


def _rows_like(head: nn.Module, rows: torch.Tensor) -> nn.Module:
    """A linear of `head`'s kind over `rows` [k, E] (int8 kernels quantize each row alone, so the
    kept rows' logits are bit for bit the full head's)."""
    from specula.models.native.kernels import KernelLinear
    from specula.models.prepack import OneDNNLinear
    from specula.models.quantize import RowInt8Linear

    if getattr(head, "bias", None) is not None:
        raise ConfigError("--draft-vocab: this draft's output layer has a bias; pass --draft-vocab full")
    lin = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    lin.weight = nn.Parameter(rows.detach().clone(), requires_grad=False)
    if isinstance(head, KernelLinear):
        return KernelLinear(lin, head.kind)
    if isinstance(head, RowInt8Linear):
        return RowInt8Linear(lin)
    if isinstance(head, OneDNNLinear):
        return OneDNNLinear(lin)
    if type(head) is nn.Linear:
        return lin
    raise ConfigError(f"--draft-vocab: a {type(head).__name__} output layer cannot be cut to a draft vocabulary; "
                      "pass --draft-vocab full")


def restrict_output(model: Any, ids: torch.Tensor) -> None:
    """Make backend `model` (native or hf) score only tokens `ids` [k] (its other logits -inf), in place."""
    with torch.inference_mode(False), torch.no_grad():
        head = model.output_layer()
        # [k, E]: the head's rows as it holds them (tied: the embedding's; fbgemm int8: dequantized, which
        # `output_rows` reads through the head, activation quantization included)
        rows = head.dequantized_rows(ids) if hasattr(head, "dequantized_rows") else model.output_rows(ids)
        model.set_output_layer(SubsetOutput(_rows_like(head, rows), ids.to(rows.device), int(model.vocab_size)))


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
        raise ConfigError(f"--draft-vocab {option}: the {type(draft).__name__} backend cannot cut its output layer; "
                          "use the native or hf backend, or --draft-vocab full")
    ranking = ranking_for(tokenizer)
    if ranking is None:
        if option == AUTO:
            return None
        raise ConfigError(f"--draft-vocab {option}: no token ranking ships for this tokenizer "
                          f"({', '.join(p.name for p in sorted(RANKINGS.glob('*.json'))) or 'none'} in {RANKINGS}); "
                          "pass --draft-vocab full")
    size = min(DEFAULT_SIZE, len(ranking.ranked)) if option == AUTO else option
    ids = draft_vocabulary(ranking, size, [*(getattr(tokenizer, "all_special_ids", None) or []), *always])
    restrict_output(draft, ids)
    return {"size": len(ids), "of": int(draft.vocab_size), "ranking": ranking.path.name}
