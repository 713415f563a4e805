"""AdamW and its learning-rate schedule, shared by sft.py, grpo.py and ppo.py.

Schedule: linear warmup from 0 over `warmup_steps_ratio` of the run, then cosine down to
`min_lr_ratio * lr`, or constant. The scheduler's state is a plain dict (step count), saved in
trainer_state.json with each checkpoint.

`SkipGuard` decides, once per optimizer step, whether to take it: a NaN or inf loss or gradient norm skips the
update (AdamW's moments and step count stay as they were; the schedule still advances, as in verl, which also
skips the update and steps the scheduler), counts it, and after `max_consecutive` skips in a row tells the
trainer to save and stop.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Literal

import torch

import config


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup and a cosine or constant schedule."""

    lr: Annotated[float, config.POSITIVE] = 1e-5
    """Peak learning rate."""
    betas: Annotated[tuple[float, float], config.UNIT] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: Annotated[float, config.NON_NEGATIVE] = 0.01
    """AdamW decoupled weight decay."""
    warmup_steps_ratio: Annotated[float, config.UNIT] = 0.0
    """Fraction of the total steps spent warming the learning rate up linearly from 0."""
    lr_warmup_steps: Annotated[int, config.Range(-1)] = -1
    """Warm-up steps; -1: warmup_steps_ratio decides (verl's meaning)."""
    lr_scheduler: Literal["cosine", "constant"] = "constant"
    """Schedule after warmup."""
    min_lr_ratio: Annotated[float, config.UNIT] = 0.0
    """Cosine floor as a fraction of `lr`."""
    fused: bool = False
    """torch.optim.AdamW(fused=True): the step in one kernel per parameter list, without the foreach step's
    sqrt(v) buffer (4 bytes a parameter: 5.7 GiB at 1.5B, where the step sets the update's memory peak). Off:
    torch's default (foreach), as verl's. verl: optim.override_optimizer_config.fused."""


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of `cfg.lr` at optimizer step `step` (0-based) of `total_steps`."""
    warmup = cfg.lr_warmup_steps if cfg.lr_warmup_steps >= 0 else int(cfg.warmup_steps_ratio * total_steps)
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
    kw = {"fused": True} if cfg.fused else {}  # else torch's own choice (foreach where it can)
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, **kw)
    init_state(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, cfg))
    return optimizer, scheduler


@torch.no_grad()
def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates the optimizer's state now (AdamW: zero moments, step 0), as its first step would have, so that
    the training that follows is bit-identical to a lazily initialised run.

    Why: AdamW creates its moments in its first step(), after the backward pass has freed the activations, so
    the caching allocator places them inside the activations' large cached segments, which then can never be
    returned to the driver (the engine's wake needs that memory). Created before the first forward, they sit
    in segments of their own. How: one step with zero gradients at lr 0 (as torch's distributed checkpoint
    does before loading an optimizer), which moves no weight, then the step count back to 0.
    A no-op when the state exists or a gradient is already set."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0
    if torch.cuda.is_available():  # the zero gradients' memory, for the engine that starts next
        torch.cuda.empty_cache()


def resume_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict) -> None:
    """Loads a checkpoint's schedule position into `scheduler`, keeping the peak lr it was built with (this run's
    config): LambdaLR's saved state carries the saved run's base lr, so a new `--optim.lr` would be dropped."""
    base_lrs = list(scheduler.base_lrs)
    scheduler.load_state_dict(state)
    scheduler.base_lrs = base_lrs
    for group, base, fn in zip(scheduler.optimizer.param_groups, base_lrs, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = base
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


class SkipGuard:
    """Skips optimizer steps whose loss or gradient norm is not finite; says when too many came in a row.

    Every rank must pass the same numbers (the all-reduced loss and the global gradient norm, which
    `fsdp.grad_norm_and_clip` returns on every rank), so every rank skips the same steps without talking.

    Args:
        max_consecutive: `stop` becomes True after this many skipped steps in a row (>= 1).
    Attributes:
        skipped: skipped steps since the start of the run (logged as `train/skipped_steps`).
        consecutive: skipped steps since the last step that was taken.
    """

    def __init__(self, max_consecutive: int):
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive_skips must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.skipped, self.consecutive = 0, 0

    def take_step(self, loss: float, grad_norm: float) -> bool:
        """True: call optimizer.step(). False: skip it (counted). Zero the gradients either way."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.consecutive = 0
            return True
        self.skipped += 1
        self.consecutive += 1
        return False

    @property
    def stop(self) -> bool:
        """True once `max_consecutive` steps in a row were skipped: save a checkpoint, then raise."""
        return self.consecutive >= self.max_consecutive

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped, self.consecutive = int(state["skipped"]), int(state["consecutive"])
