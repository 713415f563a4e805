"""verl's config keys and what flatrl does with each: one table per verl entry point, readable as documentation.

`RL` (+ `GRPO` or `PPO`) is verl.trainer.main_ppo's, read by grpo.py and ppo.py; `SFT` is
verl.trainer.fsdp_sft_trainer's and its successor verl.trainer.sft_trainer's, read by sft.py. overrides.translate looks every key a user gives up here
first, then as a flatrl field, then as a plain prefix move (`RL_PREFIXES`: `actor_rollout_ref.actor.X` ->
`actor.X`, ...); a key none of them knows is an error. A key ending in `.*` covers everything under it. Rules:
- `Map(*to, weak=(), why=, convert=)`: flatrl honours the key under other names; a rename is said on stderr,
  once (`mapped: A -> B (why)`). `weak` targets are set only when no key given sets them (verl's `clip_ratio`
  under an explicit `clip_ratio_low`; verl's critic batch sizes default to the actor's);
- `Ignore(why)`: flatrl does not implement it, and its value does not change what is trained; said on stderr
  as `ignored: KEY=VALUE (why)`;
- `Only(values, why)`: flatrl always does what one of `values` says: those are said as ignored, any other value
  is an error naming the key (it would change the results and cannot be honoured);
- `Pair(why)`: read together with another key by overrides.translate (world size, resume path).

`python verl_keys.py` prints the tables as markdown (docs/VERL.md holds that output; a test keeps it current).
Key names come from verl's trainer configs (ppo_trainer.yaml, _generated_ppo_trainer.yaml, sft_trainer.yaml,
2024-10 to 2026-01) and its examples; tests/verl_keys.txt lists them, and a test checks each is accounted for.
Every mapping target is checked against grpo.py's, ppo.py's and sft.py's dataclasses by a test.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Map:
    """flatrl honours the key as `to` (and `weak`: only where no given key sets them), converted by `convert`."""

    def __init__(
        self, *to: str, weak: tuple[str, ...] = (), why: str = "", convert: Callable[[Any], Any] | None = None
    ):
        self.to, self.weak, self.why, self.convert = to, weak, why, convert


@dataclass(frozen=True)
class Ignore:
    """Not implemented, and its value does not change what is trained: said on stderr with `why`."""

    why: str


@dataclass(frozen=True)
class Only:
    """flatrl always does what `values` say: those are said as ignored; any other value is an error."""

    values: tuple
    why: str


@dataclass(frozen=True)
class Pair:
    """Read together with another key (world size, resume path): handled by `translate` itself."""

    why: str


Rule = Map | Ignore | Only | Pair


# ------------------------------------------------------------------------------------------- reasons

PROFILER = "profiling is not built in; use torch.profiler or nsys around the script"
CKPT = "a checkpoint holds model, optimizer and trainer state; shard_merge.py writes a Hugging Face folder"
SPEED = "a speed option of verl's kernels; it does not change what is trained"
MEMORY = "memory only; it does not change what is trained"
SP = "Ulysses sequence parallelism lives in the fsdp_config (sp.py, docs/SP.md)"
SHM = "loading through /dev/shm is a speed option"
NO_CODE = "flatrl never imports code named in a config (the custom reward function is the one exception)"
FSDP2 = "flatrl shards with FSDP2"
CRITIC_FOLLOWS = "verl's critic setting defaults to the actor's"
OFFLOAD = "FSDP2 CPU offload: parameters, gradients and optimizer state in host memory"
LOGPROBS = (
    "logprob passes run in the actor's micro-batches (ppo_micro_batch_size_per_gpu or its token budget)"
)
GLOBAL_MB = "verl's older global micro-batch size, divided by the world size (WORLD_SIZE)"
DEFAULTS = "Hydra's defaults list picks verl's config groups; flatrl's dataclass defaults stand in for them"
ONE_ENGINE = "one engine per rank, or per rollout.tensor_model_parallel_size ranks"
PUSH = "weights are pushed into the engine one parameter at a time"
REF = (
    "the reference is a frozen copy of the starting policy, sharded like the actor (model.fsdp_config) and "
    "run in the actor's micro-batches"
)
WORKERS = "an internal of verl's workers"
TEXT_ONLY = "text-only data"
ALL_ROWS = "every row is used; cut the file instead"
NO_CRITIC = "grpo.py trains no critic (ppo.py does)"
SAMPLES = "a few validation generations are printed on the console; none go to the logger"
REWARD_FN = (
    "flatrl's reward pool scores each response with the function, as verl's naive, prime and dapo managers; "
    "dapo's length penalty is reward_kwargs.overlong_buffer_cfg"
)
MB_IN_ORDER = "a step's samples are already a random draw of prompts; mini-batches take them in that order"
MEGATRON = "a Megatron-LM setting (verl's ppo_megatron_trainer): flatrl trains with FSDP2"
NO_QAT = "no quantization-aware training"
FUSED = "logprobs and entropy straight from the hidden states, in row chunks: no [B, T, V] logits are held"


def _fsdp_size(value: Any) -> int:
    """verl's fsdp_size (-1: all ranks; N: HSDP groups of N) as flatrl's hsdp_shard_size (0: all ranks)."""
    if value in (-1, None):
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"want -1 or a positive group size, got {value!r}")
    return value


def _model_dtype(value: Any) -> str:
    """verl's fsdp_config.model_dtype (its PrecisionType names) as fsdp.FSDPConfig.model_dtype."""
    names = {32: "float32", "32": "float32", "fp32": "float32", "float32": "float32"}
    names |= {"bf16": "bfloat16", "bfloat16": "bfloat16"}
    if value not in names:
        raise ValueError(f"want fp32/float32 or bf16/bfloat16 (fp16 would need a loss scaler), got {value!r}")
    return names[value]


def _sharding(value: Any) -> bool:
    """FSDP1's sharding_strategy as FSDP2's reshard_after_forward."""
    choices = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}
    if value not in choices:
        raise ValueError(f"flatrl shards with FSDP2: FULL_SHARD or SHARD_GRAD_OP, got {value!r}")
    return choices[value]


def _per_gpu(value: Any) -> Any:
    """verl's older global micro-batch size as a per-GPU one, as verl divides it: by the world size."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"want a positive number of sequences, got {value!r}")
    return max(1, value // int(os.environ.get("WORLD_SIZE", "1")))


def _as_list(value: Any) -> Any:
    """verl takes `trainer.logger=console` for `[console]`."""
    return [value] if isinstance(value, str) else value


def _under(prefix: str, rules: dict[str, Rule]) -> dict[str, Rule]:
    """The rules with `prefix.` before each key (the tables group keys by verl section)."""
    return {f"{prefix}.{key}": rule for key, rule in rules.items()}


def _fsdp(ours: str) -> dict[str, Rule]:
    """verl's fsdp_config keys, onto flatrl's fsdp.FSDPConfig at `ours`."""
    return {
        "param_offload": Map(f"{ours}.cpu_offload", why=OFFLOAD),
        "offload_policy": Map(f"{ours}.cpu_offload", why=OFFLOAD),
        "grad_offload": Ignore("gradients are offloaded with the parameters (cpu_offload)"),
        "optimizer_offload": Map(
            f"{ours}.offload_optimizer_in_rollout",
            why="the optimizer state goes to host memory while the engine runs",
        ),
        "reshard_after_forward": Map(f"{ours}.reshard_after_forward"),
        "fsdp_size": Map(f"{ours}.hsdp_shard_size", convert=_fsdp_size, why="-1 becomes 0: all ranks"),
        "dtype": Map(f"{ours}.param_dtype"),
        "model_dtype": Map(
            f"{ours}.model_dtype",
            convert=_model_dtype,
            why="the stored weights', gradients' and AdamW's dtype",
        ),
        "mixed_precision.*": Ignore(
            "compute in fsdp_config.param_dtype, reduction in fp32, weights in fsdp_config.model_dtype"
        ),
        "wrap_policy.*": Ignore("each decoder layer is one FSDP unit"),
        "forward_prefetch": Ignore(SPEED),
        "use_orig_params": Ignore("an FSDP1 option; FSDP2 keeps the original parameters"),
        "seed": Ignore("seeds come from trainer.seed"),
        "full_determinism": Ignore("flatrl sets no deterministic-kernel flags"),
        "ulysses_sequence_parallel_size": Map(f"{ours}.ulysses_sequence_parallel_size", why=SP),
        "entropy_from_logits_with_chunking": Ignore("flatrl's logprob kernel is always chunked"),
        "entropy_checkpointing": Ignore(MEMORY),
        "use_torch_compile": Ignore(SPEED),
        "forward_only": Ignore(WORKERS),
        "strategy": Only(("fsdp", "fsdp2", None), FSDP2),
        "entropy_from_logits_chunk_size": Ignore("flatrl's logprob kernel is always chunked"),
        "use_no_sync_for_gradient_accumulation": Ignore(SPEED),
        "pad_to_length": Ignore(SPEED),
        "pad_to_length_bucket": Ignore(SPEED),
        "qat.enable": Only((False,), NO_QAT),
        "qat.*": Ignore("read only with qat.enable"),
        "turbo_config.*": Ignore("read only by verl's turbo engine"),
    }


def _optim(ours: str, grad_clip: str | None) -> dict[str, Rule]:
    """verl's optimizer keys, onto flatrl's optim.OptimConfig at `ours` (lr, betas, weight_decay and min_lr_ratio
    have the same names)."""
    rules: dict[str, Rule] = {
        "lr_warmup_steps_ratio": Map(f"{ours}.warmup_steps_ratio"),
        "lr_warmup_steps": Map(f"{ours}.lr_warmup_steps", convert=lambda v: -1 if v is None else v),
        "warmup_style": Map(f"{ours}.lr_scheduler"),
        "lr_scheduler_type": Map(f"{ours}.lr_scheduler"),
        "num_cycles": Only((0.5,), "flatrl's cosine is half a cycle, from lr down to min_lr_ratio"),
        "total_training_steps": Ignore("the schedule spans the run's steps (trainer.total_training_steps)"),
        "optimizer": Only(("AdamW",), "flatrl trains with torch.optim.AdamW"),
        "optimizer_impl": Only(("torch.optim",), "flatrl trains with torch.optim.AdamW"),
        "override_optimizer_config": Only((None, {}), "AdamW takes lr, betas and weight_decay only"),
        "override_optimizer_config.fused": Map(f"{ours}.fused"),
        "override_optimizer_config.*": Only(
            (None, {}), "AdamW takes lr, betas and weight_decay, and override_optimizer_config.fused only"
        ),
        "lr_decay_style": Map(f"{ours}.lr_scheduler"),
        "zero_indexed_step": Ignore(
            "flatrl's warm-up gives its first step lr / warm-up steps (verl's zero_indexed_step=false); "
            "the schedule is otherwise verl's"
        ),
    }
    if grad_clip is not None:
        rules["clip_grad"] = Map(weak=(grad_clip,), why=f"verl's engine workers read it; {grad_clip} wins")
    return rules


# ----------------------------------------------------------------------- verl.trainer.main_ppo (RL)

RL_PREFIXES = {
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.model.": "model.",
    "actor_rollout_ref.rollout.": "rollout.",
    "reward.custom_reward_function.": "custom_reward_function.",  # verl 0.9.1's place for it
}

# actor_rollout_ref.model.*: path, trust_remote_code, enable_gradient_checkpointing, use_remove_padding,
# lora_rank, lora_alpha and target_modules move to model.* as they are.
RL_MODEL: dict[str, Rule] = {
    "hf_config_path": Only((None,), "the model's own config.json is used"),
    "tokenizer_path": Only((None,), "the tokenizer is model.path's"),
    "use_shm": Ignore(SHM),
    "custom_chat_template": Only((None,), "prompts use the tokenizer's own chat template"),
    "external_lib": Only((None,), NO_CODE),
    # override_config.* moves to model.override_config.* (set on the model's config); attn_implementation, which
    # verl takes out of it for from_pretrained, is flatrl's model.attn_implementation
    "override_config.attn_implementation": Map(
        "model.attn_implementation", why="verl loads the model with it"
    ),
    "lora.rank": Only(
        (0, None), "Megatron's LoRA block: flatrl's LoRA is model.lora_rank, lora_alpha, target_modules"
    ),
    "lora.*": Ignore("read only with model.lora.rank > 0"),
    "enable_activation_offload": Ignore(MEMORY),
    "exclude_modules": Map(
        "model.exclude_modules",
        why="modules LoRA leaves out: a string is a regex on the full module name (re.fullmatch), as PEFT reads it",
    ),
    "lora_adapter_path": Map(
        "model.lora_adapter_path",
        why="LoRA starts from the saved PEFT adapter, with its adapter_config.json's r, lora_alpha and targets",
    ),
    "use_liger": Ignore(SPEED),
    "use_fused_kernels": Ignore(SPEED),
    "fused_kernel_options.*": Ignore(SPEED),
    "tiled_mlp.*": Ignore(MEMORY),
    "mtp.enable": Only((False,), "no multi-token prediction"),
    "mtp.*": Ignore("read only with model.mtp.enable"),
}

# actor_rollout_ref.actor.*: the keys not listed move to actor.* as they are.
RL_ACTOR: dict[str, Rule] = {
    "strategy": Only(("fsdp", "fsdp2"), FSDP2),
    "ppo_mini_batch_size": Map(
        "actor.ppo_mini_batch_size", weak=("critic.ppo_mini_batch_size",), why=CRITIC_FOLLOWS
    ),
    "ppo_micro_batch_size": Map(
        weak=("actor.ppo_micro_batch_size_per_gpu",), convert=_per_gpu, why=GLOBAL_MB
    ),
    "use_dynamic_bsz": Map("actor.use_dynamic_bsz", weak=("critic.use_dynamic_bsz",), why=CRITIC_FOLLOWS),
    "ppo_epochs": Map("actor.ppo_epochs", weak=("critic.ppo_epochs",), why=CRITIC_FOLLOWS),
    "loss_agg_mode": Map("actor.loss_agg_mode", weak=("critic.loss_agg_mode",), why=CRITIC_FOLLOWS),
    "clip_ratio": Map(
        weak=("actor.clip_ratio_low", "actor.clip_ratio_high"), why="both, unless given themselves"
    ),
    "tau_pos": Map(
        "actor.tau_pos", why="SAPO's gate temperatures, read by grpo.py's policy_loss.loss_mode=sapo"
    ),
    "tau_neg": Map(
        "actor.tau_neg", why="SAPO's gate temperatures, read by grpo.py's policy_loss.loss_mode=sapo"
    ),
    "freeze_vision_tower": Ignore("text-only models"),
    "policy_loss.loss_mode": Only(
        ("vanilla",),
        "ppo.py's policy loss is PPO-clip with dual clip (gspo, geo_mean, gpg, cispo and sapo: grpo.py)",
    ),
    "policy_loss.*": Ignore("parameters of clip_cov and kl_cov, loss modes flatrl does not run"),
    "loss_scale_factor": Only((None,), "the loss is normalised as actor.loss_agg_mode says"),
    "calculate_entropy": Ignore("the entropy is always logged (actor/entropy)"),
    "use_prefix_grouper": Ignore(SPEED),
    "use_torch_compile": Map(
        "model.compile_layers",
        convert=lambda v: "auto" if v else False,
        why="false turns torch.compile off, as in verl: flatrl's compiled decoder layers too (true keeps auto, on "
        "with a CUDA device)",
    ),
    "use_fused_kernels": Ignore(SPEED),
    "shuffle": Ignore(MB_IN_ORDER),
    "data_loader_seed": Ignore(MB_IN_ORDER),
    "checkpoint.*": Ignore(CKPT),
    "profiler.*": Ignore(PROFILER),
    "router_replay.mode": Only(("disabled",), "no MoE routing replay"),
    "router_replay.*": Ignore("read only with router_replay.mode"),
    "ulysses_sequence_parallel_size": Map("model.fsdp_config.ulysses_sequence_parallel_size", why=SP),
    "entropy_from_logits_with_chunking": Ignore("flatrl's logprob kernel is always chunked"),
    "entropy_checkpointing": Ignore(MEMORY),
    "use_remove_padding": Map("model.use_remove_padding"),
    "calculate_sum_pi_squared": Ignore(
        "grpo.py computes sum_v pi_v^2 in the old-logprob pass exactly when algorithm.adv_estimator="
        "optimal_token_baseline, which needs it; without that estimator nothing reads it (verl's W-score metric "
        "is not logged)"
    ),
    "sum_pi_squared_checkpointing": Ignore(MEMORY),
    "tis_imp_ratio_cap": Only((-1, None), "no truncated importance sampling of rollout logprobs"),
    "rollout_n": Ignore("verl's copy of rollout.n"),
    "megatron.*": Only((None, {}), MEGATRON),
    "entropy_from_logits_chunk_size": Ignore("flatrl's logprob kernel is always chunked"),
    "pad_to_length": Ignore(SPEED),
    "qat.enable": Only((False,), NO_QAT),
    "qat.*": Ignore("read only with qat.enable"),
    **_under("optim", _optim("actor.optim", grad_clip="actor.grad_clip")),
    **_under("fsdp_config", _fsdp("model.fsdp_config")),
}

# actor_rollout_ref.rollout.*: name, n, temperature, top_p, top_k, dtype, gpu_memory_utilization, ignore_eos,
# enforce_eager, free_cache_engine, tensor_model_parallel_size, max_num_batched_tokens, max_num_seqs,
# enable_chunked_prefill, enable_prefix_caching and val_kwargs.* move to rollout.* as they are.
RL_ROLLOUT: dict[str, Rule] = {
    "mode": Ignore("flatrl generates a step's prompts in one call to its in-process engine"),
    "prompt_length": Map(weak=("data.max_prompt_length",), why="verl copies it from data"),
    "response_length": Map(weak=("data.max_response_length",), why="verl copies it from data"),
    "do_sample": Only((True,), "training rollouts sample; rollout.temperature=0 is greedy"),
    "over_sample_rate": Only((0,), "every response is kept"),
    "use_fire_sampling": Only((False,), "no FIRE sampling"),
    "cudagraph_capture_sizes": Ignore(SPEED),
    "data_parallel_size": Ignore(ONE_ENGINE),
    "expert_parallel_size": Ignore(ONE_ENGINE),
    "pipeline_model_parallel_size": Ignore(ONE_ENGINE),
    "max_model_len": Ignore("the engine's length is data.max_prompt_length + data.max_response_length"),
    "logprobs_mode": Ignore("the engine's logprobs only check the weight push; the trainer recomputes them"),
    "calculate_log_probs": Ignore(
        "the engine's logprobs check the weight push, on short probes of rollout.logprob_check_prompts prompts a "
        "call (on every rollout with rollout importance sampling); the trainer recomputes them"
    ),
    "scheduling_policy": Ignore(SPEED),
    "load_format": Ignore("the engine loads model.path, then takes the trainer's weights every step"),
    "layered_summon": Ignore(PUSH),
    "update_weights_bucket_megabytes": Ignore(PUSH),
    "checkpoint_engine.*": Ignore(PUSH),
    "log_prob_micro_batch_size": Ignore(LOGPROBS),
    "log_prob_micro_batch_size_per_gpu": Ignore(LOGPROBS),
    "log_prob_use_dynamic_bsz": Ignore(LOGPROBS),
    "log_prob_max_token_len_per_gpu": Ignore(LOGPROBS),
    "disable_log_stats": Ignore("vLLM's own statistics are not logged"),
    "multi_stage_wake_up": Ignore(MEMORY),
    "engine_kwargs.*": Ignore("no extra engine arguments are passed: rollout.* holds those flatrl sets"),
    "multi_turn.enable": Only((False,), "single-turn generation only"),
    "multi_turn.*": Ignore("read only with multi_turn.enable"),
    "agent.*": Ignore("agent loops run only for multi-turn rollouts"),
    "chat_scheduler": Ignore("read only for multi-turn rollouts"),
    "trace.*": Ignore("no rollout tracing"),
    "skip_rollout": Only((False,), "every step generates"),
    "skip_dump_dir": Ignore("read only with skip_rollout"),
    "skip_tokenizer_init": Ignore("the engine always has a tokenizer"),
    "enable_rollout_routing_replay": Only((False,), "no MoE routing replay"),
    "profiler.*": Ignore(PROFILER),
    "prometheus.*": Ignore("no Prometheus export"),
    "quantization": Only((None,), "the engine runs the trainer's weights in rollout.dtype"),
    "quantization_config_file": Only((None,), "the engine runs the trainer's weights in rollout.dtype"),
    "mtp": Ignore("verl's copy of model.mtp"),
    "disaggregation.enabled": Only((False,), "no prefill/decode disaggregation: one engine per rank"),
    "disaggregation.*": Ignore("read only with rollout.disaggregation.enabled"),
    "full_determinism": Ignore(
        "vLLM's batch-invariant kernels are not switched on; seeded draws repeat anyway"
    ),
    "moe_load_balance_metrics_interval": Ignore("no MoE metrics"),
    "n_gpus_per_node": Ignore("the engine shares the trainer's GPUs (torchrun's)"),
    "nnodes": Ignore("the engine shares the trainer's GPUs (torchrun's)"),
    "qat": Ignore("verl's copy of the actor's qat (actor_rollout_ref.actor.fsdp_config.qat, checked there)"),
    "qat.*": Ignore(
        "verl's copy of the actor's qat (actor_rollout_ref.actor.fsdp_config.qat, checked there)"
    ),
    "router_config_path": Only((None,), "one engine per rank: no router"),
}

# data.*: train_files, val_files, prompt_key, max_prompt_length, max_response_length, train_batch_size,
# filter_overlong_prompts, shuffle and seed are flatrl's names.
RL_DATA: dict[str, Rule] = {
    "tokenizer": Only((None,), "the tokenizer is model.path's"),
    "use_shm": Ignore(SHM),
    "train_max_samples": Only((-1, None), ALL_ROWS),
    "val_max_samples": Only((-1, None), ALL_ROWS),
    "reward_fn_key": Only(("data_source",), "rewards dispatch on the data_source column"),
    "val_batch_size": Ignore("validation generates for all its prompts in one call"),
    "tool_config_path": Only((None,), "no tool calls (single-turn generation)"),
    "return_raw_input_ids": Ignore(WORKERS),
    "return_raw_chat": Ignore(WORKERS),
    "return_full_prompt": Ignore(WORKERS),
    "dataloader_num_workers": Ignore("prompts are tokenised once, at the start"),
    "validation_shuffle": Ignore("validation scores do not depend on the order"),
    "filter_overlong_prompts_workers": Ignore("prompts are tokenised once, at the start"),
    "trust_remote_code": Ignore("the tokenizer follows model.trust_remote_code"),
    "image_key": Ignore(TEXT_ONLY),
    "video_key": Ignore(TEXT_ONLY),
    "image_patch_size": Ignore(TEXT_ONLY),
    "return_multi_modal_inputs": Ignore(TEXT_ONLY),
    "custom_cls.path": Only((None,), f"data.RLDataset reads verl's schema; {NO_CODE}"),
    "custom_cls.name": Ignore("read only with data.custom_cls.path"),
    "sampler.class_path": Only((None,), f"data.EpochSampler draws the prompts; {NO_CODE}"),
    "sampler.class_name": Ignore("read only with data.sampler.class_path"),
    "datagen.path": Only((None,), NO_CODE),
    "datagen.name": Ignore("read only with data.datagen.path"),
    "audio_key": Ignore(TEXT_ONLY),
    "mm_processor_kwargs": Ignore(TEXT_ONLY),
    "mm_processor_kwargs.*": Ignore(TEXT_ONLY),
    "function_tool_path": Only((None,), "no tool calls (single-turn generation)"),
    "gen_batch_size": Ignore(
        "each generation round draws data.train_batch_size prompts (verl 0.9.1's sampler: the fetch granularity, "
        "one prompt at a time under algorithm.filter_groups)"
    ),
}

# algorithm.*: adv_estimator, kl_penalty, use_kl_in_reward and kl_ctrl.* are flatrl's names; gamma and lam in ppo.py.
RL_ALGORITHM: dict[str, Rule] = {
    "use_pf_ppo": Ignore("verl redraws the batch by score only after GAE: ppo.py has PF-PPO"),
    "pf_ppo.*": Ignore("read only with algorithm.use_pf_ppo (ppo.py)"),
    "filter_groups.enable": Only((False,), "no DAPO dynamic sampling in ppo.py (grpo.py has it)"),
    "filter_groups.*": Ignore("read only with algorithm.filter_groups.enable"),
    "rollout_correction.rollout_is": Pair("with its threshold, as algorithm.rollout_is (overrides._pairs)"),
    "rollout_correction.rollout_is_threshold": Pair("read with algorithm.rollout_correction.rollout_is"),
    "rollout_correction.rollout_is_batch_normalize": Pair(
        "read with algorithm.rollout_correction.rollout_is, as algorithm.rollout_is_batch_normalize"
    ),
    "rollout_correction.rollout_rs": Pair("with its threshold, as algorithm.rollout_rs (overrides._pairs)"),
    "rollout_correction.rollout_rs_threshold": Pair("read with algorithm.rollout_correction.rollout_rs"),
    "rollout_correction.rollout_rs_threshold_lower": Only(
        (None,), "verl 0.6's lower bound; give it in rollout_rs_threshold as lower_upper (verl 0.7+)"
    ),
    "rollout_correction.bypass_mode": Pair(
        "with its loss_type, as algorithm.rollout_bypass (overrides._pairs)"
    ),
    "rollout_correction.rollout_token_veto_threshold": Only((None,), "no veto of whole sequences"),
    "rollout_correction.loss_type": Pair(
        "read with algorithm.rollout_correction.bypass_mode, as algorithm.rollout_loss_type"
    ),
    "rollout_correction.use_policy_gradient": Pair(
        "verl 0.6's loss_type: true is reinforce; read with algorithm.rollout_correction.bypass_mode"
    ),
    "rollout_correction.*": Ignore("not read: flatrl's rollout correction is the keys above"),
    "rollout_is": Only((False, None), "no rollout importance sampling: old logprobs are recomputed"),
    "rollout_is_batch_normalize": Only((False,), "no rollout importance sampling in ppo.py (grpo.py has it)"),
    "rollout_rs": Only((None,), "no rollout rejection sampling in ppo.py (grpo.py has it)"),
    "rollout_rs_threshold": Ignore("read only with algorithm.rollout_rs"),
    "rollout_bypass": Only(
        (False,), "no bypass mode in ppo.py: it recomputes the old logprobs (grpo.py has it)"
    ),
    "rollout_loss_type": Ignore("read only with algorithm.rollout_bypass"),
    "rollout_is_level": Ignore("read only with algorithm.rollout_is"),
    "rollout_is_mode": Ignore("read only with algorithm.rollout_is"),
    "rollout_is_threshold": Ignore("read only with algorithm.rollout_is"),
    "rollout_is_threshold_lower": Ignore("read only with algorithm.rollout_is"),
    "rollout_is_veto_threshold": Ignore("read only with algorithm.rollout_is"),
}

# trainer.*: total_epochs, total_training_steps, project_name, experiment_name, save_freq, test_freq,
# resume_mode, val_before_train, val_only and default_local_dir are flatrl's names.
RL_TRAINER: dict[str, Rule] = {
    "logger": Map("trainer.logger", convert=_as_list),
    "n_gpus_per_node": Pair("torchrun sets the ranks (--nproc_per_node); checked against WORLD_SIZE"),
    "nnodes": Pair("torchrun sets the ranks (--nnodes); checked against WORLD_SIZE"),
    "resume_from_path": Pair(
        "read with trainer.resume_mode=resume_path, which becomes trainer.resume_mode=PATH"
    ),
    "max_actor_ckpt_to_keep": Map("trainer.max_ckpt_to_keep"),
    "max_critic_ckpt_to_keep": Ignore(
        "one checkpoint holds the actor and the critic: trainer.max_ckpt_to_keep"
    ),
    "remove_previous_ckpt_in_save": Only((False,), "give trainer.max_ckpt_to_keep=1 instead"),
    "default_hdfs_dir": Ignore("no HDFS copy: checkpoints stay in trainer.default_local_dir"),
    "del_local_ckpt_after_load": Only((False, None), "local checkpoints are kept"),
    "balance_batch": Ignore("each rank trains on its prompts' responses; losses are normalised globally"),
    "log_val_generations": Ignore(SAMPLES),
    "val_generations_to_log_to_wandb": Ignore(SAMPLES),
    "rollout_data_dir": Ignore("rollouts are not dumped to files"),
    "validation_data_dir": Ignore("validation generations are not dumped to files"),
    "esi_redundant_time": Ignore("no elastic-instance deadline"),
    "ray_wait_register_center_timeout": Ignore("no Ray"),
    "device": Only(("cuda", "cpu", None), "flatrl runs on CUDA, or the CPU when there is none"),
    "use_legacy_worker_impl": Ignore("verl's choice of worker implementation; flatrl has one"),
    "profile_steps": Ignore(PROFILER),
    "profile_continuous_steps": Ignore(PROFILER),
    "npu_profile.*": Ignore(PROFILER),
    "controller_nsight_options.*": Ignore(PROFILER),
    "worker_nsight_options.*": Ignore(PROFILER),
    "checkpoint_callback_class": Only((None,), NO_CODE),
    "use_v1": Ignore("verl's choice of trainer implementation; flatrl has one"),
    "v1.trainer_mode": Only(
        ("sync",), "grpo.py's loop is verl's sync mode; rollout.async_steps=1 is its one-step off-policy mode"
    ),
    "v1.*": Ignore("read only by verl's asynchronous trainer modes"),
}

# verl's reward manager and sandbox keys: at the top level, and under reward.* in verl 0.9.1.
REWARD_MANAGER: dict[str, Rule] = {
    "reward_manager.source": Only(("register",), "flatrl has one reward manager"),
    "reward_manager.name": Only(("naive", "prime", "dapo"), REWARD_FN),
    "reward_manager.module.path": Only((None,), NO_CODE),
    "reward_manager.module.name": Ignore("read only with reward_manager.module.path"),
    "sandbox_fusion.url": Only((None,), "no sandboxed code execution"),
    "sandbox_fusion.*": Ignore("read only with sandbox_fusion.url"),
}

# verl's dapo reward manager reads reward_kwargs (reward_model.reward_kwargs, reward.reward_kwargs in verl 0.9.1);
# verl's DAPO recipe had the same buffer as reward_model.overlong_buffer, with data.max_response_length for its end.
OVERLONG = "custom_reward_function.overlong_buffer"
REWARD_KWARGS: dict[str, Rule] = {
    **{
        f"reward_kwargs.overlong_buffer_cfg.{k}": Map(f"{OVERLONG}.{k}", why="DAPO's length penalty")
        for k in ("enable", "len", "penalty_factor", "log")
    },
    "reward_kwargs.max_resp_len": Map(f"{OVERLONG}.max_resp_len", why="DAPO's length penalty"),
}

# reward.* (verl 0.9.1 gathers the reward settings here; the top-level names still work there, and here).
RL_REWARD: dict[str, Rule] = {
    # custom_reward_function.* moves to flatrl's custom_reward_function.* (RL_PREFIXES)
    "num_workers": Map("custom_reward_function.num_workers", why="processes scoring the responses"),
    "reward_model.enable": Only((False,), "flatrl scores with reward functions (reward.py), no reward model"),
    "reward_model.*": Ignore("read only with reward_model.enable"),
    **REWARD_MANAGER,
    **REWARD_KWARGS,
}

RL: dict[str, Rule] = {
    "defaults": Ignore(DEFAULTS),
    "hydra.*": Ignore("Hydra's own settings (output folder, logging)"),
    "debug": Map("trainer.debug"),
    **_under("actor_rollout_ref.model", RL_MODEL),
    **_under("actor_rollout_ref.actor", RL_ACTOR),
    # verl's FusedLinearForPPO: logprobs and entropy from the hidden states, no [B, T, V] logits (the critic's and
    # SFT's copies of the key stay ignored: a value head has no vocabulary)
    "actor_rollout_ref.model.use_fused_kernels": Map("model.use_fused_kernels", why=FUSED),
    "actor_rollout_ref.actor.use_fused_kernels": Map("model.use_fused_kernels", why=FUSED),
    "actor_rollout_ref.ref.model": Only((None,), "the reference is the starting policy (model.path)"),
    "actor_rollout_ref.ref.*": Ignore(REF),
    **_under("actor_rollout_ref.rollout", RL_ROLLOUT),
    "actor_rollout_ref.profiler.*": Ignore(PROFILER),
    "actor_rollout_ref.hybrid_engine": Only((True,), "the engine always shares the trainer's GPUs"),
    "actor_rollout_ref.nccl_timeout": Map("trainer.timeout_s"),
    **_under("data", RL_DATA),
    # custom_reward_function.path and .name are flatrl's names.
    # verl 0.9.1 keeps these top-level names with null (unset) values beside its reward.* section
    "reward_model.enable": Only(
        (False, None), "flatrl scores with reward functions (reward.py), no reward model"
    ),
    "reward_model.reward_manager": Only(("naive", "prime", "dapo", None), REWARD_FN),
    "reward_model.launch_reward_fn_async": Ignore(
        "flatrl always scores in the background, beside the logprobs"
    ),
    "reward_model.sandbox_fusion.url": Only((None,), "no sandboxed code execution"),
    **_under("reward_model", REWARD_KWARGS),
    **{
        f"reward_model.overlong_buffer.{k}": Map(f"{OVERLONG}.{k}", why="DAPO's length penalty")
        for k in ("enable", "len", "penalty_factor", "log")
    },
    "reward_model.*": Ignore("read only with reward_model.enable"),
    **REWARD_MANAGER,
    **_under("reward", RL_REWARD),
    "distillation.enabled": Only((False,), "no distillation from a teacher model"),
    "distillation.*": Ignore("read only with distillation.enabled"),
    "skip.rollout.enable": Only((False,), "every step generates"),
    "skip.rollout_tq.enable": Only((False,), "every step generates"),
    "skip.async_rollout.enable": Only((False,), "every step generates"),
    "skip.*": Ignore("read only with skip.*.enable"),
    **_under("algorithm", RL_ALGORITHM),
    **_under("trainer", RL_TRAINER),
    "global_profiler.*": Ignore(PROFILER),
    "ray_init.*": Ignore("no Ray"),
    "ray_kwargs.*": Ignore("no Ray"),
    "transfer_queue.*": Ignore("no transfer queue: one process per GPU"),
    # The layout of verl's config tutorial: batch and clip settings under trainer and algorithm.
    "algorithm.clip_ratio": Map(
        weak=("actor.clip_ratio_low", "actor.clip_ratio_high"), why="the actor's PPO clip"
    ),
    "trainer.ppo_micro_batch_size_per_gpu": Map("actor.ppo_micro_batch_size_per_gpu"),
    "trainer.use_dynamic_bsz": Map("actor.use_dynamic_bsz"),
    "trainer.grad_clip": Map("actor.grad_clip"),
    "trainer.num_epochs": Only(
        (1,),
        "ambiguous: give trainer.total_epochs (passes over the data) or actor.ppo_epochs (updates per batch)",
    ),
    "trainer.fsdp_config.sharding_strategy": Map(
        "model.fsdp_config.reshard_after_forward",
        convert=_sharding,
        why="FULL_SHARD: true, SHARD_GRAD_OP: false",
    ),
    "trainer.fsdp_config.cpu_offload": Map("model.fsdp_config.cpu_offload"),
}

GRPO: dict[str, Rule] = {
    "algorithm.gamma": Only((1,), "grpo.py's estimators score whole responses (gamma 1)"),
    "algorithm.lam": Ignore("GAE's lambda: grpo.py has no GAE (ppo.py does)"),
    "critic.enable": Only((None, False), NO_CRITIC),
    "critic.*": Ignore(NO_CRITIC),
    "trainer.critic_warmup": Only((0,), NO_CRITIC),
    "actor_rollout_ref.actor.policy_loss.loss_mode": Map("actor.policy_loss.loss_mode"),
    "algorithm.rollout_is": Map("algorithm.rollout_is"),
    "algorithm.rollout_is_threshold": Map("algorithm.rollout_is_threshold"),
    "algorithm.rollout_is_level": Map("algorithm.rollout_is_level"),
    "algorithm.rollout_is_batch_normalize": Map("algorithm.rollout_is_batch_normalize"),
    "algorithm.rollout_rs": Map("algorithm.rollout_rs"),
    "algorithm.rollout_rs_threshold": Map("algorithm.rollout_rs_threshold"),
    "algorithm.rollout_bypass": Map("algorithm.rollout_bypass"),
    "algorithm.rollout_loss_type": Map("algorithm.rollout_loss_type"),
    "algorithm.rollout_is_mode": Only(("truncate",), "grpo.py truncates the weights (TIS); no masking"),
    "algorithm.rollout_is_threshold_lower": Ignore("truncate mode bounds the weights from above only"),
    "algorithm.rollout_is_veto_threshold": Only((None,), "no veto of whole sequences"),
    "algorithm.filter_groups.enable": Map("algorithm.filter_groups.enable"),
    "algorithm.filter_groups.metric": Map("algorithm.filter_groups.metric"),
    "algorithm.filter_groups.max_num_gen_batches": Map("algorithm.filter_groups.max_num_gen_batches"),
    "algorithm.filter_groups.max_inflight_gen_batches": Ignore(
        "grpo.py generates one batch at a time; the filter keeps the same groups"
    ),
}

# critic.*: the keys not listed are flatrl's names.
PPO_CRITIC: dict[str, Rule] = {
    **_under("model", RL_MODEL),
    "enable": Only((None, True), "ppo.py always trains the critic"),
    "strategy": Only(("fsdp", "fsdp2"), FSDP2),
    "rollout_n": Ignore("verl's copy of rollout.n"),
    "ppo_micro_batch_size": Map(
        weak=("critic.ppo_micro_batch_size_per_gpu",), convert=_per_gpu, why=GLOBAL_MB
    ),
    "forward_micro_batch_size": Ignore(
        "values are computed in critic.ppo_micro_batch_size_per_gpu micro-batches"
    ),
    "forward_micro_batch_size_per_gpu": Ignore(
        "values are computed in critic.ppo_micro_batch_size_per_gpu micro-batches"
    ),
    "forward_max_token_len_per_gpu": Ignore("values are computed under critic.ppo_max_token_len_per_gpu"),
    "shuffle": Ignore(MB_IN_ORDER),
    "data_loader_seed": Ignore(MB_IN_ORDER),
    "checkpoint.*": Ignore(CKPT),
    "profiler.*": Ignore(PROFILER),
    "ulysses_sequence_parallel_size": Map("critic.model.fsdp_config.ulysses_sequence_parallel_size", why=SP),
    "model.tokenizer_path": Ignore("the critic reads the actor's tokens"),
    "model.override_config.attn_implementation": Map(
        "critic.model.attn_implementation", why="verl loads the model with it"
    ),
    "megatron.*": Only((None, {}), MEGATRON),
    "model.external_lib": Only((None,), NO_CODE),
    "model.use_shm": Ignore(SHM),
    "model.enable_activation_offload": Ignore(MEMORY),
    "model.tiled_mlp.*": Ignore(MEMORY),
    **_under("optim", _optim("critic.optim", grad_clip="critic.grad_clip")),
    **_under("model.fsdp_config", _fsdp("critic.model.fsdp_config")),
    **_under("fsdp", _fsdp("critic.model.fsdp_config")),
    "loss_scale_factor": Only((None,), "the loss is normalised as critic.loss_agg_mode says"),
    # After the spread: these read differently for the critic.
    "model.lora_rank": Only((0,), "the critic trains all its weights (LoRA is the actor's)"),
    "model.exclude_modules": Only((None,), "the critic trains all its weights (LoRA is the actor's)"),
    "model.lora_adapter_path": Only((None,), "the critic trains all its weights (LoRA is the actor's)"),
}

PPO: dict[str, Rule] = {
    "algorithm.norm_adv_by_std_in_grpo": Ignore("grpo.py's option; ppo.py whitens its GAE advantages"),
    "algorithm.use_pf_ppo": Map("algorithm.use_pf_ppo"),
    "algorithm.pf_ppo.reweight_method": Map("algorithm.pf_ppo.reweight_method"),
    "algorithm.pf_ppo.weight_pow": Map("algorithm.pf_ppo.weight_pow"),
    **_under("critic", PPO_CRITIC),
}

# ------------------------------------------------------------------- verl.trainer.fsdp_sft_trainer (SFT)

# data.*: train_files, val_files, prompt_key, response_key, prompt_dict_keys, response_dict_keys, max_length,
# truncation, train_batch_size and micro_batch_size_per_gpu are flatrl's names.
SFT_DATA: dict[str, Rule] = {
    "micro_batch_size": Map(weak=("data.micro_batch_size_per_gpu",), convert=_per_gpu, why=GLOBAL_MB),
    "train_max_samples": Only((-1, None), ALL_ROWS),
    "val_max_samples": Only((-1, None), ALL_ROWS),
    "multiturn.enable": Ignore("a row whose data.messages_key column is set is read as a chat"),
    "multiturn.messages_key": Map("data.messages_key"),
    "multiturn.tools_key": Ignore("tools are not passed to the chat template"),
    "multiturn.enable_thinking_key": Ignore("the chat template's defaults are used"),
    "balance_dp_token": Ignore("each rank's share is always balanced by tokens"),
    "chat_template": Only((None,), "the tokenizer's own chat template is used"),
    "custom_cls.path": Only((None,), f"data.SFTDataset reads the rows; {NO_CODE}"),
    "custom_cls.name": Ignore("read only with data.custom_cls.path"),
    "use_shm": Ignore(SHM),
}

# model.*: partial_pretrain, trust_remote_code, enable_gradient_checkpointing, lora_rank, lora_alpha,
# target_modules and fsdp_config.cpu_offload are flatrl's names.
SFT_MODEL: dict[str, Rule] = {
    "fsdp_config.model_dtype": Map(
        "model.fsdp_config.model_dtype",
        convert=_model_dtype,
        why="the stored weights', gradients' and AdamW's dtype",
    ),
    "fsdp_config.wrap_policy.*": Ignore("each decoder layer is one FSDP unit"),
    "fsdp_config.offload_params": Ignore(f"{OFFLOAD}, with model.fsdp_config.cpu_offload"),
    "external_lib": Only((None,), NO_CODE),
    "use_liger": Ignore(SPEED),
    "strategy": Only(("fsdp", "fsdp2"), FSDP2),
    "use_shm": Ignore(SHM),
}

# trainer.*: default_local_dir, project_name, experiment_name, total_epochs, total_training_steps, seed,
# save_freq, test_freq, max_ckpt_to_keep and resume_mode are flatrl's names.
SFT_TRAINER: dict[str, Rule] = {
    "logger": Map("trainer.logger", convert=_as_list),
    "n_gpus_per_node": Pair("torchrun sets the ranks (--nproc_per_node); checked against WORLD_SIZE"),
    "nnodes": Pair("torchrun sets the ranks (--nnodes); checked against WORLD_SIZE"),
    "resume_from_path": Pair(
        "read with trainer.resume_mode=resume_path, which becomes trainer.resume_mode=PATH"
    ),
    "resume_path": Map("trainer.resume_mode", why="a checkpoint path in resume_mode resumes from it"),
    "default_hdfs_dir": Ignore("no HDFS copy: checkpoints stay in trainer.default_local_dir"),
    "checkpoint.*": Ignore(CKPT),
    "device": Only(("cuda", "cpu", None), "flatrl runs on CUDA, or the CPU when there is none"),
}

# verl.trainer.sft_trainer (the engine trainer that replaced fsdp_sft_trainer; sft_trainer_engine.yaml) keeps
# data.*, optim.* and trainer.*, and moves the model to model.path with hf_model's keys (RL_MODEL's) and the
# sharding to engine.* (fsdp_config's keys).
SFT_ENGINE_DATA: dict[str, Rule] = {
    "pad_mode": Ignore(
        "sequences are packed (model.use_remove_padding) or right-padded; the loss is the same"
    ),
    "tools_key": Ignore("tools are not passed to the chat template"),
    "enable_thinking_key": Ignore("a per-row switch of the chat template: its defaults are used"),
    "enable_thinking_default": Only(("none", None), "the chat template's defaults are used"),
    "ignore_input_ids_mismatch": Only(
        (False,), "a chat whose template does not extend turn by turn is a bad row (data.skip_bad_rows)"
    ),
    "num_workers": Ignore("rows are tokenised once, at the start"),
}

SFT_ENGINE: dict[str, Rule] = {
    "model": Only(("hf_model",), "verl's model group: flatrl loads a Hugging Face causal LM"),
    "engine": Only(("fsdp",), f"verl's engine group: {FSDP2}"),
    "optim": Only(("fsdp",), "verl's optimizer group: flatrl trains with torch.optim.AdamW"),
    "model.path": Map("model.partial_pretrain", why="fsdp_sft_trainer's model.partial_pretrain"),
    **_under("model", RL_MODEL),
    **_under("engine", _fsdp("model.fsdp_config")),
    "engine.optimizer_offload": Ignore(
        f"{MEMORY}: sft.py offloads the optimizer state with engine.param_offload"
    ),
    **_under("data", SFT_ENGINE_DATA),
    "trainer.balance_batch": Ignore("each rank's share is always balanced by tokens"),
    "trainer.profile_interval": Ignore(PROFILER),
    "checkpoint.*": Ignore(CKPT),
    "profiler.*": Ignore(PROFILER),
}

SFT: dict[str, Rule] = {
    "defaults": Ignore(DEFAULTS),
    "hydra.*": Ignore("Hydra's own settings (output folder, logging)"),
    "debug": Map("trainer.debug"),
    **_under("data", SFT_DATA),
    **_under("model", SFT_MODEL),
    **_under("optim", _optim("optim", grad_clip=None)),
    "ulysses_sequence_parallel_size": Map("model.fsdp_config.ulysses_sequence_parallel_size", why=SP),
    "use_remove_padding": Map("model.use_remove_padding"),
    **_under("trainer", SFT_TRAINER),
    **SFT_ENGINE,
}

HYDRA_TARGET = Ignore(
    "Hydra's `_target_`: the class verl builds from the section; flatrl's dataclasses are fixed"
)
"""The rule for every key named `_target_`, at any depth (a full verl config has dozens)."""

HINTS = {
    "algorithm.adv_estimator": (
        "grpo.py runs grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, gpg, remax and "
        "optimal_token_baseline (not tir_optimal_token_baseline: multi-turn rollouts are not built); ppo.py runs "
        "gae (with a critic)"
    ),
    "rollout.name": "flatrl's engines: vllm, or hf (transformers' generate, for tests)",
}


# ----------------------------------------------------------------------------------------- the docs


def _describe(key: str, rule: Rule) -> tuple[str, str]:
    if isinstance(rule, Map):
        dests = [f"`{t}`" for t in rule.to] + [f"`{t}` (weak)" for t in rule.weak]
        return "-> " + ", ".join(dests), rule.why
    if isinstance(rule, Ignore):
        return "ignored", rule.why
    if isinstance(rule, Pair):
        return "read together", rule.why
    values = ", ".join(
        "null" if v is None else f"`{json.dumps(v) if not isinstance(v, str) else v}`" for v in rule.values
    )
    return f"only {values}; else an error", rule.why


def markdown() -> str:
    """The tables as markdown: one section per table, a row per key (docs/VERL.md holds this text)."""
    sections = [
        ("verl.trainer.main_ppo: grpo.py and ppo.py", RL),
        ("main_ppo keys read differently by grpo.py", GRPO),
        ("main_ppo keys read differently by ppo.py", PPO),
        ("verl.trainer.fsdp_sft_trainer and verl.trainer.sft_trainer: sft.py", SFT),
    ]
    lines = []
    for title, table in sections:
        lines += [f"### {title}", "", "| verl key | flatrl | why |", "|---|---|---|"]
        for key, rule in table.items():
            what, why = _describe(key, rule)
            lines.append(f"| `{key}` | {what} | {why} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
