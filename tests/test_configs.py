"""Every YAML under configs/ loads strictly into its script's config (STYLE.md test tier 6)."""

from pathlib import Path

import pytest

import config
import dpo
import grpo
import ppo
import sft

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path):
    if path.name.startswith("sft"):
        cfg = config.parse(sft.SFTConfig, ["--config", str(path)])
        assert cfg.data.max_length > 0
    elif path.name.startswith("ppo"):
        cfg = config.parse(ppo.PPOConfig, ["--config", str(path)])
        assert cfg.data.max_response_length > 0 and cfg.critic.optim.lr > 0
    elif path.name.startswith("dpo"):
        cfg = config.parse(dpo.DPOConfig, ["--config", str(path)])
        assert cfg.data.max_length > 0 and cfg.algorithm.beta > 0
    else:
        cfg = config.parse(grpo.GRPOConfig, ["--config", str(path)])
        assert cfg.data.max_response_length > 0


def test_verl_tutorial_values_survive():
    path = next(p for p in CONFIGS if p.name == "grpo_verl_tutorial.yaml")
    cfg = config.parse(grpo.GRPOConfig, ["--config", str(path)])
    assert cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef == 0.001
    assert cfg.rollout.tensor_model_parallel_size == 2 and cfg.rollout.top_p == 0.9
    assert cfg.model.path.endswith("global_step_200/")
    s = config.parse(sft.SFTConfig, ["--config", str(CONFIGS[0].parent / "sft_verl_tutorial.yaml")])
    assert s.optim.lr == 2e-5 and s.model.lora_rank == 64 and s.trainer.logger == ["console"]


def load(name: str):
    """The config of configs/NAME, parsed by its script's config class (by the name's prefix)."""
    path = CONFIGS[0].parent / name
    if name.startswith("sft"):
        return config.parse(sft.SFTConfig, ["--config", str(path)])
    cls = ppo.PPOConfig if name.startswith("ppo") else grpo.GRPOConfig
    return config.parse(cls, ["--config", str(path)])


def test_new_recipes_are_there():
    names = {p.name for p in CONFIGS}
    assert {
        "grpo_countdown_qwen2.5-3b.yaml", "sft_countdown_scratch.yaml", "grpo_countdown_scratch.yaml",
        "ppo_countdown_scratch.yaml", "grpo_gsm8k_qwen2.5-0.5b.yaml", "ppo_gsm8k_qwen2.5-0.5b.yaml",
    } <= names  # fmt: skip
    for p in CONFIGS:
        if "countdown" in p.name:  # the header states what STYLE.md asks of a recipe
            header = [line for line in p.read_text().splitlines() if line.startswith("#")]
            text = "\n".join(header)
            assert "Command" in text and "Hardware" in text and "Expected" in text, p.name


def test_nano_aha_moment_values_survive():
    """nano-aha-moment's constants (configs/grpo_countdown_qwen2.5-3b.yaml header) reach the dataclasses."""
    c = load("grpo_countdown_qwen2.5-3b.yaml")
    assert (
        c.model.path == "Qwen/Qwen2.5-3B" and c.model.lora_rank == 0 and c.model.enable_gradient_checkpointing
    )
    assert c.data.train_batch_size * c.rollout.n == 64 and c.rollout.n == 4  # EPISODES_PER_ITERATION
    assert (
        c.actor.ppo_mini_batch_size == c.data.train_batch_size and c.actor.ppo_epochs == 1
    )  # one update a step
    assert c.actor.ppo_micro_batch_size_per_gpu == 4 and c.actor.loss_agg_mode == "token-mean"
    o = c.actor.optim
    assert (o.lr, o.betas, o.weight_decay, o.lr_scheduler, o.warmup_steps_ratio) == (
        1e-6,
        (0.9, 0.999),
        0.0,
        "constant",
        0.0,
    )
    assert c.actor.use_kl_loss and c.actor.kl_loss_coef == 0.001 and c.actor.kl_loss_type == "low_var_kl"
    assert c.actor.grad_clip == 1.0 and c.actor.entropy_coeff == 0.0
    s = c.rollout.train_sampling
    assert (s.temperature, s.top_p, s.top_k) == (1.0, 1.0, -1)
    assert (c.rollout.val_kwargs.temperature, c.rollout.val_kwargs.do_sample) == (0.3, True)
    assert (
        c.data.max_response_length == 1024 and c.data.max_prompt_length + c.data.max_response_length == 2048
    )
    assert c.rollout.gpu_memory_utilization == 0.3 and c.trainer.total_training_steps == 1000
    assert c.trainer.test_freq == 25 and c.algorithm.adv_estimator == "grpo"
    assert (
        c.data.prompt_key == "prompt_chatml" and not c.data.apply_chat_template
    )  # prefilled ChatML, as there


# scripts/repro.sh's tasks: config suffix, SFT model and data, RL val data, reward file, the longest prompt and
# response (+ end token) measured on the data each task writes (countdown: prepare_countdown.py on 100,000
# problems; arith3: toy.py --digits 3 on 20,000 SFT rows), and SFT's sample budget (the rows of sft/train).
SCRATCH_TASKS = {
    "countdown_scratch": ("runs/repro/model", "runs/repro/data/sft/train.parquet", "runs/repro/data/test.parquet",
                          "scripts/countdown_accuracy.py", 36 + 8, 59, 400_000),
    "arith3": ("runs/repro/data/model", "runs/repro/data/sft/train.parquet", "runs/repro/data/rl/val.parquet",
               None, 20, 40, 400_000),
}  # fmt: skip


@pytest.mark.parametrize("task", SCRATCH_TASKS)
def test_scratch_stages_fit_together(task):
    """The three stages of scripts/repro.sh read the same data, start from the SFT model, score with the task's
    reward, and their length limits hold the data the task writes."""
    model, sft_train, val, reward_path, prompt_len, response_len, rows = SCRATCH_TASKS[task]
    s, g, p = (load(f"{k}_{task}.yaml") for k in ("sft", "grpo", "ppo"))
    root = Path(__file__).resolve().parents[1]
    repro = (root / "scripts" / "repro.sh").read_text()
    assert "configs/sft_$TASK.yaml" in repro and "TASK=${TASK:-arith3}" in repro
    assert task == "arith3" or f"TASK={task}" in repro
    assert s.model.partial_pretrain == model and s.data.train_files == sft_train
    for rl_cfg in (g, p):
        assert rl_cfg.data.val_files == val and rl_cfg.model.path.endswith("sft_model")
        assert rl_cfg.custom_reward_function.path == reward_path
        assert reward_path is None or (root / reward_path).is_file()
        assert rl_cfg.trainer.val_before_train  # the SFT accuracy is GRPO's and PPO's step-0 validation
        assert rl_cfg.data.max_prompt_length >= prompt_len and rl_cfg.data.max_response_length >= response_len
        assert rl_cfg.trainer.total_training_steps % rl_cfg.trainer.test_freq == 0  # last step validates once
        assert rl_cfg.data.train_batch_size % rl_cfg.actor.ppo_mini_batch_size == 0
    assert s.data.max_length >= prompt_len + response_len
    assert s.trainer.total_training_steps * s.data.train_batch_size <= rows
    assert g.rollout.n > 1 and p.critic.model.path == ""  # the critic starts from the actor
