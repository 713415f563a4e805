"""grpo.py: GRPO (and Dr. GRPO, RLOO, REINFORCE++) with colocated vLLM rollout, sharded with FSDP2.

Every rank holds a shard of the policy (FSDP2) and a whole vLLM engine on the same device. One step:
  1. each rank generates `rollout.n` responses for its share of `data.train_batch_size` prompts;
  2. rewards are scored in a process pool (reward.py), by the row's data_source or a custom function;
  3. advantages per prompt group (`algorithm.adv_estimator`);
  4. the trainer recomputes old logprobs (and checks them against vLLM's: rollout/logprob_diff_*), and the
     frozen reference model's logprobs when a KL loss is on;
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

Where it deviates from verl's ray_trainer + dp_actor:
1. No Ray: one process per GPU under torchrun, each with its own engine (verl's colocated "hybrid engine").
2. Groups never straddle ranks: a prompt's n samples are generated, scored and normalised on one rank.
3. The KL-in-reward path (`algorithm.use_kl_in_reward`) belongs to ppo.py; here the KL is a loss term.
4. Old logprobs are always recomputed by the trainer (verl can reuse rollout logprobs); vLLM's are only
   used to prove the weight push.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

import config
import data
import fsdp
import log
import losses
import optim
import reward
import rollout


@dataclass(frozen=True)
class DataConfig:
    """RL prompts in verl's schema (data_source, prompt, ability, reward_model, extra_info)."""

    train_files: str | list[str] = "runs/toy/rl/train.parquet"
    """Parquet or jsonl file(s) of training prompts."""
    val_files: str | list[str] | None = "runs/toy/rl/val.parquet"
    """Validation prompts, scored with greedy decoding (rollout.val_kwargs); None disables validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt: chat messages, or a string rendered as one user turn."""
    max_prompt_length: int = 512
    """Longest prompt in tokens; longer ones are dropped and counted (or an error with filter_overlong_prompts off)."""
    max_response_length: int = 512
    """Most tokens generated per response."""
    train_batch_size: int = 1024
    """Prompts per step, over all ranks (each gets rollout.n responses)."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    filter_overlong_prompts: bool = True
    """Drop prompts over max_prompt_length (counted) instead of stopping with an error."""
    seed: int = 1
    """Seed of the prompt order."""


@dataclass(frozen=True)
class ModelConfig:
    """The policy (and, frozen, the reference)."""

    path: str = "runs/sft_model"
    """Hugging Face model id or local folder (e.g. a shard_merge.py output) to start from."""
    trust_remote_code: bool = False
    """Allow the model folder's own Python code to run."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation used by the trainer."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    use_remove_padding: bool = True
    """Pack sequences into one row per micro-batch (no padding tokens computed)."""
    fsdp_config: fsdp.FSDPConfig = field(default_factory=fsdp.FSDPConfig)
    """Sharding, mixed precision and offload."""


@dataclass(frozen=True)
class ActorConfig:
    """The policy update (verl's actor_rollout_ref.actor)."""

    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (times rollout.n responses), over all ranks."""
    ppo_micro_batch_size_per_gpu: int = 8
    """Responses per forward/backward on one rank."""
    use_dynamic_bsz: bool = False
    """Micro-batches under a token budget (ppo_max_token_len_per_gpu) instead of a fixed count."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one micro-batch when use_dynamic_bsz is on (also used for the logprob passes)."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
    clip_ratio_low: float = 0.2
    """PPO clip: the ratio is kept above 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip: the ratio is kept below 1 + clip_ratio_high (DAPO's clip-higher when > clip_ratio_low)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (arXiv:1912.09729)."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How token losses become one number; normalised over the global mini-batch."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(policy || reference) to the loss (needs the reference model)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3)."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (subtracted from the loss)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this."""
    optim: optim.OptimConfig = field(default_factory=lambda: optim.OptimConfig(lr=1e-6))
    """Optimizer and schedule."""


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
class RewardConfig:
    """Reward function and its worker pool."""

    path: str | None = None
    """Python file with a custom reward function (verl's custom_reward_function.path); None: by data_source."""
    name: str = "compute_score"
    """Function name in that file."""
    num_workers: int = 4
    """Worker processes scoring in parallel (0: in the trainer's process, no timeout)."""
    timeout_s: float = 10.0
    """Per-call limit; a call past it scores 0 and counts in reward/errors."""


@dataclass(frozen=True)
class TrainerConfig:
    """Loop length, validation, logging, checkpoints."""

    default_local_dir: str = "runs/grpo"
    """Run folder: metrics.jsonl, config.yaml, global_step_N/ checkpoints."""
    project_name: str = "flatrl"
    """Project name for tensorboard/wandb."""
    experiment_name: str = "grpo"
    """Run name for tensorboard/wandb."""
    total_epochs: int = 1
    """Passes over the training prompts (ignored when total_training_steps is set)."""
    total_training_steps: int | None = None
    """Stop after this many steps."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks: console, jsonl, tensorboard, wandb."""
    save_freq: int = -1
    """Checkpoint every N steps (-1: only at the end)."""
    test_freq: int = -1
    """Validate every N steps (-1: only before and after training)."""
    val_before_train: bool = True
    """Validate before the first step."""
    val_only: bool = False
    """Validate once and exit (evaluation of model.path)."""
    resume_mode: str = "auto"
    """auto: newest complete checkpoint in default_local_dir; disable: start fresh; or a checkpoint path."""
    max_ckpt_to_keep: int | None = None
    """Keep only this many newest checkpoints (None: all)."""
    seed: int = 0
    """Seed of initialisation and sampling (each rank's engine adds its rank)."""
    timeout_s: float = 600.0
    """Collective timeout: a dead rank turns into an error on the others after this long."""


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO with colocated vLLM rollout and FSDP2 (see the module docstring)."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: rollout.RolloutConfig = field(default_factory=rollout.RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    custom_reward_function: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def verl_layout(d: dict) -> dict:
    """Maps verl's `actor_rollout_ref.{model,actor,rollout,ref}` YAML sections onto ours."""
    return config.move_keys(
        d,
        {
            "actor_rollout_ref.model": "model",
            "actor_rollout_ref.actor": "actor",
            "actor_rollout_ref.rollout": "rollout",
            "actor_rollout_ref.ref": None,  # the reference is the initial policy; nothing to configure
        },
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


# ------------------------------------------------------------------------------------------ batches


@dataclass
class Sample:
    """One response and everything the update needs about it."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # vLLM's, at temperature 1
    finish_reason: str
    group: int  # index of its prompt in this rank's share
    score: float = 0.0
    advantage: float = 0.0
    old_logprobs: torch.Tensor | None = None  # [L], the trainer's at the sampling temperature
    ref_logprobs: torch.Tensor | None = None  # [L]


def micro_batch_groups(samples: list[Sample], idx: list[int], actor: ActorConfig) -> list[list[int]]:
    """Splits samples[idx] into micro-batches; every rank gets the same number of them."""
    lengths = [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in idx]
    kw = (
        dict(max_token_len=actor.ppo_max_token_len_per_gpu)
        if actor.use_dynamic_bsz
        else dict(micro_batch_size=actor.ppo_micro_batch_size_per_gpu)
    )
    n = int(fsdp.all_reduce(len(data.micro_batches(lengths, **kw)), "max"))
    return [[idx[j] for j in g] for g in data.micro_batches(lengths, **kw, min_num=n)]


def collate(samples: list[Sample], idx: list[int], packed: bool, pad_id: int, device: torch.device) -> dict:
    """Model inputs for samples[idx] (prompt + response, loss mask on the response); [[pad]] when empty."""
    if not idx:
        seqs, masks = [[pad_id]], [[0]]
    else:
        seqs = [samples[i].prompt_ids + samples[i].response_ids for i in idx]
        masks = [[0] * len(samples[i].prompt_ids) + [1] * len(samples[i].response_ids) for i in idx]
    b = data.pack_batch(seqs, masks) if packed else data.pad_batch(seqs, masks, pad_id)
    return {k: v.to(device) for k, v in b.items()}


def response_matrix(values: torch.Tensor, label_mask: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per-token values at the response positions of a micro-batch, as [S, R] (R = longest response).

    values, label_mask: [B, T] from the model (either layout); their masked entries, in row-major order, are
    the S responses' tokens one after another, which is how collate() laid them out.
    """
    flat = values[label_mask.bool()]  # [sum(lengths)]
    S, R = len(lengths), max(lengths, default=1)
    lens = torch.tensor(lengths, device=values.device)
    rows = torch.repeat_interleave(torch.arange(S, device=values.device), lens)
    cols = torch.arange(flat.numel(), device=values.device) - torch.repeat_interleave(
        lens.cumsum(0) - lens, lens
    )
    out = torch.zeros(S, R, dtype=values.dtype, device=values.device)  # [S, R]
    out[rows, cols] = flat
    return out


def padded(rows: list[torch.Tensor | list[float] | float], R: int, device: torch.device) -> torch.Tensor:
    """Right-pads per-sample 1-D values (or broadcasts scalars) into [S, R]."""
    out = torch.zeros(len(rows), R, device=device)
    for i, r in enumerate(rows):
        r = torch.as_tensor(r, dtype=torch.float32, device=device)
        out[i, : (r.numel() if r.dim() else R)] = r
    return out


# ------------------------------------------------------------------------------------------- phases


def score_samples(
    pool: reward.RewardPool, samples: list[Sample], prompts: list[dict], tokenizer
) -> dict[str, float]:
    """Decodes each response, scores it, stores sample.score; returns the pool's reward/errors* metrics."""
    items = []
    for s in samples:
        ex = prompts[s.group]
        items.append(
            dict(
                data_source=ex["data_source"],
                prompt=ex["raw_prompt"],
                response=tokenizer.decode(s.response_ids, skip_special_tokens=True),
                ground_truth=ex["ground_truth"],
                extra_info=ex["extra_info"],
            )
        )
    scores, metrics = pool.score(items)
    for s, r in zip(samples, scores, strict=True):
        s.score = float(r)
    return metrics


def generate(
    engine: rollout.Engine, prompts: list[dict], sampling: rollout.SamplingConfig, max_tokens: int
) -> list[Sample]:
    """Generates sampling.n responses per prompt on this rank's engine."""
    out = engine.generate([p["prompt_ids"] for p in prompts], sampling, max_tokens)
    samples = []
    for o in out:
        ids = o.response_ids or [0]  # an empty response cannot be scored by logprob; vLLM never returns one
        samples.append(
            Sample(prompts[o.prompt_index]["prompt_ids"], ids, o.logprobs, o.finish_reason, o.prompt_index)
        )
    return samples


def compute_logprobs(
    model: torch.nn.Module,
    samples: list[Sample],
    cfg: GRPOConfig,
    pad_id: int,
    device: torch.device,
    ref: bool,
) -> dict[str, float]:
    """Fills old_logprobs (and the vLLM comparison, entropy) or, with ref=True, ref_logprobs. No grad."""
    T = cfg.rollout.temperature
    diffs, ent_sum, n_tok = [], 0.0, 0
    with torch.no_grad():
        for g in micro_batch_groups(samples, list(range(len(samples))), cfg.actor):
            b = collate(samples, g, cfg.model.use_remove_padding, pad_id, device)
            labels, label_mask = data.shift_labels(b)
            lp, ent, raw = losses.forward_logprobs(model, b, labels, temperature=T, with_entropy=not ref)
            lens = [len(samples[i].response_ids) for i in g]
            lp_rows = response_matrix(lp, label_mask, lens)  # [S, R]
            raw_rows = response_matrix(raw, label_mask, lens)
            for j, i in enumerate(g):
                L = lens[j]
                if ref:
                    samples[i].ref_logprobs = lp_rows[j, :L].cpu()
                    continue
                samples[i].old_logprobs = lp_rows[j, :L].cpu()
                vllm_lp = torch.tensor(samples[i].rollout_logprobs[:L], dtype=torch.float32)
                if vllm_lp.numel() == L:
                    diffs.append((raw_rows[j, :L].cpu() - vllm_lp).abs())
            if ent is not None:
                ent_sum += float((ent * label_mask).sum())
                n_tok += int(label_mask.sum())
    if ref:
        return {}
    d = torch.cat(diffs) if diffs else torch.zeros(1)
    tokens = fsdp.all_reduce(d.numel())
    return {
        "rollout/logprob_diff_mean": fsdp.all_reduce(float(d.sum())) / max(tokens, 1),
        "rollout/logprob_diff_max": fsdp.all_reduce(float(d.max()), "max"),
        "actor/entropy": fsdp.all_reduce(ent_sum) / max(fsdp.all_reduce(n_tok), 1),
    }


def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: list[Sample],
    n_prompts: int,
    cfg: GRPOConfig,
    pad_id: int,
    device: torch.device,
) -> dict[str, float]:
    """ppo_epochs passes of PPO-clip over mini-batches of this rank's samples; returns mean metrics."""
    actor, world = cfg.actor, dist.get_world_size()
    per_rank = cfg.actor.ppo_mini_batch_size // world  # prompts per mini-batch on this rank
    if per_rank < 1 or n_prompts % per_rank:
        raise ValueError(
            f"actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} must split into {world} ranks and divide "
            f"data.train_batch_size / world = {n_prompts}"
        )
    sums: dict[str, float] = {}
    grad_norms, n_updates = [], 0
    for _ in range(actor.ppo_epochs):
        for start in range(0, n_prompts, per_rank):
            idx = [i for i, s in enumerate(samples) if start <= s.group < start + per_rank]
            tokens = fsdp.all_reduce(sum(len(samples[i].response_ids) for i in idx))
            seqs = fsdp.all_reduce(len(idx))
            norm = dict(global_tokens=tokens, global_seqs=seqs, norm_length=cfg.data.max_response_length)
            groups = micro_batch_groups(samples, idx, actor)
            for k, g in enumerate(groups):
                model.set_requires_gradient_sync(k == len(groups) - 1)
                b = collate(samples, g, cfg.model.use_remove_padding, pad_id, device)
                labels, label_mask = data.shift_labels(b)
                lp, ent, _ = losses.forward_logprobs(
                    model, b, labels, cfg.rollout.temperature, with_entropy=actor.entropy_coeff != 0
                )
                if not g:  # keeps this rank's collectives in step with the others; contributes 0
                    (lp.sum() * 0).backward()
                    continue
                lens = [len(samples[i].response_ids) for i in g]
                R = max(lens)
                lp = response_matrix(lp, label_mask, lens)  # [S, R]
                mask = padded([[1.0] * L for L in lens], R, device)  # [S, R]
                old = padded([samples[i].old_logprobs for i in g], R, device)
                adv = padded([samples[i].advantage for i in g], R, device) * mask
                pg_loss, m = losses.policy_loss(
                    lp, old, adv, mask, actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c,
                    actor.loss_agg_mode, **norm,
                )  # fmt: skip
                loss = pg_loss
                share = mask.sum().item() / tokens  # this micro-batch's weight in token-mean metrics
                acc = {"actor/pg_loss": pg_loss.item()}
                acc |= {f"actor/{k}": v.item() * share for k, v in m.items()}
                if actor.use_kl_loss:
                    ref = padded([samples[i].ref_logprobs for i in g], R, device)
                    kl = losses.agg_loss(
                        losses.kl_penalty(lp, ref, actor.kl_loss_type), mask, actor.loss_agg_mode, **norm
                    )
                    loss = loss + actor.kl_loss_coef * kl
                    acc["actor/kl_loss"] = kl.item()
                if actor.entropy_coeff != 0:
                    ent_loss = losses.agg_loss(
                        response_matrix(ent, label_mask, lens), mask, actor.loss_agg_mode, **norm
                    )
                    loss = loss - actor.entropy_coeff * ent_loss
                # FSDP averages gradients over ranks; each rank's loss is its share of the global mean.
                (loss * world).backward()
                for k, v in acc.items():
                    sums[k] = sums.get(k, 0.0) + v
            grad_norm = fsdp.grad_norm_and_clip(model, actor.grad_clip)
            if torch.isfinite(torch.tensor(grad_norm)):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            grad_norms.append(grad_norm)
            n_updates += 1
    out = {k: fsdp.all_reduce(v) / n_updates for k, v in sums.items()}
    out["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
    return out


def push_weights(engine: rollout.Engine, model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Streams the trainer's full parameters into this rank's engine, one at a time (it wakes itself)."""
    engine.push_weights(fsdp.iter_full_params(model, dtype))


def validate(
    engine: rollout.Engine, val: data.RLDataset, pool: reward.RewardPool, cfg: GRPOConfig, tokenizer
) -> dict[str, float]:
    """Greedy (rollout.val_kwargs) responses to every validation prompt; mean reward over all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [val[i] for i in range(len(val))][rank::world]
    samples = generate(engine, mine, cfg.rollout.val_kwargs, cfg.data.max_response_length) if mine else []
    score_samples(pool, samples, mine, tokenizer)
    for s in samples[:3]:  # a few generations on the console, so a person can see what is being scored
        text = tokenizer.decode(s.response_ids, skip_special_tokens=True).replace("\n", " | ")
        fsdp.print0(f"  val sample: {mine[s.group]['raw_prompt'][-40:]!r} -> {text!r} (reward {s.score:g})")
    n = fsdp.all_reduce(len(samples))
    return {
        "val/reward/mean": fsdp.all_reduce(sum(s.score for s in samples)) / max(n, 1),
        "val/response_length/mean": fsdp.all_reduce(sum(len(s.response_ids) for s in samples)) / max(n, 1),
    }


def compute_advantages(samples: list[Sample], cfg: AlgorithmConfig) -> None:
    """Sets sample.advantage from the scores, per prompt group (whitened over all ranks for REINFORCE++)."""
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
        s.advantage = a


def rollout_metrics(samples: list[Sample], n: int, max_len: int) -> dict[str, float]:
    """reward/*, response_length/*, rollout/zero_std_frac over all ranks."""
    k = fsdp.all_reduce(len(samples))
    scores = torch.tensor([s.score for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    mean = fsdp.all_reduce(scores.sum().item()) / k
    var = fsdp.all_reduce(((scores - mean) ** 2).sum().item()) / max(k - 1, 1)
    grouped = scores.view(-1, n)  # [prompts, n]: samples come grouped per prompt
    zero_std = float((grouped.max(1).values == grouped.min(1).values).sum())
    return {
        "reward/mean": mean,
        "reward/std": var**0.5,
        "response_length/mean": fsdp.all_reduce(lengths.sum().item()) / k,
        "response_length/max": fsdp.all_reduce(lengths.max().item(), "max"),
        "response_length/clip_ratio": fsdp.all_reduce(sum(s.finish_reason == "length" for s in samples)) / k,
        "rollout/zero_std_frac": fsdp.all_reduce(zero_std) / (k / n),
    }


def main(cfg: GRPOConfig) -> dict[str, float]:
    """Trains; returns the final metrics (val/reward/mean before and after, the last step's metrics)."""
    from transformers import AutoTokenizer

    d = fsdp.init_distributed(cfg.trainer.timeout_s)
    fsdp.seed_everything(cfg.trainer.seed)
    run_dir = Path(cfg.trainer.default_local_dir).expanduser()
    model_path = os.path.expanduser(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ds_kwargs = dict(
        tokenizer=tokenizer,
        prompt_key=cfg.data.prompt_key,
        max_prompt_length=cfg.data.max_prompt_length,
        apply_chat_template=cfg.data.apply_chat_template,
        filter_overlong_prompts=cfg.data.filter_overlong_prompts,
    )
    train = data.RLDataset(cfg.data.train_files, **ds_kwargs)
    val = data.RLDataset(cfg.data.val_files, **ds_kwargs) if cfg.data.val_files else None
    if cfg.data.train_batch_size % d.world_size:
        raise ValueError(
            f"data.train_batch_size={cfg.data.train_batch_size} must divide by {d.world_size} ranks"
        )

    def load() -> torch.nn.Module:
        m = fsdp.load_model(
            model_path,
            trust_remote_code=cfg.model.trust_remote_code,
            attn_implementation=cfg.model.attn_implementation,
            gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
        )
        return m

    model = load()
    hf_files = dict(config=model.config, generation_config=model.generation_config, tokenizer=tokenizer)
    model = fsdp.shard_model(model, d.device, cfg.model.fsdp_config)
    ref_model = None
    if cfg.actor.use_kl_loss and not cfg.trainer.val_only:
        ref_model = fsdp.shard_model(load(), d.device, cfg.model.fsdp_config)
        ref_model.eval().requires_grad_(False)

    sampler = data.EpochSampler(len(train), cfg.data.train_batch_size, seed=cfg.data.seed)
    total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * sampler.steps_per_epoch
    optimizer, scheduler = optim.build(model.parameters(), cfg.actor.optim, total_steps)

    push_dtype = torch.float32 if d.device.type == "cpu" else getattr(torch, cfg.rollout.dtype)
    engine = rollout.make_engine(
        cfg.rollout,
        model_path,
        max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
        rank=d.rank,
        world_size=d.world_size,
    )
    pool = reward.RewardPool(
        (cfg.custom_reward_function.path, cfg.custom_reward_function.name)
        if cfg.custom_reward_function.path
        else None,
        num_workers=cfg.custom_reward_function.num_workers,
        timeout_s=cfg.custom_reward_function.timeout_s,
    )

    step, results = 0, {}
    resume = None if cfg.trainer.val_only else fsdp.resolve_resume(run_dir, cfg.trainer.resume_mode)
    if resume is not None:
        state = fsdp.load_checkpoint(resume, model, optimizer)
        sampler.load_state_dict(state["sampler"])
        scheduler.load_state_dict(state["scheduler"])
        step, results = state["global_step"], state.get("results", {})
        fsdp.print0(f"resumed from {resume} at step {step}")
    push_weights(engine, model, push_dtype)  # the engine runs exactly the trainer's weights from step 0 on

    logger = log.Logger(
        run_dir, cfg.trainer.logger, rank=d.rank, total_steps=total_steps,
        project=cfg.trainer.project_name, experiment=cfg.trainer.experiment_name, config=config.to_dict(cfg),
    )  # fmt: skip
    if d.is_main:
        log.write_run_files(run_dir, config.to_yaml(cfg))
    train_sampling = cfg.rollout.train_sampling
    try:
        if val is not None and (cfg.trainer.val_only or (cfg.trainer.val_before_train and step == 0)):
            metrics = validate(engine, val, pool, cfg, tokenizer)
            results["val/reward/mean_before"] = metrics["val/reward/mean"]
            logger.log(metrics, step=step)
            if cfg.trainer.val_only:
                return results | metrics
        it = iter(sampler)
        while step < total_steps:
            timer = log.Timer(sync=torch.cuda.synchronize if torch.cuda.is_available() else None)
            with timer("step"):
                try:
                    indices = next(it)
                except StopIteration:
                    it = iter(sampler)
                    indices = next(it)
                prompts = [train[i] for i in data.split_for_rank(indices, d.rank, d.world_size)]
                with timer("gen"):
                    samples = generate(engine, prompts, train_sampling, cfg.data.max_response_length)
                    engine.sleep()
                with timer("reward"):
                    metrics = score_samples(pool, samples, prompts, tokenizer)
                compute_advantages(samples, cfg.algorithm)
                with timer("old_logprob"):
                    metrics |= compute_logprobs(model, samples, cfg, pad_id, d.device, ref=False)
                if ref_model is not None:
                    with timer("ref"):
                        compute_logprobs(ref_model, samples, cfg, pad_id, d.device, ref=True)
                if metrics["rollout/logprob_diff_mean"] > cfg.rollout.logprob_diff_tol:
                    raise RuntimeError(
                        f"step {step}: vLLM's logprobs differ from the trainer's by "
                        f"{metrics['rollout/logprob_diff_mean']:.4f} on average (> rollout.logprob_diff_tol="
                        f"{cfg.rollout.logprob_diff_tol}): the engine is not running the trained weights"
                    )
                with timer("update"):
                    metrics |= update_policy(model, optimizer, samples, len(prompts), cfg, pad_id, d.device)
                metrics["actor/lr"] = scheduler.get_last_lr()[0]
                scheduler.step()
                step += 1
                with timer("sync"):
                    push_weights(engine, model, push_dtype)
                last = step == total_steps
                if val is not None and (
                    last or (cfg.trainer.test_freq > 0 and step % cfg.trainer.test_freq == 0)
                ):
                    with timer("val"):
                        metrics |= validate(engine, val, pool, cfg, tokenizer)
            metrics |= rollout_metrics(samples, cfg.rollout.n, cfg.data.max_response_length)
            metrics |= timer.pop()
            n_tokens = fsdp.all_reduce(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples))
            metrics["perf/throughput"] = n_tokens / metrics["timing_s/step"] / d.world_size
            if torch.cuda.is_available():
                metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
            logger.log(metrics, step=step)
            results |= {k: v for k, v in metrics.items() if k.startswith(("val/", "reward/mean"))}
            if last or (cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0):
                state = dict(
                    sampler=sampler.state_dict(), scheduler=scheduler.state_dict(), results=results,
                    config=config.to_dict(cfg), run_info=log.run_info(),
                )  # fmt: skip
                fsdp.save_checkpoint(
                    run_dir, step, model, optimizer, state, hf_files, keep_last=cfg.trainer.max_ckpt_to_keep
                )
    finally:
        logger.close()
        pool.close()
        engine.shutdown()
    results["global_step"] = step
    return results


if __name__ == "__main__":
    cfg = config.parse(GRPOConfig, yaml_hook=verl_layout)
    try:
        metrics = main(cfg)
        fsdp.print0({k: round(v, 4) for k, v in metrics.items()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
