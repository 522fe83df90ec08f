"""`eagle`, `eagle3`, `medusa`, `hydra`: drafters that are trained heads on the target's hidden states.

They are the `draft-tree` drafter with a head instead of a draft model: the same EAGLE-2
dynamic expansion (top-k children per frontier node, path scores = products of the head's
probabilities, the best top-k nodes per level expanded, the best N kept; SafeAILab/EAGLE
`eagle/model/cnets1.py` `topK_genrate`), the same sampled sibling modes and rules. What differs
is the per-request state (`heads.runtime`): the head reads the target's features, which the
engine passes from the verification pass itself (`FeatureDrafter`); the head predicts over its
reduced draft vocabulary, mapped back to the target's token ids exactly (`d2t`). Losslessness
does not depend on the head: the target verifies every node with the request's rule.

The head file comes from `specula train` or `specula models install` (shipped heads); see
`heads.file` for its checks.
"""

from __future__ import annotations

import os
import sys
from dataclasses import fields

import torch

from specula.drafters.base import StepResult, method_config
from specula.drafters.draft_tree import DraftTreeConfig, DraftTreeDrafter
from specula.drafters.heads.config import AUTOREGRESSIVE
from specula.drafters.heads.online import OnlineDistillConfig, OnlineDistiller
from specula.drafters.heads.runtime import HeadState, TrainedHead, load_head
from specula.errors import ConfigError
from specula.methods import an

DEFAULTS = {"eagle": dict(tree_top_k=4, tree_depth=6, tree_nodes=48),
            "eagle3": dict(tree_top_k=4, tree_depth=6, tree_nodes=48),
            "medusa": dict(tree_top_k=4, tree_depth=4, tree_nodes=32),
            "hydra": dict(tree_top_k=4, tree_depth=4, tree_nodes=32)}
"""Tree shape per kind (EAGLE-2 uses top-k 10, depth 5-6, 60 nodes on a GPU; the planner cuts
what does not pay on this hardware). Top-4, not 8, for eagle / eagle3: a level's head pass over a
frontier of 8 rows costs 0.97 ms against 0.78 for 4 (SmolLM2 on the 2-core CPU), a non-best child
is accepted 2-5% of the time once its parent was, and the planner verified trees of 6-7 nodes
either way; `eagle3` on SmolLM2, fresh processes, three rounds each: Spec-Bench (3 a group)
1.27 / 1.30 / 1.27x with 8 against 1.31 / 1.34 / 1.32x with 4, the everyday set 1.82 / 1.95 / 1.77x
against 1.88 / 1.91 / 1.79x (docs/training.md, session 61)."""


class TrainedHeadDrafter(DraftTreeDrafter):
    """Dynamic trees from a trained head (see the module docstring)."""

    needs_hidden = True

    def __init__(self, head: TrainedHead, config: DraftTreeConfig, online: OnlineDistiller | None = None) -> None:
        super().__init__(None, config)
        self.head = head
        self.name = head.kind
        self.online = online
        """Online distillation (`--online-distill`): the head learns from every finished request."""
        self.feature_request = head.feature_request
        """The target features the head reads (`models.base.FeatureRequest`)."""
        if head.kind not in AUTOREGRESSIVE:  # head i drafts level i + 1: no deeper level exists
            self.config = DraftTreeConfig(**{**{f.name: getattr(config, f.name) for f in fields(config)},
                                             "tree_depth": min(config.tree_depth, head.config.num_offsets)})

    @property
    def memory_bytes(self) -> int:
        return self.head.memory_bytes

    @property
    def max_context(self) -> int:
        return self.head.target.max_context

    @property
    def vocab_size(self) -> int:
        return self.head.target.vocab_size

    def start(self) -> HeadState:
        state = self.head.new_state()
        if self.online is not None:
            state.history = ([], [])
        return state

    def observe_prompt(self, prompt, hidden, state: HeadState) -> None:
        if state.history is not None:
            state.history[0].extend(prompt)
        state.add_features(hidden)
        state.add_context(prompt)

    def observe(self, step: StepResult, state: HeadState) -> None:
        if step.hidden is None:
            raise RuntimeError(f"{self.name}: the step carries no hidden states (the engine must ask for them)")
        state.finish(step.accepted_tokens)
        state.observe(step.hidden, step.path)
        committed = [*step.accepted_tokens, step.next_token]
        state.add_context(committed)
        if state.history is not None:
            state.history[0].extend(committed)

    def finish(self, state: HeadState) -> None:
        if self.online is not None and state.history is not None:
            tokens, features = state.history
            state.history = None
            try:
                self.online.add(tokens, features)
            except (RuntimeError, ValueError) as exc:  # the request is served: a failed update ends OSD, not it
                print(f"warning: online distillation stopped: its update failed ({type(exc).__name__}: {exc})",
                      file=sys.stderr)
                self.online = None
        state.release()


CONFIG = DraftTreeConfig
"""The options a head drafter takes besides its keywords (`specula.methods`)."""


def create_head_drafter(kind: str, *, target=None, head: str | os.PathLike | TrainedHead | None = None,
                        target_name: str | None = None, online_distill: bool = False,
                        online_lr: float | None = None, head_window: int | None = None,
                        head_context_vocab: int | None = None, **options) -> TrainedHeadDrafter:
    """options: DraftTreeConfig fields; `head`: a head file (or a loaded `TrainedHead`);
    `online_distill`: keep training the head on what is served (OSD), at `online_lr`;
    `head_window`: committed pairs an eagle / eagle3 head attends to (None: the context it was
    trained on, `TrainedHead.window`; 0: every pair); `head_context_vocab`: most tokens outside the
    draft vocabulary a request's prompt and output add to the head's output (None: the default,
    `runtime.DEFAULT_CONTEXT_VOCAB`, none; 0: none)."""
    for name, value, zero in (("head_window", head_window, "the whole context"),
                              ("head_context_vocab", head_context_vocab, "none")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"{name} must be an integer >= 0 (0 = {zero}), got {value!r}")
    if target is None:
        raise ConfigError(f"method {kind!r} needs the target model")
    if head is None:
        raise ConfigError(f"method {kind!r} needs a trained head for this target: install the shipped one with "
                          f"`specula models install MODEL` or train one with `specula train --kind {kind}`, "
                          "then pass head=FILE")
    if not isinstance(head, TrainedHead):
        head = load_head(head, target, target_name or target.name, torch.float32 if online_distill else None)
    elif head.target is not target:
        raise ConfigError(f"the {head.kind} head given was loaded for another target ({head.target.name}); load it "
                          f"for this one ({target.name}): load_head(FILE, target, NAME)")
    if head.kind != kind:
        raise ConfigError(f'method="{kind}" got {an(head.kind)} head; use method="{head.kind}" or {an(kind)} head')
    if head_window is not None:
        head.window = head_window or None
    if head_context_vocab is not None:
        head.context_vocab = head_context_vocab
    merged = {**DEFAULTS[kind], **options}
    online = None
    if online_distill and kind == "eagle3":
        raise ConfigError("online_distill trains eagle, medusa and hydra heads; an eagle3 head learns offline only "
                          "(`specula train --kind eagle3`): drop online_distill")
    if online_distill and head.config.copy_ngram:
        raise ConfigError("online_distill trains on short windows of a request, which leave a copy hint no text to "
                          "match; a head with copy hints learns offline only (`specula train --copy-ngram`): drop "
                          "online_distill")
    if online_distill and (head.kernel is not None or head.dtype != torch.float32):
        raise ConfigError(f"online_distill trains the head in float32; this one drafts on "
                          f"{head.kernel or head.dtype} weights it cannot train: load it with "
                          "load_head(FILE, target, NAME, torch.float32), or pass the file")
    if online_distill:
        online = OnlineDistiller(head, OnlineDistillConfig(**({} if online_lr is None else {"lr": online_lr})))
    return TrainedHeadDrafter(head, method_config(kind, DraftTreeConfig, merged), online)
