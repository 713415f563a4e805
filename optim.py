"""AdamW and its learning-rate schedule, shared by sft.py, grpo.py and ppo.py.

Schedule: linear warmup from 0 over `warmup_steps_ratio` of the run, then cosine down to
`min_lr_ratio * lr`, or constant. The scheduler's state is a plain dict (step count), saved in
trainer_state.json with each checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup and a cosine or constant schedule."""

    lr: float = 1e-5
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    warmup_steps_ratio: float = 0.0
    """Fraction of the total steps spent warming the learning rate up linearly from 0."""
    lr_scheduler: Literal["cosine", "constant"] = "constant"
    """Schedule after warmup."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of `lr`."""


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of `cfg.lr` at optimizer step `step` (0-based) of `total_steps`."""
    warmup = int(cfg.warmup_steps_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.lr_scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build(
    params: Iterable[torch.nn.Parameter], cfg: OptimConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable `params` and its LambdaLR schedule."""
    params = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, cfg))
    return optimizer, scheduler
