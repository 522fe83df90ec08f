"""The target's features over the corpus, computed once and cached (later epochs cost only the head).

For every corpus sequence (prompt + the target's answer) one causal prefill with `hidden=`
(`models.base.FeatureModel`): the last hidden state of every position, the same features the
engine hands a head while generating, and for an eagle3 head the inputs of its feature layers
from the same pass. Stored as one safetensors file: `tokens` [N] long, `features` [N, E] float16,
`starts` [S + 1] long (sequence s is rows starts[s] .. starts[s+1]), `prompt_lens` [S] long, and
with layers `inputs` [N, k E] float16 and `layers` [k] long; written atomically.
"""

from __future__ import annotations

import bisect
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from specula.errors import ConfigError
from specula.training.corpus import CorpusEntry, PaddedConfig


class Rows:
    """Row tensors of one width ([n_i, D] each, in order) read as one [N, D] (N = sum n_i) without
    joining them: the corpus of several data files keeps each file's features where `load_file`
    put them (safetensors, 0.8 here, maps the file: the system pages rows in as batches read them and can drop
    them again), where a joined copy held them all in memory (8.5 GB for two files of the 1.5B's,
    on top of the target). A slice within one part is a view of it; one across parts, a copy."""

    def __init__(self, parts: Sequence[torch.Tensor]):
        if not parts:
            raise ValueError("Rows reads one part at least")
        if len({(p.shape[1:], p.dtype) for p in parts}) != 1:
            raise ValueError("rows of different widths or dtypes cannot be read as one")
        self.parts = list(parts)
        self.ends = torch.tensor([len(p) for p in parts]).cumsum(0).tolist()  # [parts]: each part's end row

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.ends[-1], *self.parts[0].shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def __len__(self) -> int:
        return self.ends[-1]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        a, b, step = rows.indices(len(self))
        if step != 1:
            raise IndexError("Rows reads contiguous slices only")
        i = bisect.bisect_right(self.ends, a)
        start = self.ends[i - 1] if i else 0
        if i == len(self.parts) or b <= self.ends[i]:
            return self.parts[min(i, len(self.parts) - 1)][a - start:max(a, b) - start]
        return torch.cat([self.parts[i][a - start:], self[self.ends[i]:b]])


@dataclass
class FeatureSet:
    """Tokens and target features of a corpus (see the module docstring)."""

    tokens: torch.Tensor  # [N] long
    features: torch.Tensor | Rows  # [N, E] float16
    starts: torch.Tensor  # [S + 1] long
    prompt_lens: torch.Tensor  # [S] long
    inputs: torch.Tensor | Rows | None = None  # [N, k E] float16: the inputs of `layers` (eagle3), else None
    layers: tuple[int, ...] = ()
    _hints: dict = field(default_factory=dict, repr=False, compare=False)  # (s, n) -> `copy_hints`

    def __len__(self) -> int:
        return len(self.starts) - 1

    def sequence(self, s: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(tokens [n], features [n, E], prompt length) of sequence s."""
        a, b = int(self.starts[s]), int(self.starts[s + 1])
        return self.tokens[a:b], self.features[a:b], int(self.prompt_lens[s])

    def copy_hints(self, s: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hint tokens [len], match lengths [len]) long of sequence s's positions (`heads.copy`),
        computed once per sequence and n."""
        key = (s, n)
        if key not in self._hints:
            from specula.drafters.heads.copy import sequence_hints

            hints, lengths = sequence_hints(self.sequence(s)[0].tolist(), n)
            self._hints[key] = (torch.tensor(hints, dtype=torch.long), torch.tensor(lengths, dtype=torch.long))
        return self._hints[key]

    def layer_inputs(self, s: int) -> torch.Tensor:
        """[n, k E]: the inputs of `layers` over sequence s."""
        a, b = int(self.starts[s]), int(self.starts[s + 1])
        return self.inputs[a:b]


def extract_features(target, corpus: Sequence[CorpusEntry], out: Path,
                     progress: Callable[[int], None] | None = None, layers: Sequence[int] = (),
                     padded: PaddedConfig | None = None, write: bool = True) -> FeatureSet:
    """Features of every corpus sequence (with `layers`, also the inputs of those layers, from the
    same pass), cached at `out` (reused when present; the caller keys the path by the layers);
    `progress(n)` as sequences are done, a cached file's all at once. `padded`: right-padded
    batched passes through the target's Hugging Face model (`training.padded`) when it has one.
    `write`: False keeps new features in memory only (a one-off run where writing tens of GB costs
    more than it saves); they are not written either when the cache's disk lacks room."""
    from safetensors.torch import load_file, save_file

    from specula.paths import atomic_path

    layers = tuple(layers)
    if out.is_file():
        from safetensors import SafetensorError

        try:
            t = load_file(str(out))
        except (SafetensorError, OSError) as exc:  # cut short (a full disk, copied while written)
            raise ConfigError(f"the cached features {out} do not read ({str(exc)[:120]}): delete the file and run "
                              "again") from None
        if progress is not None:
            progress(len(t["starts"]) - 1)
        return FeatureSet(t["tokens"], t["features"], t["starts"], t["prompt_lens"], t.get("inputs"),
                          tuple(t["layers"].tolist()) if "layers" in t else ())
    e = target.hidden_size
    seqs = [entry.ids[: target.max_context] for entry in corpus]
    starts = torch.tensor([0, *(len(ids) for ids in seqs)]).cumsum(0)  # [S + 1]
    n = int(starts[-1])
    # filled in place (no list of pieces joined at the end: a corpus's features can be half the RAM)
    feats = torch.empty((n, e), dtype=torch.float16)  # [N, E]
    inputs = torch.empty((n, len(layers) * e), dtype=torch.float16) if layers else None  # [N, k E]
    for s, hidden in _hidden_rows(target, corpus, layers, padded):  # [n_s, (k + 1) E] float16
        a, b = int(starts[s]), int(starts[s + 1])
        feats[a:b] = hidden[:, -e:]
        if inputs is not None:
            inputs[a:b] = hidden[:, :-e]
        if progress is not None:
            progress(1)
    fs = FeatureSet(torch.tensor([t for ids in seqs for t in ids], dtype=torch.long), feats, starts,
                    torch.tensor([min(len(entry.prompt_ids), len(ids)) for entry, ids in zip(corpus, seqs)]),
                    inputs, layers)
    tensors = {"tokens": fs.tokens, "features": fs.features, "starts": fs.starts, "prompt_lens": fs.prompt_lens}
    if layers:
        tensors |= {"inputs": fs.inputs, "layers": torch.tensor(layers, dtype=torch.long)}
    if not write:
        return fs
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if size > free - KEEP_FREE_BYTES:
        print(f"features of {len(corpus)} sequences ({size / 2**30:.1f} GiB) not cached: {out.parent} has "
              f"{free / 2**30:.1f} GiB free; they are kept in memory for this run", file=sys.stderr)
        return fs
    with atomic_path(out) as tmp:
        save_file(tensors, str(tmp))
    return fs


KEEP_FREE_BYTES = 2 * 2**30
"""Disk space the features cache leaves free: a corpus's features that would use it stay in memory only."""


def _hidden_rows(target, corpus: Sequence[CorpusEntry], layers: tuple[int, ...],
                 padded: PaddedConfig | None) -> Iterator[tuple[int, torch.Tensor]]:
    """(s, [n_s, (k + 1) E] float16 CPU rows of sequence s): the inputs of `layers`, then the
    final-normed state; one prefill per sequence in order, or padded batches (`training.padded`,
    longest first), each sequence handed out as its batch is done."""
    from specula.training.padded import feature_rows_padded, length_batches, padded_model

    request = (*layers, target.num_layers) if layers else True
    seqs = [entry.ids[: target.max_context] for entry in corpus]
    model = padded_model(target) if padded is not None else None
    if model is None:
        for s, ids in enumerate(seqs):
            seq = target.new_sequence()
            _, hidden = seq.prefill(ids, logits="none", hidden=request)
            seq.release()
            yield s, hidden.to(torch.float16).cpu()
        return
    for group in length_batches([len(s) for s in seqs], len(seqs), padded.feature_tokens):
        yield from zip(group, feature_rows_padded(model, [seqs[i] for i in group], (*layers, target.num_layers)))


def concat_features(sets: list[FeatureSet]) -> FeatureSet:
    """One feature set of several (their sequences in order): a corpus cached per data file. The
    features and layer inputs stay in their parts (`Rows`: no joined copy); the parts are taken out
    of `sets` (it ends empty)."""
    if len(sets) == 1:
        return sets.pop()
    if len({fs.layers for fs in sets}) != 1:
        raise ValueError("feature sets of different layers cannot be joined")
    lengths = [int(fs.starts[-1]) for fs in sets]
    offsets = torch.tensor([0] + lengths[:-1]).cumsum(0)
    starts = torch.cat([sets[0].starts[:1]] + [fs.starts[1:] + off for fs, off in zip(sets, offsets)])
    tokens = torch.cat([fs.tokens for fs in sets])
    prompt_lens = torch.cat([fs.prompt_lens for fs in sets])
    parts = [sets.pop(0) for _ in range(len(sets))]
    feats = Rows([p for fs in parts for p in _parts(fs.features)])
    inputs = None if parts[0].inputs is None else Rows([p for fs in parts for p in _parts(fs.inputs)])
    return FeatureSet(tokens, feats, starts, prompt_lens, inputs, parts[0].layers)


def _parts(rows: torch.Tensor | Rows) -> list[torch.Tensor]:
    """The row tensors `rows` is made of (itself when a tensor)."""
    return rows.parts if isinstance(rows, Rows) else [rows]


def token_counts(tokens: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """[V] float64: how often each token id occurs in `tokens` (a corpus's ids, flat)."""
    return torch.bincount(tokens, minlength=target_vocab).double()


def _ranking(fs: FeatureSet, target_vocab: int, counts: torch.Tensor | None) -> torch.Tensor:
    """[V] float64 counts a vocabulary is ranked by, a copy the caller may change: `counts` if
    given, else the feature set's own tokens'."""
    return token_counts(fs.tokens, target_vocab) if counts is None else counts.double().clone()


def _most_frequent(counts: torch.Tensor, k: int) -> torch.Tensor:
    """The k ids of highest count, ties broken by the lower id (so a vocabulary is the same on every
    machine and torch version)."""
    return torch.sort(-counts, stable=True).indices[:k]


def draft_vocabulary(fs: FeatureSet, size: int, target_vocab: int, always: Sequence[int] = (),
                     counts: torch.Tensor | None = None) -> torch.Tensor:
    """d2t [size] long, sorted: the `size` most frequent tokens of the corpus (EAGLE-3's reduced
    vocabulary), plus `always` (e.g. EOS ids); the whole vocabulary when size >= target_vocab.
    `counts` [V]: rank by these token counts (`token_counts` of another corpus, `--vocab-from`)
    instead of the feature set's tokens."""
    if size >= target_vocab:
        return torch.arange(target_vocab)
    counts = _ranking(fs, target_vocab, counts)
    counts[list(always)] = float("inf")
    return _most_frequent(counts, size).sort().values


def extend_vocabulary(d2t: torch.Tensor, fs: FeatureSet, size: int, target_vocab: int,
                      counts: torch.Tensor | None = None) -> torch.Tensor:
    """d2t [<= size] long, sorted: every token of `d2t` (a head's draft vocabulary, kept whole) and the
    corpus's most frequent tokens outside it, up to `size` in all (tokens the corpus never holds are
    not added; the whole vocabulary when size >= target_vocab); `d2t` itself when it already holds
    `size` tokens or more. `counts` [V]: rank by these token counts instead of the feature set's."""
    if len(d2t) >= size:
        return d2t
    if size >= target_vocab:
        return torch.arange(target_vocab)
    counts = _ranking(fs, target_vocab, counts)
    counts[d2t] = 0.0
    room = min(size - len(d2t), int((counts > 0).sum()))
    return torch.cat([d2t, _most_frequent(counts, room)]).sort().values


def coverage(fs: FeatureSet, d2t: torch.Tensor) -> float:
    """Fraction of corpus tokens inside the draft vocabulary."""
    inside = torch.zeros(int(max(fs.tokens.max(), d2t.max())) + 1, dtype=torch.bool)
    inside[d2t] = True
    return float(inside[fs.tokens].float().mean())
