"""sft.py: supervised fine-tuning of a Hugging Face causal LM, sharded with FSDP2.

Loss: mean negative log-likelihood of the response (assistant) tokens, normalised by the number of response
tokens in the whole global batch (all micro-batches, all ranks), so gradient accumulation and the number of
ranks do not change the update.

Launch (the defaults train the offline toy model that `python toy.py --out runs/toy` builds):
    python sft.py
    torchrun --nproc_per_node 8 sft.py --config configs/sft_verl_tutorial.yaml --model.partial_pretrain Qwen/Qwen2.5-0.5B-Instruct
    torchrun --nproc_per_node 8 sft.py data.prompt_key=extra_info data.response_key=extra_info \
        data.prompt_dict_keys=[question] +data.response_dict_keys=[answer] model.partial_pretrain=...  (verl's form)
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 sft.py --config ...
Then `python shard_merge.py --ckpt-dir RUN/global_step_N --out DIR` writes a Hugging Face folder.

Where it deviates from verl's fsdp_sft_trainer:
1. Each field has one home (these dataclasses); YAML files and `key=value` overrides may use verl's key names
   (verl_keys.py maps them; docs/VERL.md lists what is mapped and what is ignored).
2. `data.train_batch_size` is the global batch in sequences; `data.micro_batch_size_per_gpu` or, with
   `data.use_dynamic_bsz`, `data.max_token_len_per_gpu` splits each rank's share into micro-batches.
3. Padding-free packing (`model.use_remove_padding`): on CUDA torch's varlen flash kernel over the sequences'
   boundaries (attention.py, as the RL scripts), elsewhere a block-diagonal N x N mask; no flash-attn needed.
4. Ulysses sequence parallelism (`model.fsdp_config.ulysses_sequence_parallel_size`, sp.py, docs/SP.md): the SP
   ranks of a group share each micro-batch, so the data is split over world / SP ranks.

Faults (the README's Reliability section lists each with its test):
- A step whose loss or gradient norm is NaN/inf does not update the weights (optim.SkipGuard); the
  learning-rate schedule still advances. `trainer.max_consecutive_skips` in a row stop the run after a
  checkpoint.
- A CUDA out-of-memory error in a step stops the run with the memory numbers and the flags to lower;
  `trainer.debug` prints the step's memory plan at the start and each step's peak memory per phase.
- `resume_mode=auto` resumes from the newest complete checkpoint (checkpoint.checkpoint_problem) and drops the
  metrics.jsonl lines an interrupted run logged after it, so a crashed run continues exactly.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import torch

import checkpoint
import config
import data
import fsdp
import log
import optim
import perf
import sp


@dataclass(frozen=True)
class SFTDataConfig:
    """Training and validation data."""

    train_files: str | list[str] = "runs/toy/sft/train.parquet"
    """Parquet or jsonl file(s) with prompt/response columns or a chat `messages` column."""
    val_files: str | list[str] | None = "runs/toy/sft/val.parquet"
    """Validation file(s); None disables validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt text."""
    response_key: str = "response"
    """Column holding the response text (the tokens the loss is on)."""
    prompt_dict_keys: list[str] | None = None
    """Keys to follow inside prompt_key's column (verl's layout): prompt_key=extra_info with [question] reads
    row["extra_info"]["question"]."""
    response_dict_keys: list[str] | None = None
    """Keys to follow inside response_key's column, as prompt_dict_keys."""
    messages_key: str = "messages"
    """Column holding multi-turn chat messages; used when present instead of prompt/response (loss on assistant turns)."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (prompt as one user turn)."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the chat template, as verl's (`+data.apply_chat_template_kwargs.enable_thinking=false`)."""
    max_length: Annotated[int, config.AT_LEAST_ONE] = 1024
    """Longest sequence in tokens (prompt + response)."""
    truncation: Literal["left", "right", "error"] = "error"
    """What to do with a longer sequence: cut its start, cut its end, or stop with an error naming the row."""
    skip_bad_rows: bool = False
    """Skip (and count) rows with a missing key, empty or non-string response, instead of stopping."""
    train_batch_size: Annotated[int, config.AT_LEAST_ONE] = 256
    """Global batch: sequences per optimizer step, over all ranks."""
    micro_batch_size_per_gpu: Annotated[int, config.AT_LEAST_ONE] = 4
    """Sequences per forward/backward on one rank (gradient accumulation fills the rest)."""
    use_dynamic_bsz: bool = False
    """Micro-batches under a token budget (`max_token_len_per_gpu`) instead of a fixed number of sequences."""
    max_token_len_per_gpu: Annotated[int, config.AT_LEAST_ONE] = 16384
    """Token budget of one micro-batch when `use_dynamic_bsz` is on."""


@dataclass(frozen=True)
class SFTModelConfig:
    """The model being fine-tuned."""

    partial_pretrain: str = "runs/toy/model"
    """Hugging Face model id (e.g. Qwen/Qwen2.5-0.5B-Instruct) or local folder to start from."""
    trust_remote_code: bool = False
    """Allow the model folder's own Python code to run (off: a downloaded model must not run code)."""
    attn_implementation: str = "sdpa"
    """transformers attention implementation (sdpa, eager, flex_attention, flash_attention_2)."""
    enable_gradient_checkpointing: bool = True
    """Recompute activations in the backward pass to save memory: on by default, as in verl and TRL (a command
    sized for their memory fits here too). Off, every layer's activations stay: grpo.py's 0.5B update on the H200
    took 5.1 s instead of 7.7, in 50 GiB of device memory instead of 25 (bench/README.md)."""
    use_remove_padding: bool = True
    """Pack each micro-batch's sequences into one row (no padding tokens computed)."""
    lora_rank: Annotated[int, config.NON_NEGATIVE] = 0
    """LoRA rank; 0 trains all weights."""
    lora_alpha: Annotated[float, config.POSITIVE] = 16.0
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""
    target_modules: str | list[str] = "all-linear"
    """Modules LoRA wraps: `all-linear` or a list of names such as [q_proj, v_proj]."""
    exclude_modules: str | list[str] | None = None
    """Modules LoRA leaves out even where target_modules names them (verl's and PEFT's exclude_modules): a string
    is a regex the whole module name must match (re.fullmatch; verl's example `.*visual.*`), a list holds names
    or name suffixes. An exclusion that leaves no module to wrap is an error."""
    lora_adapter_path: str | None = None
    """A saved PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors, as PEFT and
    `shard_merge.py --adapter-only` write it) to start from instead of fresh adapters, as verl's key: LoRA is on
    even with lora_rank 0, and the folder's r, lora_alpha, target_modules, exclude_modules and lora_dropout
    replace this config's (each change said on stderr). Read with safetensors only; a tensor that lands on no
    LoRA parameter, a parameter left without one, or a shape mismatch is an error naming the tensor."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Settings put on the model's config before it is built (verl's model.override_config); a name the config
    lacks is set anyway and said on stderr."""
    fsdp_config: fsdp.FSDPConfig = field(default_factory=fsdp.FSDPConfig)
    """Sharding, mixed precision and offload."""

    @property
    def uses_lora(self) -> bool:
        """LoRA is on: a rank, or a saved adapter to start from (verl: either one)."""
        return self.lora_rank > 0 or self.lora_adapter_path is not None


@dataclass(frozen=True)
class SFTOptimConfig(optim.OptimConfig):
    """AdamW with warmup then cosine (verl's SFT defaults), and gradient clipping."""

    lr: Annotated[float, config.POSITIVE] = 1e-5
    """Peak learning rate."""
    betas: Annotated[tuple[float, float], config.UNIT] = (0.9, 0.95)
    """AdamW betas."""
    warmup_steps_ratio: Annotated[float, config.UNIT] = 0.1
    """Fraction of the total steps spent warming the learning rate up linearly from 0."""
    lr_scheduler: Literal["cosine", "constant"] = "cosine"
    """Schedule after warmup."""
    clip_grad: Annotated[float, config.POSITIVE] = 1.0
    """Clip the global gradient norm to this (the norm before clipping is logged as train/grad_norm)."""


@dataclass(frozen=True)
class SFTTrainerConfig(config.TrainerConfig):
    """config.TrainerConfig with SFT's run folder."""

    default_local_dir: str = "runs/sft"
    """Run folder: metrics.jsonl, config.yaml, report.md, global_step_N/ checkpoints."""
    experiment_name: str = "sft"
    """Run name for tensorboard/wandb."""
    save_freq: int | Literal["after_each_epoch"] = -1
    """Checkpoint every N steps, or after_each_epoch (verl's sft_trainer; -1: only at the end)."""
    test_freq: int | Literal["after_each_epoch"] = -1
    """Validate every N steps, or after_each_epoch (verl's sft_trainer; -1: only before and after training)."""


@dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning with FSDP2 (see the module docstring)."""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    optim: SFTOptimConfig = field(default_factory=SFTOptimConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)


def response_nll(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed NLL of the response tokens in one micro-batch (padded or packed layout) and their count."""
    labels, mask = data.shift_labels(batch)  # [B, T] next token and whether it is trained on
    logprobs, _, _ = sp.forward_logprobs(model, batch, labels)  # [B, T], chunked: no fp32 [B, T, V]
    return -(logprobs * mask).sum(), int(mask.sum())


def make_micro_batches(
    ds: data.SFTDataset,
    indices: list[int],
    cfg: SFTDataConfig,
    packed: bool,
    device: torch.device,
    sp_size: int = 1,
) -> list[dict[str, torch.Tensor]]:
    """This rank's share of a global batch, as collated micro-batches (all ranks get the same count); the
    `sp_size` ranks of a sequence-parallel group get the same share."""
    d = sp.data_parallel(sp_size)
    lengths = [len(ds[i]["input_ids"]) for i in indices]
    mine = data.split_for_rank(indices, d[0], d[1], lengths=lengths)
    mine_lengths = [len(ds[i]["input_ids"]) for i in mine]
    budget = cfg.max_token_len_per_gpu * sp_size  # per GPU: an SP group holds sp_size times it (as verl)
    if cfg.use_dynamic_bsz:
        groups = data.micro_batches(mine_lengths, max_token_len=budget)
    else:
        groups = data.micro_batches(mine_lengths, micro_batch_size=cfg.micro_batch_size_per_gpu)
    n = int(
        fsdp.all_reduce(len(groups), "max")
    )  # FSDP collectives need the same number of passes on every rank
    groups = data.micro_batches(
        mine_lengths,
        micro_batch_size=None if cfg.use_dynamic_bsz else cfg.micro_batch_size_per_gpu,
        max_token_len=budget if cfg.use_dynamic_bsz else None,
        min_num=n,
    )
    batches = []
    for g in groups:
        seqs = [ds[mine[j]]["input_ids"] for j in g]
        masks = [ds[mine[j]]["loss_mask"] for j in g]
        if not seqs:  # an empty micro-batch keeps this rank in step: one token, no loss
            seqs, masks = [[ds.pad_id]], [[0]]
        if packed:
            b = data.pack_batch(seqs, masks, mask_dtype=data.packed_mask_dtype(device))
        else:
            b = data.pad_batch(seqs, masks, ds.pad_id)
        # max_seqlen stays on the host, where data.model_inputs reads it (no device sync)
        batches.append({k: v if k == "max_seqlen" else v.to(device) for k, v in b.items()})
    return batches


def memory_settings(cfg: SFTConfig) -> dict[str, object]:
    """The flags that decide training memory, with their values, for fsdp.explain_oom's message."""
    batch = (
        {"data.max_token_len_per_gpu": cfg.data.max_token_len_per_gpu}
        if cfg.data.use_dynamic_bsz
        else {"data.micro_batch_size_per_gpu": cfg.data.micro_batch_size_per_gpu}
    )
    return batch | {
        "data.max_length": cfg.data.max_length,
        "model.enable_gradient_checkpointing": cfg.model.enable_gradient_checkpointing,
        "model.fsdp_config.cpu_offload": cfg.model.fsdp_config.cpu_offload,
    }


def memory_plan(cfg: SFTConfig, model: torch.nn.Module, world_size: int) -> str:
    """trainer.debug's memory plan of one training step on one rank, as text (perf.Plan): fp32 parameters
    (4 bytes each), gradients (4) and AdamW state (8) of the trainable ones, sharded over the ranks (none on the
    device with model.fsdp_config.cpu_offload); two layers gathered in bf16; activations, logits and the logprob
    kernel's workspace of the largest micro-batch (perf.py's per-token estimates; 1/SP of its tokens under
    Ulysses SP); the CUDA context."""
    try:
        shape = perf.ModelShape.from_config(model.config)
    except AttributeError as e:
        return f"no memory plan: the model config lacks {e.name}"
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    on_device = 0.0 if cfg.model.fsdp_config.cpu_offload else 1.0
    P = cfg.model.fsdp_config.ulysses_sequence_parallel_size  # with SP a rank holds 1/P of a micro-batch
    tokens = (
        max(cfg.data.max_token_len_per_gpu * P, cfg.data.max_length)
        if cfg.data.use_dynamic_bsz
        else cfg.data.micro_batch_size_per_gpu * cfg.data.max_length
    ) / P
    step = {
        "cuda context": perf.CUDA_CONTEXT_BYTES,
        "params": on_device * 4 * total / world_size,
        "grads": on_device * 4 * trained / world_size,
        "optimizer": on_device * 8 * trained / world_size,
        "unsharded": 2 * (shape.vocab * shape.hidden + shape.hidden) + 4 * shape.layer_matmul_params,
        **perf.update_bytes(shape, shape.layers if cfg.model.enable_gradient_checkpointing else 0, tokens),
    }
    device_total = float(torch.cuda.mem_get_info()[1]) if torch.cuda.is_available() else None
    fix = ", ".join(f"--{k} (now {v})" for k, v in memory_settings(cfg).items())
    return perf.Plan({"step": step}, device_total, {"step": f"lower or turn on: {fix}"}).render()


def debug_line(step: int, loss: float, grad_norm: float, memory: dict[str, float]) -> str:
    """trainer.debug's line for a step: loss, gradient norm (before clipping), each phase's peak device memory."""
    return f"debug step {step}: loss {loss:.4f}, grad_norm {grad_norm:.4f}, {perf.peaks_text(memory)}"


@torch.no_grad()
def validate(model: torch.nn.Module, ds: data.SFTDataset, cfg: SFTConfig, device: torch.device) -> float:
    """Mean response-token NLL over the whole validation set (all ranks share the work)."""
    model.eval()
    sp_size = cfg.model.fsdp_config.ulysses_sequence_parallel_size
    nll, n_tok = torch.zeros((), dtype=torch.float64), 0
    indices = list(range(len(ds)))
    step = cfg.data.train_batch_size
    with fsdp.explain_oom("sft validation", memory_settings(cfg)):
        for start in range(0, len(indices), step):
            for b in make_micro_batches(
                ds, indices[start : start + step], cfg.data, cfg.model.use_remove_padding, device, sp_size
            ):
                s, n = response_nll(model, b)
                nll += s.double().cpu()
                n_tok += n
    model.train()
    return fsdp.all_reduce(nll.item()) / max(1.0, fsdp.all_reduce(n_tok))


def main(cfg: SFTConfig) -> dict[str, float]:
    """Trains; returns the final metrics (train/loss, val/loss_before, val/loss, ...)."""
    from transformers import AutoTokenizer

    # a flatrl checkpoint (an earlier SFT's RUN/global_step_N) is loaded from its exported Hugging Face folder
    pretrain = checkpoint.as_hf_model(cfg.model.partial_pretrain)
    cfg = replace(cfg, model=replace(cfg.model, partial_pretrain=pretrain))
    d = fsdp.init_distributed(cfg.trainer.timeout_s)
    fsdp.seed_everything(cfg.trainer.seed)
    run_dir = Path(cfg.trainer.default_local_dir).expanduser()
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.expanduser(cfg.model.partial_pretrain), trust_remote_code=cfg.model.trust_remote_code
    )
    ds_kwargs = dict(
        tokenizer=tokenizer,
        prompt_key=cfg.data.prompt_key,
        response_key=cfg.data.response_key,
        prompt_dict_keys=cfg.data.prompt_dict_keys,
        response_dict_keys=cfg.data.response_dict_keys,
        messages_key=cfg.data.messages_key,
        apply_chat_template=cfg.data.apply_chat_template,
        max_length=cfg.data.max_length,
        truncation=cfg.data.truncation,
        skip_bad_rows=cfg.data.skip_bad_rows,
        chat_template_kwargs=cfg.data.apply_chat_template_kwargs,
    )
    for line in data.unread_template_kwargs(tokenizer, cfg.data.apply_chat_template_kwargs):
        fsdp.print0(line, file=sys.stderr)
    train_ds = data.SFTDataset(cfg.data.train_files, **ds_kwargs)
    val_ds = data.SFTDataset(cfg.data.val_files, **ds_kwargs) if cfg.data.val_files else None
    if train_ds.skipped:
        fsdp.print0(f"skipped training rows: {train_ds.skipped}")

    model = fsdp.load_model(
        cfg.model.partial_pretrain,
        trust_remote_code=cfg.model.trust_remote_code,
        attn_implementation=cfg.model.attn_implementation,
        gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
        config_overrides=cfg.model.override_config,
        dtype=getattr(torch, cfg.model.fsdp_config.model_dtype),
    )
    sp_size = cfg.model.fsdp_config.ulysses_sequence_parallel_size
    sp.setup(model, sp_size, d.device.type, cfg.model.use_remove_padding)
    lora_info = None
    if cfg.model.uses_lora:
        import lora

        settings, notes = lora.start_lora(model, cfg.model)
        for line in notes:
            fsdp.print0(line, file=sys.stderr)
        lora_info = dict(settings, base_model_name_or_path=cfg.model.partial_pretrain)
    hf_files = dict(
        config=model.config, generation_config=model.generation_config, tokenizer=tokenizer, lora=lora_info
    )
    if cfg.trainer.debug:
        fsdp.print0(memory_plan(cfg, model, d.world_size))
    model = fsdp.shard_model(model, d.device, cfg.model.fsdp_config)
    sampler = data.EpochSampler(len(train_ds), cfg.data.train_batch_size, seed=cfg.trainer.seed)
    total_steps = cfg.trainer.total_training_steps
    if total_steps is None:
        total_steps = cfg.trainer.total_epochs * sampler.steps_per_epoch
    epoch = sampler.steps_per_epoch
    test_freq, save_freq = (
        epoch if f == "after_each_epoch" else f for f in (cfg.trainer.test_freq, cfg.trainer.save_freq)
    )
    optimizer, scheduler = optim.build(model.parameters(), cfg.optim, total_steps)
    guard = optim.SkipGuard(cfg.trainer.max_consecutive_skips)

    step, results = 0, {}
    resume = checkpoint.resolve_resume(run_dir, cfg.trainer.resume_mode)
    if resume is not None:
        checkpoint.check_resume_config(resume, config.to_dict(cfg), cfg.trainer.resume_allow_changes)
        state = checkpoint.load_checkpoint(resume, model, optimizer)
        step, results = checkpoint.restore_trainer_state(state, sampler, scheduler, guard)
        fsdp.print0(f"resumed from {resume} at step {step}")

    logger = log.Logger(
        run_dir,
        cfg.trainer.logger,
        rank=d.rank,
        total_steps=total_steps,
        project=cfg.trainer.project_name,
        experiment=cfg.trainer.experiment_name,
        config=config.to_dict(cfg),
        keep_until_step=step if resume is not None else -1,
    )
    if d.is_main:
        log.write_run_files(run_dir, config.to_yaml(cfg))
    if val_ds is not None and step == 0:
        results["val/loss_before"] = validate(model, val_ds, cfg, d.device)
        logger.log({"val/loss": results["val/loss_before"]}, step=0)

    def save() -> None:
        state = checkpoint.trainer_state(cfg, sampler, scheduler, guard, results)
        checkpoint.save_checkpoint(
            run_dir, step, model, optimizer, state, hf_files, keep_last=cfg.trainer.max_ckpt_to_keep
        )

    # Per-phase device memory for trainer.debug (it resets CUDA's peak counters at each phase boundary).
    phase_memory = perf.PhaseMemory() if cfg.trainer.debug else lambda name: contextlib.nullcontext()
    it = iter(sampler)
    while step < total_steps:
        t0 = time.perf_counter()
        try:
            indices = next(it)
        except StopIteration:  # the sampler moved on to the next epoch
            it = iter(sampler)
            indices = next(it)
        batches = make_micro_batches(
            train_ds, indices, cfg.data, cfg.model.use_remove_padding, d.device, sp_size
        )
        local_tokens = sum(int(data.shift_labels(b)[1].sum()) for b in batches)
        global_tokens = fsdp.all_reduce(local_tokens) / sp_size  # an SP group's ranks hold the same tokens
        nll_sum = 0.0
        with fsdp.explain_oom(f"sft step {step + 1}", memory_settings(cfg)):
            with phase_memory("forward_backward"):
                for i, b in enumerate(batches):
                    model.set_requires_gradient_sync(i == len(batches) - 1)  # reduce-scatter once per step
                    nll, _ = response_nll(model, b)
                    # FSDP averages gradients over ranks: scale by world size for a sum over the global batch.
                    (nll * d.world_size / global_tokens).backward()
                    nll_sum += nll.item()
            loss = fsdp.all_reduce(nll_sum) / sp_size / global_tokens
            with phase_memory("optimizer"):
                grad_norm = fsdp.grad_norm_and_clip(model, cfg.optim.clip_grad)
                lr = scheduler.get_last_lr()[0]
                if guard.take_step(loss, grad_norm):  # both are global: every rank decides the same
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        memory = {}
        if cfg.trainer.debug:
            memory = phase_memory.pop()
            fsdp.print0(debug_line(step, loss, grad_norm, memory))
        elapsed = time.perf_counter() - t0
        seen = (
            fsdp.all_reduce(
                sum(
                    int(b["loss_mask"].numel() if "cu_seqlens" in b else b["attention_mask"].sum())
                    for b in batches
                )
            )
            / sp_size
        )
        metrics = {
            "train/loss": loss,
            "train/grad_norm": grad_norm,
            "train/skipped_steps": guard.skipped,
            "train/lr": lr,
            "train/num_tokens": global_tokens,
            "train/epoch": sampler.state_dict()["epoch"],
            "perf/tokens_per_s": seen / elapsed,
            "timing_s/step": elapsed,
        }
        if torch.cuda.is_available():
            peaks = [v for k, v in memory.items() if k.endswith("_peak_allocated_gb")]
            metrics["perf/max_memory_allocated_gb"] = max([torch.cuda.max_memory_allocated() / 2**30, *peaks])
        last = step == total_steps
        if val_ds is not None and (last or (test_freq > 0 and step % test_freq == 0)):
            metrics["val/loss"] = validate(model, val_ds, cfg, d.device)
        logger.log(metrics, step=step)
        results.update({k: v for k, v in metrics.items() if k in ("train/loss", "val/loss")})
        if guard.stop or last or (save_freq > 0 and step % save_freq == 0):
            save()
        if guard.stop:
            logger.close()
            n = guard.consecutive
            raise RuntimeError(
                f"step {step}: the loss or gradient norm was NaN/inf in the last {n} steps in a row "
                f"(trainer.max_consecutive_skips={cfg.trainer.max_consecutive_skips}); none of them updated "
                f"the weights, so {run_dir / f'global_step_{step}'} holds those of step {step - n}. Look at "
                "the data of those steps or lower optim.lr, then resume from it."
            )
    logger.close()
    results["global_step"] = step
    log.write_report(run_dir, config.to_yaml(cfg), results, rank=d.rank)  # RUN/report.md, rank 0
    return results


if __name__ == "__main__":
    fsdp.run_main(main, config.parse(SFTConfig))
