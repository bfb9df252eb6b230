"""Optimizer and learning-rate schedule: AdamW, linear warmup, cosine decay.

One optimizer (and one schedule) per model part: a pipeline rank holding several stages gets
one per stage, so the distributed state-dict helpers can map each optimizer's state to the
parameter names of its part. ``Optimizers`` and ``Schedulers`` step them together; with a
single part they are thin wrappers around one optimizer and one schedule.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from automodel.config.schema import OptimConfig


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, foreach=cfg.foreach)


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of ``cfg.lr`` for 0-based ``step``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(optimizer, cfg: OptimConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, max_steps))


class Optimizers:
    """One optimizer per model part, stepped together."""

    def __init__(self, parts: list[nn.Module], cfg: OptimConfig):
        self.parts = list(parts)
        # frozen parameters (model.freeze) are not the optimizer's: no state, no decay
        self.optimizers = [build_optimizer([p for p in part.parameters() if p.requires_grad],
                                           cfg) for part in self.parts]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


class Schedulers:
    """One learning-rate schedule per optimizer; they always hold the same step."""

    def __init__(self, optimizers: Optimizers, cfg: OptimConfig, max_steps: int):
        self.schedulers = [build_scheduler(opt, cfg, max_steps)
                           for opt in optimizers.optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict) -> None:
        for s in self.schedulers:
            s.load_state_dict(state)
