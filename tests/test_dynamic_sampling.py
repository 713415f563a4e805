"""DAPO's dynamic sampling in grpo.py (algorithm.filter_groups): groups whose responses all score the same are
dropped and more prompts generated until the batch is full; on the toy with the hf engine, one rank in process and
two under torchrun."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from conftest import flags, read_metrics, torchrun, toy_grpo_config

import config
import grpo

torch.set_num_threads(1)

# Half the toy's random responses hold a digit, so many groups of 2 score all 0 or all 1.
REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return {'score': float(any(c.isdigit() for c in solution_str)), 'digits': 0.0}\n"  # fmt: skip


def _cfg(toy_dir, tmp_path, run_dir, steps: int, **filter_kw) -> grpo.GRPOConfig:
    fn = tmp_path / "digit.py"
    fn.write_text(REWARD)
    return toy_grpo_config(
        toy_dir,
        run_dir,
        fn,
        steps=steps,
        lr=1e-2,
        algorithm=grpo.AlgorithmConfig(filter_groups=grpo.FilterGroupsConfig(**filter_kw)),
        save_freq=2,
    )


def _steps(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "timing_s/step" in r]


def test_flat_groups_are_replaced_and_a_resumed_run_repeats_them(one_rank, toy_dir, tmp_path):
    """Without the filter some groups of the toy's first steps score flat (zero_std_frac > 0); with it none does
    in any step, because rounds of fresh prompts replaced them (num_gen_batches > 1 somewhere, the dropped share
    logged). A run stopped after step 2 and resumed repeats steps 3-4 of the straight run exactly: the extra
    draws moved the saved data position."""
    grpo.main(_cfg(toy_dir, tmp_path, tmp_path / "plain", 4))
    plain = _steps(tmp_path / "plain")
    assert max(r["rollout/zero_std_frac"] for r in plain) > 0
    straight = tmp_path / "straight"
    grpo.main(_cfg(toy_dir, tmp_path, straight, 4, enable=True))
    rows = _steps(straight)
    assert [r["rollout/zero_std_frac"] for r in rows] == [0.0] * 4
    assert max(r["rollout/num_gen_batches"] for r in rows) > 1
    assert all(0 < r["rollout/filtered_group_frac"] < 1 for r in rows if r["rollout/num_gen_batches"] > 1)
    assert all(r["reward/digits"] == 0.0 for r in rows)  # the function's extra key, over every round

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(straight / "global_step_2", resumed / "global_step_2")
    grpo.main(_cfg(toy_dir, tmp_path, resumed, 4, enable=True))
    again = {r["step"]: r for r in _steps(resumed)}
    for r in rows[2:]:
        for key in ("reward/mean", "rollout/num_gen_batches", "actor/pg_loss", "response_length/mean"):
            assert again[r["step"]][key] == pytest.approx(r[key], abs=1e-6), (key, r["step"])


def test_a_metric_without_spread_stops_at_max_num_gen_batches(one_rank, toy_dir, tmp_path):
    """metric=digits (the function's dict key, always 0): no group ever differs, so the step stops after
    max_num_gen_batches rounds with an error naming the key; a metric the function does not return is refused by
    name with the keys it has."""
    cfg = _cfg(toy_dir, tmp_path, tmp_path / "flat", 2, enable=True, metric="digits", max_num_gen_batches=3)
    with pytest.raises(
        RuntimeError, match=r"3 generated batches \(algorithm.filter_groups.max_num_gen_batches=3"
    ):
        grpo.main(cfg)
    cfg = _cfg(toy_dir, tmp_path, tmp_path / "absent", 2, enable=True, metric="accuracy")
    with pytest.raises(KeyError, match=r"metric='accuracy'.*\['reward', 'score', 'acc', 'digits'\]"):
        grpo.main(cfg)


def test_a_key_some_responses_lack_counts_as_zero(one_rank, toy_dir, tmp_path):
    """metric=hit, a key the function returns only for responses with a digit: the others count as 0, so the
    kept groups are exactly those whose reward differs (zero_std_frac 0 in every step)."""
    cfg = _cfg(toy_dir, tmp_path, tmp_path / "hit", 3, enable=True, metric="hit")
    fn = tmp_path / "hit.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    hit = any(c.isdigit() for c in solution_str)\n"
        "    return {'score': float(hit), 'hit': 1.0} if hit else 0.0\n"
    )
    cfg = dataclasses.replace(
        cfg, custom_reward_function=dataclasses.replace(cfg.custom_reward_function, path=str(fn))
    )
    grpo.main(cfg)
    rows = _steps(tmp_path / "hit")
    assert [r["rollout/zero_std_frac"] for r in rows] == [0.0] * 3
    assert max(r["rollout/num_gen_batches"] for r in rows) > 1


def test_verl_dapo_keys_and_async_refused(capsys, monkeypatch):
    """The DAPO recipe's keys load in grpo.py (gen_batch_size and max_inflight_gen_batches said ignored, with why);
    with rollout.async_steps=1 the filter is refused before anything loads."""
    args = [
        "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=10",
        "data.gen_batch_size=96",
    ]
    cfg = config.parse(grpo.GRPOConfig, args)
    assert cfg.algorithm.filter_groups == grpo.FilterGroupsConfig(True, "acc", 10)
    assert "ignored: data.gen_batch_size=96" in capsys.readouterr().err
    cfg = config.parse(grpo.GRPOConfig, [*args, "actor_rollout_ref.rollout.async_steps=1"])
    with pytest.raises(SystemExit, match="filter_groups.enable needs rollout.async_steps=0"):
        grpo.main(cfg)
    # compiled layers trace modules process-wide: not beside an in-process engine decoding in another thread
    cfg = config.parse(grpo.GRPOConfig, ["rollout.async_steps=1", "model.compile_layers=true"])
    with pytest.raises(
        SystemExit, match="model.compile_layers with rollout.async_steps=1 needs rollout.engine_process"
    ):
        grpo.main(cfg)
    # the default, auto, turns itself off there instead, saying so where it would have compiled (a CUDA device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = config.parse(grpo.GRPOConfig, ["rollout.async_steps=1"])
    assert cfg.model.compile_layers == "auto"
    assert grpo.compile_layers_beside_async(cfg).model.compile_layers is False
    assert "model.compile_layers=auto: off, as rollout.async_steps=1" in capsys.readouterr().out
    apart = config.parse(grpo.GRPOConfig, ["rollout.async_steps=1", "rollout.engine_process=true"])
    assert grpo.compile_layers_beside_async(apart) is apart


def test_two_ranks_fill_both_shares(toy_dir, tmp_path):
    """Two ranks under torchrun: each keeps its share of the batch (2 of 4 prompts) in groups that differ, drawing
    and generating together until both are full; the logged counts are the same on both (one metrics file)."""
    fn = tmp_path / "digit.py"
    fn.write_text(REWARD)
    run = tmp_path / "two"
    args = {
        "data.train_files": toy_dir / "rl/train.parquet",
        "data.val_files": "None",
        "data.train_batch_size": 4,
        "data.max_prompt_length": 32,
        "data.max_response_length": 8,
        "model.path": toy_dir / "model",
        "rollout.name": "hf",
        "rollout.n": 2,
        "actor.ppo_mini_batch_size": 4,
        "algorithm.filter_groups.enable": "",
        "custom_reward_function.path": fn,
        "custom_reward_function.num_workers": 0,
        "trainer.default_local_dir": run,
        "trainer.logger": "jsonl",
        "trainer.total_training_steps": 3,
    }
    torchrun("grpo.py", flags(args))
    rows = _steps(run)
    assert len(rows) == 3 and all(r["rollout/zero_std_frac"] == 0.0 for r in rows), rows
    assert max(r["rollout/num_gen_batches"] for r in rows) > 1
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3
