"""grpo.py: GRPO (and Dr. GRPO, RLOO, REINFORCE++, OTB) with colocated vLLM rollout, sharded with FSDP2.

Every rank holds a shard of the policy (FSDP2) and a whole vLLM engine on the same device. One step (main's loop,
in this order):
  1. prompts: this rank's share of `data.train_batch_size`;
  2. generate: `rollout.n` responses to each, from this rank's engine (with `algorithm.filter_groups`, DAPO's
     dynamic sampling: scored at once, the groups that all score the same dropped, and more batches drawn until
     the batch is full: `filtered_rollouts`);
  3. score: the reward workers (reward.py) score them in the background while the engine sleeps and the
     logprob passes run;
  4. logprob passes: the old logprobs only when the update takes several optimizer steps (else its own forward
     gives them, detached, as TRL does) or optimal_token_baseline needs them (with sum_v pi_v^2) before the
     advantages, the frozen reference's when a KL loss is on; then, with
     algorithm.rollout_rs or rollout_is_batch_normalize, the batch-wide rollout correction (`correction.rollout_correction`:
     rejection masks, the importance weights' batch mean). With algorithm.rollout_bypass no old-logprob pass: the
     engine's logprobs are the old ones, the correction runs in every micro-batch of the update (`policy_loss`),
     and the push check, when the update takes several optimizer steps, gets a pass over one prompt's samples;
  5. advantages per prompt group (`algorithm.adv_estimator`, below);
  6. update: `actor.ppo_epochs` passes over mini-batches of `actor.ppo_mini_batch_size` prompts, minimising
     `policy_loss` (below: PPO-clip + KL to the reference - entropy bonus); the forward that first sees the
     sampled tokens also checks that the engine ran the trainer's weights (actor.PushCheck);
  7. push: the new weights are gathered one parameter at a time into every rank's engine;
  8. validate / log / save when due.

Launch (the defaults run the offline toy task that `python toy.py --out runs/toy` and sft.py produce):
    python grpo.py --config configs/grpo_toy.yaml
    torchrun --nproc_per_node 8 grpo.py --config configs/grpo_gsm8k_qwen2.5-0.5b.yaml --actor.optim.lr 1e-6

Estimators (`algorithm.adv_estimator`), per prompt group of n scores s_i:
    grpo                 (s_i - mean) / (std + eps)         arXiv:2402.03300
    grpo, norm_adv_by_std_in_grpo=false  s_i - mean   (Dr. GRPO, arXiv:2503.20783; pair with
                         actor.loss_agg_mode=seq-mean-token-sum-norm)
    rloo                 s_i - mean of the others           arXiv:2402.14740
    reinforce_plus_plus  s_i whitened over the whole batch  arXiv:2501.03262 (outcome reward, gamma = 1)
    gpg                  alpha (s_i - mean), alpha = B / #(s != 0) over the batch   arXiv:2504.02546
    reinforce_plus_plus_baseline  s_i - mean, then whitened over the batch  (verl's; REINFORCE++ with a group
                         baseline, arXiv:2501.03262)
    remax                s_i - the score of the prompt's greedy response     arXiv:2310.10505 (one more,
                         greedy, generation a step; `remax_baselines`)
    optimal_token_baseline  per token: G_t - B_t, B_t = sum_i G_t,i W_t,i / sum_i W_t,i over the group, W_t the
                         cumsum to t of 1 - 2 pi_j + sum_v pi_v^2 (old policy; times w_j^2 with rollout_is's
                         weights), G_t the return; a group of one gets B = 0   (verl's OTB; `otb_advantages`)
With algorithm.use_kl_in_reward, s_i is the score less the response's summed KL penalty (REINFORCE++ and ReMax
give each token its own return, the score less the penalty still to come).

The objective is `policy_loss`, and nothing else in the repo owns it. `actor.policy_loss.loss_mode` picks the
per-token surrogate l (`surrogate`; r = pi / pi_old per token, A the advantage, sg a stop-gradient), each as verl's
compute_policy_loss_<mode>:
    vanilla   max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), dual clip   PPO / DAPO
    gspo      the same with the sequence's geometric-mean ratio             arXiv:2507.18071  (per sequence)
    geo_mean  -A exp(mean_t clip(log r_t)), one value a sequence            arXiv:2507.20673  (per sequence)
    gpg       -A log pi                                                     arXiv:2504.02546
    cispo     -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi              arXiv:2506.13585
    sapo      -A sigmoid(tau (r - 1)) 4 / tau                               arXiv:2511.20347  (per sequence)
"per sequence": aggregated seq-mean-token-mean whatever actor.loss_agg_mode says, as verl does. A DAPO-style
fork edits these functions.

Where it deviates from verl's ray_trainer + dp_actor:
1. No Ray: one process per GPU under torchrun, each with its own engine (verl's colocated "hybrid engine").
2. Groups never straddle ranks: a prompt's n samples are generated, scored and normalised on one rank.
3. vLLM's logprobs prove the weight push and are not used in the loss unless algorithm.rollout_is asks
   (truncated importance weights) or algorithm.rollout_rs (rejection sampling), so vLLM returns them for a few
   prompts per call only, in short probe requests beside the rollouts (rollout.logprob_check_prompts and
   logprob_check_tokens; every rollout carries them with those, or algorithm.rollout_bypass: verl's bypass_mode,
   the engine's logprobs as the old ones, with its ppo_clip and reinforce losses).
4. Sampling is seeded per step and rank, so a resumed run repeats an uninterrupted one's rollouts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch

import actor
import config
import correction
import fsdp
import losses
import optim
import rl
import rollout
import scoring


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's algorithm.filter_groups; arXiv:2503.14476): a prompt whose n responses all
    score the same has zero advantage and teaches nothing. With enable, such groups are dropped and more prompts
    are drawn and generated, a data.train_batch_size batch at a time, until every rank holds its share of the
    batch in groups that differ (`filtered_rollouts`)."""

    enable: bool = False
    """Drop the groups without spread and generate more."""
    metric: str = "reward"
    """What must differ within a group: reward (the sequence reward, DAPO's length penalty included), score or
    acc (the reward function's own value), or another numeric key of the function's dict result (a response
    without it, or whose call failed, counts as 0; a key no response has stops the run)."""
    max_num_gen_batches: Annotated[int, config.NON_NEGATIVE] = 0
    """Stop the run with an error when a step has generated this many batches without filling its own (0: no
    limit; the data is then too easy or too hard for the model)."""


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantage estimation."""

    adv_estimator: Literal[
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "gpg",
        "reinforce_plus_plus_baseline",
        "remax",
        "optimal_token_baseline",
    ] = "grpo"
    """Estimator; see the module docstring."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO divides by the group's std; False is Dr. GRPO."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.kl_coef * KL(policy || reference) from each response token's reward, as verl's
    apply_kl_penalty (its REINFORCE++ and RLOO examples): grpo, rloo and gpg score a response by the sum of its
    token rewards (the score less its summed penalty); reinforce_plus_plus gives each token its return (the score
    less the penalty from that token on), whitened over all tokens. Loads the reference model and runs the
    old-logprob pass."""
    kl_penalty: str = "kl"
    """KL estimator of the reward's penalty: kl (k1), abs, mse (k2), low_var_kl (k3)."""
    kl_ctrl: rl.KLControlConfig = field(default_factory=rl.KLControlConfig)
    """The penalty's coefficient, fixed or adaptive (verl's algorithm.kl_ctrl)."""
    rollout_is_threshold: Annotated[float | None, config.POSITIVE] = None
    """Rollout importance sampling (verl's algorithm.rollout_is_threshold; TIS, TRL's
    vllm_importance_sampling_cap): the engine samples from its own bf16 numbers, not the trainer's, and each
    token's weight pi_trainer / pi_engine, truncated at this value, measures (mismatch/* metrics) and, with
    rollout_is, corrects that. None: off. Needs every sample's engine logprobs (rollout.logprob_check_prompts=-1)
    at rollout.temperature 1 (the engine reports temperature-1 logprobs)."""
    rollout_is: bool = False
    """Multiply each token's policy loss by its truncated weight; False: the mismatch/* metrics only."""
    rollout_is_level: Literal["token", "sequence"] = "token"
    """token: each token's own ratio (TIS); sequence: every token of a response weighs the product of its tokens'
    ratios, truncated at rollout_is_threshold (verl's rollout_is=sequence: unbiased, higher variance)."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated weights by their mean over the step's batch, all ranks, so that they average 1 (verl's
    rollout_correction.rollout_is_batch_normalize): the token level's over every response token, the sequence
    level's over the responses (`correction.rollout_correction`; with rollout_bypass over each micro-batch's, `correction.correct`).
    Needs rollout_is; runs the old-logprob pass unless rollout_bypass."""
    rollout_rs: str | None = None
    """Rollout rejection sampling (verl's rollout_correction.rollout_rs): modes of correction.RS_MODES, comma-separated, that
    drop from the loss each token, or each whole response, whose trainer / engine divergence is out of
    rollout_rs_threshold's bounds; a token stays only where every mode keeps it (`correction.rejection_mask`). None: off.
    Works with or without rollout_is; needs the engine logprobs as rollout_is_threshold does; runs the
    old-logprob pass unless rollout_bypass (which rejects in every micro-batch, by the current policy)."""
    rollout_rs_threshold: str | float | None = None
    """rollout_rs's bounds, one for every mode or one per mode, comma-separated (verl's syntax): a k1 mode takes
    `lower_upper` bounds on the ratio pi_engine / pi_trainer, or `upper` alone (lower 1 / upper); a k2 or k3 mode an
    upper bound on the divergence. E.g. rollout_rs=token_k1,seq_max_k2 with "0.6_1.6,2.5"."""
    rollout_bypass: bool = False
    """The engine's logprobs are the old ones (verl's rollout_correction.bypass_mode): the old-logprob pass, one
    forward over the whole batch a step, is skipped, and rollout_is's weights and rollout_rs's rejection are
    computed in every micro-batch between the current policy and the engine (`correction.correct`; the rejection drops tokens
    from the policy term only). The cost: the update's first step is off-policy by the engine/trainer mismatch
    (bf16 numbers, other kernels), which rollout_loss_type's ratio or weights then correct instead of a trainer's
    own old logprobs. Needs every sample's engine logprobs at temperature 1, as rollout_is_threshold, and
    actor.policy_loss.loss_mode=vanilla."""
    rollout_loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """The policy term under rollout_bypass (verl's rollout_correction.loss_type): ppo_clip, PPO-clip (vanilla) with
    the engine's logprobs as the old ones (its ratio is the importance weight: rollout_is's weights are measured,
    not applied); reinforce, -A w log pi, no ratio, no clip, w rollout_is's truncated (batch-normalised) weight or
    1 without rollout_is (verl's compute_policy_loss_reinforce)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling; see FilterGroupsConfig."""

    def __post_init__(self) -> None:
        if self.rollout_loss_type != "ppo_clip" and not self.rollout_bypass:
            raise ValueError(
                f"algorithm.rollout_loss_type={self.rollout_loss_type} needs algorithm.rollout_bypass=true (it is "
                "the loss of the bypass mode, whose old logprobs are the engine's)"
            )
        if self.rollout_is_batch_normalize and not (
            self.rollout_is and self.rollout_is_threshold is not None
        ):
            raise ValueError(
                "algorithm.rollout_is_batch_normalize needs algorithm.rollout_is=true and rollout_is_threshold (it "
                "normalises the truncated weights that rollout_is applies)"
            )
        if self.rollout_rs is not None:
            correction.rs_bounds(
                self.rollout_rs, self.rollout_rs_threshold
            )  # a bad mode or bound is an error now


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO with colocated vLLM rollout and FSDP2 (see the module docstring)."""

    data: rl.RLDataConfig = field(default_factory=rl.RLDataConfig)
    model: actor.ModelConfig = field(default_factory=actor.ModelConfig)
    actor: actor.ActorConfig = field(default_factory=actor.ActorConfig)
    rollout: rollout.RolloutConfig = field(default_factory=rollout.RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    custom_reward_function: scoring.RewardConfig = field(default_factory=scoring.RewardConfig)
    trainer: rl.RLTrainerConfig = field(
        default_factory=lambda: rl.RLTrainerConfig(default_local_dir="runs/grpo", experiment_name="grpo")
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


def gpg_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, total: tuple[float, float] | None = None
) -> torch.Tensor:
    """GPG outcome advantages (verl compute_gpg_outcome_advantage, f_norm 1; arXiv:2504.02546): alpha (s_i - the
    group's mean), no division by the std, alpha = B / (the responses whose score is not 0), so a batch with few
    rewarded responses is scaled up. [B], [B] -> [B]; a group of one gets 0 (as group_advantages).

    total: (B, the nonzero scores) over the whole batch on all ranks; None: this batch alone.
    """
    n, nonzero = (float(len(scores)), float((scores != 0).sum())) if total is None else total
    return n / max(nonzero, 1.0) * group_advantages(scores, group_ids, norm_by_std=False)


def whiten_by_tokens(
    scores: torch.Tensor, lengths: torch.Tensor, total: tuple[float, float, float] | None = None
) -> torch.Tensor:
    """REINFORCE++ outcome advantages (verl compute_reinforce_plus_plus_outcome_advantage, gamma = 1): every
    response token carries its sequence's score, and the scores are whitened over all response tokens, so a
    sequence weighs by its length. [B], [B] -> [B].

    total: (tokens, sum, sum of squares) over the whole batch on all ranks; None: this batch alone.
    """
    w = lengths.double()
    if total is None:
        total = (w.sum().item(), (w * scores).sum().item(), (w * scores**2).sum().item())
    n, s1, s2 = total
    mean = s1 / n
    var = (s2 - n * mean**2) / max(n - 1, 1)  # unbiased, as verl's masked_whiten
    return ((scores.double() - mean) / (var + 1e-8) ** 0.5).float()


def otb_advantages(
    returns: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    group_ids: torch.Tensor,
    is_weights: torch.Tensor | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Optimal token baseline (verl's compute_optimal_token_baseline_advantage, handle_zero_tail=False): one
    baseline per prompt group and response position, weighing each trajectory by its path variance so far,
        w_t = (1 - 2 pi_t + sum_v pi_v^2) [* rho_t^2],  W_t = sum_{j <= t} w_j mask_j,
        B_t = sum_i G_t,i W_t,i mask_t,i / (sum_i W_t,i mask_t,i + eps),   A_t = (G_t - B_t) mask_t
    pi_t = exp(old_logprobs_t); 1 - 2 pi_t + sum_v pi_v^2 = ||e_t - pi||^2 is the squared norm of the logit
    gradient of log pi_t, a proxy for the variance that token adds. rho: rollout_is's truncated weights (the
    baseline minimising the MSE under truncated IS). A group of one keeps B = 0 (its advantage is its return).

    Args: returns G, mask, old_logprobs, sum_pi_squared, is_weights all [B, R]; group_ids [B].
    Returns: advantages [B, R]."""
    w = 1.0 - 2.0 * old_logprobs.exp() + sum_pi_squared  # [B, R]
    if is_weights is not None:
        w = w * is_weights**2
    W = (w * mask).cumsum(-1)  # [B, R], the path variance up to and including t
    baselines = torch.zeros_like(returns)  # [B, R]
    for g in group_ids.unique():
        idx = (group_ids == g).nonzero(as_tuple=True)[0]
        if len(idx) > 1:
            Wm = W[idx] * mask[idx]  # [n, R]
            baselines[idx] = ((returns[idx] * Wm).sum(0) / (Wm.sum(0) + eps))[None]  # [1, R] onto [n, R]
    return (returns - baselines) * mask


def compute_advantages(
    samples: list[actor.Sample],
    cfg: AlgorithmConfig,
    kl_ctrl: rl.KLController | None = None,
    baselines: list[actor.Sample] | None = None,
    is_mean: float = 1.0,
) -> dict[str, float]:
    """Sets sample.advantages (one number per response, or [L] for REINFORCE++ and ReMax with use_kl_in_reward,
    and for optimal_token_baseline) from the scores, per prompt group (whitened over all ranks for REINFORCE++);
    returns the KL-in-reward metrics.

    baselines: ReMax's scored greedy responses, one a prompt (`remax_baselines`); remax subtracts the score of
    the one whose `group` is the sample's, as verl's compute_remax_outcome_advantage (no whitening).
    is_mean: optimal_token_baseline with rollout_is: the truncated weights' batch mean they are divided by
    (`correction.rollout_correction`; 1 unless rollout_is_batch_normalize), as the loss divides them."""
    scores = torch.tensor([s.score for s in samples])  # [B]
    groups = torch.tensor([s.group for s in samples])  # [B]
    if cfg.adv_estimator == "remax":
        if baselines is None:
            raise ValueError(
                "algorithm.adv_estimator=remax needs the greedy baselines (grpo.remax_baselines)"
            )
        greedy = {b.group: b.score for b in baselines}
        scores = scores - torch.tensor([greedy[s.group] for s in samples])  # [B]
    if cfg.adv_estimator == "optimal_token_baseline":
        return otb_from_samples(samples, cfg, kl_ctrl, is_mean)
    if cfg.use_kl_in_reward:
        lens = [len(s.response_ids) for s in samples]
        penalty, metrics = rl.kl_in_reward(samples, cfg.kl_penalty, kl_ctrl, max(lens, default=1))  # [B, R]
        if cfg.adv_estimator in ("reinforce_plus_plus", "remax"):
            # each token's return: the score less the penalty still to come (ReMax: less the baseline too)
            returns = scores[:, None] - penalty.flip(-1).cumsum(-1).flip(-1)  # [B, R]
            if cfg.adv_estimator == "reinforce_plus_plus":  # over the tokens the loss counts (as verl)
                cpu, R = torch.device("cpu"), penalty.shape[1]
                keep = [1.0 if s.loss_mask is None else s.loss_mask for s in samples]
                returns = rl.global_whiten(returns, actor.mask_of(lens, cpu, R) * actor.padded(keep, R, cpu))
            for i, s in enumerate(samples):
                s.advantages = returns[i, : lens[i]].float()
            return metrics
        scores = scores - penalty.sum(-1)  # the sum of the token rewards
    else:
        metrics = {}
    if cfg.adv_estimator == "remax":
        adv = scores
    elif cfg.adv_estimator == "grpo":
        adv = group_advantages(scores, groups, norm_by_std=cfg.norm_adv_by_std_in_grpo)
    elif cfg.adv_estimator == "rloo":
        adv = rloo_advantages(scores, groups)
    elif cfg.adv_estimator == "gpg":
        counts = (float(len(scores)), float((scores != 0).sum()))
        adv = gpg_advantages(scores, groups, tuple(fsdp.all_reduce(x) for x in counts))
    else:  # REINFORCE++, with a group baseline first or not (a group of one gets 0 there, as in grpo)
        if cfg.adv_estimator == "reinforce_plus_plus_baseline":
            scores = group_advantages(scores, groups, norm_by_std=False)
        lengths = torch.tensor([s.loss_tokens for s in samples]).double()  # [B], the tokens the loss counts
        sums = (lengths.sum(), (lengths * scores).sum(), (lengths * scores**2).sum())
        adv = whiten_by_tokens(scores, lengths, tuple(fsdp.all_reduce(x.item()) for x in sums))
    for s, a in zip(samples, adv.tolist(), strict=True):
        s.advantages = a
    return metrics


def otb_from_samples(
    samples: list[actor.Sample], cfg: AlgorithmConfig, kl_ctrl: rl.KLController | None, is_mean: float
) -> dict[str, float]:
    """compute_advantages for optimal_token_baseline: verl's token rewards (the score on the last response token,
    less the KL penalty per token with use_kl_in_reward), their returns over the tokens the loss counts (rollout
    rejection sampling's drops left out, as verl's modified response_mask), then `otb_advantages`."""
    if any(s.old_logprobs is None or s.sum_pi_squared is None for s in samples):
        raise ValueError(
            "algorithm.adv_estimator=optimal_token_baseline needs each sample's old_logprobs and sum_pi_squared "
            "(actor.compute_logprobs with with_sum_pi_squared=True) before the advantages"
        )
    cpu = torch.device("cpu")
    lens = [len(s.response_ids) for s in samples]
    R = max(lens, default=1)
    valid = actor.mask_of(lens, cpu, R)  # [B, R]
    mask = valid * actor.padded([1.0 if s.loss_mask is None else s.loss_mask for s in samples], R, cpu)
    rewards = torch.zeros(len(samples), R)  # [B, R], verl's token_level_rewards
    for i, s in enumerate(samples):
        rewards[i, lens[i] - 1] = s.score
    metrics = {}
    if cfg.use_kl_in_reward:
        penalty, metrics = rl.kl_in_reward(samples, cfg.kl_penalty, kl_ctrl, R)  # [B, R]
        rewards = rewards - penalty
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1)  # [B, R], reward to go
    old = actor.padded([s.old_logprobs for s in samples], R, cpu)  # [B, R]
    sum_pi_squared = actor.padded([s.sum_pi_squared for s in samples], R, cpu)
    weights = None
    if cfg.rollout_is and cfg.rollout_is_threshold is not None:  # as policy_loss weighs the tokens
        log_ratio = (old - actor.padded([s.rollout_logprobs for s in samples], R, cpu)) * valid  # [B, R]
        weights = correction.is_weights(log_ratio, valid, cfg)[0] / is_mean
    groups = torch.tensor([s.group for s in samples])  # [B]
    adv = otb_advantages(returns, mask, old, sum_pi_squared, groups, weights)  # [B, R]
    for i, s in enumerate(samples):
        s.advantages = adv[i, : lens[i]].clone()
    return metrics


# ----------------------------------------------------------------------------------------- objective


def clipped_surrogate(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, cfg: actor.ActorConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip per token with clip-higher (DAPO) and dual clip (arXiv:1912.09729), as verl's
    compute_policy_loss_vanilla. All [S, R]; r = exp(clamp(logprobs - old_logprobs, -20, 20)):
        l = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high));  if A < 0: l = min(l, -A clip_ratio_c)
    Returns (l, where the clipped term won, where the dual clip bound), all [S, R]."""
    log_ratio = torch.clamp(logprobs - old_logprobs, -20.0, 20.0)  # [S, R]
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    dual = -advantages * cfg.clip_ratio_c  # caps the loss of a negative-advantage token with a huge ratio
    is_dual = (loss > dual) & (advantages < 0)
    return torch.where(is_dual, dual, loss), clipped > unclipped, is_dual


def gspo_surrogate(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (arXiv:2507.18071, as verl's compute_policy_loss_gspo): one importance ratio a sequence, the geometric
    mean of its tokens' ratios, s = exp(mean_t(logprobs - old_logprobs)), clipped PPO-style:
        l_t = max(-A s_t, -A clip(s_t, 1 - clip_ratio_low, 1 + clip_ratio_high)),  s_t = sg(s) pi_t / sg(pi_t)
    so every token carries its sequence's ratio and its own gradient. All [S, R]; returns (l, clipped)."""
    seq_log_ratio = ((logprobs - old_logprobs) * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [S]
    log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach()[:, None]  # [S, R], the sequence's value
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def geo_mean_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: actor.ActorConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GMPO (arXiv:2507.20673, as verl's compute_policy_loss_geo_mean): one ratio a sequence, the geometric mean of
    its tokens' ratios, each clipped in log space on the side its advantage's sign makes pessimistic:
        c_t = sign(A) min(sign(A) log r_t, sign(A) clip(log r_t, -clip_ratio_low, clip_ratio_high))
        l = -mean_t(A) exp(mean_t c_t)   (the log-ratio unclamped, as verl)
    l is written on every token of its sequence, so seq-mean-token-mean gives verl's mean over sequences. All
    [S, R]; returns (l, tokens out of the clip range with A > 0, with A < 0: verl's two clip fractions)."""
    log_ratio = logprobs - old_logprobs  # [S, R]
    bounded = torch.clamp(log_ratio, -cfg.clip_ratio_low, cfg.clip_ratio_high)
    sign = torch.sign(advantages)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * bounded)  # [S, R]
    n = mask.sum(-1).clamp(min=1)  # [S]
    seq_ratio = torch.exp((clipped_log_ratio * mask).sum(-1) / n)  # [S]
    seq_adv = (advantages * mask).sum(-1) / n  # [S]; one number a sequence here (outcome advantages)
    loss = (-seq_adv * seq_ratio)[:, None].expand_as(log_ratio)  # [S, R]
    outside = log_ratio != bounded
    return loss, outside & (advantages > 0), outside & (advantages < 0)


def cispo_surrogate(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, cfg: actor.ActorConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv:2506.13585, as verl's compute_policy_loss_cispo): REINFORCE with a clipped,
    stop-gradient importance weight, so a clipped token still has a gradient (PPO-clip's has none):
        l = -sg(clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) A log pi,  r = exp(clamp(log r, -20, 20))
    All [S, R]; returns (l, where the clip changed the weight)."""
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -20.0, 20.0))  # [S, R]
    weight = torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    return -weight.detach() * advantages * logprobs, ratio != weight


def sapo_surrogate(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, cfg: actor.ActorConfig
) -> torch.Tensor:
    """SAPO (arXiv:2511.20347, as verl's compute_policy_loss_sapo): a soft gate in place of the clip,
        l = -A f(r),  f(r) = sigmoid(tau (r - 1)) 4 / tau,  tau = tau_pos if A > 0 else tau_neg
    with r = exp(clamp(log r, -20, 20)). df/dr = 1 at r = 1 (the plain policy gradient on policy), decaying as
    r leaves 1, faster for larger tau. All [S, R]."""
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -20.0, 20.0))  # [S, R]
    tau = torch.where(advantages > 0, cfg.tau_pos, cfg.tau_neg)  # [S, R]
    return -advantages * torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau


PER_SEQUENCE = ("gspo", "geo_mean", "sapo")
"""Loss modes whose surrogate verl aggregates seq-mean-token-mean whatever actor.loss_agg_mode says."""


def surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: actor.ActorConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token policy loss of actor.policy_loss.loss_mode (the table in the module docstring), and the two
    token masks logged as actor/pg_clipfrac and actor/pg_clipfrac_lower (what verl's function of that name
    reports: vanilla the clip and the dual clip; geo_mean the clip by the advantage's sign; gspo and cispo the
    clip and nothing; gpg and sapo nothing). All [S, R]."""
    none = torch.zeros_like(mask, dtype=torch.bool)
    mode = cfg.policy_loss.loss_mode
    if mode == "gspo":
        return *gspo_surrogate(logprobs, old_logprobs, advantages, mask, cfg), none
    if mode == "geo_mean":
        return geo_mean_surrogate(logprobs, old_logprobs, advantages, mask, cfg)
    if mode == "gpg":  # GPG (arXiv:2504.02546, verl's compute_policy_loss_gpg): no ratio, no clip
        return -advantages * logprobs, none, none
    if mode == "cispo":
        return *cispo_surrogate(logprobs, old_logprobs, advantages, cfg), none
    if mode == "sapo":
        return sapo_surrogate(logprobs, old_logprobs, advantages, cfg), none, none
    return clipped_surrogate(logprobs, old_logprobs, advantages, cfg)


def policy_loss(
    model: torch.nn.Module,
    mb: actor.MicroBatch,
    cfg: GRPOConfig,
    check: actor.PushCheck | None,
    is_mean: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's objective on one micro-batch (an actor.LossFn): the surrogate (PPO-clip unless
    actor.policy_loss.loss_mode says otherwise) + kl_loss_coef * KL(policy || reference) - entropy_coeff * entropy,
    each aggregated by actor.loss_agg_mode over the whole mini-batch (the surrogate of a PER_SEQUENCE mode
    seq-mean-token-mean) and over the tokens that rollout rejection sampling kept (mb.mask). With
    algorithm.rollout_is, the surrogate of each token is multiplied by its truncated weight divided by `is_mean`
    (the batch's mean weight under rollout_is_batch_normalize, `correction.rollout_correction`; else 1); the mismatch/*
    metrics are over every response token, the rejected ones too (mb.valid_mean: verl measures before its rejection
    mask), before that division.

    With algorithm.rollout_bypass the old logprobs are the engine's, and `correction.correct` runs here on this micro-batch
    with the current policy's logprobs (detached) against the engine's, as verl's compute_policy_loss_bypass_mode:
    its rejection drops tokens from the surrogate only (the KL and entropy terms keep every token, and the
    mini-batch's token count is every response token), its batch normalisation is the mean over this micro-batch
    on all ranks (a collective: actor.update's on_empty pairs it on a rank without samples), and the surrogate is
        ppo_clip:   PPO-clip against the engine (the ratio is the correction; rollout_is's weights not applied)
        reinforce:  -A w log pi,  w = rollout_is's truncated weight / its norm (1 without rollout_is); no clip."""
    a, alg, temperature = cfg.actor, cfg.algorithm, cfg.rollout.temperature
    logprobs, entropy = actor.forward(model, mb, temperature, a.entropy_coeff != 0, check)  # [S, R]
    old = mb.per_token("old_logprobs")
    old = logprobs.detach() if old is None else old  # one optimizer step a batch: this forward's, ratio 1
    adv = mb.per_token("advantages")  # [S, R]
    norm = dict(
        global_tokens=mb.global_tokens, global_seqs=mb.global_seqs, norm_length=cfg.data.max_response_length
    )
    agg = lambda x, mode=a.loss_agg_mode, mask=mb.mask: losses.agg_loss(x, mask, mode, **norm)  # noqa: E731
    pg_mask, w, metrics = mb.mask, None, {}  # the surrogate's tokens, the weights it is multiplied by
    if alg.rollout_bypass:  # old = the engine's; the correction by the current policy, in every micro-batch
        log_ratio = logprobs.detach() - old  # [S, R], log pi_trainer / pi_engine
        c = correction.correct(log_ratio, mb.valid, alg)
        if c.keep is not None:
            pg_mask = mb.mask * c.keep  # [S, R]
            for k, v in c.dropped.items():  # shares of the mini-batch's fractions
                metrics[f"mismatch/{k}"] = v / (
                    mb.global_seqs if k.endswith("seq_masked_fraction") else mb.global_valid_tokens
                )
        if alg.rollout_is_batch_normalize:  # the micro-batches' factors, weighed by their tokens
            metrics["mismatch/rollout_is_batch_norm_factor"] = mb.valid_mean(c.norm * mb.valid)
        if alg.rollout_is and alg.rollout_loss_type == "reinforce":
            w = c.weights / c.norm
        is_w, is_log_w = c.weights, c.log_weights
    elif alg.rollout_is_threshold is not None:  # the trainer's and the engine's numbers differ (TIS)
        log_ratio = old - mb.per_token("rollout_logprobs")  # [S, R], log pi_trainer / pi_engine per token
        # sequence: each response's product of ratios over all its tokens, rejected ones too (as verl)
        is_w, is_log_w = correction.is_weights(log_ratio, mb.valid, alg)  # [S, R] each
        if alg.rollout_is:
            w = is_w
            # geo_mean at the token level: a sequence's weight is its tokens' geometric mean
            if a.policy_loss.loss_mode == "geo_mean" and alg.rollout_is_level == "token":
                n = mb.valid.sum(-1, keepdim=True).clamp(min=1)  # [S, 1]
                w = torch.exp((torch.log(w) * mb.valid).sum(-1, keepdim=True) / n)
            w = w / is_mean
    if alg.rollout_is_threshold is not None:
        # over every response token, the rejected ones too, as verl; KL(engine || trainer), k1 on the samples
        metrics["mismatch/mismatch_kl"] = mb.valid_mean(-log_ratio)
        metrics["mismatch/rollout_is_mean"] = mb.valid_mean(is_w)
        high = is_log_w > math.log(alg.rollout_is_threshold)  # [S, R]
        metrics["mismatch/rollout_is_ratio_fraction_high"] = mb.valid_mean(high.float())
    if alg.rollout_bypass and alg.rollout_loss_type == "reinforce":  # verl's compute_policy_loss_reinforce
        pg = -adv * logprobs  # [S, R]
        clipped = clipped_lower = torch.zeros_like(pg_mask, dtype=torch.bool)
    else:
        pg, clipped, clipped_lower = surrogate(logprobs, old, adv, pg_mask, a)
    if w is not None:
        pg = pg * w.detach()
    per_sequence = a.policy_loss.loss_mode in PER_SEQUENCE  # every sequence weighs the same (verl)
    loss = pg_loss = agg(pg, "seq-mean-token-mean" if per_sequence else a.loss_agg_mode, pg_mask)
    kept_mean = lambda x: losses.agg_loss(x.detach(), pg_mask, "token-mean", global_tokens=mb.global_tokens)  # noqa: E731
    metrics |= {
        "actor/pg_loss": pg_loss.detach(),
        "actor/pg_clipfrac": kept_mean(clipped.float()),
        "actor/pg_clipfrac_lower": kept_mean(clipped_lower.float()),
        "actor/ppo_kl": kept_mean(old - logprobs),
    }
    if a.use_kl_loss:
        kl = agg(losses.kl_penalty(logprobs, mb.per_token("ref_logprobs"), a.kl_loss_type))
        loss = loss + a.kl_loss_coef * kl
        metrics["actor/kl_loss"] = kl.detach()
    if a.entropy_coeff != 0:
        loss = loss - a.entropy_coeff * agg(entropy)
    return loss, metrics


# ---------------------------------------------------------------------------------------- ReMax


def remax_baselines(
    run: rl.Run, engine: rollout.Engine, prompts: list[dict], mine: slice, step: int
) -> list[actor.Sample]:
    """ReMax's baselines (arXiv:2310.10505, verl's adv_estimator=remax): one greedy response to each of the
    engine's prompts, with the weights that sampled the step's rollouts; this rank keeps those to prompts[mine],
    `group` indexing them as the samples' does. They are scored beside the samples and then dropped: nothing
    trains on them."""
    greedy = dataclasses.replace(run.cfg.rollout.train_sampling, n=1, do_sample=False, temperature=0.0)
    return rl.generate(run, engine, prompts, mine, step, sampling=greedy)[0]


# ---------------------------------------------------------------------------------- dynamic sampling


def filtered_rollouts(
    run: rl.Run,
    engine: rollout.Engine,
    step: int,
    fg: FilterGroupsConfig,
    probes: list[actor.Sample] | None = None,
) -> tuple[list[actor.Sample], list[dict], dict[str, float]]:
    """DAPO's dynamic sampling: batches of prompts are drawn, generated and scored (round by round: the filter needs
    the scores), and each group whose `fg.metric` differs somewhere is kept, until every rank holds its share of
    data.train_batch_size (the rest of a round is dropped). All ranks draw and generate together, so the data
    position and the tensor-parallel engines stay in step; a rank whose share is full still generates until the
    last one's is. Returns this rank's samples (grouped, `group` indexing its prompts), its prompts, and the
    reward pool's metrics summed (counts) or averaged (means) over the rounds, with rollout/num_gen_batches and
    rollout/filtered_group_frac (the share of generated groups without spread). `probes` receives every round's
    push-check probes (rl.generate)."""
    quota = run.cfg.data.train_batch_size // run.dist.world_size
    kept: list[actor.Sample] = []
    kept_prompts: list[dict] = []
    rounds: list[dict[str, float]] = []
    generated = flat = 0
    while True:
        prompts, mine = run.next_prompts()
        samples, prompts = rl.generate(run, engine, prompts, mine, step, round_=len(rounds), probes=probes)
        rounds.append(rl.score_in_background(run, samples, prompts)())  # waits: the filter needs the scores
        if fg.metric != "reward" and samples and not any(fg.metric in smp.reward_info for smp in samples):
            raise KeyError(
                f"algorithm.filter_groups.metric={fg.metric!r}: the reward function returned no such key; it has "
                f"{['reward', *samples[0].reward_info]}"
            )
        by_group: list[list[actor.Sample]] = [[] for _ in prompts]
        for smp in samples:
            by_group[smp.group].append(smp)
        for prompt, group in zip(prompts, by_group, strict=True):
            # a call that failed (scored 0, counted in reward/errors) or a dict without the key counts as 0
            values = [
                smp.score if fg.metric == "reward" else smp.reward_info.get(fg.metric, 0.0) for smp in group
            ]
            generated += 1
            if len(set(values)) < 2:
                flat += 1
            elif len(kept_prompts) < quota:
                for smp in group:
                    smp.group = len(kept_prompts)
                kept += group
                kept_prompts.append(prompt)
        if fsdp.all_reduce(float(len(kept_prompts) < quota)) == 0:  # every rank's share is full
            break
        if fg.max_num_gen_batches and len(rounds) >= fg.max_num_gen_batches:
            raise RuntimeError(
                f"step {step + 1}: {len(rounds)} generated batches (algorithm.filter_groups.max_num_gen_batches="
                f"{fg.max_num_gen_batches}) left a rank with {len(kept_prompts)} of its {quota} prompts whose "
                f"responses differ in {fg.metric}: the data is too easy or too hard for the model"
            )
    metrics = {
        k: sum(r.get(k, 0.0) for r in rounds)
        / (1 if k.startswith(("reward/errors", "reward/printed")) else len(rounds))
        for k in rounds[0]
    }
    metrics["rollout/num_gen_batches"] = float(len(rounds))
    metrics["rollout/filtered_group_frac"] = fsdp.all_reduce(float(flat)) / fsdp.all_reduce(float(generated))
    return kept, kept_prompts, metrics


# --------------------------------------------------------------------------------------------- loop


def compile_layers_beside_async(cfg: GRPOConfig) -> GRPOConfig:
    """cfg with model.compile_layers=auto off where rollouts are generated ahead in this process (one line says so
    where it would have compiled); true there is refused: tracing a compiled layer patches module calls
    process-wide, and vLLM's sampler, decoding in this process's other thread, then fails ('FX to symbolically
    trace a dynamo-optimized function'; H100, 2026-12-05). rollout.engine_process=true keeps them apart."""
    if not (cfg.model.compile_layers and cfg.rollout.async_steps and not cfg.rollout.engine_process):
        return cfg
    if cfg.model.compile_layers is True:
        raise SystemExit(
            "error: model.compile_layers with rollout.async_steps=1 needs rollout.engine_process=true: compiling a "
            "layer traces modules process-wide, and vLLM's sampler, decoding in this process's other thread, then "
            "fails ('FX to symbolically trace a dynamo-optimized function'; H100, 2026-12-05)"
        )
    if actor.compiles(cfg.model):
        fsdp.print0(
            "model.compile_layers=auto: off, as rollout.async_steps=1 decodes in this process's other thread "
            "(rollout.engine_process=true keeps it on)"
        )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile_layers=False))


def main(cfg: GRPOConfig) -> dict[str, float]:
    """Trains; returns the final metrics (val/reward/mean before and after, the last step's metrics)."""
    alg = cfg.algorithm
    engine_logprobs = alg.rollout_is_threshold is not None or alg.rollout_rs is not None or alg.rollout_bypass
    if engine_logprobs and (cfg.rollout.logprob_check_prompts != -1 or cfg.rollout.temperature != 1.0):
        which = "rollout_is_threshold" if alg.rollout_is_threshold is not None else "rollout_rs"
        which = "rollout_bypass" if alg.rollout_bypass else which
        raise SystemExit(
            f"error: algorithm.{which} needs the engine's logprobs of every sample at temperature 1: "
            f"set rollout.logprob_check_prompts=-1 (now {cfg.rollout.logprob_check_prompts}) and "
            f"rollout.temperature=1.0 (now {cfg.rollout.temperature})"
        )
    a = cfg.actor
    if alg.rollout_bypass and a.policy_loss.loss_mode != "vanilla":
        raise SystemExit(
            f"error: algorithm.rollout_bypass needs actor.policy_loss.loss_mode=vanilla (got "
            f"{a.policy_loss.loss_mode}): its loss is algorithm.rollout_loss_type's, ppo_clip or reinforce, as verl's "
            "bypass_mode"
        )
    if a.policy_loss.loss_mode in PER_SEQUENCE and a.loss_agg_mode != "seq-mean-token-mean":
        fsdp.print0(
            f"note: actor.loss_agg_mode={a.loss_agg_mode} applies to the KL and entropy terms only: "
            f"actor.policy_loss.loss_mode={a.policy_loss.loss_mode} averages its policy term per sequence "
            "(seq-mean-token-mean), as verl does"
        )
    cfg = compile_layers_beside_async(cfg)
    otb = alg.adv_estimator == "optimal_token_baseline"
    if otb and (cfg.model.use_fused_kernels or alg.rollout_bypass):
        which = "model.use_fused_kernels" if cfg.model.use_fused_kernels else "algorithm.rollout_bypass"
        raise SystemExit(
            f"error: algorithm.adv_estimator=optimal_token_baseline does not go with {which}=true: it needs "
            "sum_v pi_v^2 from the trainer's old-logprob pass over the full logits (verl refuses "
            "calculate_sum_pi_squared with fused kernels too)"
        )
    fg = cfg.algorithm.filter_groups
    remax = cfg.algorithm.adv_estimator == "remax"
    if remax and (fg.enable or cfg.rollout.async_steps):
        raise SystemExit(
            "error: algorithm.adv_estimator=remax needs algorithm.filter_groups.enable=false and "
            f"rollout.async_steps=0 (got {fg.enable}, {cfg.rollout.async_steps}): its greedy baselines are "
            "generated beside each step's rollouts"
        )
    if fg.enable and cfg.rollout.async_steps:
        raise SystemExit(
            "error: algorithm.filter_groups.enable needs rollout.async_steps=0: dynamic sampling scores each round "
            "before it decides to generate more, and rollouts generated ahead are not scored yet"
        )
    run = rl.start(cfg)
    cfg, temperature = (
        run.cfg,
        cfg.rollout.temperature,
    )  # run.cfg: model.path as loaded (checkpoint.as_hf_model)
    policy, hf_files = actor.load(cfg.model, run.dist.device)
    ref = None
    if (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not cfg.trainer.val_only:
        ref = actor.load_reference(cfg.model, policy, run.dist.device)
    optimizer, scheduler = optim.build(policy.parameters(), cfg.actor.optim, run.total_steps)
    guard = optim.SkipGuard(cfg.trainer.max_consecutive_skips)
    offload = rl.offloads(cfg.model.fsdp_config, optimizer)
    components = {"": (policy, optimizer, hf_files)}
    # the decoupled rollout correction's batch-wide half (rollout_bypass corrects in every micro-batch instead)
    batch_correction = not alg.rollout_bypass and (
        alg.rollout_rs is not None or alg.rollout_is_batch_normalize
    )
    one_step = actor.one_optimizer_step(cfg.actor, cfg.data.train_batch_size)
    # the old-logprob pass: not with rollout_bypass (the engine's are the old ones), nor when the update takes one
    # optimizer step (its own forward gives them), unless the KL in the reward (as ppo.py) or the batch-wide
    # correction or optimal_token_baseline (with sum_v pi_v^2) needs them before the update
    needed_early = alg.use_kl_in_reward or batch_correction or otb
    old_pass = not alg.rollout_bypass and not (one_step and not needed_early)
    # the push check reads the first forward that sees the sampling weights: the old-logprob pass, else the
    # update's when it is one optimizer step, else (rollout_bypass) a pass of its own over one prompt's samples
    check_in_update = one_step and not old_pass
    # rollout_bypass's batch normalisation all-reduces in every micro-batch: a rank without samples joins with none
    on_empty = None
    if alg.rollout_bypass and alg.rollout_is_batch_normalize:
        none = torch.zeros(0, 1)
        on_empty = functools.partial(correction.weights_mean, none, none, alg.rollout_is_level)
    kl_ctrl = rl.KLController(cfg.algorithm.kl_ctrl)
    engine = None
    try:
        engine = rl.make_engine(cfg, run)
        step, results, extra = rl.resume(run, components, scheduler, guard)
        kl_ctrl.value = extra.get("kl_coef", kl_ctrl.value)
        # trainer.val_only stops here
        if rl.push_and_validate_first(run, engine, policy, step, results, offload):
            return results
        ahead = run.ahead = rl.RolloutAhead(run, engine) if cfg.rollout.async_steps else None
        probing = rl.probing(cfg)  # the push check on short probes (rollout.logprob_check_tokens)
        while step < run.total_steps:
            with rl.step_timer(cfg) as timer:
                # 1-2. prompts, and rollout.n responses to each
                probes: list[actor.Sample] | None = [] if probing else None
                with timer("gen"):
                    if fg.enable:  # DAPO: generated and scored round by round until the groups differ
                        samples, prompts, scored = filtered_rollouts(run, engine, step, fg, probes)
                    elif ahead is None:
                        # the engine's prompts; this rank trains on prompts[mine]
                        prompts, mine = run.next_prompts()
                        if remax:  # the greedy responses, whose scores are the baselines
                            baselines = remax_baselines(run, engine, prompts, mine, step)
                        samples, prompts = rl.generate(run, engine, prompts, mine, step, probes=probes)
                    else:  # generated during the last step (one update old), or now at the first
                        samples, prompts = ahead.take(step)
                pushed = {}
                if ahead is not None and ahead.stale:  # the engine runs this step's weights: a short response
                    with timer("push_check"):  # checks the last push, before the batch ahead takes the engine
                        pushed = rl.check_push(run, policy, ahead.probe(prompts[0], step), temperature, step)
                if ahead is not None and step + 1 < run.total_steps:
                    # the next step's rollouts, with these weights, while this step trains
                    ahead.start(step + 1)
                # 3. scores, in the reward workers while the engine sleeps and the passes below run
                scores = scored.copy if fg.enable else rl.score_in_background(run, samples, prompts)
                if remax:  # scored after the samples, in the same thread
                    baseline_scores = rl.score_in_background(run, baselines, prompts)
                if ahead is None:
                    with timer("sleep"):  # frees the KV cache (and weights) for the trainer
                        engine.sleep()
                if probes is not None:  # before the update changes the weights that sampled them
                    with timer("push_check"):
                        pushed = rl.check_push(run, policy, probes, temperature, step)
                # 4. logprob passes
                check = actor.PushCheck(run.dist.device)  # fed by the first forward over the samples
                if old_pass:
                    with timer("old_logprob"):
                        actor.compute_logprobs(
                            policy,
                            samples,
                            cfg.actor,
                            run.layout,
                            temperature,
                            check,
                            with_sum_pi_squared=otb,
                        )
                elif alg.rollout_bypass:  # the engine's logprobs are the old ones (verl's apply_bypass_mode)
                    for s in samples:
                        s.old_logprobs = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
                    if not check_in_update:  # copies: their old logprobs stay the engine's
                        with timer("push_check"):
                            probe = [dataclasses.replace(s) for s in samples if s.group == 0]
                            actor.compute_logprobs(policy, probe, cfg.actor, run.layout, temperature, check)
                if ref is not None:
                    with timer("ref"):
                        actor.compute_logprobs(ref, samples, cfg.actor, run.layout, temperature, ref=True)
                with timer("reward"):
                    metrics = scores()  # waits for what is left of the scoring
                    if remax:  # the baselines' pool metrics (their errors too), and their mean score
                        metrics |= {f"remax/{k}": v for k, v in baseline_scores().items()}
                        n_base = fsdp.all_reduce(float(len(baselines)))
                        metrics["remax/baseline_reward_mean"] = fsdp.all_reduce(
                            sum(b.score for b in baselines)
                        ) / max(n_base, 1.0)
                is_mean = 1.0  # rejection masks and the weights' batch mean, as verl before the advantages
                if batch_correction:
                    is_mean, corrected = correction.rollout_correction(samples, alg)
                    metrics |= corrected
                # 5. advantages
                metrics |= compute_advantages(
                    samples, cfg.algorithm, kl_ctrl, baselines if remax else None, is_mean
                )
                # 6. the update, and the proof that the engine ran the trainer's weights
                with timer("update"):
                    loss_fn = functools.partial(
                        policy_loss, cfg=cfg, check=check if check_in_update else None, is_mean=is_mean
                    )
                    batch = (samples, len(prompts), cfg.actor, run.layout)
                    metrics |= actor.update(policy, optimizer, guard, *batch, loss_fn, on_empty=on_empty)
                stale = ahead is not None and ahead.stale  # the batch is one update old: the probe checked
                metrics |= check.result(cfg.rollout.logprob_diff_tol, step, stale, probing) | pushed
                metrics["rollout/staleness"] = float(stale)
                metrics |= {"actor/lr": scheduler.get_last_lr()[0], "actor/skipped_steps": guard.skipped}
                scheduler.step()
                step += 1
                # 7. push, once the engine is done with the rollouts generated ahead
                if ahead is not None:
                    with timer("gen_wait"):
                        metrics |= ahead.wait()
                with timer("offload"):  # the AdamW state to host memory, so the waking engine finds its room
                    for o in offload:
                        o.offload()
                with timer("sync"):
                    rl.push(run, engine, policy)
            # 8. validate, log, save when due
            own = {"kl_coef": kl_ctrl.value}
            save = functools.partial(
                rl.save, run, step, components, scheduler, guard, results, own, offload=offload, engine=engine
            )
            rl.finish_step(run, engine, step, samples, metrics, timer, guard, results, save)
    finally:
        rl.close(run, engine)
    return results | {"global_step": step}


if __name__ == "__main__":
    fsdp.run_main(main, config.parse(GRPOConfig))
