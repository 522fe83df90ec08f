"""`specula train` end to end: corpus -> features -> draft vocabulary -> head -> checked head file.

    specula train --target smollm2-135m --kind eagle --out heads/smollm2

Writes OUT/<kind>.safetensors (the head, atomically: `drafters.heads.file`), OUT/checkpoint.pt
(resumable) and OUT/report.json (what was trained on, how long each stage took, the held-out
acceptance before and after). The corpus and the features are cached under
$SPECULA_CACHE/training/ by what they depend on, one cache per data file, so a second run (another
kind, more epochs) starts at the head, and a run with one more data file generates only that
file's sequences.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch

from specula.errors import ConfigError
from specula.methods import an
from specula.training.corpus import (DEFAULT_PROMPTS, EVAL_PROMPTS, CorpusConfig, PaddedConfig, answer_files,
                                     answers_hash, corpus_key, generate_corpus, match_answers, read_answers,
                                     read_prompts)
from specula.training.padded import padded_model
from specula.training.features import (
    FeatureSet, concat_features, coverage, draft_vocabulary, extend_vocabulary, extract_features, token_counts,
)
from specula.training.trainer import (
    CHECKPOINT_FILE, TrainConfig, acceptance_report, data_fingerprint, feature_fingerprint, resume_changes, split,
    split_tokens, step_counts, train_head,
)


PADDED_NEEDS_HF = 'padded batches run through a Hugging Face model: load the target with backend="hf" (or padded=None)'
"""Why `padded` is refused on the native backend (`specula train`: `--padded-rows`, before the load where
`--backend native` is given; the command spells `padded=None` `--padded-rows 0`)."""


def target_identity(target) -> dict:
    """What the target's outputs depend on (not the machine's threads or kernels)."""
    key = target.cost_key()
    return {k: key.get(k) for k in ("model", "dtype", "quantize")}


def _bar(total: int, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step" if desc.startswith("training") else "seq",
                disable=quiet, dynamic_ncols=True)


def out_files(out: Path, kind: str) -> tuple[Path, Path, Path]:
    """What a run writes into OUT: the head (KIND.safetensors), its checkpoint and the report."""
    return out / f"{kind}.safetensors", out / CHECKPOINT_FILE, out / "report.json"


def check_inputs(config: TrainConfig, data: Sequence[str | os.PathLike] = (),
                 eval_data: Sequence[str | os.PathLike] | None = None, *,
                 init_head: str | os.PathLike | None = None,
                 stop_after: Literal["answers", "features"] | None = None,
                 answers: Sequence[str | os.PathLike] | None = None, cache_features: bool = True,
                 vocab_from: Sequence[str | os.PathLike] | None = None):
    """What `run_training` is given (its arguments of the same names), checked without the target:
    `specula train` calls it before the target loads, `run_training` again before it writes anything.
    Returns the training and the evaluation prompts, (file, prompts) per file."""
    per_file = [(f, read_prompts([f])) for f in [Path(f) for f in data] or [DEFAULT_PROMPTS]]
    eval_files = [Path(f) for f in (eval_data if eval_data is not None else [EVAL_PROMPTS])]
    eval_per_file = [(f, read_prompts([f], training=False)) for f in eval_files]
    check_held_out(per_file, eval_per_file)
    if answers is not None and stop_after == "answers":
        raise ConfigError('stop_after="answers" makes the target\'s answers; with answers= there are none to make')
    if not cache_features and stop_after == "features":
        raise ConfigError('stop_after="features" caches the features; cache_features=False keeps them in memory only')
    for paths, option in ((answers, "answers"), (vocab_from, "vocab_from")):
        if paths:
            answer_files(paths, option)
    if config.epochs == 0 and init_head is None:
        raise ConfigError("epochs=0 writes out the init_head head untrained; give init_head (or epochs > 0)")
    if init_head is not None:
        check_init_head(init_head, config)
    return per_file, eval_per_file


def check_held_out(per_file, eval_per_file) -> None:
    """Refuse evaluation prompts that are also training prompts (compared as the benchmark check compares)."""
    from specula.training.contamination import normalise

    trained = {normalise(text): text for _, file_prompts in per_file for _, text in file_prompts}
    shared = [trained[k] for k in {normalise(text) for _, prompts in eval_per_file for _, text in prompts}
              if k in trained]
    if shared:
        raise ConfigError(f"{len(shared)} evaluation prompt(s) are also training prompts (e.g. {shared[0][:60]!r}); "
                          "held-out acceptance must come from prompts the head never trained on: pass other "
                          "eval_data")


def print_note(line: str) -> None:
    """`line`, a note of the run (`run_training`'s `on_note`), on stderr after "note: "."""
    print(f"note: {line}", file=sys.stderr, flush=True)


def run_training(target, tokenizer, target_name: str, out: Path, config: TrainConfig,
                 data: Sequence[str | os.PathLike] = (), corpus: CorpusConfig = CorpusConfig(), *,
                 quiet: bool = False, max_minutes: float | None = None, deadline: float | None = None,
                 eval_data: Sequence[str | os.PathLike] | None = None,
                 padded: PaddedConfig | Literal["auto"] | None = "auto",
                 init_head: str | os.PathLike | None = None,
                 stop_after: Literal["answers", "features"] | None = None,
                 answers: Sequence[str | os.PathLike] | None = None, cache_features: bool = True,
                 vocab_from: Sequence[str | os.PathLike] | None = None,
                 on_note: Callable[[str], None] = print_note) -> dict:
    """Train one head for `target`; returns the report (also written to OUT/report.json).
    `eval_data`: prompt files of another source than the training prompts (default the everyday
    set; () for none): the target answers them too and the report gives the head's acceptance on
    them, the figure that predicts what the engine sees (a split of the training prompts reads
    higher when they share templates). `padded`: answers and features in padded batches through the
    target's Hugging Face model (`training.padded`); "auto" = with the default `PaddedConfig` for a
    Hugging Face model on CUDA, else the engine's path (None). `init_head`: a head file for this
    target to start from (fine-tuning, `initial_head`): its weights, shape and draft vocabulary.
    A `config.draft_vocab` above the head's own extends its draft vocabulary (`extend_vocabulary`,
    `widened_head`). `deadline` (`time.monotonic()` seconds): the run ends by then; after the answers and features,
    the epochs are cut so the whole training schedule and the reports fit (`_fit_to_deadline`).
    `stop_after`: end once the training prompts' answers (or also their features) are cached; the
    report says what was made, and the same call without it goes on from the cache (a GPU lent
    twice: answers in one session, carried back, features and training in the next). `answers`:
    corpus files (or folders of them) holding answers to the training prompts written earlier, e.g.
    by a smaller model with the target's tokenizer (`corpus.read_answers`): the target then only
    takes its features over them; the held-out reports still use the target's own answers.
    `cache_features`: False keeps the features in memory only (`extract_features`' `write`).
    `vocab_from`: corpus files (or folders, as `answers`) whose tokens, prompts and answers, rank the
    draft vocabulary instead of the training sequences' (a fine-tune on a few thousand sequences
    extending a head's vocabulary by the tokens the target writes across a large corpus). `on_note` hears what
    the run notes on its way, naming `run_training`'s keywords (a checkpoint not resumed: pass another out=);
    default `print_note`."""
    from specula.drafters.heads.file import HeadFile, save_head, target_record
    from specula.drafters.heads.config import feature_layers_of
    from specula.drafters.heads.runtime import new_head
    from specula.models.install import sha256_file
    from specula.models.base import FeatureModel
    from specula.paths import atomic_write_json

    if not isinstance(target, FeatureModel):
        raise ConfigError(f'{target_name} cannot return hidden states; train with backend="native" or backend="hf"')
    per_file, eval_per_file = check_inputs(config, data, eval_data, init_head=init_head, stop_after=stop_after,
                                           answers=answers, cache_features=cache_features, vocab_from=vocab_from)
    files = [f for f, _ in per_file]
    prompts = [p for _, file_prompts in per_file for p in file_prompts]
    torch.manual_seed(config.seed)  # OUT is made by the first write into it: a run refused before leaves none
    eval_files = [f for f, _ in eval_per_file]
    eval_prompts = [p for _, file_prompts in eval_per_file for p in file_prompts]
    given = None if answers is None else read_answers(answers, target.vocab_size)  # (table, hash): before the slow part
    ranked = None if not vocab_from else read_answers(vocab_from, target.vocab_size, "vocab_from")
    start = None if init_head is None else initial_head(init_head, target, target_name, config)
    if start is None:  # a new head's shape checked before the answers and features are made, not after them
        check_new_shape(config, target)
    head_file, _, report_file = out_files(out, config.kind)
    times = {}
    layers = feature_layers_of(config.kind, target.num_layers)  # the depths an eagle3 head fuses; else ()

    t = time.perf_counter()
    model = padded_model(target)
    if padded == "auto":
        padded = PaddedConfig() if model is not None and target.device.type == "cuda" else None
    elif padded is not None and model is None:
        raise ConfigError(PADDED_NEEDS_HF)
    padded = None if padded is None else padded.on(target.device)
    stamp = weights_stamp(target)  # one short pass for every file's cache, answers and evaluation data alike
    seqs, fs, features_seconds = _corpus_and_features(target, tokenizer, per_file, corpus, layers,
                                                      None if quiet else "corpus (target answers)", padded,
                                                      features=stop_after != "answers", answers=given,
                                                      write=cache_features, stamp=stamp)
    times["corpus_seconds"] = round(time.perf_counter() - t - features_seconds, 1)
    times["features_seconds"] = round(features_seconds, 1)
    made = {"target": target_name, "kind": config.kind, "data": [str(f) for f in files], "prompts": len(prompts),
            "corpus": {"sequences": len(seqs), "answer_tokens": sum(len(s.output_ids) for s in seqs),
                       "prompt_tokens": sum(len(s.prompt_ids) for s in seqs), **asdict(corpus),
                       "answers_by": "target" if answers is None else {"files": [str(f) for f in answers],
                                                                        "sha256_16": given[1]}}}  # what any report opens with
    if stop_after is not None:
        report = {**made, "device": str(getattr(target, "device", "cpu")), "stopped_after": stop_after, **times}
        atomic_write_json(report_file, report)
        return report

    eval_fs = None
    if eval_prompts:
        t = time.perf_counter()
        _, eval_fs, _ = _corpus_and_features(target, tokenizer, eval_per_file, corpus, layers,
                                             None if quiet else "evaluation answers (other source)", padded,
                                             stamp=stamp)
        times["evaluation_data_seconds"] = round(time.perf_counter() - t, 1)

    counts = None
    if ranked is not None:
        table, vocab_hash = ranked
        flat = [t for prompt_ids, answer_ids in table.items() for t in (*prompt_ids, *answer_ids)]
        counts = token_counts(torch.tensor(flat, dtype=torch.long), target.vocab_size)
        made["vocab_from"] = {"files": [str(f) for f in vocab_from], "sha256_16": vocab_hash, "tokens": len(flat)}
    if counts is None:  # the vocabulary ranked by the training part's tokens: the held-out answers are not seen
        counts = token_counts(split_tokens(fs, split(fs, config.holdout, config.seed, config.max_sequences)[0]),
                              target.vocab_size)
    if start is not None:
        head, d2t = start, extend_vocabulary(start.d2t, fs, config.draft_vocab, target.vocab_size, counts)
        if len(d2t) > len(start.d2t):  # the head's output rows are the target's: more of them need no new weights
            head = widened_head(start, d2t, target)
    else:
        d2t = draft_vocabulary(fs, config.draft_vocab, target.vocab_size, sorted(target.eos_token_ids), counts)
        head = new_head(config.kind, target, d2t, seed=config.seed, num_offsets=config.num_offsets,
                        intermediate_size=config.intermediate_size, num_kv_heads=config.num_kv_heads,
                        copy_ngram=config.copy_ngram)
    started_from = None if init_head is None else {"path": str(init_head), "sha256": sha256_file(Path(init_head))}
    init = None if started_from is None else started_from["sha256"]
    every = list(range(len(eval_fs))) if eval_fs is not None else []
    other_before = acceptance_report(head, eval_fs, every, config, head.embed) if every else None
    losses: list[float] = []
    with _bar(0, f"training {config.kind}", quiet) as bar:
        def progress(n: int, loss: float) -> None:
            losses.append(loss)
            bar.update(n)
            bar.set_postfix(loss=f"{loss:.3f}")

        budget = stop_at = most = None
        if deadline is not None and config.epochs > 0:  # nothing to fit (or probe) without training
            per_epoch, most = step_counts(fs, config)
            config, budget = _fit_to_deadline(head, fs, config, deadline, len(every), cache_features)
            resumed = budgeted_checkpoint(out, config, head, fs, init)
            if resumed is not None:  # this run's own checkpoint: its schedule, re-fitted to this deadline as it goes
                config = resumed
                budget |= {"resumed_epochs": resumed.epochs,
                           "report_sequences": resumed.report_sequences or budget["heldout_sequences"]}
            stop_at = time.monotonic() + budget["seconds_for_training"]
        record = _train_with_total(head, fs, config, out, progress, bar, max_minutes, stop_at, most, init,
                                   on_note)
    if budget is not None:
        budget["epochs_run"] = round(record["steps"] / per_epoch, 3)
        record["time_budget"] = budget
    record["other_source"] = {
        "data": [str(f) for f in eval_files], "sequences": len(every), "before": other_before,
        "after": acceptance_report(head, eval_fs, every, config, head.embed) if every else None}
    report = {
        **made, "draft_vocab": len(d2t), "draft_vocab_coverage": round(coverage(fs, d2t), 4),
        "threads": torch.get_num_threads(), "device": str(getattr(target, "device", "cpu")),
        "padded_batches": asdict(padded) if padded is not None else None, "init_head": started_from, **times,
        "training": record,
    }
    state = {k: v.detach().cpu() for k, v in head.module.state_dict().items()}
    path = save_head(head_file,
                     HeadFile(head.config, state, d2t, target_record(target, target_name),
                              {k: report[k] for k in ("data", "draft_vocab_coverage")} | {
                                  "steps": record["steps"], "seconds": record["seconds"],
                                  "heldout": record["heldout_after"],
                                  "heldout_other_source": record["other_source"]["after"],
                                  "config": record["config"], "init_head": started_from}))
    report["head"] = str(path)
    atomic_write_json(report_file, report)
    return report


def initial_head(path: str | os.PathLike, target, target_name: str, config: TrainConfig):
    """The head a fine-tuning run starts from: `path` read and checked against the target like a head
    to draft with (a `HeadFileError` naming the fix for a missing, corrupted or other-target file),
    in float32 for training. Its kind must be `config.kind`; its shape is kept (the weights fit
    nothing else; its draft vocabulary may grow, `widened_head`), so a `config` that asks for another width is refused (a
    medusa / hydra head keeps its own number of offsets whatever `config.num_offsets` says)."""
    from specula.drafters.heads.runtime import load_head

    head = load_head(path, target, target_name, torch.float32)
    check_init_shape(path, head.config, config)
    if config.copy_ngram and not head.config.copy_ngram:  # the one part of the shape a fine-tune may add
        return with_copy_hints(head, config.copy_ngram, target)
    return head


def check_new_shape(config: TrainConfig, target) -> None:
    """The shape `config` asks of a new head for `target`, refused (`head_config`) where the target
    cannot have it: `run_training` asks on the loaded target, `specula train` before the load on a
    stand-in read from its config.json (`hidden_size`, `num_layers`, `vocab_size`)."""
    from specula.drafters.heads.runtime import head_config

    head_config(config.kind, target, min(config.draft_vocab, target.vocab_size), config.num_offsets,
                config.intermediate_size, config.num_kv_heads, config.copy_ngram)


def check_init_head(path: str | os.PathLike, config: TrainConfig) -> None:
    """The head file `initial_head` starts from, checked without the target: readable (a
    `HeadFileError` naming the fix), of `config.kind`, of the shape `config` asks for (its own is
    kept; 0: not asked for; copy hints may be added to a head without them)."""
    from specula.drafters.heads.file import read_head

    check_init_shape(path, read_head(path).config, config)


def check_init_shape(path: str | os.PathLike, has, config: TrainConfig) -> None:
    """The config `has` of the head at `path` against what `config` asks for (`check_init_head`)."""
    if has.kind != config.kind:
        raise ConfigError(f'init_head={str(path)!r} is {an(has.kind)} head; train it with kind="{has.kind}"')
    for name in ("intermediate_size", "num_kv_heads", "copy_ngram"):  # 0: not asked for
        wanted, value = getattr(config, name), getattr(has, name)
        if wanted and wanted != value and not (name == "copy_ngram" and not value):
            raise ConfigError(f"init_head={str(path)!r} was trained with {name}={value}, not {wanted}: its shape is "
                              f"kept when fine-tuning; drop {name}")


def with_copy_hints(head, n: int, target):
    """`head` (eagle / eagle3, no copy hints) reading copy hints of up to `n` tokens: its weights
    kept, the new ones at zero, so it drafts exactly as before until it learns them."""
    from specula.drafters.heads.runtime import TrainedHead, build_module

    module = build_module(replace(head.config, copy_ngram=n))  # HeadConfig refuses a kind that reads no hints
    missing, unexpected = module.load_state_dict(head.module.state_dict(), strict=False)
    assert not unexpected and set(missing) == {"copy_proj.weight", "copy_len", "copy_gain"}, (missing, unexpected)
    module.reset_copy()
    return TrainedHead(module.to(head.dtype), head.d2t, target, head.file)


def widened_head(head, d2t: torch.Tensor, target):
    """`head` over the larger draft vocabulary `d2t` (a superset of its own): the same module (its
    config's `draft_vocab` updated); every head kind scores its draft vocabulary with the target's
    own output rows, so the new tokens' rows come from the target and no weight is added."""
    from specula.drafters.heads.runtime import TrainedHead

    module = head.module
    module.cfg = replace(module.cfg, draft_vocab=len(d2t))
    return TrainedHead(module, d2t, target, head.file)


def cache_paths(target, file: Path, corpus: CorpusConfig, layers: tuple[int, ...] = (),
                answers: str | None = None, stamp: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """(answers, features) cache files of one prompt file, keyed by the target, the generation
    settings and the file's bytes (features with `layers`' inputs have their own file; features
    over answers given with `--answers` are keyed by those files' hash `answers` too);
    `specula train` and the scripts that reuse its answers read the same paths. Files made by other
    weights at the target's path are deleted first (`_forget_other_weights`). `stamp`: the target's
    `weights_stamp`, taken once by a caller that asks for many files (None: taken here, a short pass)."""
    from specula.paths import cache_dir

    identity = target_identity(target)
    key = corpus_key(identity, [file], corpus)
    fkey = key if answers is None else corpus_key(identity | {"answers": answers}, [file], corpus)
    suffix = "" if not layers else "-layers" + "_".join(map(str, layers))
    corpus_path = cache_dir("training", f"corpus-{key}.jsonl")
    _forget_other_weights(target, cache_dir("training", f"weights-{key}.txt"),
                          [f"corpus-{key}.jsonl*", f"features-{key}*", f"features-{fkey}*"], stamp)
    return corpus_path, cache_dir("training", f"features-{fkey}{suffix}.safetensors")


STAMP_TOLERANCE = (0.05, 0.01)
"""Largest difference (absolute, relative: the larger counts) between two stamps' logits (`weights_stamp`) that
still reads as the same weights: the same model in the same dtype on another thread count or machine differs by
rounding (~1e-4 in float32; bfloat16 keeps 8 bits, 0.4%); a fine-tune, even of a few layers, moves them by tenths
or more."""
STAMP_IDS = tuple(range(1, 17))
"""Tokens (taken modulo the vocabulary) the stamp's forward pass reads: every layer's weights act on them."""


def weights_stamp(target) -> dict[str, Any]:
    """What tells apart two models saved at one path (the cache keys hold the path, so that answers
    carried from another machine with the same cache root are found): a few values of the output head,
    hashed (`rows`), and the logits of a fixed short pass for a few tokens (`logits`), which every layer
    moves, so a fine-tune that left the output head as it was reads as other weights too."""
    from specula.drafters.heads.file import FINGERPRINT_IDS, fingerprint

    rows = hashlib.sha256(json.dumps([round(v, 3) for v in fingerprint(target)]).encode()).hexdigest()[:16]
    seq = target.new_sequence()
    try:
        out = seq.prefill([i % target.vocab_size for i in STAMP_IDS])
    finally:
        seq.release()
    last = out[-1] if out.dim() > 1 else out  # [vocab]: "last" gives one row (a [1, vocab] block on some backends)
    ids = torch.tensor([i for i in FINGERPRINT_IDS if i < target.vocab_size])
    return {"rows": rows, "logits": [round(float(v), 4) for v in last.float()[ids]]}


def same_weights(ours: dict[str, Any], theirs: str) -> bool:
    """Whether the stamp file's text `theirs` was written for the weights of stamp `ours` (`weights_stamp`):
    the same output head and logits within `STAMP_TOLERANCE`. A stamp of before the logits (the head's
    hash alone) is judged by the head, as it was written."""
    try:
        old = json.loads(theirs)
    except json.JSONDecodeError:
        return theirs == ours["rows"]
    if not isinstance(old, dict) or old.get("rows") != ours["rows"]:
        return False
    logits = old.get("logits")
    return (isinstance(logits, list) and len(logits) == len(ours["logits"])
            and all(isinstance(a, (int, float)) and abs(a - b) <= max(STAMP_TOLERANCE[0], STAMP_TOLERANCE[1] * abs(b))
                    for a, b in zip(logits, ours["logits"])))


def _forget_other_weights(target, stamp: Path, patterns: Sequence[str], ours: dict[str, Any] | None = None) -> None:
    """Where the cached answers of a prompt file were made by other weights at the target's path (a
    model retrained, fine-tuned or replaced in place; `stamp`, written beside them, says so:
    `weights_stamp`), delete every cache file `patterns` names, so they are made again for these
    weights: the old model's answers and features were trained on, and the head recorded as the new
    model's. Stamped when unstamped (a cache from before the stamp, or carried from another machine,
    counts as these weights'); a stamp of before the logits is rewritten with them. `ours`: the target's
    `weights_stamp` when the caller has taken it (None: taken here)."""
    from specula.paths import atomic_write_text

    ours = weights_stamp(target) if ours is None else ours
    try:
        theirs = stamp.read_text().strip()
    except OSError:
        theirs = None
    if theirs is not None and same_weights(ours, theirs):
        if theirs.startswith("{"):
            return
    elif theirs is not None:
        stale = sorted({p for pattern in patterns for p in stamp.parent.glob(pattern)})
        if stale:
            print(f"note: the cached answers and features {', '.join(p.name for p in stale)} were made by other "
                  f"weights at this model's path; making them again", file=sys.stderr, flush=True)
        for path in stale:
            path.unlink(missing_ok=True)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(stamp, json.dumps(ours) + "\n")


def file_corpus(tokenizer, prompts: Sequence[tuple[str, str]], corpus: CorpusConfig) -> CorpusConfig:
    """The settings one file's answers depend on: a prompt limit that cuts none of its prompts, nor
    would the default limit, reads as the default (the answers are the same), so raising
    `max_prompt_tokens` for a file of long prompts keeps the cached answers and features of the
    files beside it."""
    from specula.prompts import encode_prompt

    default = CorpusConfig.max_prompt_tokens
    if corpus.max_prompt_tokens == default:
        return corpus
    limit = min(corpus.max_prompt_tokens, default)
    if any(len(encode_prompt(tokenizer, text)) > limit for _, text in prompts):
        return corpus
    return replace(corpus, max_prompt_tokens=default)


def _corpus_and_features(target, tokenizer, per_file: Sequence[tuple[Path, list[tuple[str, str]]]],
                         corpus: CorpusConfig, layers: tuple[int, ...],
                         label: str | None, padded: PaddedConfig | None = None, features: bool = True,
                         answers: tuple[dict, str] | None = None, write: bool = True,
                         stamp: dict[str, Any] | None = None) -> tuple[list, FeatureSet | None, float]:
    """The target's answers to every file's prompts ((file, prompts) pairs), their features (None
    when `features` is false), and the seconds the features took; each file cached on its own
    (`cache_paths`), so adding a file to the data generates only its sequences. `answers`: (answer
    ids by prompt ids, their hash) from `corpus.read_answers`, used instead of the target's; a file's
    features are then keyed by the answers it took (`answers_hash`), so adding a corpus file to
    `--answers` keeps the cached features of the files it does not answer. `write`:
    False keeps new features in memory only. Progress bars under `label` (None: none). `stamp`: the
    target's `weights_stamp` (None: taken here), one for every file's cache (`cache_paths`)."""
    stamp = weights_stamp(target) if stamp is None else stamp
    configs = [file_corpus(tokenizer, prompts, corpus) for _, prompts in per_file]
    seqs, sets = [], []
    with _bar(sum(len(p) for _, p in per_file), label or "", label is None) as bar:
        for (file, prompts), config in zip(per_file, configs):
            if answers is None:
                cached, _ = cache_paths(target, file, config, layers, stamp=stamp)
                seqs.append(generate_corpus(target, tokenizer, prompts, cached, config, progress=bar.update,
                                            padded=padded))
            else:
                seqs.append(match_answers(tokenizer, prompts, answers[0], config,
                                          f"answers= hold no answer to prompt {{}} of {file} (its prompts cut at "
                                          f"another max_prompt_tokens than {config.max_prompt_tokens}?): pass "
                                          "the corpus files made for these prompts"))
                bar.update(len(prompts))
    if not features:
        return [s for file_seqs in seqs for s in file_seqs], None, 0.0
    # with --answers each file's features are keyed by the answers it took, not by all of --answers
    paths = [cache_paths(target, file, config, layers, None if answers is None else answers_hash(file_seqs),
                         stamp)[1] for (file, _), config, file_seqs in zip(per_file, configs, seqs)]
    t = time.perf_counter()
    with _bar(sum(len(s) for s in seqs), "features (target hidden states)", label is None) as bar:
        for file_seqs, features in zip(seqs, paths):
            sets.append(extract_features(target, file_seqs, features, progress=bar.update, layers=layers, padded=padded,
                                         write=write))
    return [s for file_seqs in seqs for s in file_seqs], concat_features(sets), time.perf_counter() - t


def _train_with_total(head, fs, config, out, progress, bar, max_minutes, stop_at=None, most_steps=None, init=None,
                      on_note: Callable[[str], None] | None = None):
    """`train_head` with the bar's total set once the step count is known (and again when a re-fit
    changes it); it stops after `max_minutes`, and at `stop_at` (`time.monotonic()`) at the latest,
    to which its schedule is re-fitted (up to `most_steps`, the epochs asked) as it learns its rate.
    `on_note` hears its notes."""

    def set_total(n: int) -> None:
        bar.total = n
        bar.refresh()

    set_total(step_counts(fs, config)[1])
    limits = [] if max_minutes is None else [max_minutes * 60]
    if stop_at is not None:
        limits.append(max(0.0, stop_at - time.monotonic()))
    return train_head(head, fs, config, out, progress=progress, max_seconds=min(limits) if limits else None,
                      until=stop_at, most_steps=most_steps, on_total=set_total,
                      on_note=on_note, init=init)


PROBE_SECONDS = 10.0
"""How long `--time-budget` times real training steps before it sizes the run."""
KEEP_SECONDS = 20.0
"""What `--time-budget` keeps back beside the held-out reports: saving the head and the report."""
REPORT_SHARE = 0.2
"""Most of the time left that `--time-budget` gives the held-out reports (before and after
training): past it they read a seeded share of the held-out split (`TrainConfig.report_sequences`).
On a GPU lent for a fixed time the reports over a 1.5B target's 1,552 held-out sequences once
took all that was left after the features, and no head was trained."""


FITTED_BY_BUDGET = ("epochs", "report_sequences")
"""The settings `--time-budget` fits anew at each start (`_fit_to_deadline`)."""


def budgeted_checkpoint(out: Path, config: TrainConfig, head, fs: FeatureSet, init: str | None = None,
                        ) -> TrainConfig | None:
    """The settings of OUT/checkpoint.pt where it differs from a run of `head` on `fs` with `config`
    (`resume_changes`) in what a time budget fits (`FITTED_BY_BUDGET`) and in nothing else, else
    None: a run under `--time-budget` that was stopped is then resumed by its own command, where its
    fit, made anew, would read as other settings and start afresh over the checkpoint."""
    ckpt = out / CHECKPOINT_FILE
    if not ckpt.is_file():
        return None
    state = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)
    changes = resume_changes(state, config, head, data_fingerprint(fs), feature_fingerprint(fs), init)
    if not changes or set(changes) - set(FITTED_BY_BUDGET):
        return None
    return replace(config, **{k: was for k, (was, _) in changes.items()})


def _fit_to_deadline(head, fs, config: TrainConfig, deadline: float, other_sequences: int,
                     features_cached: bool = True) -> tuple[TrainConfig, dict]:
    """`config` with its epochs cut so that training and the held-out reports after it end before
    `deadline` (`time.monotonic()`), and the record of how: a probe times the optimizer steps on
    this machine (`probe_steps_per_second`), one held-out report on a few sequences times the
    reports; where reports over the whole held-out split would take more than `REPORT_SHARE` of the
    time left they read a seeded draw of N of its sequences (at least 20), N fitted to that share
    (`TrainConfig.report_sequences`). Too little time for 20 steps (or the whole run, if shorter) is an error; the answers
    and features are cached by then, so a rerun with a larger budget starts at training (at the
    features when `features_cached` is false: `cache_features=False` kept them in memory only)."""
    from specula.training.trainer import fit_epochs, probe_steps_per_second, split

    per_epoch, total = step_counts(fs, config)
    rate = probe_steps_per_second(head, fs, config, min(PROBE_SECONDS, max(1.0, 0.1 * (deadline - time.monotonic()))))
    heldout = split(fs, config.holdout, config.seed, config.max_sequences)[1]
    t = time.monotonic()
    sample = heldout[:20]
    if sample:
        acceptance_report(head, fs, sample, config, head.embed)
    # the held-out report runs before and after training, the other source's after it
    per_sequence = (time.monotonic() - t) / max(1, len(sample))
    available = deadline - time.monotonic() - KEEP_SECONDS
    reported = len(heldout)
    if heldout and per_sequence * (2 * reported + other_sequences) > REPORT_SHARE * available:
        fit = int((REPORT_SHARE * available / max(per_sequence, 1e-9) - other_sequences) / 2)
        reported = min(len(heldout), max(min(20, len(heldout)), fit))
        config = replace(config, report_sequences=reported)
    report_seconds = per_sequence * (2 * reported + other_sequences)
    left = available - report_seconds
    epochs = fit_epochs(config.epochs, per_epoch, rate, left)
    steps = round(epochs * per_epoch)
    if steps < min(20, total):
        kept = ("the answers and features are cached now, so running again with more time (deadline=) starts at "
                "training") if features_cached else ("the answers are cached now (the features, kept in memory by "
                "cache_features=False, are not), so running again with more time (deadline=) starts at the features")
        raise ConfigError(f"deadline= leaves {max(left, 0):.0f} s to train, {steps} optimizer steps at the measured "
                          f"{rate:.2f} steps/s: too few; {kept}")
    fitted = replace(config, epochs=round(epochs, 3)) if epochs < config.epochs else config
    return fitted, {"probe_steps_per_second": round(rate, 2), "seconds_for_training": round(left, 1),
                    "reports_seconds_estimate": round(report_seconds, 1), "report_sequences": reported,
                    "heldout_sequences": len(heldout), "epochs_asked": config.epochs,
                    "epochs": fitted.epochs}


def print_report(report: dict) -> None:
    if report.get("stopped_after"):
        c = report["corpus"]
        print(f"stopped after the {report['stopped_after']}: {c['sequences']} sequences ({c['answer_tokens']} answer "
              f"tokens) cached in {report['corpus_seconds'] + report['features_seconds']:.0f} s; the same command "
              "without --stop-after goes on from them")
        return
    rec = report["training"]
    after, before = rec.get("heldout_after") or {}, rec.get("heldout_before") or {}
    done = "wrote" if rec["total_steps"] == 0 else "trained"  # --epochs 0: the starting head, untrained
    print(f"{done} {report['kind']} head for {report['target']}: {rec['steps']}/{rec['total_steps']} steps in "
          f"{rec['seconds']:.0f} s (corpus {report['corpus_seconds']:.0f} s, features {report['features_seconds']:.0f} s)")
    print(f"draft vocabulary {report['draft_vocab']} tokens ({100 * report['draft_vocab_coverage']:.1f}% of the corpus)")
    if after:
        print(f"held-out greedy chain acceptance (split of the training prompts): mean accepted "
              f"{before.get('mean_accepted_chain', '-')} -> {after['mean_accepted_chain']} per root, "
              f"{after.get('mean_accepted_walk', '-')} per decode step; by depth {after['accept_rate_by_depth']}")
    other = rec.get("other_source") or {}
    if other.get("after"):
        o_before, o_after = other["before"] or {}, other["after"]
        print(f"held-out greedy chain acceptance (other source: {', '.join(Path(f).name for f in other['data'])}, "
              f"{other['sequences']} sequences): mean accepted {o_before.get('mean_accepted_walk', '-')} -> "
              f"{o_after['mean_accepted_walk']} per decode step; by depth {o_after['accept_rate_by_depth']}")
    budget = rec.get("time_budget")
    if budget:
        print(f"time budget: {budget['epochs_run']} of {budget['epochs_asked']} epochs run "
              f"(the probe's {budget['probe_steps_per_second']} steps/s fit {budget['epochs']}; the schedule is "
              "re-fitted as the rate is learned)")
        if "resumed_epochs" in budget:
            print(f"time budget: resumed the run's checkpoint with the schedule of its first fit, "
                  f"{budget['resumed_epochs']} epochs (this start's fit: {budget['epochs']})")
        if budget.get("report_sequences", 0) < budget.get("heldout_sequences", 0):
            print(f"time budget: the held-out reports read {budget['report_sequences']} of the "
                  f"{budget['heldout_sequences']} held-out sequences")
    print(f"head: {report['head']}")
    print(json.dumps({"report": str(Path(report['head']).with_name('report.json'))}))
