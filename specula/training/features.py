"""The target's features over the corpus, computed once and cached (later epochs cost only the head).

For every corpus sequence (prompt + the target's answer) one causal prefill with `hidden=True`
(`models.base.FeatureModel`): the last hidden state of every position, the same features the
engine hands a head while generating. Stored as one safetensors file: `tokens` [N] long,
`features` [N, E] float16, `starts` [S + 1] long (sequence s is rows starts[s] .. starts[s+1]),
`prompt_lens` [S] long; written atomically.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from specula.training.corpus import CorpusEntry


@dataclass
class FeatureSet:
    """Tokens and target features of a corpus (see the module docstring)."""

    tokens: torch.Tensor  # [N] long
    features: torch.Tensor  # [N, E] float16
    starts: torch.Tensor  # [S + 1] long
    prompt_lens: torch.Tensor  # [S] long

    def __len__(self) -> int:
        return len(self.starts) - 1

    def sequence(self, s: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(tokens [n], features [n, E], prompt length) of sequence s."""
        a, b = int(self.starts[s]), int(self.starts[s + 1])
        return self.tokens[a:b], self.features[a:b], int(self.prompt_lens[s])


def extract_features(target, corpus: Sequence[CorpusEntry], out: Path,
                     progress: Callable[[int], None] | None = None) -> FeatureSet:
    """Features of every corpus sequence, cached at `out` (reused when present)."""
    from safetensors.torch import load_file, save_file

    from specula.paths import atomic_path

    if out.is_file():
        t = load_file(str(out))
        return FeatureSet(t["tokens"], t["features"], t["starts"], t["prompt_lens"])
    tokens, feats, starts, plens = [], [], [0], []
    for entry in corpus:
        ids = entry.ids[: target.max_context]
        seq = target.new_sequence()
        _, hidden = seq.prefill(ids, logits="none", hidden=True)  # [n, E]
        seq.release()
        tokens.append(torch.tensor(ids, dtype=torch.long))
        feats.append(hidden.to(torch.float16).cpu().clone())
        starts.append(starts[-1] + len(ids))
        plens.append(min(len(entry.prompt_ids), len(ids)))
        if progress is not None:
            progress(1)
    fs = FeatureSet(torch.cat(tokens), torch.cat(feats), torch.tensor(starts), torch.tensor(plens))
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        save_file({"tokens": fs.tokens, "features": fs.features, "starts": fs.starts, "prompt_lens": fs.prompt_lens},
                  str(tmp))
    return fs


def draft_vocabulary(fs: FeatureSet, size: int, target_vocab: int, always: Sequence[int] = ()) -> torch.Tensor:
    """d2t [size] long, sorted: the `size` most frequent tokens of the corpus (EAGLE-3's reduced
    vocabulary), plus `always` (e.g. EOS ids); the whole vocabulary when size >= target_vocab."""
    if size >= target_vocab:
        return torch.arange(target_vocab)
    counts = torch.bincount(fs.tokens, minlength=target_vocab).double()
    counts[list(always)] = float("inf")
    top = counts.topk(size).indices
    return top.sort().values


def coverage(fs: FeatureSet, d2t: torch.Tensor) -> float:
    """Fraction of corpus tokens inside the draft vocabulary."""
    inside = torch.zeros(int(max(fs.tokens.max(), d2t.max())) + 1, dtype=torch.bool)
    inside[d2t] = True
    return float(inside[fs.tokens].float().mean())
