"""grpo.py: GRPO (and Dr. GRPO, RLOO, REINFORCE++) with colocated vLLM rollout, sharded with FSDP2.

Every rank holds a shard of the policy (FSDP2) and a whole vLLM engine on the same device. One step:
  1. each rank generates `rollout.n` responses for its share of `data.train_batch_size` prompts;
  2. rewards are scored in a process pool (reward.py), by the row's data_source or a custom function;
  3. advantages per prompt group (`algorithm.adv_estimator`);
  4. the trainer recomputes old logprobs (and checks them against vLLM's: rollout/logprob_diff_*), and the
     frozen reference model's logprobs when a KL loss is on; when step 5 is a single optimizer step, the
     old logprobs are its own forward's, detached, and this pass covers the checked samples only;
  5. `actor.ppo_epochs` passes over mini-batches of `actor.ppo_mini_batch_size` prompts, PPO-clip loss;
  6. the new weights are gathered one parameter at a time and pushed into every rank's engine.

Launch (the defaults run the offline toy task that `python toy.py --out runs/toy` and sft.py produce):
    python grpo.py --config configs/grpo_toy.yaml
    torchrun --nproc_per_node 8 grpo.py --config configs/grpo_gsm8k_qwen2.5-0.5b.yaml --actor.optim.lr 1e-6

Estimators (`algorithm.adv_estimator`), per prompt group of n scores s_i:
    grpo                 (s_i - mean) / (std + eps)         arXiv:2402.03300
    grpo, norm_adv_by_std_in_grpo=false  s_i - mean   (Dr. GRPO, arXiv:2503.20783; pair with
                         actor.loss_agg_mode=seq-mean-token-sum-norm)
    rloo                 s_i - mean of the others           arXiv:2402.14740
    reinforce_plus_plus  s_i whitened over the whole batch  arXiv:2501.03262 (outcome reward, gamma = 1)

The policy update (PPO-clip, KL loss, entropy bonus, micro-batching) is actor.py's, shared with ppo.py; the loop's
plumbing (data, rollouts, rewards, validation, checkpoints) is rl.py's. This file holds GRPO's own part: the
advantage estimators and the order of the phases.

Where it deviates from verl's ray_trainer + dp_actor:
1. No Ray: one process per GPU under torchrun, each with its own engine (verl's colocated "hybrid engine").
2. Groups never straddle ranks: a prompt's n samples are generated, scored and normalised on one rank.
3. The KL-in-reward path (`algorithm.use_kl_in_reward`) belongs to ppo.py; here the KL is a loss term.
4. Old logprobs are always recomputed by the trainer (verl can reuse rollout logprobs); vLLM's are only
   used to prove the weight push, so vLLM returns them for a few prompts per call only
   (rollout.logprob_check_prompts).
5. Sampling is seeded per step and rank, so a resumed run repeats an uninterrupted one's rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

import actor
import config
import fsdp
import optim
import rl
import rollout


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantage estimation."""

    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus"] = "grpo"
    """Estimator; see the module docstring."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO divides by the group's std; False is Dr. GRPO."""
    kl_penalty: str = "kl"
    """KL estimator for a KL-in-reward penalty (ppo.py); accepted here so verl configs load."""


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO with colocated vLLM rollout and FSDP2 (see the module docstring)."""

    data: rl.DataConfig = field(default_factory=rl.DataConfig)
    model: actor.ModelConfig = field(default_factory=actor.ModelConfig)
    actor: actor.ActorConfig = field(default_factory=actor.ActorConfig)
    rollout: rollout.RolloutConfig = field(default_factory=rollout.RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    custom_reward_function: rl.RewardConfig = field(default_factory=rl.RewardConfig)
    trainer: rl.TrainerConfig = field(
        default_factory=lambda: rl.TrainerConfig(default_local_dir="runs/grpo", experiment_name="grpo")
    )


# ---------------------------------------------------------------------------------------- advantages


def group_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantages (verl compute_grpo_outcome_advantage): each score minus its group's mean,
    divided by the group's std (unbiased, torch.std) plus eps unless norm_by_std is False (Dr. GRPO).

    Args:
        scores: [B] rewards; group_ids: [B] ints, equal for the responses to one prompt.
    Returns:
        [B] advantages. A group of one gets 0: it has no baseline, so it carries no signal (verl instead
        uses mean 0, std 1 there, i.e. the raw score; groups of two or more agree with verl).
    """
    adv = torch.zeros_like(scores, dtype=torch.float32)
    for g in group_ids.unique():
        idx = (group_ids == g).nonzero(as_tuple=True)[0]
        if len(idx) > 1:
            s = scores[idx].float()
            adv[idx] = (s - s.mean()) / (s.std() + eps) if norm_by_std else s - s.mean()
    return adv


def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO (verl compute_rloo_outcome_advantage): s_i minus the mean of the other n-1 scores of its group,
    i.e. (s_i - mean) * n / (n - 1). [B] -> [B]; a group of one gets 0."""
    adv = torch.zeros_like(scores, dtype=torch.float32)
    for g in group_ids.unique():
        idx = (group_ids == g).nonzero(as_tuple=True)[0]
        n = len(idx)
        if n > 1:
            s = scores[idx].float()
            adv[idx] = (s - s.mean()) * n / (n - 1)
    return adv


def whiten_by_tokens(
    scores: torch.Tensor, lengths: torch.Tensor, total: tuple[float, float, float] | None = None
) -> torch.Tensor:
    """REINFORCE++ outcome advantages (verl compute_reinforce_plus_plus_outcome_advantage, gamma = 1): every
    response token carries its sequence's score, and the scores are whitened over all response tokens, so a
    sequence weighs by its length. [B], [B] -> [B].

    total: (tokens, sum, sum of squares) over the whole batch on all ranks; None: this batch alone.
    """
    w = lengths.double()
    n, s1, s2 = (
        total
        if total is not None
        else (w.sum().item(), (w * scores).sum().item(), (w * scores**2).sum().item())
    )
    mean = s1 / n
    var = (s2 - n * mean**2) / max(n - 1, 1)  # unbiased, as verl's masked_whiten
    return ((scores.double() - mean) / (var + 1e-8) ** 0.5).float()


def compute_advantages(samples: list[actor.Sample], cfg: AlgorithmConfig) -> None:
    """Sets sample.advantages (one number per response) from the scores, per prompt group (whitened over all ranks for REINFORCE++)."""
    scores = torch.tensor([s.score for s in samples])  # [B]
    groups = torch.tensor([s.group for s in samples])  # [B]
    if cfg.adv_estimator == "grpo":
        adv = group_advantages(scores, groups, norm_by_std=cfg.norm_adv_by_std_in_grpo)
    elif cfg.adv_estimator == "rloo":
        adv = rloo_advantages(scores, groups)
    else:
        lengths = torch.tensor([len(s.response_ids) for s in samples]).double()
        total = (
            fsdp.all_reduce(lengths.sum().item()),
            fsdp.all_reduce((lengths * scores).sum().item()),
            fsdp.all_reduce((lengths * scores**2).sum().item()),
        )
        adv = whiten_by_tokens(scores, lengths, total)
    for s, a in zip(samples, adv.tolist(), strict=True):
        s.advantages = a


def main(cfg: GRPOConfig) -> dict[str, float]:
    """Trains; returns the final metrics (val/reward/mean before and after, the last step's metrics)."""
    run = rl.start(cfg)
    device, pad_id, T, packed = (
        run.dist.device,
        run.pad_id,
        cfg.rollout.temperature,
        cfg.model.use_remove_padding,
    )
    policy, hf_files = actor.load(cfg.model, device)
    ref = None
    if cfg.actor.use_kl_loss and not cfg.trainer.val_only:
        ref = actor.load_reference(cfg.model, policy, device)
    optimizer, scheduler = optim.build(policy.parameters(), cfg.actor.optim, run.total_steps)
    guard = optim.SkipGuard(cfg.trainer.max_consecutive_skips)
    offload = rl.offloads(cfg, optimizer)
    components = {"": (policy, optimizer, hf_files)}
    engine = None
    try:
        engine = rl.make_engine(cfg, run)
        step, results, _ = rl.resume(run, components, scheduler, guard)
        if rl.first_push(run, engine, policy, step, results):
            return results
        # One optimizer step a batch: the update's forward gives the old logprobs and checks the push
        # (actor.old_logprobs_from_update).
        reuse = rl.old_logprobs_from_update(cfg)
        while step < run.total_steps:
            with rl.step_timer() as timer:
                prompts, samples, metrics = rl.make_experience(run, engine, policy, ref, step, timer, reuse)
                compute_advantages(samples, cfg.algorithm)
                with timer("update"), rl.oom("policy update", cfg):
                    metrics |= actor.update_policy(
                        policy, optimizer, scheduler, guard, samples, len(prompts), cfg.actor, T, packed, pad_id,
                        device, norm_length=cfg.data.max_response_length,
                    )  # fmt: skip
                if reuse:  # the update's forward compared the engine's logprobs
                    rl.check_push(metrics, cfg.rollout, step)
                step += 1
                rl.push(run, engine, policy, timer, offload)
            rl.finish_step(
                run, engine, step, samples, metrics, timer, guard, results,
                save_fn=lambda s=step: rl.save(run, s, components, scheduler, guard, results),
            )  # fmt: skip
    finally:
        rl.close(run, engine)
    return results | {"global_step": step}


if __name__ == "__main__":
    fsdp.run_main(main, config.parse(GRPOConfig, yaml_hook=rl.verl_layout))
