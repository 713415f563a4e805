"""verl users' command lines and configs run unchanged: Hydra-style overrides, verl's key names (verl_keys.py),
the config tutorial's template, duplicate YAML keys, the --print-config round trip, the world-size check.

The example command lines are written from verl's public examples (examples/grpo_trainer/run_qwen2-7b.sh,
examples/ppo_trainer/run_deepseek7b_llm.sh, examples/sft/gsm8k/run_qwen_05_peft.sh: FSDP + vLLM, GSM8K) and its
SFT engine test (tests/special_e2e/sft/run_sft_engine.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import config
import grpo
import overrides
import ppo
import reward
import rl
import sft
import verl_keys

ROOT = Path(__file__).resolve().parents[1]
HOME = "/home/user"

GRPO_EXAMPLE = f"""
    algorithm.adv_estimator=grpo data.train_files={HOME}/data/gsm8k/train.parquet
    data.val_files={HOME}/data/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512
    data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False trainer.critic_warmup=0
    trainer.logger=["console","wandb"] trainer.project_name=verl_grpo_example_gsm8k
    trainer.experiment_name=qwen2_7b_function_rm trainer.n_gpus_per_node=8 trainer.nnodes=1
    trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
""".split()  # as bash passes them: quotes gone

PPO_EXAMPLE = f"""
    algorithm.adv_estimator=gae data.train_files={HOME}/data/gsm8k/train.parquet
    data.val_files={HOME}/data/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512
    data.max_response_length=512 data.filter_overlong_prompts=True data.truncation=error
    actor_rollout_ref.model.path=deepseek-ai/deepseek-llm-7b-chat actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.rollout.tensor_model_parallel_size=4
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.4 critic.optim.lr=1e-5
    critic.model.use_remove_padding=True critic.model.path=deepseek-ai/deepseek-llm-7b-chat
    critic.model.enable_gradient_checkpointing=True critic.ppo_micro_batch_size_per_gpu=32
    critic.model.fsdp_config.param_offload=False critic.model.fsdp_config.optimizer_offload=False
    algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=["console","wandb"]
    trainer.project_name=verl_example_gsm8k trainer.experiment_name=deepseek_llm_7b_function_rm
    trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=1
    trainer.use_legacy_worker_impl=auto trainer.total_epochs=15
""".split()

SFT_EXAMPLE = f"""
    data.train_files={HOME}/data/gsm8k/train.parquet data.val_files={HOME}/data/gsm8k/test.parquet
    data.prompt_key=extra_info data.response_key=extra_info optim.lr=1e-4 data.prompt_dict_keys=['question']
    +data.response_dict_keys=['answer'] data.micro_batch_size_per_gpu=4
    model.partial_pretrain=Qwen/Qwen2.5-0.5B-Instruct trainer.default_local_dir=/tmp/sft-save
    trainer.project_name=gsm8k-sft trainer.experiment_name=gsm8k-sft-qwen-2.5-0.5b-instruct trainer.logger=console
    trainer.total_epochs=1 model.lora_rank=32 model.lora_alpha=16 model.target_modules=all-linear
""".split()

# verl 0.9.1's SFT trainer (verl.trainer.sft_trainer, which replaced fsdp_sft_trainer): the model under model.path,
# the sharding under engine.*, Hydra group choices; as verl's tests/special_e2e/sft/run_sft_engine.sh passes them.
SFT_ENGINE_EXAMPLE = f"""
    data.train_files={HOME}/data/gsm8k_sft/train.parquet data.val_files={HOME}/data/gsm8k_sft/test.parquet
    data.train_batch_size=256 data.pad_mode=no_padding data.truncation=error data.use_dynamic_bsz=True
    data.max_token_len_per_gpu=8192 data.messages_key=messages model.path=Qwen/Qwen2.5-0.5B-Instruct
    engine=fsdp optim=fsdp optim.lr=1e-5 optim.lr_warmup_steps_ratio=0.05 optim.weight_decay=0.1
    optim.betas=[0.9,0.95] optim.clip_grad=1.0 optim.min_lr_ratio=0.1 optim.warmup_style=cosine
    engine.ulysses_sequence_parallel_size=2 engine.strategy=fsdp trainer.save_freq=-1 trainer.logger=['console']
    trainer.project_name=verl_sft_test trainer.experiment_name=gsm8k-fsdp trainer.total_epochs=2
    trainer.total_training_steps=2 trainer.default_local_dir=/tmp/sft-engine trainer.resume_mode=disable
""".split()

# verl's config tutorial's own template (as the issue gives it): Hydra defaults, batch keys under trainer,
# clip_ratio under algorithm, and a second trainer: block.
TUTORIAL = """\
defaults: [{override /algorithm: ppo}, {override /rollout: vllm}, {override /trainer: fsdp}]
model: {path: Qwen/Qwen2-7B-Instruct, trust_remote_code: true, lora_rank: 64}
algorithm: {gamma: 1.0, lam: 0.95, clip_ratio: 0.1, kl_ctrl: {type: adaptive, kl_coef: 0.0005, target_kl: 0.1}}
trainer: {ppo_micro_batch_size_per_gpu: 16, use_dynamic_bsz: true, grad_clip: 0.1, num_epochs: 1}
rollout: {name: vllm, gpu_memory_utilization: 0.6, max_num_batched_tokens: 16384, enable_chunked_prefill: true}
trainer: {fsdp_config: {sharding_strategy: FULL_SHARD, cpu_offload: false}}
"""


def run(script: str, args: list[str], world_size: int | None = 8) -> subprocess.CompletedProcess:
    """`python script args` from the repo root, as a user runs it (WORLD_SIZE as torchrun would set it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")} | {"OMP_NUM_THREADS": "1"}
    if world_size is not None:
        env["WORLD_SIZE"] = str(world_size)
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_accounted(args: list[str], stderr: str, cls: type) -> None:
    """Every override is a flatrl key, a plain prefix move, or named on stderr (mapped / ignored)."""
    prefixes = overrides.table_for(cls)[1]
    for arg in args:
        key = arg.lstrip("+~").split("=", 1)[0]
        silent = overrides.targets(key, cls) in ([key], [overrides._moved(key, prefixes)])
        assert silent or f" {key}" in stderr or f"{key}=" in stderr, (key, stderr)


def print_config(script: str, args: list[str], cls: type, tmp_path: Path, world_size: int | None = 8):
    """Runs `script args --print-config`; returns (the config it printed, stderr). Checks rc 0, that stdout is
    YAML only, and the round trip: the printed YAML loaded back with --config is the same config."""
    p = run(script, [*args, "--print-config"], world_size)
    assert p.returncode == 0, p.stderr
    printed = yaml.safe_load(p.stdout)
    cfg = config.from_dict(cls, printed)
    path = tmp_path / "printed.yaml"
    path.write_text(p.stdout)
    assert config.parse(cls, ["--config", str(path)]) == cfg
    assert config.to_yaml(cfg) == p.stdout
    return cfg, p.stderr


def test_grpo_example_command_line(tmp_path):
    c, err = print_config("grpo.py", GRPO_EXAMPLE, grpo.GRPOConfig, tmp_path)
    assert c.algorithm.adv_estimator == "grpo" and c.data.train_files == f"{HOME}/data/gsm8k/train.parquet"
    assert (c.data.train_batch_size, c.data.max_prompt_length, c.data.max_response_length) == (
        1024,
        512,
        1024,
    )
    assert c.model.path == "Qwen/Qwen2-7B-Instruct" and c.model.use_remove_padding
    assert c.model.enable_gradient_checkpointing and not c.model.fsdp_config.cpu_offload
    a = c.actor
    assert (a.optim.lr, a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu) == (1e-6, 256, 40)
    assert a.use_kl_loss and (a.kl_loss_coef, a.kl_loss_type, a.entropy_coeff) == (0.001, "low_var_kl", 0.0)
    r = c.rollout
    assert (r.tensor_model_parallel_size, r.name, r.gpu_memory_utilization, r.n) == (2, "vllm", 0.6, 5)
    t = c.trainer
    assert t.logger == ["console", "wandb"] and t.project_name == "verl_grpo_example_gsm8k"
    assert (t.experiment_name, t.save_freq, t.test_freq, t.total_epochs) == (
        "qwen2_7b_function_rm",
        20,
        5,
        15,
    )
    assert_accounted(GRPO_EXAMPLE, err, grpo.GRPOConfig)
    for line in (
        "mapped: actor_rollout_ref.actor.fsdp_config.param_offload -> model.fsdp_config.cpu_offload",
        "ignored: actor_rollout_ref.ref.fsdp_config.param_offload=True (the reference is a frozen copy",
        "ignored: actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
    ):
        assert line in err, err
    assert (
        c.algorithm.use_kl_in_reward is False and "use_kl_in_reward" not in err
    )  # flatrl's own key, honoured
    assert "mapped: actor_rollout_ref.actor.ppo_mini_batch_size" not in err  # a plain move in grpo.py


# verl's DAPO recipe on main_ppo (recipe/dapo/test_dapo_7b_math.sh, its shell variables written out; 8 nodes x 8
# GPUs): dynamic sampling off there, the length penalty, clip-higher, override_config, left truncation, warm-up steps.
DAPO_EXAMPLE = f"""
    data.train_files={HOME}/verl/data/dapo-math-17k.parquet data.val_files={HOME}/verl/data/aime-2024.parquet
    data.prompt_key=prompt data.truncation=left data.max_prompt_length=2048 data.max_response_length=8192
    data.train_batch_size=512 actor_rollout_ref.rollout.n=16 algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.0 actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.kl_loss_coef=0.0 actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28 actor_rollout_ref.actor.clip_ratio_c=10.0
    actor_rollout_ref.model.use_remove_padding=True +actor_rollout_ref.model.override_config.max_position_embeddings=32768
    actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=30720
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=30720
    actor_rollout_ref.model.path={HOME}/verl/models/Qwen2.5-Math-7B
    actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.optim.lr_warmup_steps=10 actor_rollout_ref.actor.optim.weight_decay=0.1
    actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.fsdp_config.param_offload=True
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.grad_clip=1.0 actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=4 actor_rollout_ref.rollout.gpu_memory_utilization=0.80
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 actor_rollout_ref.rollout.enable_chunked_prefill=True
    actor_rollout_ref.rollout.max_num_batched_tokens=10240 actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.top_p=0.7
    actor_rollout_ref.rollout.val_kwargs.top_k=-1 actor_rollout_ref.rollout.val_kwargs.do_sample=True
    actor_rollout_ref.rollout.val_kwargs.n=1 actor_rollout_ref.ref.fsdp_config.param_offload=True
    actor_rollout_ref.ref.ulysses_sequence_parallel_size=4 actor_rollout_ref.actor.fsdp_config.fsdp_size=32
    reward_model.reward_manager=dapo +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True
    +reward_model.reward_kwargs.overlong_buffer_cfg.len=4096
    +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0
    +reward_model.reward_kwargs.overlong_buffer_cfg.log=False +reward_model.reward_kwargs.max_resp_len=8192
    trainer.logger=['console','wandb'] trainer.project_name=DAPO trainer.experiment_name=DAPO-Qwen2.5-7b-MATH-0527a1
    trainer.n_gpus_per_node=8 trainer.nnodes=8 trainer.val_before_train=True trainer.test_freq=10
    trainer.save_freq=10 trainer.total_epochs=10 trainer.total_training_steps=200
    trainer.default_local_dir={HOME}/verl/ckpts/DAPO/DAPO-Qwen2.5-7b-MATH-0527a1 trainer.resume_mode=auto
    trainer.log_val_generations=10
""".split()


def test_dapo_recipe_command_line(tmp_path):
    """verl's DAPO recipe command (64 ranks) loads in grpo.py with every key honoured or said; with dynamic
    sampling added (the recipe's other scripts), the filter too."""
    args = [*DAPO_EXAMPLE, "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc"]
    args += ["algorithm.filter_groups.max_num_gen_batches=10", "data.gen_batch_size=1536"]
    c, err = print_config("grpo.py", args, grpo.GRPOConfig, tmp_path, world_size=64)
    assert (c.data.truncation, c.data.max_response_length, c.rollout.n) == ("left", 8192, 16)
    ob = c.custom_reward_function.overlong_buffer
    assert (ob.enable, ob.len, ob.penalty_factor, ob.max_resp_len, ob.log) == (True, 4096, 1.0, 8192, False)
    assert (c.actor.clip_ratio_low, c.actor.clip_ratio_high, c.actor.loss_agg_mode) == (
        0.2,
        0.28,
        "token-mean",
    )
    assert c.actor.optim.lr_warmup_steps == 10 and c.model.override_config == {
        "max_position_embeddings": 32768
    }
    assert c.algorithm.filter_groups == grpo.FilterGroupsConfig(True, "acc", 10)
    assert_accounted(args, err, grpo.GRPOConfig)


# verl's examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh (2 GPUs, LoRA, the prompts in file order)
GRPO_LORA_EXAMPLE = f"""
    algorithm.adv_estimator=grpo trainer.val_before_train=False data.train_files={HOME}/data/gsm8k/train.parquet
    data.val_files={HOME}/data/gsm8k/test.parquet data.train_batch_size=16 data.max_prompt_length=512
    data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error data.shuffle=False
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct actor_rollout_ref.model.lora_rank=64
    actor_rollout_ref.model.lora_alpha=32 actor_rollout_ref.actor.optim.lr=3e-6
    actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=16
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.rollout.tensor_model_parallel_size=2
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5 actor_rollout_ref.rollout.load_format=safetensors
    actor_rollout_ref.rollout.layered_summon=True actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
    actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False trainer.critic_warmup=0
    trainer.logger=["console","wandb"] trainer.project_name=verl_grpo_example_gsm8k
    trainer.experiment_name=qwen2.5_3b_grpo_lora trainer.n_gpus_per_node=2 trainer.nnodes=1 trainer.save_freq=20
    trainer.test_freq=5 trainer.total_epochs=15
""".split()


def test_grpo_lora_example_command_line(tmp_path):
    """verl's LoRA GRPO example: data.shuffle=False keeps the file order (data.EpochSampler), LoRA rank and
    alpha land on the model, and every key is honoured or said."""
    c, err = print_config("grpo.py", GRPO_LORA_EXAMPLE, grpo.GRPOConfig, tmp_path, world_size=2)
    assert c.data.shuffle is False and grpo.GRPOConfig().data.shuffle is True
    assert (c.model.lora_rank, c.model.lora_alpha, c.rollout.n, c.data.train_batch_size) == (64, 32, 5, 16)
    assert c.trainer.val_before_train is False and c.actor.use_kl_loss and c.actor.kl_loss_coef == 0.001
    assert_accounted(GRPO_LORA_EXAMPLE, err, grpo.GRPOConfig)


def test_lora_exclusions_and_adapter_path_reach_the_config(tmp_path):
    """verl's LoRA exclusions (its VLM example's exclude_modules='.*visual.*', quotes gone as bash passes it) and
    saved adapter land on model.exclude_modules and model.lora_adapter_path, for grpo.py and sft.py (the SFT engine's
    model.* keys); the critic refuses both."""
    adapter = f"{HOME}/sft/lora_adapter"
    args = [
        *GRPO_LORA_EXAMPLE,
        "actor_rollout_ref.model.exclude_modules=.*visual.*",
        f"actor_rollout_ref.model.lora_adapter_path={adapter}",
    ]
    c, err = print_config("grpo.py", args, grpo.GRPOConfig, tmp_path, world_size=2)
    assert (c.model.exclude_modules, c.model.lora_adapter_path, c.model.lora_rank) == (
        ".*visual.*",
        adapter,
        64,
    )
    assert (
        grpo.GRPOConfig().model.exclude_modules is None and grpo.GRPOConfig().model.lora_adapter_path is None
    )
    assert_accounted(args, err, grpo.GRPOConfig)
    s = config.parse(
        sft.SFTConfig, ["model.exclude_modules=[visual,lm_head]", f"model.lora_adapter_path={adapter}"]
    )
    assert (s.model.exclude_modules, s.model.lora_adapter_path) == (["visual", "lm_head"], adapter)
    assert s.model.uses_lora and s.model.lora_rank == 0  # the adapter alone turns LoRA on, as in verl
    for key in ("exclude_modules", "lora_adapter_path"):
        with pytest.raises(
            SystemExit, match=rf"critic.model.{key}=/a cannot be honoured: the critic trains all"
        ):
            config.parse(ppo.PPOConfig, [f"critic.model.{key}=/a"])


def test_ppo_example_command_line(tmp_path):
    c, err = print_config("ppo.py", PPO_EXAMPLE, ppo.PPOConfig, tmp_path)
    assert c.algorithm.adv_estimator == "gae" and not c.algorithm.use_kl_in_reward
    assert c.model.path == "deepseek-ai/deepseek-llm-7b-chat" and c.rollout.tensor_model_parallel_size == 4
    assert (c.actor.ppo_micro_batch_size_per_gpu, c.actor.optim.lr, c.actor.use_kl_loss) == (16, 1e-6, False)
    k = c.critic
    assert k.model.path == "deepseek-ai/deepseek-llm-7b-chat" and k.optim.lr == 1e-5
    assert k.model.enable_gradient_checkpointing and k.model.use_remove_padding
    assert k.ppo_micro_batch_size_per_gpu == 32 and k.ppo_mini_batch_size == 256  # the actor's, as in verl
    assert (
        c.trainer.critic_warmup == 0 and c.trainer.test_freq == 1 and c.trainer.logger == ["console", "wandb"]
    )
    assert_accounted(PPO_EXAMPLE, err, ppo.PPOConfig)
    assert "critic.model.fsdp_config.optimizer_offload" not in err.replace(
        "mapped: critic.model.fsdp_config.optimizer_offload", ""
    )
    assert not k.model.fsdp_config.offload_optimizer_in_rollout  # the critic's own flag (rl.offloads)
    assert "mapped: critic.model.fsdp_config.param_offload -> critic.model.fsdp_config.cpu_offload" in err
    assert (
        "mapped: actor_rollout_ref.actor.ppo_mini_batch_size -> actor.ppo_mini_batch_size, critic.ppo_mini_batch_size"
        in err
    )
    assert "ignored: trainer.use_legacy_worker_impl=auto" in err


def test_sft_example_command_line(tmp_path):
    c, err = print_config("sft.py", SFT_EXAMPLE, sft.SFTConfig, tmp_path, world_size=None)
    d = c.data
    assert (d.prompt_key, d.response_key, d.prompt_dict_keys, d.response_dict_keys) == (
        "extra_info", "extra_info", ["question"], ["answer"],
    )  # fmt: skip
    assert d.micro_batch_size_per_gpu == 4 and d.val_files == f"{HOME}/data/gsm8k/test.parquet"
    m = c.model
    assert (m.partial_pretrain, m.lora_rank, m.lora_alpha, m.target_modules) == (
        "Qwen/Qwen2.5-0.5B-Instruct", 32, 16.0, "all-linear",
    )  # fmt: skip
    assert c.optim.lr == 1e-4 and c.trainer.logger == ["console"] and c.trainer.total_epochs == 1
    assert c.trainer.default_local_dir == "/tmp/sft-save"
    assert_accounted(SFT_EXAMPLE, err, sft.SFTConfig)


def test_tutorial_template_loads_in_ppo(tmp_path):
    path = tmp_path / "tutorial.yaml"
    path.write_text(TUTORIAL)
    c, err = print_config("ppo.py", ["--config", str(path)], ppo.PPOConfig, tmp_path, world_size=None)
    assert (c.actor.clip_ratio_low, c.actor.clip_ratio_high) == (0.1, 0.1)
    assert (c.actor.ppo_micro_batch_size_per_gpu, c.actor.use_dynamic_bsz, c.actor.grad_clip) == (
        16,
        True,
        0.1,
    )
    assert (c.algorithm.gamma, c.algorithm.lam) == (1.0, 0.95)
    assert (c.algorithm.kl_ctrl.type, c.algorithm.kl_ctrl.kl_coef, c.algorithm.kl_ctrl.target_kl) == (
        "adaptive",
        0.0005,
        0.1,
    )
    assert c.model.path == "Qwen/Qwen2-7B-Instruct" and c.model.trust_remote_code and c.model.lora_rank == 64
    assert (c.rollout.gpu_memory_utilization, c.rollout.max_num_batched_tokens) == (0.6, 16384)
    assert c.model.fsdp_config.reshard_after_forward and not c.model.fsdp_config.cpu_offload
    assert f"warning: {path}: 'trainer' is given on lines 4 and 6; merged the two blocks" in err
    for needle in (
        "ignored: defaults=",
        "ignored: trainer.num_epochs=1 (ambiguous",
        "mapped: trainer.fsdp_config.sharding_strategy -> model.fsdp_config.reshard_after_forward",
        "mapped: algorithm.clip_ratio -> actor.clip_ratio_low, actor.clip_ratio_high",
        "mapped: trainer.ppo_micro_batch_size_per_gpu -> actor.ppo_micro_batch_size_per_gpu",
    ):
        assert needle in err, err


# ------------------------------------------------------------------------------------------ YAML


def test_repeated_keys_in_yaml(tmp_path, capsys):
    repeated_scalar = tmp_path / "scalar.yaml"
    repeated_scalar.write_text("trainer:\n  save_freq: 1\n  test_freq: 2\n  save_freq: 3\n")
    with pytest.raises(SystemExit, match=r"scalar.yaml: 'save_freq' is set twice, on lines 2 and 4"):
        config.parse(grpo.GRPOConfig, ["--config", str(repeated_scalar)])
    nested = tmp_path / "nested.yaml"  # two blocks whose inner blocks repeat too: merged at every level
    nested.write_text("actor:\n  optim: {lr: 2e-6}\nactor:\n  optim: {weight_decay: 0.1}\n  ppo_epochs: 2\n")
    c = config.parse(grpo.GRPOConfig, ["--config", str(nested)])
    assert (c.actor.optim.lr, c.actor.optim.weight_decay, c.actor.ppo_epochs) == (2e-6, 0.1, 2)
    err = capsys.readouterr().err
    assert "'actor' is given on lines 1 and 3" in err and "'optim' is given on lines 2 and 4" in err
    both = tmp_path / "clash.yaml"  # a verl name and a flatrl name for one field, disagreeing, in one file
    both.write_text("actor_rollout_ref: {actor: {ppo_epochs: 2}}\nactor: {ppo_epochs: 3}\n")
    with pytest.raises(SystemExit, match=r"clash.yaml: two keys set actor.ppo_epochs to different values"):
        config.parse(grpo.GRPOConfig, ["--config", str(both)])


def test_repeated_config_files_merge_in_order(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("actor:\n  optim: {lr: 1e-5, weight_decay: 0.0}\n  ppo_epochs: 3\n")
    b.write_text("actor:\n  optim: {lr: 2e-5}\n")
    c = config.parse(grpo.GRPOConfig, ["--config", str(a), "--config", str(b)])
    assert (c.actor.optim.lr, c.actor.optim.weight_decay, c.actor.ppo_epochs) == (2e-5, 0.0, 3)
    c = config.parse(grpo.GRPOConfig, ["--config-path", str(tmp_path), "--config-name", "a", f"--config={b}"])
    assert (c.actor.optim.lr, c.actor.ppo_epochs) == (2e-5, 3)  # Hydra's primary config first, then --config


# ---------------------------------------------------------------------------------- the overrides


@pytest.mark.parametrize(
    "text, expected",
    [
        ('["console","wandb"]', ["console", "wandb"]),
        ("['a.parquet', 'b.parquet']", ["a.parquet", "b.parquet"]),
        ("[q_proj, v_proj]", ["q_proj", "v_proj"]),
        ("True", True),
        ("false", False),
        ("null", None),
        ("NULL", None),
        ("1_000", 1000),
        ("-3", -3),
        ("1e-6", 1e-6),
        (".5", 0.5),
        ("3.", 3.0),
        ("01", "01"),
        ("'1e-6'", "1e-6"),
        ("'it''s'", None),
        (r"'.*layers\.0\..*'", r".*layers\.0\..*"),  # Hydra keeps a backslash that precedes no quote
        (r"'it\'s'", "it's"),
        (r"'a\\'", "a\\"),  # two before the closing quote: one backslash, and the string ends
        (r"""'a\\\'b'""", "a\\'b"),
        ("{a: 1, b: [x, 'y z']}", {"a": 1, "b": ["x", "y z"]}),
        ("~/data/x.parquet", "~/data/x.parquet"),
        ("${oc.env:HOME}/x", "${oc.env:HOME}/x"),
        ("", ""),
    ],
)
def test_value_grammar(text, expected):
    if expected is None and text.startswith("'it"):
        with pytest.raises(ValueError, match="text after a quoted string"):
            overrides.parse_value(text)
        return
    assert overrides.plain(overrides.parse_value(text)) == expected
    assert type(overrides.plain(overrides.parse_value(text))) is type(expected)


def test_value_grammar_refuses_a_sweep():
    with pytest.raises(ValueError, match="comma outside brackets"):
        overrides.parse_value("a,b")


def test_verl_fused_kernels_reach_the_policy_only(capsys):
    """actor_rollout_ref.model.use_fused_kernels (and verl's actor-level copy) turn on flatrl's fused LM head;
    the critic's key stays ignored, with its reason."""
    c = config.parse(grpo.GRPOConfig, ["actor_rollout_ref.model.use_fused_kernels=True"])
    assert c.model.use_fused_kernels and not grpo.GRPOConfig().model.use_fused_kernels
    assert config.parse(
        grpo.GRPOConfig, ["actor_rollout_ref.actor.use_fused_kernels=true"]
    ).model.use_fused_kernels
    k = config.parse(ppo.PPOConfig, ["critic.model.use_fused_kernels=True"])
    assert not k.critic.model.use_fused_kernels and not k.model.use_fused_kernels
    err = capsys.readouterr().err
    assert "mapped: actor_rollout_ref.actor.use_fused_kernels -> model.use_fused_kernels" in err
    assert "ignored: critic.model.use_fused_kernels=True" in err  # model.* keys move silently, as named


def test_verl_use_torch_compile_false_turns_the_compiled_layers_off(capsys):
    """actor_rollout_ref.actor.use_torch_compile=false (no torch.compile, as a verl user means it) gives eager
    decoder layers; true keeps flatrl's default, auto; each said mapped on stderr."""
    off = config.parse(grpo.GRPOConfig, ["actor_rollout_ref.actor.use_torch_compile=False"])
    assert off.model.compile_layers is False
    on = config.parse(grpo.GRPOConfig, ["actor_rollout_ref.actor.use_torch_compile=true"])
    assert on.model.compile_layers == "auto" == grpo.GRPOConfig().model.compile_layers
    assert (
        config.parse(ppo.PPOConfig, ["actor_rollout_ref.actor.use_torch_compile=false"]).model.compile_layers
        is False
    )
    assert (
        "mapped: actor_rollout_ref.actor.use_torch_compile -> model.compile_layers" in capsys.readouterr().err
    )


def test_verl_fused_optimizer_reaches_each_optimizer(capsys):
    """verl's optim.override_optimizer_config.fused (its optimizer's kwargs) turns on torch's fused AdamW for the
    policy and the critic; any other kwarg is refused naming the key, as before."""
    c = config.parse(grpo.GRPOConfig, ["+actor_rollout_ref.actor.optim.override_optimizer_config.fused=true"])
    assert c.actor.optim.fused and not grpo.GRPOConfig().actor.optim.fused
    k = config.parse(ppo.PPOConfig, ["+critic.optim.override_optimizer_config.fused=True"])
    assert k.critic.optim.fused and not k.actor.optim.fused
    assert "override_optimizer_config.fused -> actor.optim.fused" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        config.parse(
            grpo.GRPOConfig, ["+actor_rollout_ref.actor.optim.override_optimizer_config.foreach=false"]
        )
    assert "override_optimizer_config.foreach" in str(e.value.code), e.value.code


def test_verl_model_dtype_reaches_each_model(capsys):
    """verl's fsdp_config.model_dtype (bf16 master weights in its gpt-oss and multi-turn examples) sets the stored
    dtype of the policy, the critic and SFT's model, by verl's names; fp16 is refused naming the key."""
    c = config.parse(grpo.GRPOConfig, ["+actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"])
    assert (
        c.model.fsdp_config.model_dtype == "bfloat16"
        and grpo.GRPOConfig().model.fsdp_config.model_dtype == "float32"
    )
    k = config.parse(ppo.PPOConfig, ["critic.model.fsdp_config.model_dtype=bfloat16"])
    assert (k.critic.model.fsdp_config.model_dtype, k.model.fsdp_config.model_dtype) == (
        "bfloat16",
        "float32",
    )
    s = config.parse(sft.SFTConfig, ["model.fsdp_config.model_dtype=fp32"])
    assert s.model.fsdp_config.model_dtype == "float32"
    with pytest.raises(SystemExit) as e:
        config.parse(grpo.GRPOConfig, ["actor_rollout_ref.actor.fsdp_config.model_dtype=fp16"])
    msg = str(e.value.code)
    assert "actor_rollout_ref.actor.fsdp_config.model_dtype" in msg and "bf16/bfloat16" in msg, msg
    assert "\n" not in msg


def test_a_blank_argument_is_one_line_naming_what_came_before():
    """verl's PF-PPO example ends a line with `\\  # [...]`: bash passes a blank argument and ends the command.
    One line says so (tyro would print a box); a blank value of a flag stays a value."""
    with pytest.raises(SystemExit) as e:
        config.parse(
            ppo.PPOConfig, ["algorithm.use_pf_ppo=True", "algorithm.pf_ppo.reweight_method=pow", " "]
        )
    msg = str(e.value.code)
    assert "' ' after 'algorithm.pf_ppo.reweight_method=pow' is blank" in msg and "\n" not in msg, msg
    assert config.parse(ppo.PPOConfig, ["--trainer.project_name", " "]).trainer.project_name == " "


def test_overrides_and_precedence(tmp_path, capsys):
    path = tmp_path / "x.yaml"
    path.write_text("actor:\n  ppo_epochs: 4\n  optim: {lr: 3e-6}\ntrainer: {experiment_name: from-yaml}\n")
    c = config.parse(
        grpo.GRPOConfig,
        ["--config", str(path), "actor.ppo_epochs=2", "+actor_rollout_ref.rollout.n=6", "++data.seed=7",
         "~actor.optim.lr", "trainer.experiment_name=0.10", "data.val_files=null", "--rollout.top_p", "0.5",
         "rollout.top_p=0.9"],
    )  # fmt: skip
    assert c.actor.ppo_epochs == 2  # command line > YAML
    assert c.actor.optim.lr == grpo.GRPOConfig().actor.optim.lr  # ~ put the default back
    assert (c.rollout.n, c.data.seed, c.data.val_files) == (6, 7, None)
    assert c.trainer.experiment_name == "0.10"  # an unquoted value is text for a str field
    assert c.rollout.top_p == 0.5  # a tyro flag wins over an override
    verl_name = config.parse(grpo.GRPOConfig, ["--config", str(path), "~actor_rollout_ref.actor.optim.lr"])
    assert verl_name.actor.optim.lr == grpo.GRPOConfig().actor.optim.lr  # ~ by verl's name reaches ours
    with pytest.raises(SystemExit, match=r"actor.ppo_epochs is 4, not 5"):
        config.parse(grpo.GRPOConfig, ["--config", str(path), "~actor.ppo_epochs=5"])
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "arg, needle",
    [
        (
            "actor_rollout_ref.actor.not_a_key=1",
            "command line 'actor_rollout_ref.actor.not_a_key=1': unknown key",
        ),
        ("actor.ppo_epoch=1", "unknown key 'actor.ppo_epoch' (known: ppo_mini_batch_size"),
        (
            "actor_rollout_ref.rollout.multi_turn.enable=True",
            "multi_turn.enable=True cannot be honoured: single-turn",
        ),
        (
            "algorithm.rollout_correction.rollout_rs=token",
            "algorithm.rollout_rs='token': token is not a mode; give one or more of token_k1",
        ),
        ("reward_model.enable=True", "reward_model.enable=True cannot be honoured"),
        ("actor_rollout_ref.actor.ppo_epochs=two", "key 'actor.ppo_epochs' expects int, got str 'two'"),
        (
            "algorithm.adv_estimator=gae",
            "must be one of ['grpo', 'rloo', 'reinforce_plus_plus', 'gpg', 'reinforce_plus_plus_baseline', 'remax', 'optimal_token_baseline'], got 'gae'",
        ),
        ("trainer.logger=a,b", "comma outside brackets"),
    ],
)
def test_errors_name_the_key(arg, needle):
    with pytest.raises(SystemExit) as e:
        config.parse(grpo.GRPOConfig, [arg])
    assert needle in str(e.value.code), e.value.code


def test_clip_ratio_and_weak_keys(capsys):
    c = config.parse(grpo.GRPOConfig, ["actor_rollout_ref.actor.clip_ratio=0.1"])
    assert (c.actor.clip_ratio_low, c.actor.clip_ratio_high) == (0.1, 0.1)
    c = config.parse(
        grpo.GRPOConfig,
        ["actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.clip_ratio=0.1"],
    )
    assert (c.actor.clip_ratio_low, c.actor.clip_ratio_high) == (0.1, 0.28)  # the explicit bound wins
    c = config.parse(ppo.PPOConfig, ["actor_rollout_ref.actor.ppo_epochs=3", "critic.ppo_epochs=2"])
    assert (c.actor.ppo_epochs, c.critic.ppo_epochs) == (3, 2)
    c = config.parse(ppo.PPOConfig, ["actor.ppo_epochs=3"])  # flatrl's own name: the critic keeps its default
    assert c.critic.ppo_epochs == ppo.PPOConfig().critic.ppo_epochs
    assert (
        "mapped: actor_rollout_ref.actor.clip_ratio -> actor.clip_ratio_low, actor.clip_ratio_high"
        in capsys.readouterr().err
    )


def test_interpolations(tmp_path, monkeypatch):
    monkeypatch.setenv("FLATRL_TEST_DIR", "/data")
    path = tmp_path / "x.yaml"
    path.write_text(
        "trainer:\n  project_name: p\n  default_local_dir: ckpt/${trainer.project_name}/${trainer.experiment_name}\n"
        "data: {train_files: '${oc.env:FLATRL_TEST_DIR}/train.parquet'}\n"
        "actor_rollout_ref: {actor: {ppo_mini_batch_size: 64}}\n"
        "critic: {ppo_mini_batch_size: '${oc.select:actor_rollout_ref.actor.ppo_mini_batch_size,256}',"
        " ppo_epochs: '${oc.select:actor_rollout_ref.actor.ppo_epochs,1}'}\n"
    )
    c = config.parse(ppo.PPOConfig, ["--config", str(path)])
    assert c.trainer.default_local_dir == "ckpt/p/ppo" and c.data.train_files == "/data/train.parquet"
    assert (c.critic.ppo_mini_batch_size, c.critic.ppo_epochs) == (64, 1)
    with pytest.raises(SystemExit, match=r"the resolver 'oc.create:' .* is not supported"):
        config.parse(ppo.PPOConfig, ["trainer.project_name=${oc.create:x}"])


def test_world_size_check(monkeypatch, capsys):
    args = ["trainer.n_gpus_per_node=4", "trainer.nnodes=2"]
    monkeypatch.setenv("WORLD_SIZE", "8")
    config.parse(grpo.GRPOConfig, args)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as e:
        config.parse(grpo.GRPOConfig, args)
    msg = str(e.value.code)
    assert (
        "trainer.n_gpus_per_node=4 x trainer.nnodes=2 = 8 ranks, but this was launched as WORLD_SIZE=4" in msg
    )
    assert "torchrun --nnodes 2 --nproc_per_node 4" in msg
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(SystemExit) as e:  # --print-config on a laptop: a note, and the YAML
        config.parse(sft.SFTConfig, ["trainer.n_gpus_per_node=8", "--print-config"])
    assert e.value.code == 0
    out, err = capsys.readouterr()
    assert "note: " in err and "launched as one process (WORLD_SIZE unset)" in err and out.startswith("data:")


def test_resume_path_and_debug():
    c = config.parse(
        grpo.GRPOConfig,
        ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ck/global_step_5", "debug=true"],
    )
    assert c.trainer.resume_mode == "/ck/global_step_5" and c.trainer.debug
    with pytest.raises(SystemExit, match="resume_mode=resume_path needs trainer.resume_from_path"):
        config.parse(grpo.GRPOConfig, ["trainer.resume_mode=resume_path"])


def test_sft_engine_example_command_line(tmp_path):
    """verl 0.9.1's SFT trainer layout: model.path, engine.*, the group choices `engine=fsdp optim=fsdp`, a
    messages column; a Megatron engine is refused by name."""
    c, err = print_config("sft.py", SFT_ENGINE_EXAMPLE, sft.SFTConfig, tmp_path, world_size=2)
    assert c.model.partial_pretrain == "Qwen/Qwen2.5-0.5B-Instruct" and c.data.messages_key == "messages"
    assert c.data.use_dynamic_bsz and c.data.max_token_len_per_gpu == 8192 and c.data.train_batch_size == 256
    assert c.model.fsdp_config.ulysses_sequence_parallel_size == 2
    o = c.optim
    assert (o.lr, o.warmup_steps_ratio, o.weight_decay, o.betas, o.min_lr_ratio) == (
        1e-5,
        0.05,
        0.1,
        (0.9, 0.95),
        0.1,
    )
    assert (
        o.lr_scheduler == "cosine" and c.trainer.total_training_steps == 2 and c.trainer.logger == ["console"]
    )
    assert_accounted(SFT_ENGINE_EXAMPLE, err, sft.SFTConfig)
    assert "mapped: model.path -> model.partial_pretrain" in err
    assert "ignored: engine=fsdp" in err and "ignored: data.pad_mode=no_padding" in err
    p = run("sft.py", [*SFT_ENGINE_EXAMPLE, "engine=megatron", "--print-config"], 2)
    assert p.returncode != 0 and "engine=megatron cannot be honoured: verl's engine group" in p.stderr


def test_verl_0_9_reward_section(tmp_path):
    """verl 0.9.1 gathers the reward settings under reward.*: its custom function and workers reach flatrl's
    custom_reward_function, and a reward model is refused by name."""
    args = [
        *GRPO_EXAMPLE,
        "reward.custom_reward_function.path=/r.py",
        "reward.custom_reward_function.name=score",
    ]
    c, err = print_config(
        "grpo.py",
        [*args, "reward.num_workers=3", "reward.reward_manager.name=naive"],
        grpo.GRPOConfig,
        tmp_path,
    )
    rc = c.custom_reward_function
    assert (rc.path, rc.name, rc.num_workers) == ("/r.py", "score", 3)
    # the path moves silently, as actor_rollout_ref.actor.X does; num_workers is renamed, and says so
    assert "mapped: reward.num_workers -> custom_reward_function.num_workers" in err
    p = run("grpo.py", [*args, "reward.reward_model.enable=true", "--print-config"])
    assert p.returncode != 0 and "reward.reward_model.enable=true cannot be honoured" in p.stderr


@pytest.mark.skipif(
    not os.environ.get("FLATRL_VERL_SITE"), reason="FLATRL_VERL_SITE (verl's config tree) not set"
)
@pytest.mark.parametrize(
    "script, name, extra",
    [
        ("grpo.py", "_generated_ppo_trainer", ["algorithm.adv_estimator=grpo"]),
        ("grpo.py", "ppo_trainer", ["algorithm.adv_estimator=grpo"]),
        ("ppo.py", "_generated_ppo_trainer", []),
        ("sft.py", "sft_trainer_engine", []),
    ],
)
def test_verl_0_9_own_configs_load(tmp_path, script, name, extra):
    """verl 0.9.1's own trainer configs (the installed wheel's verl/trainer/config), loaded whole with
    --config-path/--config-name: every key is mapped, ignored with its reason, or a flatrl key."""
    site = Path(os.environ["FLATRL_VERL_SITE"]) / "verl" / "trainer" / "config"
    cls = {"grpo.py": grpo.GRPOConfig, "ppo.py": ppo.PPOConfig, "sft.py": sft.SFTConfig}[script]
    world = 1 if script == "sft.py" else 8  # trainer.n_gpus_per_node x nnodes in the file
    c, err = print_config(
        script, ["--config-path", str(site), "--config-name", name, *extra], cls, tmp_path, world
    )
    if script == "sft.py":
        assert c.data.use_dynamic_bsz and c.data.max_token_len_per_gpu == 8192 and c.trainer.total_epochs == 4
    else:
        assert c.data.train_batch_size == 1024 and c.trainer.project_name == "verl_examples"
    if name == "_generated_ppo_trainer":  # verl 0.9.1's reward section
        assert c.custom_reward_function.num_workers == 8
        assert "mapped: reward.num_workers -> custom_reward_function.num_workers" in err


# ------------------------------------------------------------------------------- the table itself


def _verl_keys() -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    name = ""
    for line in (ROOT / "tests" / "verl_keys.txt").read_text().splitlines():
        if line.startswith("["):
            name = line.strip("[]")
        elif line and not line.startswith("#"):
            sections.setdefault(name, []).append(line)
    return sections


SCRIPTS = {
    "main_ppo": (grpo.GRPOConfig, ppo.PPOConfig),
    "fsdp_sft_trainer": (sft.SFTConfig,),
    "sft_trainer": (sft.SFTConfig,),
}


@pytest.mark.parametrize("cls", [grpo.GRPOConfig, ppo.PPOConfig, sft.SFTConfig], ids=lambda c: c.__name__)
def test_every_mapping_target_exists(cls):
    """A rename of a flatrl field breaks this test, not a user's run."""
    table, prefixes = overrides.table_for(cls)
    assert table
    for key, rule in table.items():
        if isinstance(rule, verl_keys.Map):
            for target in rule.to:
                assert overrides.field_type(cls, target) is not None, (key, target)
            weak = [t for t in rule.weak if overrides.field_type(cls, t) is not None]
            assert rule.to or weak, key
    for target in verl_keys.HINTS:
        assert any(overrides.field_type(c, target) for c in (grpo.GRPOConfig, ppo.PPOConfig)), target
    for src, dst in prefixes.items():
        assert overrides.field_type(cls, dst.rstrip(".")) is not None, src


@pytest.mark.parametrize("entry", list(SCRIPTS), ids=str)
def test_every_verl_key_is_accounted_for(entry):
    keys = _verl_keys()[entry]
    assert len(keys) > 50
    for cls in SCRIPTS[entry]:
        for key in keys:
            assert overrides.targets(key, cls) is not None  # raises for an unknown key


def test_docs_hold_the_table():
    assert verl_keys.markdown() in (ROOT / "docs" / "VERL.md").read_text()


def test_missing_reward_function_names_compute_score(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with pytest.raises(
        AttributeError, match=r"no function 'compute_score'.*as verl does.*callables in the file: score"
    ):
        reward.load_reward_fn(str(path), "compute_score")


def test_pieces_of_a_full_verl_config(tmp_path, monkeypatch, capsys):
    """What verl's own full trainer config holds: _target_ keys, ??? (OmegaConf's missing), interpolations of
    siblings, the older global micro-batch size (divided by the world size, as verl does)."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    path = tmp_path / "full.yaml"
    path.write_text(
        "actor_rollout_ref:\n"
        "  actor: {_target_: verl.workers.config.FSDPActorConfig, ppo_micro_batch_size: 64,"
        " ppo_micro_batch_size_per_gpu: null, checkpoint: {save_contents: [model], load_contents: '${.save_contents}'}}\n"
        "  rollout:\n    name: ???\n    prompt_length: ${oc.select:data.max_prompt_length,512}\n"
        "data: {max_prompt_length: 300}\n"
    )
    c = config.parse(ppo.PPOConfig, ["--config", str(path)])
    assert (
        c.actor.ppo_micro_batch_size_per_gpu == 8
        and c.rollout.name == "vllm"
        and c.data.max_prompt_length == 300
    )
    err = capsys.readouterr().err
    assert (
        "ignored: actor_rollout_ref.actor._target_=verl.workers.config.FSDPActorConfig (Hydra's `_target_`"
        in err
    )
    assert "ignored: actor_rollout_ref.rollout.name=??? (verl's 'unset'" in err
    assert "mapped: actor_rollout_ref.actor.ppo_micro_batch_size -> actor.ppo_micro_batch_size_per_gpu" in err


def test_rollout_correction_token_is(tmp_path):
    """verl 0.7+'s algorithm.rollout_correction.rollout_is=token is grpo.py's truncated IS: the threshold given
    or verl's 2.0, every sample's engine logprobs; rollout_is=sequence is rollout_is_level=sequence; another level and
    ppo.py refuse by name; the threshold
    alone (in every verl trainer config) changes nothing."""
    key = "algorithm.rollout_correction"
    c, err = print_config("grpo.py", [f"{key}.rollout_is=token"], grpo.GRPOConfig, tmp_path, world_size=None)
    assert (c.algorithm.rollout_is, c.algorithm.rollout_is_threshold, c.rollout.logprob_check_prompts) == (
        True,
        2.0,
        -1,
    )
    assert "verl's default" in err
    args = [f"{key}.rollout_is=token", f"{key}.rollout_is_threshold=3.5", "rollout.logprob_check_prompts=-1"]
    c, _ = print_config("grpo.py", args, grpo.GRPOConfig, tmp_path, world_size=None)
    assert c.algorithm.rollout_is_threshold == 3.5
    c, err = print_config(
        "grpo.py", [f"{key}.rollout_is=sequence"], grpo.GRPOConfig, tmp_path, world_size=None
    )
    assert (c.algorithm.rollout_is, c.algorithm.rollout_is_level) == (True, "sequence")
    assert "mapped: algorithm.rollout_correction.rollout_is=sequence" in err
    c, err = print_config(
        "grpo.py", [f"{key}.rollout_is_threshold=5"], grpo.GRPOConfig, tmp_path, world_size=None
    )
    assert (
        c.algorithm == grpo.AlgorithmConfig()
        and "ignored: algorithm.rollout_correction.rollout_is_threshold" in err
    )
    for script, arg, needle in [
        ("grpo.py", f"{key}.rollout_is=geometric", "weighs each token or each sequence (token, sequence)"),
        ("ppo.py", f"{key}.rollout_rs=token_k1", "no rollout rejection sampling in ppo.py (grpo.py has it)"),
        ("ppo.py", f"{key}.rollout_is=token", "algorithm.rollout_is=true cannot be honoured"),
    ]:
        p = run(script, [arg, "--print-config"], None)
        assert p.returncode != 0 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    for arg, needle in [  # the config's own check: one error line, after the notes on what was mapped
        (f"{key}.rollout_rs=seq_max_k1", "seq_max_k1 is not a mode; give one or more of token_k1"),
        (f"{key}.rollout_rs=token_k2", "needs one bound for all its modes or one per mode"),
    ]:
        p = run("grpo.py", [arg, "--print-config"], None)
        errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert p.returncode != 0 and len(errors) == 1 and needle in errors[0], p.stderr


def test_rollout_correction_rejection_sampling_and_batch_normalize(tmp_path):
    """verl 0.9's examples/rollout_correction keys: rollout_rs with its thresholds (quoted, comma-separated) reach
    algorithm.rollout_rs and rollout_rs_threshold, without rollout_is too; rollout_is_batch_normalize reaches
    algorithm.rollout_is_batch_normalize beside rollout_is, and is ignored without it; both want every sample's
    engine logprobs."""
    key = "algorithm.rollout_correction"
    args = [
        f"{key}.rollout_is=token",
        f"{key}.rollout_is_threshold=2.0",
        f"{key}.rollout_is_batch_normalize=false",
        f"{key}.rollout_rs='token_k1,seq_max_k2'",
        f"{key}.rollout_rs_threshold='0.6_1.6,2.5'",
    ]
    c, err = print_config("grpo.py", args, grpo.GRPOConfig, tmp_path, world_size=None)
    a = c.algorithm
    assert (a.rollout_rs, a.rollout_rs_threshold) == ("token_k1,seq_max_k2", "0.6_1.6,2.5")
    assert (a.rollout_is, a.rollout_is_level, a.rollout_is_batch_normalize) == (True, "token", False)
    assert "mapped: algorithm.rollout_correction.rollout_rs, rollout_rs_threshold" in err
    c, _ = print_config(
        "grpo.py", [f"{key}.rollout_rs=seq_mean_k3", f"{key}.rollout_rs_threshold=0.01"], grpo.GRPOConfig,
        tmp_path, world_size=None,
    )  # fmt: skip
    assert (c.algorithm.rollout_rs, c.algorithm.rollout_rs_threshold, c.algorithm.rollout_is) == (
        "seq_mean_k3",
        "0.01",
        False,
    )
    assert c.rollout.logprob_check_prompts == -1
    args = [f"{key}.rollout_is=sequence", f"{key}.rollout_is_batch_normalize=true", f"{key}.rollout_rs=null"]
    c, _ = print_config("grpo.py", args, grpo.GRPOConfig, tmp_path, world_size=None)
    assert (c.algorithm.rollout_is_level, c.algorithm.rollout_is_batch_normalize, c.algorithm.rollout_rs) == (
        "sequence",
        True,
        None,
    )
    c, err = print_config(
        "grpo.py", [f"{key}.rollout_is_batch_normalize=true"], grpo.GRPOConfig, tmp_path, world_size=None
    )
    assert c.algorithm == grpo.AlgorithmConfig()
    assert "ignored: algorithm.rollout_correction.rollout_is_batch_normalize=true" in err


def test_rollout_correction_bypass_mode_of_verls_examples(tmp_path):
    """verl's examples/rollout_correction command lines: bypass_mode=true with loss_type reach
    algorithm.rollout_bypass and rollout_loss_type beside their rollout_is / batch normalisation / rollout_rs keys,
    and want every sample's engine logprobs; verl 0.6's use_policy_gradient=true is loss_type=reinforce; a loss
    type without bypass_mode is ignored; ppo.py refuses bypass_mode by name."""
    key = "algorithm.rollout_correction"
    rloo = [  # run_with_rollout_corr.sh
        f"{key}.rollout_is=sequence", f"{key}.rollout_is_threshold=2.0", f"{key}.rollout_is_batch_normalize=true",
        f"{key}.rollout_rs=null", f"{key}.rollout_rs_threshold=null", f"{key}.bypass_mode=true",
        f"{key}.loss_type=reinforce", "algorithm.adv_estimator=rloo",
    ]  # fmt: skip
    c, err = print_config("grpo.py", rloo, grpo.GRPOConfig, tmp_path, world_size=None)
    a = c.algorithm
    assert (a.rollout_bypass, a.rollout_loss_type, a.rollout_is, a.rollout_is_level) == (
        True, "reinforce", True, "sequence"
    )  # fmt: skip
    assert a.rollout_is_batch_normalize and a.rollout_rs is None and c.rollout.logprob_check_prompts == -1
    assert "mapped: algorithm.rollout_correction.bypass_mode, loss_type -> algorithm.rollout_bypass" in err
    multi_rs = [  # run_with_rollout_corr_multi_rs.sh
        f"{key}.rollout_is=token", f"{key}.rollout_is_threshold=2.0", f"{key}.rollout_is_batch_normalize=false",
        f"{key}.rollout_rs='token_k1,seq_max_k2'", f"{key}.rollout_rs_threshold='0.6_1.6,2.5'",
        f"{key}.bypass_mode=true", f"{key}.loss_type=ppo_clip",
    ]  # fmt: skip
    c, _ = print_config("grpo.py", multi_rs, grpo.GRPOConfig, tmp_path, world_size=None)
    a = c.algorithm
    assert (a.rollout_bypass, a.rollout_loss_type, a.rollout_rs, a.rollout_rs_threshold) == (
        True, "ppo_clip", "token_k1,seq_max_k2", "0.6_1.6,2.5"
    )  # fmt: skip
    c, err = print_config(
        "grpo.py", [f"{key}.bypass_mode=true", f"{key}.use_policy_gradient=true"], grpo.GRPOConfig, tmp_path,
        world_size=None,
    )  # fmt: skip
    assert (c.algorithm.rollout_bypass, c.algorithm.rollout_loss_type) == (True, "reinforce")
    assert c.rollout.logprob_check_prompts == -1 and "use_policy_gradient=true: reinforce" in err
    c, err = print_config(
        "grpo.py", [f"{key}.loss_type=reinforce"], grpo.GRPOConfig, tmp_path, world_size=None
    )
    assert c.algorithm == grpo.AlgorithmConfig()
    assert "ignored: algorithm.rollout_correction.loss_type=reinforce (read only with" in err
    for script, args, needle in [
        (
            "ppo.py",
            [f"{key}.bypass_mode=true"],
            "algorithm.rollout_bypass=true cannot be honoured: no bypass mode",
        ),
        (
            "grpo.py",
            [f"{key}.bypass_mode=true", f"{key}.use_policy_gradient=true", f"{key}.loss_type=ppo_clip"],
            "use_policy_gradient=true (verl 0.6's loss_type=reinforce) contradicts",
        ),
    ]:
        p = run(script, [*args, "--print-config"], None)
        assert p.returncode != 0 and needle in p.stderr, p.stderr
        assert len([x for x in p.stderr.splitlines() if x.startswith("error")]) == 1, p.stderr


def test_verl_config_path_resolves_in_an_installed_verl(tmp_path):
    """verl's examples write `--config-path=config --config-name=ppo_trainer`, which Hydra reads relative to
    verl/trainer: found there when verl is installed (located, not imported: its __init__ would fail); Megatron
    configs and a file found nowhere are one line naming the options."""
    trainer = tmp_path / "site" / "verl" / "trainer"
    (trainer / "config").mkdir(parents=True)
    (trainer.parent / "__init__.py").write_text("raise RuntimeError('verl must not be imported')\n")
    (trainer / "config" / "ppo_trainer.yaml").write_text("data:\n  train_batch_size: 48\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    args = ["--config-path=config", "--config-name=ppo_trainer", "--print-config"]

    def grpo_py(extra_env: dict, argv: list[str]) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(ROOT / "grpo.py"), *argv]
        return subprocess.run(cmd, cwd=ROOT, env=env | extra_env, capture_output=True, text=True, timeout=300)

    p = grpo_py({"PYTHONPATH": str(tmp_path / "site")}, args)
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load(p.stdout)["data"]["train_batch_size"] == 48
    p = grpo_py({}, args)
    assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1
    assert "config/ppo_trainer.yaml is not in the working directory" in p.stderr
    p = grpo_py({}, ["--config-path=config", "--config-name=ppo_megatron_trainer.yaml", "--print-config"])
    assert p.returncode != 0 and "Megatron" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_sweep_of_verl_examples_counts_what_loads(tmp_path):
    """scripts/sweep_verl_examples.py on a stand-in checkout: each script's trainer call is recorded (through a
    line continuation and a variable), sent to grpo.py, and counted; a refusal is grouped under its one line."""
    ex = tmp_path / "verl" / "examples" / "grpo_trainer"
    ex.mkdir(parents=True)
    (ex / "ok.sh").write_text(
        "set -x\nN=5\npython3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo \\\n"
        "    data.shuffle=False actor_rollout_ref.rollout.n=$N trainer.n_gpus_per_node=1 $@\n"
    )
    (ex / "refused.sh").write_text("python3 -m verl.trainer.main_ppo reward_model.enable=True\n")
    (ex / "prep.sh").write_text(
        "python3 examples/data_preprocess/gsm8k.py --local_dir /tmp/x\n"
    )  # not a trainer
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "sweep_verl_examples.py"), str(tmp_path / "verl"), "--out",
         str(tmp_path / "sweep.json")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "1 of 2 command lines loaded (2 calls recorded)" in p.stdout
    assert "[1] error: command line 'reward_model.enable=True'" in p.stdout
    runs = {Path(r["example"]).name: r for r in json.loads((tmp_path / "sweep.json").read_text())}
    assert runs["ok.sh"]["rc"] == 0 and "actor_rollout_ref.rollout.n=5" in runs["ok.sh"]["args"]


# verl's examples/rloo_trainer/run_qwen2-7b.sh: RLOO with the KL in the reward
RLOO_EXAMPLE = f"""
    algorithm.adv_estimator=rloo data.train_files={HOME}/data/gsm8k/train.parquet
    data.val_files={HOME}/data/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512
    data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=80 actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=160
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=160 actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=True algorithm.kl_penalty=kl algorithm.kl_ctrl.kl_coef=0.001 trainer.critic_warmup=0
    trainer.logger=["console","wandb"] trainer.project_name=verl_rloo_example_gsm8k
    trainer.experiment_name=qwen2_7b_function_rm trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=-1
    trainer.test_freq=5 trainer.total_epochs=15
""".split()


def test_rloo_example_with_kl_in_reward(tmp_path):
    """verl's RLOO example puts the KL in the reward: grpo.py honours it with verl's fixed coefficient."""
    c, err = print_config("grpo.py", RLOO_EXAMPLE, grpo.GRPOConfig, tmp_path)
    assert (c.algorithm.adv_estimator, c.algorithm.use_kl_in_reward, c.algorithm.kl_penalty) == (
        "rloo",
        True,
        "kl",
    )
    assert c.algorithm.kl_ctrl == rl.KLControlConfig(type="fixed", kl_coef=0.001) and not c.actor.use_kl_loss
    assert_accounted(RLOO_EXAMPLE, err, grpo.GRPOConfig)
