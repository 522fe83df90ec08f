"""`specula train`: train a drafter head (EAGLE, Medusa, Hydra) for a target by self-distillation.

    specula train --target smollm2-135m --kind eagle --out heads/smollm2
    specula generate --target smollm2-135m --method eagle --head heads/smollm2/eagle.safetensors --prompt "Hi"

The target answers the prompts of --data (JSONL: {"prompt": ...} or {"turns": [...]}; default:
specula's own training prompts) greedily, its features are cached, the head is trained on the
target's own distributions with a progress bar, checkpoints are atomic and a second run with the
same settings resumes; the end prints the held-out acceptance. See docs/training.md.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from specula.commands.common import add_load_args, load_config
from specula.methods import METHODS

HEAD_KINDS = tuple(spec.head for spec in METHODS.values() if spec.head is not None)
"""What `--kind` trains: the head kinds of the method table (`HeadKind`)."""

TRAIN_SPELLINGS = {"cache_features=False": "--no-feature-cache", "cache_features": "--no-feature-cache",
                   "eval_data=[]": "--eval-data none", "padded=None": "--padded-rows 0", "deadline": "--time-budget"}
"""`run_training`'s keywords (some with a value) that this command sets by another flag (`--time-budget`: minutes
from the start, `deadline` a `time.monotonic()`)."""


def train_options() -> list[str]:
    """What the library's training errors name (`TrainConfig`'s and `CorpusConfig`'s fields, `run_training`'s
    keywords): each this command sets by the flag of the same name is named by it (`common.flags_in_errors`)."""
    import inspect
    from dataclasses import fields

    from specula.training.corpus import CorpusConfig
    from specula.training.run import run_training
    from specula.training.trainer import TrainConfig

    return [*(f.name for config in (TrainConfig, CorpusConfig) for f in fields(config)),
            *inspect.signature(run_training).parameters]


def register(sub) -> None:
    p = sub.add_parser("train", help=f"train a drafter head ({', '.join(HEAD_KINDS)}) for a target",
                       description="Self-distillation: the target writes the answers, the head learns the target's "
                                   "own next-token distributions from its cached hidden states.")
    p.add_argument("--target", required=True, metavar="MODEL", help="the target model (alias, directory, .gguf)")
    p.add_argument("--kind", choices=HEAD_KINDS, default=HEAD_KINDS[0], help=f"head to train (default {HEAD_KINDS[0]})")
    p.add_argument("--data", nargs="+", default=None, metavar="FILE",
                   help="JSONL prompt files (default: specula/data/training/prompts.jsonl); never a benchmark's prompts")
    p.add_argument("--eval-data", nargs="*", default=None, metavar="FILE",
                   help="prompt files of another source for the held-out report (default: the everyday set; "
                        "'none' or no file: skip)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for KIND.safetensors, checkpoint.pt, report.json")
    p.add_argument("--epochs", type=float, default=4.0,
                   help="passes over the training sequences (default 4); 0 = no training: the starting head "
                        "(--init-head) written out as it is, e.g. with its draft vocabulary extended")
    p.add_argument("--draft-vocab", type=int, default=8192, metavar="N",
                   help="reduced draft vocabulary: the corpus's N most frequent tokens (default 8192); with --init-head, "
                        "an N above the head's own extends it (its tokens kept, the corpus's most frequent others added)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="chunks per step (default 8)")
    p.add_argument("--seq-len", type=int, default=256, metavar="N", help="pairs per chunk (default 256)")
    p.add_argument("--length-groups", action="store_true",
                   help="batch chunks of like length together (each epoch still sees every chunk once): "
                        "far fewer padded rows on mixed data at a long --seq-len")
    p.add_argument("--ttt-steps", type=int, default=None, metavar="N",
                   help="eagle: training-time-test steps (1 = plain teacher forcing; default 2)")
    p.add_argument("--topk-loss", type=float, default=0.0, metavar="W",
                   help="weight of HASS's top-k distillation term beside the cross-entropy (default 0 = off; HASS "
                        "fine-tunes a trained head with 1 at a low --lr)")
    p.add_argument("--topk-loss-k", type=int, default=10, metavar="K",
                   help="target tokens the top-k term reads (default 10)")
    p.add_argument("--num-offsets", type=int, default=None, metavar="K", help="medusa / hydra: heads (default 4)")
    p.add_argument("--intermediate-size", type=int, default=0, metavar="N",
                   help="eagle / eagle3: MLP width of the head's layer (default 0 = 8/3 of the target's hidden size)")
    p.add_argument("--num-kv-heads", type=int, default=0, metavar="N",
                   help="eagle / eagle3: key/value heads of the head's attention, dividing its query heads "
                        "(hidden size / 64) (default 0 = one per query head)")
    p.add_argument("--copy-ngram", type=int, default=0, metavar="N",
                   help="eagle / eagle3: the head also reads a copy hint, the token that followed the latest earlier "
                        "match of the 1 .. N tokens ending at its own, at any distance (what prompt lookup finds), "
                        "and learns how far to trust it; with --init-head a head without hints gains them at zero "
                        "(default 0 = none)")
    p.add_argument("--copy-lr-scale", type=float, default=None, metavar="X",
                   help="learning rate of the copy hints' vectors (a gain and a bias per match length) over --lr (default 30): they "
                        "start at zero and must grow to the head's scale before it follows a hint; their projection "
                        "matrix keeps --lr")
    p.add_argument("--max-new-tokens", type=int, default=160, metavar="N", help="answer length per prompt (default 160)")
    p.add_argument("--max-prompt-tokens", type=int, default=768, metavar="N",
                   help="prompts longer than N tokens are cut from the left, their end kept (default 768); raise it "
                        "for long-context prompts (documents, articles to summarise)")
    p.add_argument("--max-minutes", type=float, default=None, metavar="M",
                   help="stop training after M minutes (checkpointed; rerun to go on)")
    p.add_argument("--time-budget", type=float, default=None, metavar="M",
                   help="end within M minutes of the start: after the answers and features (not cut: when they "
                        "leave too little time, the command ends there with an error, their cache kept) a short "
                        "probe times the training steps and the epochs are cut so the full learning-rate schedule "
                        "and the reports fit (over a share of the held-out split when the whole would take more "
                        "than a fifth of the time left), e.g. on a GPU lent for a fixed time; rerun after a stop, "
                        "the same command resumes its checkpoint with the schedule of its first fit")
    p.add_argument("--stop-after", choices=("answers", "features"), default=None,
                   help="end once the answers (or also the features) of --data are cached: the same command "
                        "without it goes on from them (e.g. answers on a GPU lent now, training on one lent later)")
    p.add_argument("--answers", nargs="+", default=None, metavar="PATH",
                   help="answers to the --data prompts written earlier instead of the target's: corpus files as "
                        "specula train caches them ($SPECULA_CACHE/training/corpus-*.jsonl) or folders of them, e.g. "
                        "a smaller model's with the target's tokenizer (cheaper; the head learns the target's "
                        "predictions over that text); the target only takes its features over them")
    p.add_argument("--no-feature-cache", dest="cache_features", action="store_false",
                   help="keep the features in memory only, not in $SPECULA_CACHE/training (a one-off run on a machine "
                        "lent for a fixed time: a 1.5B target's features of 30,000 sequences are ~66 GB to write)")
    p.add_argument("--max-sequences", type=int, default=0, metavar="N",
                   help="train on N of the corpus's training sequences (a seeded subset; default 0 = all): "
                        "data-size studies reuse one cached corpus")
    p.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="matrix products while training: bfloat16 autocast (float32 weights and losses) or "
                        "float32; auto = bfloat16 on CUDA and on CPUs with AVX512-BF16 (default auto)")
    p.add_argument("--padded-rows", type=int, default=None, metavar="N",
                   help="answers and features in padded batches of up to N prompts through the Hugging Face "
                        "model (--backend hf): the fast path on a GPU, where it is the default (512); "
                        "0 = the engine's batched step (the CPU default)")
    p.add_argument("--vocab-from", nargs="+", default=None, metavar="PATH",
                   help="rank the draft vocabulary by the tokens of these corpus files (or folders of them, as "
                        "--answers: prompts and answers) instead of the training sequences'; e.g. with --init-head and a "
                        "larger --draft-vocab, the tokens the target writes across its whole corpus")
    p.add_argument("--init-head", default=None, metavar="FILE|installed",
                   help="start from this head (fine-tuning: its weights, shape and draft vocabulary, which a larger "
                        "--draft-vocab extends; 'installed' = "
                        "the head of --kind that `specula models install` put in place for --target), e.g. the "
                        "shipped head on prompts like yours; --seq-len sets the context it learns to attend to")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_load_args(p)
    p.set_defaults(handler=run)


def check_inputs_kept(args: argparse.Namespace, init_head) -> None:
    """Refuse an --out whose head, checkpoint or report would overwrite a file the run reads."""
    from specula.paths import check_not_input
    from specula.training.run import out_files

    given = [("the --init-head head", init_head)]
    for what, option in (("a --data file", "data"), ("an --eval-data file", "eval_data"),
                         ("an --answers file", "answers"), ("a --vocab-from file", "vocab_from")):
        given += [(what, path) for path in getattr(args, option) or ()]
    for written in out_files(Path(args.out).expanduser(), args.kind):
        check_not_input(written, "--out", given)


def train_config(args: argparse.Namespace):
    """The `TrainConfig` of the command line (its own checks run here, before anything loads). An
    option given for a head it does not shape is refused, not ignored."""
    from specula.commands.common import flags_in_errors
    from specula.drafters.heads.config import AUTOREGRESSIVE
    from specula.errors import ConfigError
    from specula.methods import spelled
    from specula.training.trainer import TrainConfig

    offsets = tuple(kind for kind in HEAD_KINDS if kind not in AUTOREGRESSIVE)
    for name, kinds in (("ttt_steps", AUTOREGRESSIVE), ("num_offsets", offsets)):  # argparse default None
        if getattr(args, name) is not None and args.kind not in kinds:
            raise ConfigError(f"{spelled(name)} is for {' / '.join(kinds)} heads, not --kind "
                              f"{args.kind}: drop it")
    if args.copy_lr_scale is not None and not args.copy_ngram and args.init_head is None:
        raise ConfigError("--copy-lr-scale is the copy hints' learning rate and this head has none: add "
                          "--copy-ngram N (or fine-tune a head with hints: --init-head), or drop it")
    given = {name: getattr(args, name) for name in ("ttt_steps", "num_offsets", "copy_lr_scale")
             if getattr(args, name) is not None}  # else TrainConfig's defaults
    with flags_in_errors(args, train_options(), TRAIN_SPELLINGS):  # its errors name the flags
        return TrainConfig(kind=args.kind, draft_vocab=args.draft_vocab, epochs=args.epochs, lr=args.lr,
                           batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                           max_sequences=args.max_sequences, precision=args.precision,
                           intermediate_size=args.intermediate_size, num_kv_heads=args.num_kv_heads,
                           copy_ngram=args.copy_ngram, length_groups=args.length_groups, topk_loss=args.topk_loss,
                           topk_loss_k=args.topk_loss_k, **given)


def check_minutes(args: argparse.Namespace) -> None:
    from specula.errors import ConfigError

    if args.max_minutes is not None and not 0 < args.max_minutes < math.inf:  # -1 trained one step, saved as finished
        raise ConfigError(f"--max-minutes must be > 0 (a finite number), got {args.max_minutes}")
    if args.time_budget is not None and not 0 < args.time_budget < math.inf:
        raise ConfigError(f"--time-budget must be > 0 minutes (a finite number), got {args.time_budget}")


def init_head_file(args: argparse.Namespace):
    """--init-head's file: the one given, or for `installed` the head installed for --target (None: none)."""
    from specula.errors import ConfigError

    if args.init_head != "installed":
        return args.init_head
    from specula.drafters.heads.shipped import default_head

    found = default_head(args.target, args.kind)
    if found is None:
        raise ConfigError(f"--init-head installed: no {args.kind} head is installed for {args.target}; install "
                          f"one with `specula models install {args.target}` or pass a head file")
    return found


def check_before_load(args: argparse.Namespace, config, init_head) -> None:
    """What the target's `config.json` decides, checked before the target loads (up to a minute for
    the 1.5B): a new head's shape (`--num-kv-heads`), and `--padded-rows` on `--backend native`.
    `run_training` checks both again on the loaded target (a `.gguf` has no config to read here)."""
    from specula.errors import ConfigError
    from specula.models.loading import config_shape
    from specula.training.run import PADDED_NEEDS_HF, check_new_shape

    if args.padded_rows and args.backend == "native":
        raise ConfigError(PADDED_NEEDS_HF)
    shape = None if init_head is not None else config_shape(args.target)  # a fine-tune's shape is its head's
    if shape is not None:
        check_new_shape(config, shape)


def run(args: argparse.Namespace) -> int:
    import time

    from specula.commands.common import in_command_flags
    from specula.models.loading import load_backend
    from specula.errors import ConfigError, reworded
    from specula.paths import check_output
    from specula.training.corpus import CorpusConfig, PaddedConfig
    from specula.training.heap import return_freed_memory
    from specula.training.run import check_inputs, print_note, print_report, run_training

    check_minutes(args)
    deadline = None if args.time_budget is None else time.monotonic() + 60 * args.time_budget
    config = train_config(args)
    if args.max_prompt_tokens < 1:
        raise ConfigError(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    corpus = CorpusConfig(max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens)
    if args.padded_rows is not None and args.padded_rows < 0:
        raise ConfigError(f"--padded-rows must be >= 0 (0 = the engine's batched step), got {args.padded_rows}")
    padded = "auto" if args.padded_rows is None else PaddedConfig(max_rows=args.padded_rows) if args.padded_rows else None
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1 (the answer tokens a prompt gets), got {args.max_new_tokens}")
    check_output(args.out, "--out", "dir")
    init_head = init_head_file(args)
    eval_data = [] if args.eval_data == ["none"] else args.eval_data
    inputs = dict(init_head=init_head, stop_after=args.stop_after, answers=args.answers,
                  cache_features=args.cache_features, vocab_from=args.vocab_from)
    check_inputs_kept(args, init_head)
    flagged = in_command_flags(args, train_options(), TRAIN_SPELLINGS)  # its errors and notes: out= as --out
    with reworded(flagged):  # the library names run_training's keywords
        check_inputs(config, args.data or (), eval_data, **inputs)  # bad prompts, files, settings: before the load
        check_before_load(args, config, init_head)
        return_freed_memory()  # this process's heap would keep every step's freed blocks (`training.heap`)
        target, tokenizer = load_backend(args.target, load_config(args), name="target")
        report = run_training(target, tokenizer, args.target, Path(args.out), config, args.data or (), corpus,
                              quiet=args.quiet, max_minutes=args.max_minutes, deadline=deadline, eval_data=eval_data,
                              padded=padded, on_note=lambda line: print_note(flagged(line)), **inputs)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0
