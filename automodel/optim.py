"""Optimizer and learning-rate schedule: AdamW, linear warmup, cosine decay."""

from __future__ import annotations

import math

import torch

from automodel.config.schema import OptimConfig


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


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
