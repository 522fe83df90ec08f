"""Online distillation of a trained head while it drafts (OSD, Liu et al. 2024), opt-in.

Each request's committed tokens and the target's features at them (which the engine hands the
head anyway) are recorded; when a request ends its sequence joins a bounded replay buffer, and
every `update_every` finished requests the head takes `steps` optimizer steps (AdamW, small
learning rate) on windows drawn from the buffer with the training loss (`heads.losses`: the
target's own distributions, so the head moves towards what the target accepts on the traffic it
actually serves). The target verifies every draft, so output never changes; only acceptance does.
The head is shared by all requests; updates happen between steps, on the engine's thread.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import torch

from specula.drafters.heads.losses import LossConfig, loss_of
from specula.drafters.heads.runtime import TrainedHead


@dataclass(frozen=True)
class OnlineDistillConfig:
    """How the head keeps learning while serving."""

    lr: float = 1e-4
    """AdamW learning rate (small: the head must not forget its offline training)."""
    buffer_sequences: int = 64
    """Finished requests kept in the replay buffer (oldest dropped first)."""
    buffer_mib: float = 512.0
    """Most memory the buffer's features take, in MiB (oldest requests dropped first; a request
    longer than this alone keeps its last positions that fit, at least one window): an EAGLE-3
    head's features of a 4,000-token request take 75 MiB at the 1.5B's width."""
    update_every: int = 1
    """Finished requests between updates."""
    steps: int = 4
    """Optimizer steps per update."""
    window: int = 256
    """Pairs per training window."""
    batch_size: int = 4
    """Windows per optimizer step."""
    seed: int = 0
    """Seeds the window draws."""


class OnlineDistiller:
    """Replay buffer + optimizer of one shared head (see the module docstring)."""

    def __init__(self, head: TrainedHead, config: OnlineDistillConfig = OnlineDistillConfig()) -> None:
        self.head = head
        self.config = config
        self.buffer: deque[tuple[torch.Tensor, torch.Tensor]] = deque()
        self.buffer_bytes = 0  # of the features held
        self.optimizer = torch.optim.AdamW(head.module.parameters(), lr=config.lr, betas=(0.9, 0.95))
        self.rng = random.Random(config.seed)
        self.finished = 0
        self.updates = 0
        self.last_loss: float | None = None

    def add(self, tokens: list[int], features: list[torch.Tensor]) -> None:
        """A finished request: tokens [n] and the features of its first n - 1 positions."""
        n = min(len(tokens), len(features) + 1)
        if n >= 3:
            row_bytes = features[0].numel() * features[0].element_size()
            keep = max(self.config.window + 1, int(self.config.buffer_mib * 2**20) // max(1, row_bytes))
            first = max(0, n - 1 - keep)  # the last positions that fit
            feats = torch.stack(features[first: n - 1]).detach().clone()  # [<= keep, E] (out of inference mode)
            self.buffer.append((torch.tensor(tokens[first: n - 1], dtype=torch.long), feats))
            self.buffer_bytes += feats.numel() * feats.element_size()
            while len(self.buffer) > 1 and (len(self.buffer) > self.config.buffer_sequences
                                            or self.buffer_bytes > self.config.buffer_mib * 2**20):
                _, dropped = self.buffer.popleft()
                self.buffer_bytes -= dropped.numel() * dropped.element_size()
        self.finished += 1
        if self.finished % self.config.update_every == 0 and self.buffer:
            self.update()

    def _window(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, feats = self.buffer[self.rng.randrange(len(self.buffer))]
        w = self.config.window + 1
        start = self.rng.randrange(max(1, len(tokens) - w + 1))
        return tokens[start:start + w], feats[start:start + w]

    def update(self) -> None:
        """`steps` optimizer steps on windows from the buffer."""
        head, cfg = self.head, self.config
        module = head.module
        module.train().requires_grad_(True)
        try:
            for _ in range(cfg.steps):
                windows = [self._window() for _ in range(cfg.batch_size)]
                t1 = max(len(t) for t, _ in windows)
                e = windows[0][1].shape[1]
                device = next(module.parameters()).device  # the head's, which may be an accelerator
                tokens = torch.zeros((len(windows), t1), dtype=torch.long, device=device)
                feats = torch.zeros((len(windows), t1, e), device=device)
                valid = torch.zeros((len(windows), t1), dtype=torch.bool, device=device)
                for b, (t, f) in enumerate(windows):
                    tokens[b, :len(t)], feats[b, :len(t)], valid[b, :len(t)] = t, f.float(), True
                batch = {"tokens": tokens, "feats": feats.to(head.dtype), "emb": head.embed(tokens), "valid": valid}
                loss = loss_of(head, batch, LossConfig(), None)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
                self.optimizer.step()
                self.last_loss = loss.item()
        finally:
            module.eval().requires_grad_(False)
        self.updates += 1
