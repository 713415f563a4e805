"""The policy side of an RL step, shared by grpo.py and ppo.py: its settings, the samples it trains on, the
logprob passes and the PPO-clip update (verl's dp_actor), and the weight push into the rollout engine.

    policy = actor.load(cfg.model, device)                          # FSDP2-sharded Hugging Face causal LM
    actor.compute_logprobs(policy, samples, ...)                    # old (and vLLM check) or reference logprobs
    actor.update_policy(policy, optimizer, scheduler, guard, samples, ...)  # epochs x mini- x micro-batches
    actor.push_weights(engine, policy, dtype)                       # one full parameter at a time

A `Sample` is one response with everything the update needs. Its `advantages` is a float (GRPO & co.: one
advantage for every token of the response) or a [L] tensor (PPO's GAE); `padded` turns either into [S, R].
The batching helpers (`micro_batch_groups`, `collate`, `response_matrix`, `padded`) also serve ppo.py's critic.

Micro-batches: every rank runs the same number of forward/backward passes (FSDP's collectives pair up), so a
rank with fewer samples runs an empty pass (one pad token, no loss). Losses are normalised by the token /
sequence counts of the whole mini-batch on all ranks (losses.agg_loss), so the split into micro-batches and
ranks does not change the update.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch
import torch.distributed as dist

import data
import fsdp
import lora
import losses
import optim

T = TypeVar("T")


@dataclass(frozen=True)
class ModelConfig:
    """The policy (and, frozen, the reference): verl's actor_rollout_ref.model."""

    path: str = "runs/sft_model"
    """Hugging Face model id (e.g. Qwen/Qwen2.5-0.5B-Instruct) or local folder (a shard_merge.py output)."""
    trust_remote_code: bool = False
    """Allow the model folder's own Python code to run (off: a downloaded model must not run code)."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation used by the trainer."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    use_remove_padding: bool = True
    """Pack sequences into one row per micro-batch (no padding tokens computed)."""
    lora_rank: int = 0
    """LoRA rank; 0 trains all weights. With LoRA the reference policy is the base model (adapters off) and
    the engine receives the merged weights."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""
    target_modules: str | list[str] = "all-linear"
    """Modules LoRA wraps: `all-linear` or a list of names such as [q_proj, v_proj]."""
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
    old_logprobs_from_update: bool = True
    """When the update is one optimizer step over the whole batch (ppo_epochs 1, ppo_mini_batch_size = the
    step's prompts) the weights have not moved before its forward, so the old logprobs are that forward's, detached
    (ratio 1; TRL does the same), and that forward also checks the weight push and measures the entropy: no
    separate old-logprob pass runs. Off: always the full pass. ppo.py keeps the full pass when the KL is in the
    reward (it needs them before the advantages) and in the critic's warm-up steps (no actor update)."""
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
    """KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3); a '+' suffix takes k2's gradient."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight (subtracted from the loss)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this."""
    optim: optim.OptimConfig = field(default_factory=lambda: optim.OptimConfig(lr=1e-6))
    """Optimizer and schedule."""


def load(cfg: ModelConfig, device: torch.device, value_head: bool = False) -> tuple[torch.nn.Module, dict]:
    """The model at cfg.path (with a scalar value head for ppo.py's critic), FSDP2-sharded on `device`, and the
    files a checkpoint needs to describe it (checkpoint.save_checkpoint's hf_files)."""
    model = fsdp.load_model(
        cfg.path,
        trust_remote_code=cfg.trust_remote_code,
        attn_implementation=cfg.attn_implementation,
        gradient_checkpointing=cfg.enable_gradient_checkpointing,
        value_head=value_head,
    )
    hf_files = dict(config=model.config, generation_config=getattr(model, "generation_config", None))
    if cfg.lora_rank > 0 and not value_head:
        wrapped = lora.apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.target_modules)
        hf_files["lora"] = dict(
            rank=cfg.lora_rank, alpha=cfg.lora_alpha, base_model_name_or_path=cfg.path,
            target_modules=sorted({w.rsplit(".", 1)[-1] for w in wrapped}),
        )  # fmt: skip
    return fsdp.shard_model(model, device, cfg.fsdp_config), hf_files


def load_reference(cfg: ModelConfig, policy: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The frozen reference policy: with LoRA the policy itself (compute_logprobs(ref=True) turns its adapters
    off, so no second copy), else a second sharded copy of the starting weights."""
    if cfg.lora_rank > 0:
        return policy
    return load(cfg, device)[0].eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------ samples


@dataclass
class Sample:
    """One response and everything the update needs about it."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float] | None  # the engine's, temperature 1; None: not a checked prompt's
    finish_reason: str
    group: int  # index of its prompt in this rank's share of the step's prompts
    score: float = 0.0
    advantages: float | torch.Tensor = 0.0  # one value for every token, or [L]
    old_logprobs: torch.Tensor | None = None  # [L], the trainer's at the sampling temperature
    ref_logprobs: torch.Tensor | None = None  # [L]
    values: torch.Tensor | None = None  # [L], the critic's (ppo.py)
    returns: torch.Tensor | None = None  # [L], the critic's targets (ppo.py)


def micro_batch_groups(
    samples: list[Sample], idx: list[int], micro_batch_size: int, max_token_len: int | None
) -> list[list[int]]:
    """Splits samples[idx] into micro-batches (by count, or under a token budget when max_token_len is set);
    every rank gets the same number of them (an all-reduce)."""
    lengths = [len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in idx]
    kw = dict(max_token_len=max_token_len) if max_token_len else dict(micro_batch_size=micro_batch_size)
    n = int(fsdp.all_reduce(len(data.micro_batches(lengths, **kw)), "max"))
    return [[idx[j] for j in g] for g in data.micro_batches(lengths, **kw, min_num=n)]


def actor_micro_batches(samples: list[Sample], idx: list[int], cfg: ActorConfig) -> list[list[int]]:
    """micro_batch_groups with the actor's sizes."""
    budget = cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
    return micro_batch_groups(samples, idx, cfg.ppo_micro_batch_size_per_gpu, budget)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. On CUDA through pinned memory without blocking: a copy from pageable memory
    synchronises the stream, and a micro-batch loop that waits for the GPU to drain its queue leaves it idle
    while the host prepares the next kernels."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def collate(samples: list[Sample], idx: list[int], packed: bool, pad_id: int, device: torch.device) -> dict:
    """Model inputs for samples[idx] (prompt + response, loss mask on the response); [[pad]] when empty.

    Also `labels` and `label_mask` [B, T] (data.shift_labels) and `response_index` [M], the flat row-major
    positions of the labelled tokens (response_matrix). All built on the host and copied without a device sync;
    `max_seqlen` stays on the host, where data.model_inputs reads it.
    """
    if not idx:
        seqs, masks = [[pad_id]], [[0]]
    else:
        seqs = [samples[i].prompt_ids + samples[i].response_ids for i in idx]
        masks = [[0] * len(samples[i].prompt_ids) + [1] * len(samples[i].response_ids) for i in idx]
    dense = None if device.type == "cuda" else torch.bool  # GPU: no N x N mask (varlen attention)
    b = data.pack_batch(seqs, masks, mask_dtype=dense) if packed else data.pad_batch(seqs, masks, pad_id)
    b["labels"], b["label_mask"] = data.shift_labels(b)
    b["response_index"] = b["label_mask"].reshape(-1).nonzero().reshape(-1)
    return {k: v if k == "max_seqlen" else to_device(v, device) for k, v in b.items()}


def response_matrix(values: torch.Tensor, index: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per-token values at the response positions of a micro-batch, as [S, R] (R = longest response).

    values: [B, T] from the model (either layout); index: collate's `response_index`, the flat positions of
    the S responses' tokens one after another, which is how collate() laid them out. No device sync.
    """
    flat = values.reshape(-1)[index]  # [sum(lengths)]
    S, R = len(lengths), max(lengths, default=1)
    lens = torch.tensor(lengths)
    rows = torch.repeat_interleave(torch.arange(S), lens)
    cols = torch.arange(int(lens.sum())) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    out = values.new_zeros(S, R)  # [S, R]
    out[to_device(rows, values.device), to_device(cols, values.device)] = flat
    return out


def padded(rows: list[torch.Tensor | list[float] | float], R: int, device: torch.device) -> torch.Tensor:
    """Right-pads per-sample 1-D values (or broadcasts scalars) into [S, R] float32 on `device` (built on the
    host: the samples keep theirs there)."""
    out = torch.zeros(len(rows), R)
    for i, r in enumerate(rows):
        r = torch.as_tensor(r, dtype=torch.float32)
        out[i, : (r.numel() if r.dim() else R)] = r
    return to_device(out, device)


def mask_of(lengths: list[int], device: torch.device, R: int | None = None) -> torch.Tensor:
    """[S, R] float mask of S responses of these lengths (R: the longest, unless given)."""
    R = max(lengths, default=1) if R is None else R
    return to_device((torch.arange(R)[None] < torch.tensor(lengths)[:, None]).float(), device)


# ------------------------------------------------------------------------------------------- passes


def in_train_mode(update: Callable[..., T]) -> Callable[..., T]:
    """Decorates an update whose first argument is the model: train mode while it runs, eval mode after (also
    on an exception), as verl's dp_actor. from_pretrained returns a model in eval mode, and Hugging Face decoder
    layers recompute activations (model.enable_gradient_checkpointing) only when `self.training`; the no-grad
    passes (compute_logprobs, ppo.compute_values) run in eval mode."""

    @functools.wraps(update)
    def wrapper(model: torch.nn.Module, *args, **kwargs) -> T:
        model.train()
        try:
            return update(model, *args, **kwargs)
        finally:
            model.eval()

    return wrapper


@torch.no_grad()
def compute_logprobs(
    model: torch.nn.Module,
    samples: list[Sample],
    cfg: ActorConfig,
    temperature: float,
    packed: bool,
    pad_id: int,
    device: torch.device,
    ref: bool = False,
) -> dict[str, float]:
    """Fills sample.old_logprobs (and compares the engine's logprobs, measures entropy) or, with ref=True,
    sample.ref_logprobs (with any LoRA adapters of `model` off: the base model is the reference). No grad.

    Returns (not ref): rollout/logprob_diff_mean, rollout/logprob_diff_max (|trainer - engine| at temperature
    1, over every sampled token of the samples that carry the engine's logprobs, all ranks), actor/entropy
    (token mean at the sampling temperature).
    Raises RuntimeError (on every rank) when no sample of any rank carries the engine's logprobs: the weight
    push would go unchecked.
    """
    model.eval()
    diffs, ent_sum, n_tok = [], 0.0, 0
    for g in actor_micro_batches(samples, list(range(len(samples))), cfg):
        b = collate(samples, g, packed, pad_id, device)
        label_mask = b["label_mask"]
        with lora.disabled(model) if ref else contextlib.nullcontext():
            lp, ent, raw = losses.forward_logprobs(model, b, b["labels"], temperature, with_entropy=not ref)
        lens = [len(samples[i].response_ids) for i in g]
        lp_rows = response_matrix(lp, b["response_index"], lens).cpu()  # [S, R]
        raw_rows = response_matrix(raw, b["response_index"], lens).cpu()
        for j, i in enumerate(g):
            L = lens[j]
            if ref:
                samples[i].ref_logprobs = lp_rows[j, :L]
                continue
            samples[i].old_logprobs = lp_rows[j, :L]
            if checkable(samples[i]):
                engine_lp = torch.tensor(samples[i].rollout_logprobs, dtype=torch.float32)
                diffs.append((raw_rows[j, :L] - engine_lp).abs())
        if ent is not None:
            ent_sum += float((ent * label_mask).sum())
            n_tok += int(label_mask.sum())
    if ref:
        return {}
    d = torch.cat(diffs) if diffs else torch.zeros(0)
    return push_check_metrics(d.sum(), d.max() if d.numel() else 0.0, d.numel()) | {
        "actor/entropy": fsdp.all_reduce(ent_sum) / max(fsdp.all_reduce(n_tok), 1)
    }


def checkable(sample: Sample) -> bool:
    """Whether the sample carries the engine's logprob of every response token: it is one of the push check's
    (rollout.logprob_check_prompts), and not rl.generate's stand-in [0] for an empty response."""
    return sample.rollout_logprobs is not None and len(sample.rollout_logprobs) == len(sample.response_ids)


def push_check_metrics(diff_sum: torch.Tensor | float, diff_max: torch.Tensor | float, tokens: int) -> dict:
    """rollout/logprob_diff_mean and _max over all ranks from this rank's sum and max of |trainer - engine| over
    its `tokens` checked tokens (rl.check_push compares the mean to rollout.logprob_diff_tol).
    Raises RuntimeError (on every rank) when no rank has a checked token: the weight push would go unchecked."""
    total = fsdp.all_reduce(tokens)
    if total == 0:
        raise RuntimeError(
            "no sample carries the engine's logprobs, so the weight push cannot be checked "
            "(rollout.logprob_check_prompts selects the prompts whose samples carry them)"
        )
    return {
        "rollout/logprob_diff_mean": fsdp.all_reduce(float(diff_sum)) / total,
        "rollout/logprob_diff_max": fsdp.all_reduce(float(diff_max), "max"),  # a rank without any: 0
    }


def mini_batches(samples: list[Sample], n_prompts: int, mini_batch_size: int) -> list[list[int]]:
    """Indices of samples per mini-batch: `mini_batch_size` prompts over all ranks, this rank's share of them.

    Raises ValueError when the mini-batch does not split into the ranks or divide this rank's prompts.
    """
    world = dist.get_world_size()
    per_rank = mini_batch_size // world  # prompts per mini-batch on this rank
    if per_rank < 1 or mini_batch_size % world or n_prompts % per_rank:
        raise ValueError(
            f"ppo_mini_batch_size={mini_batch_size} must split into {world} ranks and divide "
            f"data.train_batch_size / world = {n_prompts}"
        )
    return [
        [i for i, s in enumerate(samples) if start <= s.group < start + per_rank]
        for start in range(0, n_prompts, per_rank)
    ]


@in_train_mode
def update_policy(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    guard: optim.SkipGuard,
    samples: list[Sample],
    n_prompts: int,
    cfg: ActorConfig,
    temperature: float,
    packed: bool,
    pad_id: int,
    device: torch.device,
    norm_length: int,
) -> dict[str, float]:
    """`cfg.ppo_epochs` passes of PPO-clip (+ KL loss, - entropy bonus) over mini-batches of this rank's samples,
    at the scheduler's learning rate, which then advances one step.

    Args:
        n_prompts: prompts of this rank's share (sample.group < n_prompts).
        norm_length: seq-mean-token-sum-norm's constant divisor (the max response length).
    Returns:
        actor/pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl, (kl_loss), grad_norm, skipped_steps: means
        over the optimizer steps (token means for the clip fractions and ppo_kl); actor/lr, the rate used.
        When the samples carry no old logprobs (rl.make_experience left them to this forward, which then also
        does compute_logprobs' other work): rollout/logprob_diff_mean and _max, the weight-push check over the
        samples that carry the engine's logprobs (push_check_metrics; the caller runs rl.check_push), and
        actor/entropy over every response token.
    """
    world = dist.get_world_size()
    sums: dict[str, torch.Tensor] = {}  # metric sums, on the device until the update ends
    grad_norms = []
    steps = mini_batches(samples, n_prompts, cfg.ppo_mini_batch_size)
    from_update = any(s.old_logprobs is None for s in samples)  # rl.make_experience left them to this forward
    if from_update and (cfg.ppo_epochs != 1 or len(steps) != 1):
        raise RuntimeError(
            f"actor: samples without old logprobs, but the update takes {cfg.ppo_epochs} epoch(s) of {len(steps)} "
            "mini-batch(es): after the first optimizer step the update's own logprobs are no longer the old ones"
        )
    check = [torch.zeros((), device=device) for _ in range(4)]  # |diff| sum, max; entropy sum, count
    checked_tokens = 0
    for _ in range(cfg.ppo_epochs):
        for idx in steps:
            tokens = fsdp.all_reduce(sum(len(samples[i].response_ids) for i in idx))
            norm = dict(global_tokens=tokens, global_seqs=fsdp.all_reduce(len(idx)), norm_length=norm_length)
            groups = actor_micro_batches(samples, idx, cfg)
            loss_sum = 0.0
            for k, g in enumerate(groups):
                model.set_requires_gradient_sync(k == len(groups) - 1)  # reduce-scatter once per mini-batch
                b = collate(samples, g, packed, pad_id, device)
                rows = [checkable(samples[i]) for i in g] if from_update else []  # the push check's
                lp, ent, raw = losses.forward_logprobs(
                    model, b, b["labels"], temperature, with_entropy=cfg.entropy_coeff != 0 or from_update,
                    with_raw=any(rows),
                )  # fmt: skip
                if not g:  # keeps this rank's collectives in step with the others; contributes 0
                    (lp.sum() * 0).backward()
                    continue
                lens = [len(samples[i].response_ids) for i in g]
                R = max(lens)
                lp = response_matrix(lp, b["response_index"], lens)  # [S, R]
                mask = mask_of(lens, device)  # [S, R]
                # compute_logprobs' push check and entropy ride on this forward: no pass of their own
                if from_update and any(rows):
                    on = [L if r else 0 for L, r in zip(lens, rows, strict=True)]  # checked tokens a row
                    engine = [samples[i].rollout_logprobs if on[j] else [] for j, i in enumerate(g)]
                    diff = response_matrix(raw, b["response_index"], lens) - padded(engine, R, device)
                    diff = diff.abs() * mask_of(on, device, R)
                    check[0] += diff.sum()
                    check[1] = torch.maximum(check[1], diff.max())
                    checked_tokens += sum(on)
                if from_update:
                    check[2] += (response_matrix(ent.detach(), b["response_index"], lens) * mask).sum()
                    check[3] += sum(lens)
                old = lp.detach() if from_update else padded([samples[i].old_logprobs for i in g], R, device)
                adv = padded([samples[i].advantages for i in g], R, device) * mask
                pg_loss, m = losses.policy_loss(
                    lp, old, adv, mask, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c,
                    cfg.loss_agg_mode, **norm,
                )  # fmt: skip
                loss = pg_loss
                # Metrics stay device tensors until the mini-batch ends: no sync per micro-batch.
                share = sum(lens) / tokens  # this micro-batch's weight in token-mean metrics
                acc = {"actor/pg_loss": pg_loss.detach()} | {f"actor/{k}": v * share for k, v in m.items()}
                if cfg.use_kl_loss:
                    ref = padded([samples[i].ref_logprobs for i in g], R, device)
                    kl = losses.agg_loss(
                        losses.kl_penalty(lp, ref, cfg.kl_loss_type), mask, cfg.loss_agg_mode, **norm
                    )
                    loss = loss + cfg.kl_loss_coef * kl
                    acc["actor/kl_loss"] = kl.detach()
                if cfg.entropy_coeff != 0:
                    entropy = losses.agg_loss(
                        response_matrix(ent, b["response_index"], lens), mask, cfg.loss_agg_mode, **norm
                    )
                    loss = loss - cfg.entropy_coeff * entropy
                # FSDP averages gradients over ranks; each rank's loss is its share of the global mean.
                (loss * world).backward()
                loss_sum = loss_sum + loss.detach()
                for k, v in acc.items():
                    sums[k] = sums.get(k, 0.0) + v
            grad_norm = fsdp.grad_norm_and_clip(model, cfg.grad_clip)
            # global numbers: all ranks agree
            if guard.take_step(fsdp.all_reduce(float(loss_sum)), grad_norm):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            grad_norms.append(grad_norm)
    out = {k: fsdp.all_reduce(float(v)) / len(grad_norms) for k, v in sums.items()}
    out["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["actor/skipped_steps"] = guard.skipped
    out["actor/lr"] = scheduler.get_last_lr()[0]
    scheduler.step()
    if from_update:
        out |= push_check_metrics(check[0], check[1], checked_tokens)
        out["actor/entropy"] = fsdp.all_reduce(float(check[2])) / max(fsdp.all_reduce(float(check[3])), 1.0)
    return out


def push_weights(engine, model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Streams the trainer's full parameters into this rank's engine (rollout.Engine), one at a time, LoRA
    modules merged; every rank calls it together (each parameter is all-gathered)."""
    params = fsdp.iter_full_params(model, dtype)
    scaling = next((m.scaling for m in model.modules() if isinstance(m, lora.LoRALinear)), None)
    engine.push_weights(params if scaling is None else lora.merged_params(params, scaling))
