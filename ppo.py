"""ppo.py: PPO with a learned critic (GAE), KL in the reward with a fixed or adaptive controller, colocated vLLM
rollout, FSDP2 for the actor, the critic and the frozen reference.

Every rank holds a shard of the actor, the critic (and the reference when a KL is on) and a whole rollout engine.
One step:
  1. each rank generates `rollout.n` responses for its share of `data.train_batch_size` prompts, scored by
     reward.py (rl.generate_and_start_scoring);
  2. the actor recomputes old logprobs (and checks the engine's), the reference its logprobs, the critic values;
  3. token rewards: the score on the last response token, minus `kl_coef * KL(actor || ref)` on every token when
     `algorithm.use_kl_in_reward` (the coefficient fixed, or adapted towards `kl_ctrl.target_kl` as in Ziegler
     et al. 2019, arXiv:1909.08593);
  4. GAE over the response tokens (`gamma`, `lam`); returns = advantages + values; advantages whitened over all
     the step's response tokens on all ranks;
  5. the critic: `critic.ppo_epochs` passes of the clipped value loss; then (after `trainer.critic_warmup`
     steps) the actor: PPO-clip over mini-batches (actor.py, as grpo.py);
  6. the actor's weights are pushed into every rank's engine.

Launch (the defaults run the offline toy task that `python toy.py --out runs/toy` and sft.py produce):
    torchrun --nproc_per_node 2 ppo.py --config configs/ppo_toy.yaml
    torchrun --nproc_per_node 8 ppo.py --config configs/ppo_gsm8k_qwen2.5-0.5b.yaml

Where it deviates from verl's ray_trainer + dp_critic:
1. No Ray: one process per GPU under torchrun; the actor, critic and reference are FSDP2 modules in it.
2. GAE skips positions whose mask is 0 anywhere in a row (their value and TD error are not used), as verl's
   current `compute_gae_advantage_return`; whitening and the KL controller's measurement span all ranks.
3. `trainer.critic_warmup = k` trains only the critic for the first k steps (verl updates the actor from step k,
   counting from 1, one step earlier).
4. One skip guard (NaN/inf loss or gradient norm) counts both the critic's and the actor's optimizer steps.
5. Sampling is seeded per step and rank, so a resumed run repeats an uninterrupted one's rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.distributed as dist

import actor
import config
import data
import fsdp
import losses
import optim
import rl
import rollout


@dataclass(frozen=True)
class KLControlConfig:
    """The KL-in-reward coefficient (verl's algorithm.kl_ctrl)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed: kl_coef throughout; adaptive: kl_coef moves towards the target KL (Ziegler et al. 2019)."""
    kl_coef: float = 0.001
    """The (initial) coefficient."""
    target_kl: float = 0.1
    """adaptive: the per-token KL the controller aims at."""
    horizon: int = 10000
    """adaptive: sequences over which an error of the KL is corrected."""


@dataclass(frozen=True)
class AlgorithmConfig:
    """Rewards and advantages."""

    adv_estimator: Literal["gae"] = "gae"
    """GAE with the critic (the other estimators are grpo.py's)."""
    gamma: float = 1.0
    """Discount per token."""
    lam: float = 1.0
    """GAE's lambda (1: Monte Carlo returns minus values; 0: one-step TD)."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.kl_coef * KL(actor || reference) from every response token's reward."""
    kl_penalty: str = "kl"
    """KL estimator in the reward: kl (k1), abs, mse (k2), low_var_kl (k3)."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """The coefficient's controller."""


@dataclass(frozen=True)
class CriticConfig:
    """The value model and its update (verl's critic.*)."""

    model: actor.ModelConfig = field(default_factory=lambda: actor.ModelConfig(path=""))
    """The backbone (model.path "" = the actor's model.path) with a new scalar head; sharding and memory."""
    optim: optim.OptimConfig = field(default_factory=lambda: optim.OptimConfig(lr=1e-5))
    """Optimizer and schedule."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (times rollout.n responses), over all ranks."""
    ppo_micro_batch_size_per_gpu: int = 8
    """Responses per forward/backward on one rank."""
    use_dynamic_bsz: bool = False
    """Micro-batches under a token budget (ppo_max_token_len_per_gpu) instead of a fixed count."""
    ppo_max_token_len_per_gpu: int = 32768
    """Token budget of one micro-batch when use_dynamic_bsz is on."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
    cliprange_value: float = 0.5
    """New values are kept within old value +- this in the clipped term of the loss."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How token losses become one number; normalised over the global mini-batch."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this."""


@dataclass(frozen=True)
class TrainerConfig(rl.TrainerConfig):
    """rl.TrainerConfig and the critic's warm-up."""

    default_local_dir: str = "runs/ppo"
    """Run folder: metrics.jsonl, config.yaml, global_step_N/ checkpoints (actor at the top, critic/)."""
    experiment_name: str = "ppo"
    """Run name for tensorboard/wandb."""
    critic_warmup: int = 0
    """Steps at the start that train only the critic."""


@dataclass(frozen=True)
class PPOConfig:
    """PPO with a critic, colocated vLLM rollout and FSDP2 (see the module docstring)."""

    data: rl.DataConfig = field(default_factory=rl.DataConfig)
    model: actor.ModelConfig = field(default_factory=actor.ModelConfig)
    actor: actor.ActorConfig = field(default_factory=actor.ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: rollout.RolloutConfig = field(default_factory=lambda: rollout.RolloutConfig(n=1))
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    custom_reward_function: rl.RewardConfig = field(default_factory=rl.RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# ------------------------------------------------------------------------------------- rewards, GAE


class KLController:
    """The KL-in-reward coefficient: fixed, or adaptive (Ziegler et al. 2019, as verl's AdaptiveKLController):

        value <- value * (1 + clip(kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon)

    after each batch, where kl is the batch's measured KL and n_steps its number of sequences.
    """

    def __init__(self, cfg: KLControlConfig):
        if cfg.type == "adaptive" and cfg.horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0, got {cfg.horizon}")
        self.cfg, self.value = cfg, cfg.kl_coef

    def update(self, kl: float, n_steps: int) -> None:
        if self.cfg.type == "adaptive":
            error = min(max(kl / self.cfg.target_kl - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.cfg.horizon


def gae_unwhitened(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns (= advantages + values), all [B, T], before whitening.

    Backwards over t: delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next, where V_next and A_next
    are those of the next position with mask 1 (0 after the last one). Positions with mask 0 are skipped: they
    carry V_next and A_next through unchanged (their own entries are meaningless).
    """
    B, T = rewards.shape
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)  # [B]
    next_adv = torch.zeros(B, dtype=values.dtype, device=values.device)
    advantages = torch.zeros_like(values)  # [B, T]
    m = mask.to(values.dtype)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_value = m[:, t] * values[:, t] + (1 - m[:, t]) * next_value
        next_adv = m[:, t] * adv + (1 - m[:, t]) * next_adv
        advantages[:, t] = next_adv
    return advantages, advantages + values


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's compute_gae_advantage_return: (advantages whitened over the mask's tokens, returns), all [B, T]."""
    advantages, returns = gae_unwhitened(rewards, values, mask, gamma, lam)
    return losses.masked_whiten(advantages, mask), returns


def global_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """losses.masked_whiten with the mean and (unbiased) variance of the masked entries on all ranks. [B, T]."""
    m = mask.to(torch.float64)
    n = fsdp.all_reduce(m.sum().item())
    mean = fsdp.all_reduce((x.double() * m).sum().item()) / n
    var = fsdp.all_reduce((((x.double() - mean) ** 2) * m).sum().item()) / max(n - 1, 1)
    return ((x - mean) / (var + 1e-8) ** 0.5).to(x.dtype)


def advantages_and_returns(
    samples: list[actor.Sample], cfg: AlgorithmConfig, kl_ctrl: KLController
) -> dict[str, float]:
    """Token rewards (score on the last token, minus the KL penalty), GAE, global whitening: sets each sample's
    `advantages` and `returns` ([L] tensors) and updates the KL controller. Returns the step's reward metrics."""
    lens = [len(s.response_ids) for s in samples]
    R = max(lens, default=1)
    mask = actor.mask_of(lens, torch.device("cpu"))  # [S, R]
    rewards = torch.zeros(len(samples), R)  # [S, R]
    rewards[torch.arange(len(samples)), torch.tensor(lens) - 1] = torch.tensor([s.score for s in samples])
    values = actor.padded([s.values for s in samples], R, torch.device("cpu"))
    metrics = {"actor/reward_kl_penalty_coeff": kl_ctrl.value}
    if cfg.use_kl_in_reward:
        old = actor.padded([s.old_logprobs for s in samples], R, torch.device("cpu"))
        ref = actor.padded([s.ref_logprobs for s in samples], R, torch.device("cpu"))
        kl = losses.kl_penalty(old, ref, cfg.kl_penalty) * mask  # [S, R]
        rewards = rewards - kl_ctrl.value * kl
        n = fsdp.all_reduce(len(samples))
        current = fsdp.all_reduce(losses.masked_mean(kl, mask, dim=-1).sum().item()) / n  # mean of sequences
        kl_ctrl.update(current, n_steps=int(n))
        metrics["actor/reward_kl_penalty"] = current
    advantages, returns = gae_unwhitened(rewards, values, mask, cfg.gamma, cfg.lam)
    advantages = global_whiten(advantages, mask)
    for i, s in enumerate(samples):
        s.advantages, s.returns = advantages[i, : lens[i]], returns[i, : lens[i]]
    resid = (returns - values) * mask
    tokens = fsdp.all_reduce(mask.sum().item())

    def mean(x: torch.Tensor) -> float:
        return fsdp.all_reduce((x * mask).sum().item()) / tokens

    def var(x: torch.Tensor) -> float:
        return mean(x**2) - mean(x) ** 2

    metrics |= {
        "critic/returns/mean": mean(returns),
        "critic/values/mean": mean(values),
        "critic/advantages/mean": mean(advantages),
        # How much of the returns' variance the values (made before this step's critic update) explain.
        "critic/explained_variance": 1.0 - var(resid) / max(var(returns), 1e-8),
    }
    return metrics


# ------------------------------------------------------------------------------------------- critic


def critic_values(
    critic: torch.nn.Module, samples: list[actor.Sample], g: list[int], packed: bool, pad_id: int, device
) -> torch.Tensor:
    """The critic's values at the response positions of samples[g], [S, R]: the value of the state before
    each response token (aligned as the actor's logprobs)."""
    b = actor.collate(samples, g, packed, pad_id, device)
    out = critic(**data.model_inputs(b))
    values = out.logits[..., 0].float()  # [B, T]
    if not g:  # an empty pass (one pad token): a [1, 1] zero that still depends on the parameters
        return values[:, :1] * 0
    return actor.response_matrix(values, b["response_index"], [len(samples[i].response_ids) for i in g])


def critic_micro_batches(samples: list[actor.Sample], idx: list[int], cfg: CriticConfig) -> list[list[int]]:
    budget = cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
    return actor.micro_batch_groups(samples, idx, cfg.ppo_micro_batch_size_per_gpu, budget)


@torch.no_grad()
def compute_values(
    critic: torch.nn.Module, samples: list[actor.Sample], cfg: CriticConfig, packed: bool, pad_id: int, device
) -> None:
    """Sets sample.values ([L], on the CPU) for every sample of this rank (in eval mode)."""
    critic.eval()
    for g in critic_micro_batches(samples, list(range(len(samples))), cfg):
        v = critic_values(critic, samples, g, packed, pad_id, device).cpu()  # [S, R]
        for j, i in enumerate(g):
            samples[i].values = v[j, : len(samples[i].response_ids)]


@actor.in_train_mode
def update_critic(
    critic: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    guard: optim.SkipGuard,
    samples: list[actor.Sample],
    n_prompts: int,
    cfg: CriticConfig,
    packed: bool,
    pad_id: int,
    device: torch.device,
    norm_length: int,
) -> dict[str, float]:
    """`cfg.ppo_epochs` passes of the clipped value loss over mini-batches; returns the mean critic/* metrics."""
    world = dist.get_world_size()
    sums = {"critic/vf_loss": 0.0, "critic/vf_clipfrac": 0.0, "critic/vpred_mean": 0.0}
    grad_norms = []
    for _ in range(cfg.ppo_epochs):
        for idx in actor.mini_batches(samples, n_prompts, cfg.ppo_mini_batch_size):
            tokens = fsdp.all_reduce(sum(len(samples[i].response_ids) for i in idx))
            norm = dict(global_tokens=tokens, global_seqs=fsdp.all_reduce(len(idx)), norm_length=norm_length)
            groups = critic_micro_batches(samples, idx, cfg)
            loss_sum = 0.0
            for k, g in enumerate(groups):
                critic.set_requires_gradient_sync(k == len(groups) - 1)
                vpreds = critic_values(critic, samples, g, packed, pad_id, device)  # [S, R]
                if not g:  # an empty pass keeps the collectives paired; contributes 0
                    (vpreds.sum() * 0).backward()
                    continue
                lens = [len(samples[i].response_ids) for i in g]
                R, mask = max(lens), actor.mask_of(lens, device)
                returns = actor.padded([samples[i].returns for i in g], R, device)
                values = actor.padded([samples[i].values for i in g], R, device)
                loss, clipfrac = losses.value_loss(
                    vpreds, returns, values, mask, cfg.cliprange_value, cfg.loss_agg_mode, **norm
                )
                (loss * world).backward()  # FSDP averages over ranks; each rank's loss is its share
                loss_sum = loss_sum + loss.detach()  # device tensors until the mini-batch ends (actor's loop)
                share = sum(lens) / tokens
                sums["critic/vf_loss"] += loss.detach()
                sums["critic/vf_clipfrac"] += clipfrac.detach() * share
                sums["critic/vpred_mean"] += losses.masked_mean(vpreds.detach(), mask) * share
            grad_norm = fsdp.grad_norm_and_clip(critic, cfg.grad_clip)
            if guard.take_step(fsdp.all_reduce(float(loss_sum)), grad_norm):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            grad_norms.append(grad_norm)
    out = {k: fsdp.all_reduce(float(v)) / len(grad_norms) for k, v in sums.items()}
    out["critic/grad_norm"] = sum(grad_norms) / len(grad_norms)
    return out


# --------------------------------------------------------------------------------------------- loop


def main(cfg: PPOConfig) -> dict[str, float]:
    """Trains; returns the final metrics (val/reward/mean before and after, the last step's metrics)."""
    if not cfg.critic.model.path:  # the critic starts from the actor's model unless told otherwise
        cfg = replace(cfg, critic=replace(cfg.critic, model=replace(cfg.critic.model, path=cfg.model.path)))
    run = rl.start(cfg)
    device, pad_id, T = run.dist.device, run.pad_id, cfg.rollout.temperature
    packed, critic_packed = cfg.model.use_remove_padding, cfg.critic.model.use_remove_padding
    policy, hf_files = actor.load(cfg.model, device)
    critic, critic_files = actor.load(cfg.critic.model, device, value_head=True)
    ref = None
    if (cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss) and not cfg.trainer.val_only:
        ref = actor.load_reference(cfg.model, policy, device)
    optimizer, scheduler = optim.build(policy.parameters(), cfg.actor.optim, run.total_steps)
    critic_optimizer, critic_scheduler = optim.build(critic.parameters(), cfg.critic.optim, run.total_steps)
    guard = optim.SkipGuard(cfg.trainer.max_consecutive_skips)
    kl_ctrl = KLController(cfg.algorithm.kl_ctrl)
    offload = rl.offloads(cfg, optimizer, critic_optimizer)
    components = {"": (policy, optimizer, hf_files), "critic": (critic, critic_optimizer, critic_files)}
    engine = None
    try:
        engine = rl.make_engine(cfg, run)
        step, results, extra = rl.resume(run, components, scheduler, guard)
        if extra:
            critic_scheduler.load_state_dict(extra["critic_scheduler"])
            kl_ctrl.value = extra["kl_coef"]
        if rl.first_push(run, engine, policy, step, results):
            return results
        # As grpo.py, unless the KL in the reward needs the old logprobs before the advantages.
        # The critic's warm-up steps do not update the actor, so their old-logprob pass checks the push.
        reuse = rl.old_logprobs_from_update(cfg) and not cfg.algorithm.use_kl_in_reward
        while step < run.total_steps:
            with rl.step_timer() as timer:
                from_update = reuse and step >= cfg.trainer.critic_warmup
                prompts, samples, metrics = rl.make_experience(
                    run, engine, policy, ref, step, timer, from_update
                )
                with timer("values"), rl.oom("critic values", cfg):
                    compute_values(critic, samples, cfg.critic, critic_packed, pad_id, device)
                with timer("adv"):
                    metrics |= advantages_and_returns(samples, cfg.algorithm, kl_ctrl)
                with timer("update_critic"), rl.oom("critic update", cfg):
                    metrics |= update_critic(
                        critic, critic_optimizer, guard, samples, len(prompts), cfg.critic, critic_packed,
                        pad_id, device, norm_length=cfg.data.max_response_length,
                    )  # fmt: skip
                metrics["critic/lr"] = critic_scheduler.get_last_lr()[0]
                critic_scheduler.step()
                if step >= cfg.trainer.critic_warmup:
                    with timer("update_actor"), rl.oom("actor update", cfg):
                        metrics |= actor.update_policy(
                            policy, optimizer, scheduler, guard, samples, len(prompts), cfg.actor, T, packed,
                            pad_id, device, norm_length=cfg.data.max_response_length,
                        )  # fmt: skip
                    if from_update:  # the update's forward compared the engine's logprobs
                        rl.check_push(metrics, cfg.rollout, step)
                step += 1
                rl.push(run, engine, policy, timer, offload)

            def save(s: int = step) -> object:
                own = dict(critic_scheduler=critic_scheduler.state_dict(), kl_coef=kl_ctrl.value)
                return rl.save(run, s, components, scheduler, guard, results, extra=own)

            rl.finish_step(run, engine, step, samples, metrics, timer, guard, results, save_fn=save)
    finally:
        rl.close(run, engine)
    return results | {"global_step": step}


if __name__ == "__main__":
    fsdp.run_main(main, config.parse(PPOConfig, yaml_hook=rl.verl_layout))
