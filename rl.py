"""The RL loop's plumbing, shared by grpo.py and ppo.py; their steps and objectives stay in their own files.
One job a section:

- settings: `RLDataConfig` (verl's data.*), `RLTrainerConfig` (trainer.*); verl's key names are mapped by
  config.parse (verl_keys.py, docs/VERL.md); the reward's settings (custom_reward_function.*) and scoring are
  scoring.py's;
- set-up and checkpoints: `start` (process group, tokenizer, datasets, sampler, reward pool), `make_engine`,
  `resume`, `save`, `close`;
- rollouts: `Run.next_prompts`, `generate` (seeded per step and rank, so a resumed run draws the same responses
  as an uninterrupted one given the same weights), `score_in_background`, `push`;
- validation: `validate` (and RUN/val_generations/step_N.jsonl), `push_and_validate_first`;
- the step's end: `step_timer` (per-phase time and memory; an out-of-memory error names the phase and the flags
  to lower), `finish_step` (validation when due, the log line, checkpoints).

Groups never straddle ranks: a prompt's n responses are generated, scored and normalised on one rank. With
tensor-parallel rollout the tp ranks of one engine generate their prompts together, then each trains on its own
prompts' responses (`Run.next_prompts`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist

import actor
import checkpoint
import config
import data
import fsdp
import log
import losses
import optim
import perf
import reward
import reward_pool
import rollout
import scoring

# ------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class RLDataConfig:
    """RL prompts in verl's schema (data_source, prompt, ability, reward_model, extra_info)."""

    train_files: str | list[str] = "runs/toy/rl/train.parquet"
    """Parquet or jsonl file(s) of training prompts."""
    val_files: str | list[str] | None = "runs/toy/rl/val.parquet"
    """Validation prompts, scored with rollout.val_kwargs (greedy); None disables validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt: chat messages, or a string rendered as one user turn."""
    max_prompt_length: Annotated[int, config.AT_LEAST_ONE] = 512
    """Longest prompt in tokens; longer ones are dropped and counted (or an error with filter_overlong_prompts off)."""
    max_response_length: Annotated[int, config.AT_LEAST_ONE] = 512
    """Most tokens generated per response."""
    train_batch_size: Annotated[int, config.AT_LEAST_ONE] = 1024
    """Prompts per step, over all ranks (each gets rollout.n responses)."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the chat template, as verl's: `+data.apply_chat_template_kwargs.enable_thinking=false`
    (Qwen3), `reasoning_effort=medium` (gpt-oss). A name the template does not read changes nothing."""
    filter_overlong_prompts: bool = True
    """Drop prompts over max_prompt_length (counted) instead of cutting them (truncation)."""
    truncation: Literal["error", "left", "right", "middle"] = "error"
    """With filter_overlong_prompts off, a prompt over max_prompt_length tokens: error stops the run naming its
    row; left keeps its last tokens, right its first, middle both ends (verl's data.truncation)."""
    skip_bad_rows: bool = False
    """Skip (and count) rows with a missing key or an empty or malformed prompt, instead of stopping."""
    shuffle: bool = True
    """A seeded permutation of the prompts every epoch (data.seed); False: the files' row order, every epoch
    (verl's data.shuffle=False, as its LoRA and NPU examples set)."""
    seed: int = 1
    """Seed of the prompt order (with shuffle)."""


@dataclass(frozen=True)
class RLTrainerConfig(config.TrainerConfig):
    """config.TrainerConfig (loop, logging, checkpoints) and RL validation; rollout.seed seeds the sampling."""

    default_local_dir: str = "runs/rl"
    """Run folder: metrics.jsonl, config.yaml, report.md, val_generations/, global_step_N/ checkpoints."""
    experiment_name: str = "rl"
    """Run name for tensorboard/wandb."""
    val_before_train: bool = True
    """Validate before the first step."""
    val_only: bool = False
    """Validate once and exit (evaluation of model.path)."""
    plan: bool = False
    """Print the memory plan (perf.plan: each phase's estimated device memory next to the device's, and the
    flag to lower where it does not fit) and exit before loading anything."""
    save_freq: int | Literal["end"] = "end"
    """Checkpoint every N steps and after the last (verl's); 0 or less: never, as in verl's RL trainer (a stop
    by signal still saves, so the same command resumes); end: only after the last step."""
    test_freq: int | Literal["end"] = "end"
    """Validate every N steps and after the last (verl's); 0 or less: never during or after training, as in
    verl's RL trainer (val_before_train decides before); end: only after the last step."""


@dataclass(frozen=True)
class KLControlConfig:
    """The KL-in-reward coefficient (verl's algorithm.kl_ctrl)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed: kl_coef throughout; adaptive: kl_coef moves towards the target KL (Ziegler et al. 2019)."""
    kl_coef: Annotated[float, config.NON_NEGATIVE] = 0.001
    """The (initial) coefficient."""
    target_kl: Annotated[float, config.POSITIVE] = 0.1
    """adaptive: the per-token KL the controller aims at."""
    horizon: Annotated[int, config.AT_LEAST_ONE] = 10000
    """adaptive: sequences over which an error of the KL is corrected."""


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


def global_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """losses.masked_whiten with the mean and (unbiased) variance of the masked entries on all ranks. [B, T]."""
    m = mask.to(torch.float64)
    n = fsdp.all_reduce(m.sum().item())
    mean = fsdp.all_reduce((x.double() * m).sum().item()) / n
    var = fsdp.all_reduce((((x.double() - mean) ** 2) * m).sum().item()) / max(n - 1, 1)
    return ((x - mean) / (var + 1e-8) ** 0.5).to(x.dtype)


def kl_in_reward(
    samples: list[actor.Sample], estimator: str, kl_ctrl: KLController, R: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """The KL-in-reward penalty (verl's apply_kl_penalty): kl_coef * KL(old policy || reference) per response
    token, by `estimator` (losses.kl_penalty), [S, R] and 0 past each response; then the controller moves on the
    batch's KL (the mean over all ranks' sequences of each one's token mean). Needs each sample's old_logprobs and
    ref_logprobs. Returns the penalty and its metrics."""
    cpu = torch.device("cpu")
    mask = actor.mask_of([len(s.response_ids) for s in samples], cpu, R)  # [S, R]
    old = actor.padded([s.old_logprobs for s in samples], R, cpu)
    ref = actor.padded([s.ref_logprobs for s in samples], R, cpu)
    kl = losses.kl_penalty(old, ref, estimator) * mask  # [S, R]
    coef, n = kl_ctrl.value, fsdp.all_reduce(len(samples))
    current = fsdp.all_reduce(losses.masked_mean(kl, mask, dim=-1).sum().item()) / n
    kl_ctrl.update(current, n_steps=int(n))
    return coef * kl, {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": coef}


# ------------------------------------------------------------------------------ set-up, checkpoints


@dataclass
class Run:
    """What a running RL job holds besides its models (made by `start`)."""

    cfg: Any  # GRPOConfig / PPOConfig: data, model, actor, rollout, custom_reward_function, trainer
    dist: fsdp.Dist
    run_dir: Path
    tokenizer: Any
    pad_id: int
    train: data.RLDataset | None  # None with trainer.val_only
    val: data.RLDataset | None
    sampler: data.EpochSampler | None
    total_steps: int
    pool: reward_pool.RewardPool
    logger: log.Logger | None = None
    scorer: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flatrl-reward")
    )
    ahead: RolloutAhead | None = None  # rollout.async_steps=1: the rollouts generated one step ahead
    _batches: Any = None

    @property
    def layout(self) -> actor.Layout:
        """How the policy's micro-batches are laid out (model.use_remove_padding: packed)."""
        return actor.Layout(self.cfg.model.use_remove_padding, self.pad_id, self.dist.device)

    @property
    def push_dtype(self) -> torch.dtype:
        """Dtype of the pushed weights: the engine's (float32 on CPU, where the trainer is fp32 too)."""
        return torch.float32 if self.dist.device.type == "cpu" else getattr(torch, self.cfg.rollout.dtype)

    @property
    def tp(self) -> int:
        """Ranks per rollout engine (vLLM tensor parallelism): consecutive ranks share one engine's work."""
        return self.cfg.rollout.tensor_model_parallel_size

    def next_prompts(self) -> tuple[list[dict], slice]:
        """The next global batch's prompts for this rank's engine, and which of them this rank trains on.

        Each rank trains on its own share of the batch. With tensor-parallel rollout (tp > 1) the tp ranks of
        an engine must generate together from the same prompts, so they all get their group's shares and each
        keeps its own slice of the responses; with tp = 1 the slice is everything.
        """
        if self._batches is None:
            self._batches = iter(self.sampler)
        try:
            indices = next(self._batches)
        except StopIteration:  # the sampler moved on to the next epoch
            self._batches = iter(self.sampler)
            indices = next(self._batches)
        rank, world, tp = self.dist.rank, self.dist.world_size, self.tp
        group = range(rank - rank % tp, rank - rank % tp + tp)
        shares = [data.split_for_rank(indices, r, world) for r in group]
        start = sum(len(sh) for sh in shares[: rank % tp])
        prompts = [self.train[i] for sh in shares for i in sh]
        return prompts, slice(start, start + len(shares[rank % tp]))


def start(cfg: Any) -> Run:
    """Joins the process group; loads the tokenizer and datasets; starts the reward pool. With trainer.val_only
    only the validation prompts are loaded (no training sampler: its batch size need not fit)."""
    from transformers import AutoTokenizer

    cfg = hf_model_paths(cfg)
    d = fsdp.init_distributed(cfg.trainer.timeout_s)
    ledger("the process group's start")  # the CUDA context and what the process group holds, before any model
    fsdp.stop_at_step_boundary_on_sigterm()
    cfg, said = perf.resolve_auto_checkpointing(cfg, d.world_size)
    for line in said:
        fsdp.print0(line)
    if cfg.trainer.plan or cfg.trainer.debug:
        fsdp.print0(perf.plan(cfg, d.world_size).render())
    if cfg.trainer.plan:
        raise SystemExit(0)
    fsdp.seed_everything(cfg.trainer.seed)
    model_path = os.path.expanduser(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ds_kwargs = dict(
        tokenizer=tokenizer,
        prompt_key=cfg.data.prompt_key,
        max_prompt_length=cfg.data.max_prompt_length,
        apply_chat_template=cfg.data.apply_chat_template,
        filter_overlong_prompts=cfg.data.filter_overlong_prompts,
        skip_bad_rows=cfg.data.skip_bad_rows,
        custom_reward=cfg.custom_reward_function.path is not None,  # data_source, ground_truth optional then
        truncation=cfg.data.truncation,
        chat_template_kwargs=cfg.data.apply_chat_template_kwargs,
    )
    if cfg.data.truncation != "error" and cfg.data.filter_overlong_prompts:
        fsdp.print0(
            f"note: data.truncation={cfg.data.truncation} cuts nothing: data.filter_overlong_prompts=True (flatrl's "
            "default; verl's is false) drops overlong prompts first; set it false to cut them",
            file=sys.stderr,
        )
    if not cfg.trainer.val_only and not saves(cfg.trainer.save_freq):  # verl's -1, once flatrl's "end"
        fsdp.print0(
            f"note: trainer.save_freq={cfg.trainer.save_freq} saves no checkpoint, as in verl (only a stop by signal "
            "does, so the same command resumes); trainer.save_freq=end saves once after the last step",
            file=sys.stderr,
        )
    if not cfg.trainer.val_only and cfg.data.val_files and not saves(cfg.trainer.test_freq):
        fsdp.print0(
            f"note: trainer.test_freq={cfg.trainer.test_freq} "
            + ("validates only before training" if cfg.trainer.val_before_train else "never validates")
            + f" (val_before_train={cfg.trainer.val_before_train}), as in verl; trainer.test_freq=end validates after "
            "the last step too",
            file=sys.stderr,
        )
    for line in data.unread_template_kwargs(tokenizer, cfg.data.apply_chat_template_kwargs):
        fsdp.print0(line, file=sys.stderr)
    train = None if cfg.trainer.val_only else data.RLDataset(cfg.data.train_files, **ds_kwargs)
    val = data.RLDataset(cfg.data.val_files, **ds_kwargs) if cfg.data.val_files else None
    for name, ds in (("train", train), ("val", val)):
        if ds is not None and (ds.dropped_overlong or ds.truncated or ds.skipped):
            fsdp.print0(
                f"{name} prompts: {ds.dropped_overlong} over max_prompt_length dropped, {ds.truncated} cut "
                f"({cfg.data.truncation} truncation), skipped {ds.skipped}"
            )
    sampler, total_steps = None, 0
    if train is not None:
        if cfg.data.train_batch_size % d.world_size:
            raise ValueError(
                f"data.train_batch_size={cfg.data.train_batch_size} must divide by {d.world_size} ranks"
            )
        sampler = data.EpochSampler(
            len(train), cfg.data.train_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle
        )
        total_steps = cfg.trainer.total_training_steps
        if total_steps is None:
            total_steps = cfg.trainer.total_epochs * sampler.steps_per_epoch
    rc = cfg.custom_reward_function
    fn_spec = (rc.path, rc.name, rc.reward_kwargs) if rc.path else None
    sources = (ex["data_source"] for ds in (train, val) if ds is not None for ex in ds.examples)
    reward.check_data_sources(sources, fn_spec)  # an unknown data_source is an error now, not 0 reward later
    # a buffer longer than its max_resp_len is an error now, not at the first score
    scoring.overlong_buffer(cfg)
    pool = reward_pool.RewardPool(
        fn_spec,
        num_workers=rc.num_workers,
        timeout_s=rc.timeout_s,
        max_error_frac=rc.max_error_frac,
        max_abs_reward=rc.max_abs_reward,
    )
    run_dir = Path(cfg.trainer.default_local_dir).expanduser()
    return Run(cfg, d, run_dir, tokenizer, pad_id, train, val, sampler, total_steps, pool)


def hf_model_paths(cfg: Any) -> Any:
    """cfg with model.path (and PPO's critic.model.path) as the trainers load them: a flatrl checkpoint becomes its
    exported Hugging Face folder (checkpoint.as_hf_model), so RUN/global_step_N can follow SFT as verl's tutorial
    hands it over."""
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=checkpoint.as_hf_model(cfg.model.path))
    )
    if getattr(cfg, "critic", None) is not None and cfg.critic.model.path:
        critic_model = dataclasses.replace(
            cfg.critic.model, path=checkpoint.as_hf_model(cfg.critic.model.path)
        )
        cfg = dataclasses.replace(cfg, critic=dataclasses.replace(cfg.critic, model=critic_model))
    return cfg


def memory_settings(cfg: Any) -> dict[str, Any]:
    """The flags that decide memory in an RL step, with their values, for fsdp.explain_oom's message."""
    a = cfg.actor
    batch = (
        {"actor.ppo_max_token_len_per_gpu": a.ppo_max_token_len_per_gpu}
        if a.use_dynamic_bsz
        else {"actor.ppo_micro_batch_size_per_gpu": a.ppo_micro_batch_size_per_gpu}
    )
    return batch | {
        "data.max_response_length": cfg.data.max_response_length,
        "rollout.gpu_memory_utilization": cfg.rollout.gpu_memory_utilization,
        "rollout.max_num_seqs": cfg.rollout.max_num_seqs,
        "model.enable_gradient_checkpointing": cfg.model.enable_gradient_checkpointing,
        "model.gradient_checkpointing_layers": cfg.model.gradient_checkpointing_layers,
        "model.fsdp_config.cpu_offload": cfg.model.fsdp_config.cpu_offload,
    }


def oom(what: str, cfg: Any) -> contextlib.AbstractContextManager:
    """fsdp.explain_oom for an RL phase: the memory settings' flags and, on an out-of-memory error, perf.plan."""
    return fsdp.explain_oom(
        what, memory_settings(cfg), plan=lambda: perf.plan(cfg, dist.get_world_size()).render()
    )


def ledger(mark: str) -> None:
    """Prints perf.device_ledger's line for this point of the set-up (CUDA only)."""
    if (line := perf.device_ledger(mark)) is not None:
        fsdp.print0(line)


def make_engine(cfg: Any, run: Run) -> rollout.Engine:
    """This rank's rollout engine on model.path (its weights are replaced by the first push)."""
    ledger("the engine's start (the trainer's models built)")
    with oom("rollout engine start", cfg):
        engine = rollout.make_engine(
            cfg.rollout,
            os.path.expanduser(cfg.model.path),
            max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
            rank=run.dist.rank,
            world_size=run.dist.world_size,
            hf_overrides=cfg.model.override_config,
        )
    ledger("engine started")
    return engine


Components = dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None, dict]]
"""Checkpointed models: {"": (policy, optimizer, hf_files), "critic": (...)}; "" is the top level."""


def resume(
    run: Run, components: Components, scheduler: Any, guard: optim.SkipGuard
) -> tuple[int, dict, dict]:
    """Loads the checkpoint trainer.resume_mode points at (if any) and opens the logger.

    Returns (step, results, extra): the step to continue from, the results so far, and the script's own state
    (e.g. the KL-in-reward coefficient) as `save` wrote it.

    Restores every component's model and optimizer, the data position, the schedule and the skip counters.
    metrics.jsonl keeps the lines up to the resumed step (an interrupted run may have logged past it).
    """
    cfg = run.cfg
    step, results, extra = 0, {}, {}
    path = None if cfg.trainer.val_only else checkpoint.resolve_resume(run.run_dir, cfg.trainer.resume_mode)
    if path is not None:
        checkpoint.check_resume_config(path, config.to_dict(cfg), cfg.trainer.resume_allow_changes)
        for prefix, (model, optimizer, _) in components.items():
            state = checkpoint.load_checkpoint(path, model, optimizer, prefix=prefix)
        step, results = checkpoint.restore_trainer_state(state, run.sampler, scheduler, guard)
        extra = state.get("extra", {})
        fsdp.print0(f"resumed from {path} at step {step}")
    run.logger = log.Logger(
        run.run_dir,
        cfg.trainer.logger,
        rank=run.dist.rank,
        total_steps=run.total_steps,
        project=cfg.trainer.project_name,
        experiment=cfg.trainer.experiment_name,
        config=config.to_dict(cfg),
        keep_until_step=step if path is not None else -1,
    )
    if run.dist.is_main:
        log.write_run_files(run.run_dir, config.to_yaml(cfg))
    return step, results, extra


def save(
    run: Run,
    step: int,
    components: Components,
    scheduler: Any,
    guard: optim.SkipGuard,
    results: dict,
    extra: dict | None = None,
    offload: list[fsdp.OptimizerOffload] = (),
    engine: rollout.Engine | None = None,
) -> Path:
    """Writes RUN/global_step_N/ with every component (collective); `extra` is the script's own JSON state.
    Reading an offloaded optimizer state brings it back to the device (its state_dict hook); `offload` sends it
    back to the host once written, before the next step's generation. Beside the awake engine that state most
    likely made the run's peak (e3556ff, 1.5B: 41.8 GiB, 9.7 over every phase's own, sampled after the last step's
    row), so an `engine` that can sleep sleeps through the save, at level 1: its weights wait in host memory, and
    the next generate() wakes it without a push. One generating ahead (rollout.async_steps) stays awake."""
    nap = bool(offload) and run.ahead is None and getattr(engine, "sleep_enabled", False)
    if nap:
        engine.sleep(level=1)
    # With a batch drawn ahead (rollout.async_steps), the data position before it: a resumed run draws it again.
    position = run.ahead.position if run.ahead is not None else None
    state = checkpoint.trainer_state(
        run.cfg, run.sampler, scheduler, guard, results, extra=extra or {}, sampler_state=position
    )
    parts = {k: (m, opt, files | {"tokenizer": run.tokenizer}) for k, (m, opt, files) in components.items()}
    model, optimizer, hf_files = parts.pop("")
    keep = run.cfg.trainer.max_ckpt_to_keep
    path = checkpoint.save_checkpoint(
        run.run_dir, step, model, optimizer, state, hf_files, keep_last=keep, extra=parts
    )
    for o in offload:
        o.offload()
    return path


def close(run: Run, engine: rollout.Engine | None) -> None:
    """Flushes the logger, stops the reward workers and the engine (the process group stays for the caller)."""
    if run.logger is not None:
        run.logger.close()
    run.scorer.shutdown(wait=True)
    if run.ahead is not None:  # a generation still running (the step failed) finishes before the engine stops
        run.ahead.thread.shutdown(wait=True, cancel_futures=True)
    run.pool.close()
    if engine is not None:
        engine.shutdown()
    log.write_report(run.run_dir, config.to_yaml(run.cfg), rank=run.dist.rank)  # RUN/report.md, rank 0


# ------------------------------------------------------------------------------------------ rollouts


def rollout_seed(base: int, step: int, rank: int, round_: int = 0) -> int:
    """The sampling seed of one rank's rollouts at one step (and generation round, for grpo.py's dynamic
    sampling): reproducible, distinct across steps, ranks and rounds."""
    return (base * 1_000_003 + step * 10_007 + rank + round_ * 104_729) % 2**31


def sample(
    engine: rollout.Engine,
    prompts: list[dict],
    sampling: rollout.SamplingConfig,
    max_tokens: int,
    seed: int,
    probes: list[actor.Sample] | None = None,
) -> list[actor.Sample]:
    """`sampling.n` responses to each prompt from the engine, as Samples grouped per prompt. `probes`: a list that
    receives the push check's probes, which the engine then adds (rollout.logprob_check_tokens)."""
    ids = [p["prompt_ids"] for p in prompts]
    out = engine.generate(ids, sampling, max_tokens, seed=seed, probes=probes is not None)
    samples = []
    for o in out:
        # an empty response cannot be scored by logprob; vLLM never returns one
        response = o.response_ids or [0]
        s = actor.Sample(ids[o.prompt_index], response, o.logprobs, o.finish_reason, o.prompt_index)
        (probes if o.probe else samples).append(s)  # probes is a list whenever the engine returns one
    return samples


def generate(
    run: Run,
    engine: rollout.Engine,
    prompts: list[dict],
    mine: slice,
    step: int,
    round_: int = 0,
    sampling: rollout.SamplingConfig | None = None,
    probes: list[actor.Sample] | None = None,
) -> tuple[list[actor.Sample], list[dict]]:
    """A training step's rollouts: rollout.n responses to each of the engine's prompts (at this step's and
    round's seed; `sampling` instead of rollout.train_sampling when given), of which this rank keeps those to
    prompts[mine]. Returns (its samples, with `group` indexing its prompts; its prompts). `probes`: a list that
    receives the push check's probes (see `check_push`): all of the engine's, so the ranks of one tensor-parallel
    group check the same ones."""
    cfg = run.cfg
    seed = rollout_seed(cfg.rollout.seed, step, run.dist.rank // run.tp, round_)
    sampling = sampling or cfg.rollout.train_sampling
    samples = sample(engine, prompts, sampling, cfg.data.max_response_length, seed, probes)
    samples = [s for s in samples if mine.start <= s.group < mine.stop]
    for s in samples:
        s.group -= mine.start
    return samples, prompts[mine]


def probing(cfg: Any) -> bool:
    """Whether the push check of grpo.py and ppo.py runs on probes (rollout.logprob_check_tokens; not with
    rollout.async_steps=1, whose batches are one update old) rather than on the rollouts that carry logprobs."""
    return rollout.uses_probes(cfg.rollout) and not cfg.rollout.async_steps


def check_push(
    run: Run, policy: torch.nn.Module, probes: list[actor.Sample], temperature: float, step: int
) -> dict[str, float]:
    """The push check on `probes`, short responses from the engine's weights, which the policy still holds (before
    its update): one no-grad pass over them. Returns rollout/logprob_diff_mean and _max; raises as
    actor.PushCheck.result does (collective: every rank calls it, each with its engine's probes)."""
    check = actor.PushCheck(run.dist.device)
    actor.compute_logprobs(policy, probes, run.cfg.actor, run.layout, temperature, check)
    return {
        k: v
        for k, v in check.result(run.cfg.rollout.logprob_diff_tol, step).items()
        if k.startswith("rollout/")
    }


class RolloutAhead:
    """rollout.async_steps=1: one-step off-policy rollouts (RolloutConfig.async_steps says what it changes).

    `take(step)` returns the step's rollouts: the ones `start(step)` began in the background during the previous
    step, or, when none was started (the first step, the first after a resume), generated now. `start(step + 1)`
    draws the next batch's prompts and generates them in a background thread with the engine's current weights
    while this step trains; `wait()` joins it before the push changes those weights.
    """

    def __init__(self, run: Run, engine: rollout.Engine) -> None:
        if run.tp != 1:
            raise SystemExit(
                f"error: rollout.async_steps=1 needs rollout.tensor_model_parallel_size=1 (got {run.tp}): a "
                "tensor-parallel engine's collectives would run beside the trainer's in another thread"
            )
        self.run, self.engine = run, engine
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flatrl-rollout")
        self.future: concurrent.futures.Future | None = None
        self.position: dict | None = None  # the sampler's state before the batch drawn ahead (rl.save)
        self.stale = False  # whether the last batch taken came from weights one update old
        self.seconds = 0.0  # the background generation's own time (perf/gen_ahead_s)

    def take(self, step: int) -> tuple[list[actor.Sample], list[dict]]:
        """Step `step`'s (0-based) samples and prompts, as `generate` returns them."""
        if self.future is None:
            self.stale = False
            prompts, mine = self.run.next_prompts()
            return generate(self.run, self.engine, prompts, mine, step)
        out, self.future, self.position, self.stale = self.future.result(), None, None, True
        return out

    PROBE_TOKENS = 32

    def probe(self, prompt: dict, step: int) -> list[actor.Sample]:
        """One response of at most PROBE_TOKENS tokens to `prompt` from the engine's weights now, which the trainer
        holds too until its update: grpo.py checks the last push with it where the step's batch is one update old
        (the engine's logprobs of that batch come from weights the trainer no longer has)."""
        cfg = self.run.cfg
        sampling = dataclasses.replace(cfg.rollout.train_sampling, n=1)
        seed = rollout_seed(cfg.rollout.seed, step, self.run.dist.rank, round_=-1)
        tokens = min(cfg.data.max_response_length, self.PROBE_TOKENS)
        return sample(self.engine, [prompt], sampling, tokens, seed)

    def start(self, step: int) -> None:
        """Draws step `step`'s prompts and starts generating their rollouts in the background."""
        self.position = self.run.sampler.state_dict()
        prompts, mine = self.run.next_prompts()
        device = self.run.dist.device

        def job() -> tuple[list[actor.Sample], list[dict]]:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            begin = time.perf_counter()
            out = generate(self.run, self.engine, prompts, mine, step)
            self.seconds = time.perf_counter() - begin
            return out

        self.future = self.thread.submit(job)

    def wait(self) -> dict[str, float]:
        """Blocks until the background generation is done (it raises here what it raised); its metrics."""
        if self.future is None:
            return {}
        try:
            self.future.result(timeout=self.run.cfg.rollout.timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"rollout: the background generate did not finish within "
                f"rollout.timeout_s={self.run.cfg.rollout.timeout_s:.0f}s"
            ) from None
        return {"perf/gen_ahead_s": self.seconds}


def score_in_background(run: Run, samples: list[actor.Sample], prompts: list[dict]) -> Callable[[], dict]:
    """Starts `scoring.score` in run's scoring thread and returns the function that waits for it, so the trainer's
    passes run meanwhile (the reward workers are processes: the thread decodes and waits on them). The function
    returns the metrics merged over ranks (a collective, so in the calling thread), with `perf/reward_scoring_s`,
    the scoring's own seconds; it raises what the scoring raised."""

    def job() -> dict[str, float]:
        start = time.perf_counter()
        metrics = scoring.score(run.pool, samples, prompts, run.tokenizer, scoring.overlong_buffer(run.cfg))
        return metrics | {"perf/reward_scoring_s": time.perf_counter() - start}

    if run.pool.num_workers == 0:  # in process: its timeout is a SIGALRM, which only the main thread gets
        metrics = job()
        return lambda: scoring.merge_ranks(metrics)
    future = run.scorer.submit(job)
    return lambda: scoring.merge_ranks(future.result())


def offloads(fsdp_cfg: fsdp.FSDPConfig, optimizer: torch.optim.Optimizer) -> list[fsdp.OptimizerOffload]:
    """[fsdp.OptimizerOffload(optimizer)] when fsdp_cfg.offload_optimizer_in_rollout (the policy's
    model.fsdp_config, or the critic's critic.model.fsdp_config), else []. The state (made at build,
    optim.init_state) leaves the device at once: the engine starts next, and the first step's generation, often
    the run's peak, runs before any update."""
    out = [fsdp.OptimizerOffload(optimizer)] if fsdp_cfg.offload_optimizer_in_rollout else []
    for o in out:
        o.offload()
    return out


def push(
    run: Run, engine: rollout.Engine, policy: torch.nn.Module, offload: list[fsdp.OptimizerOffload] = ()
) -> None:
    """The policy's weights into the engine (waking it). Offloaded optimizer states in `offload` leave the device
    first (they come back at the next optimizer step), so the engine's KV cache finds the room; the training loops
    move them in a phase of their own before this (timing_s/offload), so that the sync phase's memory peak is the
    awake engine's, not the instant before the state left (torch counts the sleeping engine's pool as allocated)."""
    for o in offload:
        o.offload()
    actor.push_weights(engine, policy, run.push_dtype)


# ---------------------------------------------------------------------------------------- validation


def validate(run: Run, engine: rollout.Engine, step: int) -> dict[str, float]:
    """Responses (rollout.val_kwargs, greedy by default) to every validation prompt; means over all ranks.
    Rank 0 writes every response, its prompt, ground truth and score to RUN/val_generations/step_N.jsonl (the
    first thing to read when the reward stays at 0) and prints three."""
    cfg, dp_rank, dp_size = run.cfg, run.dist.rank // run.tp, run.dist.world_size // run.tp
    mine = [run.val[i] for i in range(len(run.val))][dp_rank::dp_size]  # an engine's share (its tp ranks')
    samples = []
    if mine:
        seed = rollout_seed(cfg.rollout.seed, -1, dp_rank)
        samples = sample(engine, mine, cfg.rollout.val_kwargs, cfg.data.max_response_length, seed)
    scoring.score(run.pool, samples, mine, run.tokenizer, scoring.overlong_buffer(cfg))
    w = float(run.dist.rank % run.tp == 0)  # the tp ranks of an engine hold the same responses: count once
    texts = run.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    rows = [
        dict(
            prompt=mine[s.group]["raw_prompt"],
            response=t,
            ground_truth=mine[s.group]["ground_truth"],
            score=s.score,
        )
        for s, t in zip(samples, texts, strict=True)
    ]
    every = [None] * run.dist.world_size
    dist.all_gather_object(every, rows if w else [])
    if run.dist.is_main:
        out = run.run_dir / "val_generations"
        out.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(r, default=str) + "\n" for part in every for r in part]
        (out / f"step_{step}.jsonl").write_text("".join(lines))
        for r in rows[:3]:  # a few on the console, so a person can see what is being scored
            text = r["response"].replace("\n", " | ")
            print(f"  val sample: {str(r['prompt'])[-40:]!r} -> {text!r} (reward {r['score']:g})", flush=True)
    n = fsdp.all_reduce(w * len(samples))
    return {
        "val/reward/mean": fsdp.all_reduce(w * sum(s.score for s in samples)) / max(n, 1),
        "val/response_length/mean": fsdp.all_reduce(w * sum(len(s.response_ids) for s in samples))
        / max(n, 1),
    }


def push_and_validate_first(
    run: Run,
    engine: rollout.Engine,
    policy: torch.nn.Module,
    step: int,
    results: dict,
    offload: list[fsdp.OptimizerOffload] = (),
) -> bool:
    """Pushes the policy's weights (the engine then runs exactly the trainer's weights, resumed or not) and runs
    the validation before training (or the whole of val_only); True when the run should stop here. `offload`
    as push's: a resumed optimizer state came back to the device to be loaded, and leaves it again here."""
    push(run, engine, policy, offload)
    trainer = run.cfg.trainer
    if run.val is not None and (trainer.val_only or (trainer.val_before_train and step == 0)):
        metrics = validate(run, engine, step)
        engine.pop_call_seconds()  # validation's calls stay out of step 1's perf/gen_*
        results["val/reward/mean_before"] = metrics["val/reward/mean"]
        results |= metrics
        run.logger.log(metrics, step=step)
    return trainer.val_only


# ------------------------------------------------------------------------------------- the step's end


@contextlib.contextmanager
def step_timer(cfg: Any) -> Iterator[log.Timer]:
    """A fresh per-phase timer for one step: `with timer("update"): ...` records the phase's time (waiting for
    queued GPU work before each clock read) and CUDA memory (perf.PhaseTimer), and turns an out-of-memory error
    in it into one that names the phase and the flags to lower (oom), and the garbage collector's pauses in each
    phase (perf/gc/*). The block's own time is timing_s/step."""
    t = perf.PhaseTimer(
        sync=torch.cuda.synchronize if torch.cuda.is_available() else None,
        explain=lambda name: oom(name, cfg),
        watch_gc=True,
    )
    try:
        with t("step"):
            yield t
    finally:
        t.close()  # the collector's hook goes; what it measured stays for finish_step's pop


def rollout_metrics(samples: list[actor.Sample], n: int) -> dict[str, float]:
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


def saves(freq: int | str) -> bool:
    """Whether trainer.save_freq (or test_freq) ever fires: "end" or N > 0; verl's 0 or -1 never does."""
    return freq == "end" or freq > 0


def due(freq: int | str, step: int, last: bool) -> bool:
    """Whether trainer.save_freq or test_freq fires after step `step` (1-based): every N steps and after the
    last, or only after the last ("end"); never at 0 or less, as in verl's RL trainer."""
    return saves(freq) and (last or (freq != "end" and step % freq == 0))


def finish_step(
    run: Run,
    engine: rollout.Engine,
    step: int,
    samples: list[actor.Sample],
    metrics: dict[str, float],
    timer: log.Timer,
    guard: optim.SkipGuard,
    results: dict,
    save_fn: Callable[[], Path],
) -> None:
    """After the update and the push of step `step` (1-based): validation when due, the step's metrics, the log
    line, the checkpoint when due; stops the run (after a checkpoint) when too many steps in a row were skipped."""
    trainer = run.cfg.trainer
    last = step == run.total_steps
    # the step's generate() calls in parts (rollout.VLLMEngine.pop_call_seconds), before validation's own calls
    metrics |= {f"perf/gen_{k}_s": v for k, v in engine.pop_call_seconds().items()}
    if run.val is not None and due(trainer.test_freq, step, last):
        with timer("val"):
            metrics |= validate(run, engine, step)
        engine.pop_call_seconds()  # and out of the next step's
    metrics |= rollout_metrics(samples, run.cfg.rollout.n)
    metrics |= timer.pop()
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    n_tokens = fsdp.all_reduce(sum(lengths))
    metrics["perf/throughput"] = n_tokens / metrics["timing_s/step"] / run.dist.world_size
    update_s = metrics.get("timing_s/update", metrics.get("timing_s/update_actor"))
    if update_s is not None:  # the policy update's MFU (perf.py): 6 x matmul params x tokens trained
        epochs = run.cfg.actor.ppo_epochs
        sum_sq = fsdp.all_reduce(sum(n * n for n in lengths))
        shape = perf.model_shape(run.cfg.model.path)
        metrics |= perf.update_metrics(
            shape, epochs * n_tokens, epochs * sum_sq, update_s, run.dist.world_size
        )
    peaks = [
        v for k, v in metrics.items() if k.startswith("perf/memory/") and k.endswith("_peak_allocated_gb")
    ]
    if peaks:  # this step's peak: PhaseTimer resets the counters at every phase boundary
        metrics["perf/max_memory_allocated_gb"] = max(peaks)
    if rollout.cache_kept_gb is not None:  # the trainer's cache the engine could not have at its wake
        metrics["perf/memory/cache_kept_at_wake_gb"] = rollout.cache_kept_gb
    run.logger.log(metrics, step=step)
    if trainer.debug:  # verl's debug=true: memory and gradient norms on the console
        norms = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.endswith("/grad_norm"))
        fsdp.print0(f"debug step {step}: {norms}, {perf.peaks_text(metrics)}")
    results |= {k: v for k, v in metrics.items() if k.startswith(("val/", "reward/mean"))}
    stop = fsdp.stop_requested()  # SIGTERM on any rank: save, then exit (the same command resumes)
    path = None
    if stop or (guard.stop and saves(trainer.save_freq)) or due(trainer.save_freq, step, last):
        path = save_fn()
    if stop and not last:
        fsdp.print0(f"stopped by signal {stop} after step {step}; {path} holds it: the same command resumes")
        raise SystemExit(128 + stop)
    if guard.stop:
        held = (
            f"so {path} holds the last good ones. Look at those steps' data or lower the learning rate, then "
            "resume from it."
            if path
            else f"and trainer.save_freq={trainer.save_freq} saves no checkpoint. Look at those steps' data or "
            "lower the learning rate."
        )
        raise RuntimeError(
            f"step {step}: the loss or gradient norm was NaN/inf in the last {guard.consecutive} optimizer "
            f"steps in a row (trainer.max_consecutive_skips={trainer.max_consecutive_skips}); none of them "
            f"updated the weights, {held}"
        )
