"""ppo.py: PPO with a learned critic (GAE), KL in the reward with a fixed or adaptive controller, colocated vLLM
rollout, FSDP2 for the actor, the critic and the frozen reference.

Every rank holds a shard of the actor, the critic (and the reference when a KL is on) and a whole rollout engine.
One step (main's loop, in this order):
  1. prompts and generation: `rollout.n` responses to each prompt of this rank's share of `data.train_batch_size`;
  2. scoring by reward.py's workers, in the background while the engine sleeps and the passes below run;
  3. passes: the actor's old logprobs (unless the update's own forward gives them, as in grpo.py), the
     reference's (with a KL), the critic's values;
  4. token rewards: the score on the last response token, minus `kl_coef * KL(actor || ref)` on every token when
     `algorithm.use_kl_in_reward` (the coefficient fixed, or adapted towards `kl_ctrl.target_kl` as in Ziegler
     et al. 2019, arXiv:1909.08593); GAE over the response tokens (`gamma`, `lam`); returns = advantages +
     values; advantages whitened over all the step's response tokens on all ranks;
  5. the critic: `critic.ppo_epochs` passes of `value_loss`; then (after `trainer.critic_warmup` steps) the
     actor: `policy_loss` (PPO-clip + KL loss - entropy bonus, the same objective as grpo.py's, repeated here so
     that a fork edits one file) over mini-batches, both through actor.update's loop;
  6. the actor's weights are pushed into every rank's engine; validation, the log line, checkpoints when due.

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

import functools
from dataclasses import dataclass, field, replace
from typing import Annotated, Literal

import torch

import actor
import config
import fsdp
import losses
import optim
import rl
import rollout
import scoring
import sp


@dataclass(frozen=True)
class PFPPOConfig:
    """PF-PPO's resampling weights (verl's algorithm.pf_ppo)."""

    reweight_method: Literal["pow", "max_min", "max_random"] = "pow"
    """pow: |score| ** weight_pow; max_min: 1 for the batch's highest and lowest scores, 0 for the rest; max_random:
    0.4 for the highest score, 0.1 for the rest (all + 1e-8, as verl)."""
    weight_pow: float = 2.0
    """The exponent of `pow`."""


@dataclass(frozen=True)
class AlgorithmConfig:
    """Rewards and advantages."""

    adv_estimator: Literal["gae"] = "gae"
    """GAE with the critic (the other estimators are grpo.py's)."""
    gamma: Annotated[float, config.UNIT] = 1.0
    """Discount per token."""
    lam: Annotated[float, config.UNIT] = 1.0
    """GAE's lambda (1: Monte Carlo returns minus values; 0: one-step TD)."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.kl_coef * KL(actor || reference) from every response token's reward."""
    kl_penalty: str = "kl"
    """KL estimator in the reward: kl (k1), abs, mse (k2), low_var_kl (k3)."""
    kl_ctrl: rl.KLControlConfig = field(default_factory=rl.KLControlConfig)
    """The coefficient's controller."""
    use_pf_ppo: bool = False
    """PF-PPO (verl's algorithm.use_pf_ppo; Zhang et al. 2024, arXiv:2409.06957): after GAE, the step's responses
    are redrawn with replacement, as many as there were, weighted by their scores (`pf_ppo`), and the critic and
    the actor train on the redraw (`pf_ppo_resample`). verl redraws the whole batch at once; here each rank
    redraws its own share (the max and min scores are the batch's), so every rank keeps its number of samples."""
    pf_ppo: PFPPOConfig = field(default_factory=PFPPOConfig)
    """The weights of the redraw."""


@dataclass(frozen=True)
class CriticConfig:
    """The value model and its update (verl's critic.*)."""

    model: actor.ModelConfig = field(default_factory=lambda: actor.ModelConfig(path=""))
    """The backbone (model.path "" = the actor's model.path) with a new scalar head; sharding and memory."""
    optim: optim.OptimConfig = field(default_factory=lambda: optim.OptimConfig(lr=1e-5))
    """Optimizer and schedule."""
    ppo_mini_batch_size: Annotated[int, config.AT_LEAST_ONE] = 256
    """Prompts per optimizer step (times rollout.n responses), over all ranks."""
    ppo_micro_batch_size_per_gpu: Annotated[int, config.AT_LEAST_ONE] = 8
    """Responses per forward/backward on one rank."""
    use_dynamic_bsz: bool = False
    """Micro-batches under a token budget (ppo_max_token_len_per_gpu) instead of a fixed count."""
    ppo_max_token_len_per_gpu: Annotated[int, config.AT_LEAST_ONE] = 32768
    """Token budget of one micro-batch when use_dynamic_bsz is on."""
    ppo_epochs: Annotated[int, config.AT_LEAST_ONE] = 1
    """Passes over each step's samples."""
    cliprange_value: Annotated[float, config.POSITIVE] = 0.5
    """New values are kept within old value +- this in the clipped term of the loss."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How token losses become one number; normalised over the global mini-batch."""
    grad_clip: Annotated[float, config.POSITIVE] = 1.0
    """Clip the global gradient norm to this."""


@dataclass(frozen=True)
class PPOTrainerConfig(rl.RLTrainerConfig):
    """rl.RLTrainerConfig and the critic's warm-up."""

    default_local_dir: str = "runs/ppo"
    """Run folder: metrics.jsonl, config.yaml, global_step_N/ checkpoints (actor at the top, critic/)."""
    experiment_name: str = "ppo"
    """Run name for tensorboard/wandb."""
    critic_warmup: Annotated[int, config.NON_NEGATIVE] = 0
    """Steps at the start that train only the critic."""


@dataclass(frozen=True)
class PPOConfig:
    """PPO with a critic, colocated vLLM rollout and FSDP2 (see the module docstring)."""

    data: rl.RLDataConfig = field(default_factory=rl.RLDataConfig)
    model: actor.ModelConfig = field(default_factory=actor.ModelConfig)
    actor: actor.ActorConfig = field(default_factory=actor.ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: rollout.RolloutConfig = field(default_factory=lambda: rollout.RolloutConfig(n=1))
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    custom_reward_function: scoring.RewardConfig = field(default_factory=scoring.RewardConfig)
    trainer: PPOTrainerConfig = field(default_factory=PPOTrainerConfig)


# ------------------------------------------------------------------------------------- rewards, GAE


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


def advantages_and_returns(
    samples: list[actor.Sample], cfg: AlgorithmConfig, kl_ctrl: rl.KLController
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
        penalty, kl_metrics = rl.kl_in_reward(samples, cfg.kl_penalty, kl_ctrl, R)  # [S, R]
        rewards = rewards - penalty
        metrics |= kl_metrics
    advantages, returns = gae_unwhitened(rewards, values, mask, cfg.gamma, cfg.lam)
    advantages = rl.global_whiten(advantages, mask)
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
    }
    spread = var(returns)
    if spread > 1e-8:  # how much of the returns' variance the values (before this step's update) explain
        metrics["critic/explained_variance"] = 1.0 - var(resid) / spread
    return metrics


def pf_ppo_resample(
    samples: list[actor.Sample], cfg: PFPPOConfig, generator: torch.Generator
) -> list[actor.Sample]:
    """PF-PPO's redraw of this rank's samples (verl's compute_pf_ppo_reweight_data): len(samples) draws with
    replacement, sample i with probability proportional to w_i + 1e-8, w from its score (the reward before any KL
    penalty): |score| ** weight_pow (pow); 1 at the batch's highest or lowest score, else 0 (max_min); 0.4 at the
    highest, else 0.1 (max_random). Collective (the batch's max and min): every rank calls it."""
    scores = torch.tensor([s.score for s in samples], dtype=torch.float64)  # [S]
    hi = fsdp.all_reduce(scores.max().item() if len(samples) else -float("inf"), "max")
    lo = fsdp.all_reduce(scores.min().item() if len(samples) else float("inf"), "min")
    if not samples:
        return []
    if cfg.reweight_method == "pow":
        weights = scores.abs() ** cfg.weight_pow
    elif cfg.reweight_method == "max_min":
        weights = ((scores == hi) | (scores == lo)).double()
    else:
        weights = torch.where(scores == hi, 0.4, 0.1).double()
    picks = torch.multinomial(
        (weights + 1e-8).clamp(min=1e-8), len(samples), replacement=True, generator=generator
    )
    return [replace(samples[i]) for i in picks.tolist()]  # copies: a response drawn twice trains twice


# ------------------------------------------------------------------------------------------ objectives


def clipped_surrogate(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, cfg: actor.ActorConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip per token with clip-higher and dual clip, as grpo.py's (verl compute_policy_loss_vanilla):
        l = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high));  if A < 0: l = min(l, -A clip_ratio_c)
    with r = exp(clamp(logprobs - old_logprobs, -20, 20)). Returns (l, clipped, dual-clipped), all [S, R]."""
    log_ratio = torch.clamp(logprobs - old_logprobs, -20.0, 20.0)  # [S, R]
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    dual = -advantages * cfg.clip_ratio_c
    is_dual = (loss > dual) & (advantages < 0)
    return torch.where(is_dual, dual, loss), clipped > unclipped, is_dual


def policy_loss(
    model: torch.nn.Module, mb: actor.MicroBatch, cfg: PPOConfig, check: actor.PushCheck | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's objective on one micro-batch (an actor.LossFn): PPO-clip on the GAE advantages +
    kl_loss_coef * KL(actor || reference) - entropy_coeff * entropy, aggregated by actor.loss_agg_mode."""
    a = cfg.actor
    logprobs, entropy = actor.forward(
        model, mb, cfg.rollout.temperature, a.entropy_coeff != 0, check
    )  # [S, R]
    old = mb.per_token("old_logprobs")
    old = logprobs.detach() if old is None else old  # one optimizer step a batch: this forward's, ratio 1
    norm = dict(
        global_tokens=mb.global_tokens, global_seqs=mb.global_seqs, norm_length=cfg.data.max_response_length
    )
    agg = lambda x: losses.agg_loss(x, mb.mask, a.loss_agg_mode, **norm)  # noqa: E731
    pg, clipped, dual = clipped_surrogate(logprobs, old, mb.per_token("advantages"), a)
    loss = pg_loss = agg(pg)
    metrics = {
        "actor/pg_loss": pg_loss.detach(),
        "actor/pg_clipfrac": mb.token_mean(clipped.float()),
        "actor/pg_clipfrac_lower": mb.token_mean(dual.float()),
        "actor/ppo_kl": mb.token_mean(old - logprobs),
    }
    if a.use_kl_loss:
        kl = agg(losses.kl_penalty(logprobs, mb.per_token("ref_logprobs"), a.kl_loss_type))
        loss = loss + a.kl_loss_coef * kl
        metrics["actor/kl_loss"] = kl.detach()
    if a.entropy_coeff != 0:
        loss = loss - a.entropy_coeff * agg(entropy)
    return loss, metrics


def critic_values(critic: torch.nn.Module, mb: actor.MicroBatch) -> torch.Tensor:
    """The critic's values at mb's response positions, [S, R]: the value of the state before each response
    token (aligned as the actor's logprobs)."""
    logits = sp.forward_logits(critic, mb.inputs)  # [B, T, 1]
    return mb.rows(logits[..., 0].float())  # [B, T] -> [S, R]


def value_loss(
    critic: torch.nn.Module, mb: actor.MicroBatch, cfg: PPOConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's objective on one micro-batch (an actor.LossFn), verl's compute_value_loss with its 0.5:
        0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)),  c = critic.cliprange_value
    where v are the new values, v_old the rollout's and R the returns."""
    c = cfg.critic
    vpreds = critic_values(critic, mb)  # [S, R]
    returns, values = mb.per_token("returns"), mb.per_token("values")
    vpred_clipped = torch.clamp(vpreds, values - c.cliprange_value, values + c.cliprange_value)
    unclipped, clipped = (vpreds - returns) ** 2, (vpred_clipped - returns) ** 2
    norm = dict(
        global_tokens=mb.global_tokens, global_seqs=mb.global_seqs, norm_length=cfg.data.max_response_length
    )
    loss = 0.5 * losses.agg_loss(torch.maximum(unclipped, clipped), mb.mask, c.loss_agg_mode, **norm)
    return loss, {
        "critic/vf_loss": loss.detach(),
        "critic/vf_clipfrac": mb.token_mean((clipped > unclipped).float()),
        "critic/vpred_mean": mb.token_mean(vpreds),
    }


@torch.no_grad()
def compute_values(
    critic: torch.nn.Module, samples: list[actor.Sample], cfg: CriticConfig, layout: actor.Layout
) -> None:
    """Sets sample.values ([L], on the CPU) for every sample of this rank (in eval mode)."""
    critic.eval()
    # with SP: the group's samples, on each of its ranks
    group, _, mine = sp.share_samples(critic, samples, 0)
    for g in actor.micro_batches(group, list(range(len(group))), cfg, sp.size_of(critic)):
        mb = actor.MicroBatch.of([group[i] for i in g], layout)
        v = critic_values(critic, mb).cpu()  # [S, R]
        for j, s in enumerate(mb.samples):
            s.values = v[j, : mb.lengths[j]]
    for s, i in zip(samples, mine, strict=True):  # SP: this rank's own (a no-op without it)
        s.values = group[i].values


# --------------------------------------------------------------------------------------------- loop


def main(cfg: PPOConfig) -> dict[str, float]:
    """Trains; returns the final metrics (val/reward/mean before and after, the last step's metrics)."""
    if not cfg.critic.model.path:  # the critic starts from the actor's model unless told otherwise
        cfg = replace(cfg, critic=replace(cfg.critic, model=replace(cfg.critic.model, path=cfg.model.path)))
    if cfg.rollout.async_steps:
        raise SystemExit(
            "error: rollout.async_steps=1 (one-step off-policy rollouts) is grpo.py's only; ppo.py generates every "
            "step with the weights just pushed: set rollout.async_steps=0"
        )
    if cfg.actor.policy_loss.loss_mode != "vanilla":
        raise SystemExit(
            f"error: actor.policy_loss.loss_mode={cfg.actor.policy_loss.loss_mode} is grpo.py's (gspo, geo_mean, "
            "gpg, cispo, sapo); ppo.py's objective is PPO-clip (vanilla)"
        )
    run = rl.start(cfg)
    cfg = run.cfg  # model paths as loaded (rl.hf_model_paths)
    device, temperature = run.dist.device, cfg.rollout.temperature
    critic_layout = actor.Layout(cfg.critic.model.use_remove_padding, run.pad_id, device)
    policy, hf_files = actor.load(cfg.model, device)
    critic, critic_files = actor.load(cfg.critic.model, device, value_head=True)
    ref = None
    if (cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss) and not cfg.trainer.val_only:
        ref = actor.load_reference(cfg.model, policy, device)
    optimizer, scheduler = optim.build(policy.parameters(), cfg.actor.optim, run.total_steps)
    critic_optimizer, critic_scheduler = optim.build(critic.parameters(), cfg.critic.optim, run.total_steps)
    guard = optim.SkipGuard(cfg.trainer.max_consecutive_skips)  # counts the critic's and the actor's steps
    kl_ctrl = rl.KLController(cfg.algorithm.kl_ctrl)
    offload = rl.offloads(cfg.model.fsdp_config, optimizer) + rl.offloads(
        cfg.critic.model.fsdp_config, critic_optimizer
    )
    components = {"": (policy, optimizer, hf_files), "critic": (critic, critic_optimizer, critic_files)}
    # As grpo.py, unless the KL in the reward needs the old logprobs before the advantages.
    one_step = (
        actor.one_optimizer_step(cfg.actor, cfg.data.train_batch_size) and not cfg.algorithm.use_kl_in_reward
    )
    engine = None
    try:
        engine = rl.make_engine(cfg, run)
        step, results, extra = rl.resume(run, components, scheduler, guard)
        if extra:
            optim.resume_schedule(critic_scheduler, extra["critic_scheduler"])
            kl_ctrl.value = extra["kl_coef"]
        # trainer.val_only stops here
        if rl.push_and_validate_first(run, engine, policy, step, results, offload):
            return results
        probing = rl.probing(cfg)  # the push check on short probes (rollout.logprob_check_tokens)
        while step < run.total_steps:
            with rl.step_timer(cfg) as timer:
                train_actor = step >= cfg.trainer.critic_warmup
                prompts, mine = run.next_prompts()  # the engine's prompts; this rank trains on prompts[mine]
                probes: list[actor.Sample] | None = [] if probing else None
                with timer("gen"):
                    samples, prompts = rl.generate(run, engine, prompts, mine, step, probes=probes)
                scores = rl.score_in_background(run, samples, prompts)  # beside the sleep and the passes
                with timer("sleep"):  # frees the KV cache (and weights) for the trainer
                    engine.sleep()
                pushed = {}
                if probes is not None:  # before the update changes the weights that sampled them
                    with timer("push_check"):
                        pushed = rl.check_push(run, policy, probes, temperature, step)
                check = actor.PushCheck(device)
                if not (one_step and train_actor):  # a warm-up step has no actor update to check the push
                    with timer("old_logprob"):
                        actor.compute_logprobs(policy, samples, cfg.actor, run.layout, temperature, check)
                if ref is not None:
                    with timer("ref"):
                        actor.compute_logprobs(ref, samples, cfg.actor, run.layout, temperature, ref=True)
                with timer("values"):
                    compute_values(critic, samples, cfg.critic, critic_layout)
                with timer("reward"):
                    metrics = scores()
                with timer("adv"):
                    metrics |= advantages_and_returns(samples, cfg.algorithm, kl_ctrl)
                trained = samples  # PF-PPO: the redraw trains; the log reports what was generated
                if cfg.algorithm.use_pf_ppo:
                    seed = rl.rollout_seed(cfg.rollout.seed, step, run.dist.rank)
                    pick = torch.Generator().manual_seed(seed)
                    trained = pf_ppo_resample(samples, cfg.algorithm.pf_ppo, pick)
                    drawn = len({id(t.response_ids) for t in trained})  # the copies share their response
                    metrics["pf_ppo/unique_fraction"] = fsdp.all_reduce(drawn) / max(
                        1.0, fsdp.all_reduce(len(trained))
                    )
                with timer("update_critic"):
                    batch = (trained, len(prompts), cfg.critic, critic_layout)
                    loss_fn = functools.partial(value_loss, cfg=cfg)
                    metrics |= actor.update(
                        critic, critic_optimizer, guard, *batch, loss_fn, prefix="critic/"
                    )
                metrics["critic/lr"] = critic_scheduler.get_last_lr()[0]
                critic_scheduler.step()
                if train_actor:
                    with timer("update_actor"):
                        loss_fn = functools.partial(policy_loss, cfg=cfg, check=check if one_step else None)
                        batch = (trained, len(prompts), cfg.actor, run.layout)
                        metrics |= actor.update(policy, optimizer, guard, *batch, loss_fn)
                    metrics |= {"actor/lr": scheduler.get_last_lr()[0], "actor/skipped_steps": guard.skipped}
                    scheduler.step()
                # the engine ran our weights
                metrics |= check.result(cfg.rollout.logprob_diff_tol, step, probed=probing) | pushed
                step += 1
                with timer("offload"):  # the AdamW state to host memory, so the waking engine finds its room
                    for o in offload:
                        o.offload()
                with timer("sync"):
                    rl.push(run, engine, policy)
            own = dict(critic_scheduler=critic_scheduler.state_dict(), kl_coef=kl_ctrl.value)
            save = functools.partial(
                rl.save, run, step, components, scheduler, guard, results, own, offload=offload, engine=engine
            )
            rl.finish_step(run, engine, step, samples, metrics, timer, guard, results, save)
    finally:
        rl.close(run, engine)
    return results | {"global_step": step}


if __name__ == "__main__":
    fsdp.run_main(main, config.parse(PPOConfig))
