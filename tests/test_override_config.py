"""model.override_config (verl's actor_rollout_ref.model.override_config, which DAPO's recipe sets): the values
reach the trainer's model and the rollout engine alike, verl's spelling of it parses, and a name the model's
config lacks is set and said."""

from __future__ import annotations

import pytest
import torch
from conftest import read_metrics, toy_grpo_config

import config
import fsdp
import grpo

torch.set_num_threads(1)


def test_the_override_changes_the_model_and_unknown_names_are_said(toy_dir, capsys):
    """rms_norm_eps=0.5 on the toy changes its logits (the override reaches the built model); embd_pdrop, which a
    Qwen2 config lacks, is set and said on stderr; without overrides the model is the checkpoint's."""
    ids = torch.tensor([[5, 9, 14, 20, 33]])
    plain = fsdp.load_model(str(toy_dir / "model"))
    changed = fsdp.load_model(
        str(toy_dir / "model"), config_overrides={"rms_norm_eps": 0.5, "embd_pdrop": 0.0}
    )
    assert changed.config.rms_norm_eps == 0.5 and plain.config.rms_norm_eps != 0.5
    with torch.no_grad():
        diff = (plain(ids).logits - changed(ids).logits).abs().max().item()
    assert diff > 1e-3
    err = capsys.readouterr().err
    assert "model.override_config.embd_pdrop=0.0: Qwen2Config has no such setting" in err
    assert "rms_norm_eps" not in err


def test_grpo_engine_runs_the_overridden_model(one_rank, toy_dir, tmp_path):
    """GRPO on the toy with rms_norm_eps=0.5 (hf engine): each step's push check compares the engine's logprobs
    with the trainer's. The weights are pushed, the config is not, so the check holds only if the engine built its
    model with the override too (an engine that ignored it failed step 1: mean logprob difference 0.40 nats)."""
    fn = tmp_path / "length.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) % 3)\n"
    )
    cfg = toy_grpo_config(toy_dir, tmp_path / "run", fn, steps=2, lr=1e-2)
    cfg = config.parse(
        grpo.GRPOConfig,
        ["--config", _yaml(cfg, tmp_path), "+actor_rollout_ref.model.override_config.rms_norm_eps=0.5"],
    )
    assert cfg.model.override_config == {"rms_norm_eps": 0.5}
    grpo.main(cfg)
    rows = [r for r in read_metrics(tmp_path / "run") if "rollout/logprob_diff_max" in r]
    assert len(rows) == 2 and max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4, rows


def _yaml(cfg, tmp_path) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(config.to_yaml(cfg))
    return str(path)


@pytest.mark.parametrize("script", ["grpo", "sft"])
def test_dapo_recipe_lines_parse(script):
    import sft

    cls = {"grpo": grpo.GRPOConfig, "sft": sft.SFTConfig}[script]
    prefix = "actor_rollout_ref.model" if script == "grpo" else "model"
    names = ("attention_dropout", "embd_pdrop", "resid_pdrop")
    cfg = config.parse(cls, [f"+{prefix}.override_config.{n}=0." for n in names])
    assert cfg.model.override_config == dict.fromkeys(names, 0.0)
