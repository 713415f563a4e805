"""Every YAML under configs/ loads strictly into its script's config (STYLE.md test tier 6)."""

from pathlib import Path

import pytest

import config
import grpo
import ppo
import rl
import sft

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path):
    if path.name.startswith("sft"):
        cfg = config.parse(sft.SFTConfig, ["--config", str(path)])
        assert cfg.data.max_length > 0
    elif path.name.startswith("ppo"):
        cfg = config.parse(ppo.PPOConfig, ["--config", str(path)], yaml_hook=rl.verl_layout)
        assert cfg.data.max_response_length > 0 and cfg.critic.optim.lr > 0
    else:
        cfg = config.parse(grpo.GRPOConfig, ["--config", str(path)], yaml_hook=rl.verl_layout)
        assert cfg.data.max_response_length > 0


def test_verl_tutorial_values_survive():
    path = next(p for p in CONFIGS if p.name == "grpo_verl_tutorial.yaml")
    cfg = config.parse(grpo.GRPOConfig, ["--config", str(path)], yaml_hook=rl.verl_layout)
    assert cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef == 0.001
    assert cfg.rollout.tensor_model_parallel_size == 2 and cfg.rollout.top_p == 0.9
    assert cfg.model.path.endswith("global_step_200/")
    s = config.parse(sft.SFTConfig, ["--config", str(CONFIGS[0].parent / "sft_verl_tutorial.yaml")])
    assert s.optim.lr == 2e-5 and s.model.lora_rank == 64 and s.trainer.logger == ["console"]
