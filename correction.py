"""Rollout correction: what grpo.py does about the engine's numbers differing from the trainer's (verl 0.9's
rollout_correction, verl/trainer/ppo/rollout_corr_helper.py). Truncated importance weights at the token or the
sequence level (TIS), their batch mean (`weights_mean`, over all ranks), rejection sampling by a divergence
estimate (`rejection_mask`), and `correct`, which makes all of them from one batch of log pi_trainer - log
pi_engine. grpo.py's algorithm.rollout_* settings choose (`alg` below is its AlgorithmConfig); grpo.policy_loss
applies them, over the step's batch (`rollout_correction`, the decoupled mode) or over each micro-batch
(algorithm.rollout_bypass). Tensors are [S, R]: S responses, R response positions, `valid` their tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import actor
import fsdp

RS_MODES = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)  # fmt: skip
"""algorithm.rollout_rs's modes (verl 0.9's rollout_corr_helper): a level (token; a response's sum, mean or max
over its tokens) of a divergence estimate between trainer and engine (`rejection_mask`)."""


def rs_bounds(modes: str, threshold: str | float | None) -> list[tuple[str, float | None, float]]:
    """algorithm.rollout_rs and rollout_rs_threshold read as verl reads them: (mode, lower, upper) per mode, in
    the order given, duplicates dropped; the bounds are on the mode's statistic (k1's: log lower, log upper;
    k2's and k3's: None, upper). Raises ValueError naming the key and what it allows."""
    names = list(dict.fromkeys(m.strip() for m in modes.split(",") if m.strip()))
    bad = [m for m in names if m not in RS_MODES]
    if not names or bad:
        raise ValueError(
            f"algorithm.rollout_rs={modes!r}: {', '.join(bad) or 'no mode'} is not a mode; give one or more of "
            f"{', '.join(RS_MODES)}, comma-separated"
        )
    specs = [] if threshold is None else [t.strip() for t in str(threshold).split(",") if t.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"algorithm.rollout_rs_threshold={threshold!r}: algorithm.rollout_rs={modes!r} needs one bound for "
            f"all its modes or one per mode ({len(names)}), comma-separated"
        )
    out = []
    for mode, spec in zip(names, specs * len(names) if len(specs) == 1 else specs, strict=False):
        k1 = mode.endswith("k1")
        try:
            parts = [float(x) for x in spec.split("_")] if k1 or "_" not in spec else []
        except ValueError:
            parts = []
        if not (1 <= len(parts) <= (2 if k1 else 1)) or min(parts) <= 0:
            takes = (
                "'lower_upper' or 'upper', positive ratios" if k1 else "one positive number (an upper bound)"
            )
            raise ValueError(
                f"algorithm.rollout_rs_threshold={threshold!r}: {spec!r} is not a bound for {mode}; it takes {takes}"
            )
        if k1:  # on log(pi_engine / pi_trainer); one number is the upper bound and its reciprocal the lower
            lower, upper = parts if len(parts) == 2 else (1.0 / parts[0], parts[0])
            out.append((mode, math.log(lower), math.log(upper)))
        else:
            out.append((mode, None, parts[0]))
    return out


def is_log_weights(log_ratio: torch.Tensor, valid: torch.Tensor, level: str) -> torch.Tensor:
    """The log of each token's rollout importance weight before truncation, [S, R]. log_ratio [S, R]: log
    pi_trainer - log pi_engine per token (0 off `valid` [S, R], the response tokens). token: the token's own;
    sequence: its response's sum (the log of the ratios' product), clamped to [-20, 20] as verl, on every token."""
    if level == "sequence":
        return (log_ratio * valid).sum(-1, keepdim=True).clamp(-20.0, 20.0).expand_as(log_ratio)
    return log_ratio


def rejection_mask(
    log_ratio: torch.Tensor, valid: torch.Tensor, bounds: list[tuple[str, float | None, float]]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rollout rejection sampling (verl 0.9's compute_rollout_rejection_mask). With r = log pi_trainer - log
    pi_engine per token, clamped to [-20, 20], three divergence estimates of the engine from the trainer:
        k1 = -r = log(pi_engine / pi_trainer),   k2 = r^2 / 2 >= 0,   k3 = exp(r) - 1 - r >= 0
    Each mode of `bounds` (rs_bounds) takes one at a level: token_* each token's own; seq_sum_* / seq_mean_* /
    seq_max_* its response's sum / mean / max over the response's tokens (a response of no tokens: 0), for all of
    them. A k1 statistic is kept within [lower, upper], a k2 or k3 one at or below upper; a token is kept when
    every mode keeps it.

    Args: log_ratio [S, R] (any value off `valid`), valid [S, R] the response tokens (float).
    Returns: keep [S, R] float (1 kept, 0 dropped; `valid` not applied), and each mode's keep [S, R] bool.
    """
    r = log_ratio.clamp(-20.0, 20.0)  # [S, R]
    stats = {"k1": -r, "k2": 0.5 * r**2, "k3": torch.expm1(r) - r}  # [S, R] each
    n = valid.sum(-1, keepdim=True)  # [S, 1]
    keep = torch.ones_like(r)
    by_mode = {}
    for mode, lower, upper in bounds:
        level, k = mode.rsplit("_", 1)
        x = stats[k]
        if level == "seq_sum":
            x = (x * valid).sum(-1, keepdim=True)  # [S, 1]
        elif level == "seq_mean":
            x = (x * valid).sum(-1, keepdim=True) / n.clamp(min=1)
        elif level == "seq_max":
            x = x.masked_fill(valid == 0, -math.inf).amax(-1, keepdim=True)
            x = torch.where(n > 0, x, torch.zeros_like(x))
        kept = (x <= upper) if lower is None else (x >= lower) & (x <= upper)
        by_mode[mode] = kept.expand_as(r)
        keep = keep * by_mode[mode]
    return keep, by_mode


def is_weights(log_ratio: torch.Tensor, valid: torch.Tensor, alg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout importance weights at alg.rollout_is_level, truncated at alg.rollout_is_threshold (TIS), [S, R],
    and their logs before truncation (`is_log_weights`) [S, R]. log_ratio, valid: as is_log_weights'."""
    log_w = is_log_weights(log_ratio, valid, alg.rollout_is_level)  # [S, R]
    return torch.exp(torch.clamp(log_w, max=math.log(alg.rollout_is_threshold))), log_w


def weights_mean(w: torch.Tensor, valid: torch.Tensor, level: str) -> torch.Tensor:
    """The mean of the truncated weights w [S, R] over all ranks (verl's distributed_masked_mean): the token level's
    over every response token of `valid` [S, R], the sequence level's over the responses that have a token (one
    weight each, its first token's); 1 where it is <= 1e-8. A 0-dim tensor on w's device, no host sync. A
    collective when torch.distributed is initialised: every rank calls it together (an empty [0, R] w adds
    nothing, which is how a rank without samples joins). The ranks of a sequence-parallel group hold the same
    samples: they count each P times in both sums, which leaves the mean as it is."""
    w = w * valid  # [S, R]
    if level == "sequence":
        sums = torch.stack([w[:, 0].sum(), (valid[:, 0] > 0).sum().to(w.dtype)])  # [2]
    else:
        sums = torch.stack([w.sum(), valid.sum().to(w.dtype)])
    sums = sums.double()
    if dist.is_initialized():
        sums = sums.to(fsdp.comm_device())
        dist.all_reduce(sums)
    mean = sums[0] / sums[1].clamp(min=1.0)
    return torch.where(mean > 1e-8, mean, torch.ones_like(mean)).to(w.device, w.dtype)


@dataclass
class Correction:
    """What the rollout correction makes of one batch of log pi_trainer - log pi_engine (`correct`)."""

    weights: torch.Tensor | None
    """[S, R] the truncated importance weights (with rollout_is_threshold; else None)."""
    log_weights: torch.Tensor | None
    """[S, R] their logs before truncation."""
    norm: torch.Tensor
    """0-dim: the weights' mean over all ranks under rollout_is_batch_normalize, the divisor; else 1."""
    keep: torch.Tensor | None
    """[S, R] rollout_rs's keep mask (1 kept; `valid` not applied); None without rollout_rs."""
    dropped: dict[str, torch.Tensor]
    """rollout_rs_[mode_]masked_fraction and _seq_masked_fraction: this rank's counts of dropped tokens and
    responses."""


def correct(log_ratio: torch.Tensor, valid: torch.Tensor, alg: Any) -> Correction:
    """The rollout correction of one batch (verl's compute_rollout_correction_and_rejection_mask): with
    rollout_is_threshold the truncated importance weights (`is_weights`), with rollout_is_batch_normalize their
    mean over all ranks (`weights_mean`, a collective), with rollout_rs the keep mask (`rejection_mask`) and the
    counts of response tokens and of responses it dropped, overall and per mode (to divide by the token and
    response counts they are of). Serves both modes: decoupled, over the step's batch with the old logprobs
    (`rollout_correction`); rollout_bypass, over each micro-batch with the current policy's (`policy_loss`).

    Args: log_ratio [S, R] log pi_trainer - log pi_engine per token (0 off `valid`), valid [S, R] the response
    tokens (float)."""
    weights = log_weights = None
    norm = torch.ones((), dtype=log_ratio.dtype, device=log_ratio.device)
    if alg.rollout_is_threshold is not None:
        weights, log_weights = is_weights(log_ratio, valid, alg)
        if alg.rollout_is_batch_normalize:
            norm = weights_mean(weights, valid, alg.rollout_is_level)
    keep, dropped = None, {}
    if alg.rollout_rs is not None:
        keep, by_mode = rejection_mask(log_ratio, valid, rs_bounds(alg.rollout_rs, alg.rollout_rs_threshold))
        for mode, kept in [("", keep.bool()), *((f"{m}_", k) for m, k in by_mode.items())]:
            gone = ~kept & valid.bool()  # [S, R]
            dropped[f"rollout_rs_{mode}masked_fraction"] = gone.sum()
            dropped[f"rollout_rs_{mode}seq_masked_fraction"] = gone.any(-1).sum()
    return Correction(weights, log_weights, norm, keep, dropped)


def rollout_correction(samples: list[actor.Sample], alg: Any) -> tuple[float, dict[str, float]]:
    """The batch-wide half of the decoupled rollout correction, after the old-logprob pass and before the update
    (verl's compute_rollout_correction_and_add_to_batch): `correct` over the step's samples on all ranks with
    log pi_old - log pi_engine. With algorithm.rollout_rs, sets each sample's loss_mask; with
    rollout_is_batch_normalize, returns the mean of the truncated weights that policy_loss then divides every
    weight by,
        token level:     sum over all response tokens of w_t / #tokens
        sequence level:  sum over responses of w_i / #responses (responses with a token)
    (on every response token, rejected ones too, as verl; 1 unless normalising, or if the mean is <= 1e-8). Also
    returns the mismatch/rollout_rs_* fractions of response tokens and of responses that rejection dropped, and
    mismatch/rollout_is_batch_norm_factor (the mean)."""
    lens = [len(s.response_ids) for s in samples]
    cpu = torch.device("cpu")
    valid = actor.mask_of(lens, cpu, max(lens, default=1))  # [B, L]
    L = valid.shape[1]
    log_ratio = (
        actor.padded([s.old_logprobs for s in samples], L, cpu)
        - actor.padded([s.rollout_logprobs for s in samples], L, cpu)
    ) * valid  # [B, L], log pi_trainer / pi_engine
    c = correct(log_ratio, valid, alg)
    if c.keep is not None:
        for s, row in zip(samples, c.keep, strict=True):
            s.loss_mask = row[: len(s.response_ids)].clone()
    local = {"tokens": valid.sum(), "seqs": float(len(samples)), **c.dropped}
    # over all ranks (verl's distributed_masked_mean): a prompt's samples sit on one rank, the batch on all
    total = {k: fsdp.all_reduce(float(v)) if dist.is_initialized() else float(v) for k, v in local.items()}
    metrics = {
        f"mismatch/{k}": v / max(total["seqs" if k.endswith("seq_masked_fraction") else "tokens"], 1.0)
        for k, v in total.items()
        if k.startswith("rollout_rs_")
    }
    mean = float(c.norm)
    if alg.rollout_is_batch_normalize:
        metrics["mismatch/rollout_is_batch_norm_factor"] = mean
    return mean, metrics
