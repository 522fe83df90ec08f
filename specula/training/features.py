"""The target's features over the corpus, computed once and cached (later epochs cost only the head).

For every corpus sequence (prompt + the target's answer) one causal prefill with `hidden=`
(`models.base.FeatureModel`): the last hidden state of every position, the same features the
engine hands a head while generating, and for an eagle3 head the inputs of its feature layers
from the same pass. Stored as one safetensors file: `tokens` [N] long, `features` [N, E] float16,
`starts` [S + 1] long (sequence s is rows starts[s] .. starts[s+1]), `prompt_lens` [S] long, and
with layers `inputs` [N, k E] float16 and `layers` [k] long; written atomically.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from specula.training.corpus import CorpusEntry, PaddedConfig


@dataclass
class FeatureSet:
    """Tokens and target features of a corpus (see the module docstring)."""

    tokens: torch.Tensor  # [N] long
    features: torch.Tensor  # [N, E] float16
    starts: torch.Tensor  # [S + 1] long
    prompt_lens: torch.Tensor  # [S] long
    inputs: torch.Tensor | None = None  # [N, k E] float16: the inputs of `layers` (eagle3), else None
    layers: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.starts) - 1

    def sequence(self, s: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(tokens [n], features [n, E], prompt length) of sequence s."""
        a, b = int(self.starts[s]), int(self.starts[s + 1])
        return self.tokens[a:b], self.features[a:b], int(self.prompt_lens[s])

    def layer_inputs(self, s: int) -> torch.Tensor:
        """[n, k E]: the inputs of `layers` over sequence s."""
        a, b = int(self.starts[s]), int(self.starts[s + 1])
        return self.inputs[a:b]


def extract_features(target, corpus: Sequence[CorpusEntry], out: Path,
                     progress: Callable[[int], None] | None = None, layers: Sequence[int] = (),
                     padded: PaddedConfig | None = None) -> FeatureSet:
    """Features of every corpus sequence (with `layers`, also the inputs of those layers, from the
    same pass), cached at `out` (reused when present; the caller keys the path by the layers);
    `progress(n)` as sequences are done, a cached file's all at once. `padded`: right-padded
    batched passes through the target's Hugging Face model (`training.padded`) when it has one."""
    from safetensors.torch import load_file, save_file

    from specula.paths import atomic_path

    layers = tuple(layers)
    if out.is_file():
        t = load_file(str(out))
        if progress is not None:
            progress(len(t["starts"]) - 1)
        return FeatureSet(t["tokens"], t["features"], t["starts"], t["prompt_lens"], t.get("inputs"),
                          tuple(t["layers"].tolist()) if "layers" in t else ())
    e = target.hidden_size
    tokens, feats, inputs, starts, plens = [], [], [], [0], []
    for entry, hidden in zip(corpus, _hidden_rows(target, corpus, layers, padded)):  # [n, (k + 1) E] float16
        ids = entry.ids[: target.max_context]
        tokens.append(torch.tensor(ids, dtype=torch.long))
        feats.append(hidden[:, -e:].clone())
        if layers:
            inputs.append(hidden[:, :-e].clone())
        starts.append(starts[-1] + len(ids))
        plens.append(min(len(entry.prompt_ids), len(ids)))
        if progress is not None:
            progress(1)
    fs = FeatureSet(torch.cat(tokens), torch.cat(feats), torch.tensor(starts), torch.tensor(plens),
                    torch.cat(inputs) if layers else None, layers)
    tensors = {"tokens": fs.tokens, "features": fs.features, "starts": fs.starts, "prompt_lens": fs.prompt_lens}
    if layers:
        tensors |= {"inputs": fs.inputs, "layers": torch.tensor(layers, dtype=torch.long)}
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        save_file(tensors, str(tmp))
    return fs


def _hidden_rows(target, corpus: Sequence[CorpusEntry], layers: tuple[int, ...],
                 padded: PaddedConfig | None) -> Iterator[torch.Tensor]:
    """[n, (k + 1) E] float16 CPU rows of each sequence in order: the inputs of `layers`, then the
    final-normed state; one prefill per sequence, or padded batches (`training.padded`)."""
    from specula.training.padded import feature_rows_padded, length_batches, padded_model

    request = (*layers, target.num_layers) if layers else True
    seqs = [entry.ids[: target.max_context] for entry in corpus]
    model = padded_model(target) if padded is not None else None
    if model is None:
        for ids in seqs:
            seq = target.new_sequence()
            _, hidden = seq.prefill(ids, logits="none", hidden=request)
            seq.release()
            yield hidden.to(torch.float16).cpu()
        return
    ready: dict[int, torch.Tensor] = {}
    batches = iter(length_batches([len(s) for s in seqs], len(seqs), padded.feature_tokens))
    for s in range(len(seqs)):  # batches run longest first; rows are handed out in corpus order
        while s not in ready:
            group = next(batches)
            ready.update(zip(group, feature_rows_padded(model, [seqs[i] for i in group], (*layers, target.num_layers))))
        yield ready.pop(s)


def concat_features(sets: Sequence[FeatureSet]) -> FeatureSet:
    """One feature set of several (their sequences in order): a corpus cached per data file."""
    if len(sets) == 1:
        return sets[0]
    if len({fs.layers for fs in sets}) != 1:
        raise ValueError("feature sets of different layers cannot be joined")
    offsets = torch.tensor([0] + [int(fs.starts[-1]) for fs in sets[:-1]]).cumsum(0)
    starts = torch.cat([sets[0].starts[:1]] + [fs.starts[1:] + off for fs, off in zip(sets, offsets)])
    inputs = torch.cat([fs.inputs for fs in sets]) if sets[0].inputs is not None else None
    return FeatureSet(torch.cat([fs.tokens for fs in sets]), torch.cat([fs.features for fs in sets]), starts,
                      torch.cat([fs.prompt_lens for fs in sets]), inputs, sets[0].layers)


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
