"""What resume checks before loading (issue 22 item 3): the stored config against the new one
(checkpoint.config_changes), and the checkpoint's model against the one built from the config (one error line,
not DCP's traceback)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import checkpoint
import config
import fsdp
import grpo
import lora
import optim
import rl

torch.set_num_threads(1)


def test_config_changes_sorts_errors_from_changes():
    stored = config.to_dict(grpo.GRPOConfig())
    new = copy.deepcopy(stored)
    new["actor"]["optim"]["lr"] = 3e-6  # may change: takes effect
    new["trainer"]["logger"] = ["jsonl"]
    new["data"]["train_batch_size"] = 2 * stored["data"]["train_batch_size"]  # changes which rows a step sees
    new["trainer"]["seed"] = 7  # allowed below
    new["model"]["path"] = "other/model"
    new["trainer"]["a_new_setting"] = 1  # a config from another flatrl version
    errors, changed = checkpoint.config_changes(stored, new, allowed={"trainer.seed", "trainer.no_such_key"})
    bs = stored["data"]["train_batch_size"]
    assert errors == [
        "trainer.no_such_key: not a config key (trainer.resume_allow_changes)",
        f"data.train_batch_size: {bs} -> {2 * bs}",
        f"model.path: {stored['model']['path']!r} -> 'other/model'",
    ]
    assert changed == [
        f"actor.optim.lr: {stored['actor']['optim']['lr']!r} -> 3e-06",
        "trainer.a_new_setting: '<absent>' -> 1",
        "trainer.logger: ['console', 'jsonl'] -> ['jsonl']",
        "trainer.seed: 0 -> 7",
    ]
    assert checkpoint.config_changes(stored, copy.deepcopy(stored), set()) == ([], [])


def test_check_resume_config_reads_the_checkpoint(tmp_path, capsys):
    stored = config.to_dict(grpo.GRPOConfig())
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 3, "config": stored}))
    new = copy.deepcopy(stored)
    new["trainer"]["seed"], new["data"]["seed"], new["trainer"]["save_freq"] = 7, 9, 2
    with pytest.raises(ValueError) as e:
        checkpoint.check_resume_config(tmp_path, new, ["trainer.seed"])
    assert str(e.value).startswith(f"resume from {tmp_path}: settings differ") and "\n" not in str(e.value)
    assert "data.seed: 1 -> 9" in str(e.value) and "trainer.seed" not in str(e.value)
    changed = checkpoint.check_resume_config(tmp_path, new, ["trainer.seed,data.seed"])
    assert changed == ["data.seed: 1 -> 9", "trainer.save_freq: 'end' -> 2", "trainer.seed: 0 -> 7"]
    assert "changed on resume: trainer.save_freq: 'end' -> 2" in capsys.readouterr().out


def build(model_dir, device, lora_rank: int = 0):
    model = fsdp.load_model(str(model_dir))
    if lora_rank:
        lora.apply_lora(model, lora_rank, 2.0 * lora_rank, "all-linear")
    model = fsdp.shard_model(model, device, fsdp.FSDPConfig())
    optimizer, _ = optim.build(model.parameters(), optim.OptimConfig(lr=1e-2), total_steps=10)
    return model, optimizer


def test_another_model_shape_is_one_line(tiny_qwen2, one_rank, tmp_path):
    model, optimizer = build(tiny_qwen2, one_rank.device)
    ckpt = checkpoint.save_checkpoint(tmp_path / "run", 1, model, optimizer, {})
    wider = tmp_path / "wider"
    cfg = Qwen2Config.from_pretrained(tiny_qwen2)
    cfg.intermediate_size = 96
    Qwen2ForCausalLM(cfg).save_pretrained(wider)
    other, other_opt = build(wider, one_rank.device)
    with pytest.raises(ValueError) as e:
        checkpoint.load_checkpoint(ckpt, other, other_opt)
    msg = str(e.value)
    assert (
        "\n" not in msg and str(ckpt / "model") in msg and "differs from the one built from the config" in msg
    )
    assert (
        "3 tensors differ in shape (first: model.layers.0.mlp.gate_proj.weight (64, 32) in the checkpoint, (96, 32) in the model)"
        in msg
    )

    with_lora, lora_opt = build(tiny_qwen2, one_rank.device, lora_rank=2)
    with pytest.raises(
        ValueError,
        match="model tensors are not in the checkpoint .first: model.layers.0.mlp.down_proj.base_layer.weight",
    ) as e:
        checkpoint.load_checkpoint(ckpt, with_lora, lora_opt)
    assert "checkpoint tensors are not in the model (first: model.layers.0.mlp.down_proj.weight)" in str(
        e.value
    )
    checkpoint.load_checkpoint(ckpt, model, optimizer)  # the same model loads


def test_rl_save_and_test_freq_read_as_verls():
    """trainer.save_freq / test_freq in grpo.py and ppo.py: N fires every N steps and after the last, "end" only after
    the last (flatrl's default), 0 or less never (verl's RL trainer: `save_freq > 0 and (last or step % N == 0)`)."""
    assert rl.saves("end") and rl.saves(3) and not rl.saves(0) and not rl.saves(-1)
    fired = {f: [s for s in range(1, 8) if rl.due(f, s, last=s == 7)] for f in ("end", 3, 1, 0, -1)}
    assert fired == {"end": [7], 3: [3, 6, 7], 1: list(range(1, 8)), 0: [], -1: []}
    assert grpo.GRPOConfig().trainer.save_freq == "end" == grpo.GRPOConfig().trainer.test_freq
