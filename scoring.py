"""Scoring an RL step's responses, shared by grpo.py and ppo.py (rl.score_in_background runs it beside the
trainer's passes):

- settings: `RewardConfig` (verl's custom_reward_function.*) and DAPO's length penalty, `OverlongBufferConfig`;
- `score`: decode the responses, score them in the reward pool, add the penalty, store sample.score;
  `overlong_buffer` resolves the penalty's settings; `merge_ranks` sums or averages the pool's metrics over ranks.

This is the trainer's side of the reward: the worker processes import only reward.py and reward_pool.py, which
stay free of torch and config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import torch.distributed as dist

import config
import reward

if TYPE_CHECKING:
    import actor
    import reward_pool

# ------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment, verl's dapo reward manager (reward_model.reward_manager=dapo with
    reward_kwargs.overlong_buffer_cfg): a response of L tokens gets reward.overlong_penalty added to its score,
    0 up to max_resp_len - len tokens, then falling linearly to -penalty_factor at max_resp_len. Applied to
    training and validation rewards alike, as verl's manager scores both."""

    enable: bool = False
    """Add the penalty to every reward."""
    len: Annotated[int, config.AT_LEAST_ONE] = 4096
    """Tokens before max_resp_len over which the penalty grows (the buffer)."""
    penalty_factor: Annotated[float, config.NON_NEGATIVE] = 1.0
    """The penalty at max_resp_len tokens."""
    max_resp_len: Annotated[int | None, config.AT_LEAST_ONE] = None
    """The length at which the penalty is penalty_factor (verl's reward_kwargs.max_resp_len); None:
    data.max_response_length, as verl's DAPO recipe sets it."""
    log: bool = False
    """Log reward/overlong_reward (the mean penalty) and reward/overlong (the share of penalised responses)."""


@dataclass(frozen=True)
class RewardConfig:
    """Reward function and its worker pool (verl's custom_reward_function)."""

    path: str | None = None
    """Python file with a custom reward function; None: reward.default_compute_score by data_source."""
    name: str = "compute_score"
    """Function name in that file."""
    num_workers: Annotated[int, config.NON_NEGATIVE] = 4
    """Worker processes scoring in parallel (0: in the trainer's main thread, timeout_s enforced by SIGALRM)."""
    timeout_s: Annotated[float, config.TIMEOUT] = 10.0
    """Per-call limit; a call past it scores 0 and counts in reward/errors (its worker and the processes it
    started are killed)."""
    max_error_frac: Annotated[float, config.UNIT] = 0.5
    """Stop the run when more than this fraction of one batch's reward calls fail (1.0: never)."""
    max_abs_reward: Annotated[float, config.POSITIVE] = 1e6
    """A reward beyond +-this scores 0 and counts in reward/errors_out_of_range (1e308 would make the loss NaN)."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the function at path, beside the row's (verl's custom_reward_function.reward_kwargs:
    `+custom_reward_function.reward_kwargs.alpha=0.5`); each must be a parameter of the function, or it must
    take **kwargs."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's length penalty (verl's reward_kwargs.overlong_buffer_cfg), added to the function's reward."""

    def __post_init__(self) -> None:
        if self.reward_kwargs and not self.path:
            raise ValueError(
                f"custom_reward_function.reward_kwargs={self.reward_kwargs} needs custom_reward_function.path: the "
                "built-in scorers (reward.default_compute_score) take no extra arguments"
            )


# -------------------------------------------------------------------------------------------- scoring


def overlong_buffer(cfg: Any) -> OverlongBufferConfig | None:
    """custom_reward_function.overlong_buffer with max_resp_len resolved (None: data.max_response_length), or None
    when it is off."""
    ob = cfg.custom_reward_function.overlong_buffer
    if not ob.enable:
        return None
    ob = dataclasses.replace(ob, max_resp_len=ob.max_resp_len or cfg.data.max_response_length)
    if ob.len > ob.max_resp_len:
        raise ValueError(
            f"custom_reward_function.overlong_buffer.len={ob.len} must be at most its max_resp_len={ob.max_resp_len}"
            " (None: data.max_response_length): the penalty starts max_resp_len - len tokens into a response"
        )
    return ob


def score(
    pool: reward_pool.RewardPool,
    samples: list[actor.Sample],
    prompts: list[dict],
    tokenizer,
    overlong: OverlongBufferConfig | None = None,
) -> dict:
    """Decodes the responses (in one batch: the tokenizer's Rust side, threads where TOKENIZERS_PARALLELISM
    allows), scores them, adds DAPO's length penalty when `overlong` is given (overlong_buffer(cfg)), stores
    sample.score; returns the pool's reward/errors* metrics (and the penalty's, when overlong.log)."""
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    items = []
    for s, text in zip(samples, texts, strict=True):
        ex = prompts[s.group]
        items.append(
            dict(
                data_source=ex["data_source"],
                prompt=ex["raw_prompt"],
                response=text,
                ground_truth=ex["ground_truth"],
                extra_info=ex["extra_info"],
            )
        )
    scores, metrics = pool.score(items)
    penalties = [0.0] * len(samples)
    if overlong is not None:
        penalties = [
            reward.overlong_penalty(
                len(s.response_ids), overlong.max_resp_len, overlong.len, overlong.penalty_factor
            )
            for s in samples
        ]
        if overlong.log and samples:  # verl's reward_extra_info keys, as means over this rank's responses
            metrics["reward/overlong_reward"] = sum(penalties) / len(samples)
            metrics["reward/overlong"] = sum(p < 0 for p in penalties) / len(samples)
    for s, r, p, extra in zip(samples, scores, penalties, pool.last_extras, strict=True):
        s.score = float(r) + p
        # the function's own value under verl's names for it, and the keys of its dict result
        s.reward_info = dict(score=float(r), acc=float(r)) | extra
    return metrics


def merge_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """The reward pool's per-rank metrics over all ranks: `reward/errors*` and `reward/printed` counts summed, the
    means of extra keys averaged over the ranks that have them (ranks may see different keys)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, metrics)
    out: dict[str, float] = {}
    for k in sorted({k for m in every for k in m}):
        values = [m[k] for m in every if k in m]
        counted = k.startswith(("reward/errors", "reward/printed"))
        out[k] = sum(values) if counted else sum(values) / len(values)
    return out
