"""Ulysses sequence parallelism (sp.py) against the same runs without it: SFT, GRPO's policy update and PPO's
critic on 2 and 4 gloo ranks; a checkpoint taken under SP resumes without it and merges; bad head counts and
layouts are refused at start-up."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import read_metrics, torchrun
from test_sft import sft_args

import sp


class _Config:
    def __init__(self, heads: int, kv: int) -> None:
        self.num_attention_heads, self.num_key_value_heads = heads, kv


def test_head_counts_that_cannot_split_name_the_model_s_heads():
    sp.check_heads(_Config(2, 1), 2)  # KV heads repeated up to 2
    sp.check_heads(_Config(8, 2), 4)
    with pytest.raises(ValueError, match="num_attention_heads=2, num_key_value_heads=1"):
        sp.check_heads(_Config(2, 1), 4)  # 4 query heads needed
    sp.check_heads(_Config(6, 3), 2)  # KV heads repeated to lcm(3, 2) = 6
    with pytest.raises(ValueError, match="num_attention_heads=12, num_key_value_heads=3"):
        sp.check_heads(_Config(12, 3), 8)  # 8 does not divide 12


def test_padded_layout_is_refused(tiny_qwen2):
    import fsdp

    model = fsdp.load_model(str(tiny_qwen2))
    with pytest.raises(ValueError, match="model.use_remove_padding=true"):
        sp.setup(model, 2, "cpu", packed=False)


def _rl(toy: Path, tmp: Path, nproc: int, sp_size: int, *extra: str) -> dict:
    out = tmp / f"rl_{nproc}_{sp_size}{''.join(extra)}.json"
    torchrun("tests/sp_job.py", [str(toy / "model"), str(sp_size), str(out), *extra], nproc=nproc)
    return json.loads(out.read_text())


def _close(a: dict, b: dict, keys: list[str]) -> None:
    for k in keys:
        if k.endswith("grad_norm"):
            assert abs(a[k] - b[k]) <= 1e-4 * abs(b[k]), (k, a[k], b[k])
        else:
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])), (k, a[k], b[k])


@pytest.mark.slow
def test_grpo_update_and_critic_match_without_sp(toy_dir, tmp_path):
    """One GRPO policy step and one PPO critic step on the same 16 samples (one 160 tokens long): SP=2 on 2
    ranks and [dp 2, sp 2] on 4 ranks equal SP=1 on 2 ranks, and so does SP=2 with the fused LM head; under SP no
    rank's forward holds that sequence."""
    ref = _rl(toy_dir, tmp_path, 2, 1)
    keys = ["actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "critic/vf_loss", "critic/vpred_mean"]
    keys += ["critic/grad_norm", "old_logprobs_sum", "values_sum"]
    assert ref["max_tokens"] > 160 and ref["actor/grad_norm"] > 0.1 and ref["critic/grad_norm"] > 0.1, ref
    for nproc in (2, 4):
        got = _rl(toy_dir, tmp_path, nproc, 2)
        _close(got, ref, keys)
        assert got["max_tokens"] < 100, got  # each rank runs half of its micro-batch's packed row
        assert got["direct_call_refused"] is True, got
    # the fused LM head (model.use_fused_kernels) under SP: each rank's chunks of its own tokens, the same step
    fused = _rl(toy_dir, tmp_path, 2, 2, "fused")
    _close(fused, ref, keys)
    assert fused["max_tokens"] < 100 and fused["fused_head"] and not ref["fused_head"], fused


@pytest.mark.slow
def test_sft_matches_without_sp_resumes_without_it_and_merges(toy_dir, tmp_path):
    """sft.py: SP=2 equals SP=1 (2 ranks, packed) for 2 steps; its step-1 checkpoint resumes
    on one rank without SP to the same step-2 loss; its last checkpoint merges into a Hugging Face folder."""
    import shard_merge

    over = {
        "data.train_batch_size": 8,
        "data.micro_batch_size_per_gpu": 2,
        "data.val_files": "None",
        "trainer.total_training_steps": 2,
        "trainer.save_freq": 1,
    }
    runs = {}
    for sp_size in (1, 2):
        run = tmp_path / f"sp{sp_size}"
        args = sft_args(toy_dir, run, **over, **{"model.fsdp_config.ulysses_sequence_parallel_size": sp_size})
        torchrun("sft.py", args)
        runs[sp_size] = {r["step"]: r for r in read_metrics(run) if "train/loss" in r}
    for step in (1, 2):
        _close(runs[2][step], runs[1][step], ["train/loss", "train/grad_norm", "train/num_tokens"])

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "sp2" / "global_step_1", resumed / "global_step_1")
    torchrun("sft.py", sft_args(toy_dir, resumed, **over), nproc=1)
    again = {r["step"]: r for r in read_metrics(resumed) if "train/loss" in r}
    assert sorted(again) == [2]
    _close(again[2], runs[2][2], ["train/loss", "train/grad_norm"])

    out = shard_merge.merge(tmp_path / "sp2" / "global_step_2", tmp_path / "hf")
    assert (out / "config.json").is_file()
    assert shard_merge.verify(tmp_path / "sp2" / "global_step_2", out) < 1e-5


def test_verl_keys_set_the_sp_degree():
    """verl's three spellings land on the fsdp_config field that sp.setup reads."""
    import config
    import grpo
    import ppo
    import sft

    cfg = config.parse(sft.SFTConfig, ["ulysses_sequence_parallel_size=2"])
    assert cfg.model.fsdp_config.ulysses_sequence_parallel_size == 2
    cfg = config.parse(grpo.GRPOConfig, ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=4"])
    assert cfg.model.fsdp_config.ulysses_sequence_parallel_size == 4
    cfg = config.parse(ppo.PPOConfig, ["critic.ulysses_sequence_parallel_size=2"])
    assert cfg.critic.model.fsdp_config.ulysses_sequence_parallel_size == 2
    assert cfg.model.fsdp_config.ulysses_sequence_parallel_size == 1


def test_plan_divides_activations_and_logits_by_sp(tmp_path):
    """--trainer.plan with SP=4: a rank holds a quarter of a micro-batch of ppo_micro_batch_size_per_gpu
    sequences; a token budget stays per GPU (an SP group's micro-batch holds 4 budgets); the states do not change."""
    from dataclasses import replace

    from test_perf import QWEN05, Qwen2Config, _plan_cfg

    import fsdp
    import perf

    Qwen2Config(**QWEN05).save_pretrained(tmp_path)
    sp4 = fsdp.FSDPConfig(ulysses_sequence_parallel_size=4)
    for dynamic, ratio in ((False, 4), (True, 1)):
        cfg, cfg4 = (_plan_cfg(str(tmp_path), use_dynamic_bsz=dynamic) for _ in range(2))
        cfg4.model = replace(cfg.model, fsdp_config=sp4)
        one = perf.plan(cfg, world_size=4, device_total=140 * 2**30).phases["update"]
        four = perf.plan(cfg4, world_size=4, device_total=140 * 2**30).phases["update"]
        assert four["activations"] * ratio == one["activations"] and four["logits"] * ratio == one["logits"]
        assert four["optimizer"] == one["optimizer"] and four["kernel"] == one["kernel"]
