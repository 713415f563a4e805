"""HSDP, simulated on one CPU host (nothing here has run on more than one GPU).

- HSDP (fsdp.device_mesh's 2-D mesh: shard within k consecutive ranks, replicate across the groups) gives
  sft.py the losses and gradient norms of plain FSDP and of one process, and its checkpoint resumes on one
  process and merges with shard_merge.py.
- The groups of the 2-D mesh fail within trainer.timeout_s when a peer hangs, as the default group does.

    python tests/test_multinode.py TIMEOUT_S    # the worker of test_hsdp_groups_fail_within_the_timeout
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, free_port, read_metrics, torchrun


def flags(d: dict) -> list[str]:
    out = []
    for k, v in d.items():
        out += [f"--{k}"] if v == "" else [f"--{k}", str(v)]
    return out


def sft_args(toy: Path, run: Path, **over) -> list[str]:
    """sft.py on the toy: global batch 8 in micro-batches of 2, 4 steps, a checkpoint at step 2 and 4."""
    args = {
        "data.train_files": toy / "sft/train.parquet",
        "data.val_files": "None",
        "data.max_length": 64,
        "data.train_batch_size": 8,
        "data.micro_batch_size_per_gpu": 2,
        "model.partial_pretrain": toy / "model",
        "optim.lr": 3e-3,
        "optim.warmup_steps_ratio": 0.0,
        "trainer.total_training_steps": 4,
        "trainer.save_freq": 2,
        "trainer.default_local_dir": run,
        "trainer.logger": "jsonl",
        "trainer.seed": 0,
    }
    return flags(args | over)


def by_step(run: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run) if r.get(key) is not None}


# ---------------------------------------------------------------------------------------------------- HSDP


@pytest.mark.slow
def test_hsdp_matches_fsdp_and_one_process_and_resumes_on_one(toy_dir, tmp_path):
    """One process, plain FSDP on 2 ranks, HSDP 2 x 1 (replicate x shard) and 2 x 2 on 4 ranks: the same 4 steps."""
    import fsdp
    import shard_merge

    runs = {"one": (1, 0), "fsdp2": (2, 0), "hsdp2x1": (2, 1), "hsdp2x2": (4, 2)}
    for name, (nproc, k) in runs.items():
        over = {"model.fsdp_config.hsdp_shard_size": k}
        torchrun("sft.py", sft_args(toy_dir, tmp_path / name, **over), nproc=nproc)
    ref_loss, ref_norm = by_step(tmp_path / "one", "train/loss"), by_step(tmp_path / "one", "train/grad_norm")
    assert sorted(ref_loss) == [1, 2, 3, 4] and ref_loss[4] < ref_loss[1] - 0.5, ref_loss  # it trains
    for name in runs:
        loss, norm = by_step(tmp_path / name, "train/loss"), by_step(tmp_path / name, "train/grad_norm")
        # Step 1 shows the forward pass and the gradient reduction, steps 2-4 the optimizer's updates too.
        for s in range(1, 5):
            assert abs(loss[s] - ref_loss[s]) < 1e-5, (name, s, loss[s], ref_loss[s])
            assert abs(norm[s] - ref_norm[s]) < 1e-4 * ref_norm[s], (name, s, norm[s], ref_norm[s])

    # The 2 x 2 checkpoint of step 2, alone in a new run folder, resumes on one process to the same steps 3-4.
    ckpt = tmp_path / "hsdp2x2" / "global_step_2"
    assert fsdp.checkpoint_problem(ckpt) is None
    assert json.loads((ckpt / "trainer_state.json").read_text())["world_size"] == 4
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(ckpt, resumed / "global_step_2")
    torchrun("sft.py", sft_args(toy_dir, resumed), nproc=1)
    again = by_step(resumed, "train/loss")
    assert sorted(again) == [3, 4]
    for s in (3, 4):
        assert abs(again[s] - ref_loss[s]) < 1e-4, (s, again[s], ref_loss[s])  # as test_sft's 2 -> 1 rank

    # shard_merge reads the HSDP checkpoint (DCP wrote each replicated shard once) into a model that matches it.
    out = shard_merge.merge(tmp_path / "hsdp2x2" / "global_step_4", tmp_path / "merged")
    assert shard_merge.verify(tmp_path / "hsdp2x2" / "global_step_4", out) < 1e-5


def hang_worker(timeout_s: float) -> None:
    """One of 4 ranks (env RANK, WORLD_SIZE=4, MASTER_ADDR/PORT) holding fsdp.device_mesh's 2 x 2 HSDP mesh.

    Rank 1 hangs; rank 0 all-reduces over its "shard" group, rank 3 over its "replicate" group (both hold
    rank 1) and prints `rank R GROUP RANKS waited S s: ERROR`; rank 2 prints its groups and sleeps.
    """
    import torch
    import torch.distributed as dist

    import fsdp

    d = fsdp.init_distributed(timeout_s=timeout_s)
    mesh = fsdp.device_mesh("cpu", hsdp_shard_size=2)
    groups = {n: dist.get_process_group_ranks(mesh.get_group(n)) for n in ("replicate", "shard")}
    print(f"rank {d.rank} groups {json.dumps(groups)}", flush=True)
    dist.barrier()  # all four are up
    if d.rank in (1, 2):
        time.sleep(3600)
    name = "shard" if d.rank == 0 else "replicate"
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=mesh.get_group(name))
    except Exception as e:  # what FSDP's collectives would raise in a trainer
        waited = time.monotonic() - start
        print(f"rank {d.rank} {name} {groups[name]} waited {waited:.2f} s: {e!r:.150}", flush=True)
        os._exit(1)
    print(f"rank {d.rank}: no error", flush=True)
    os._exit(0)


@pytest.mark.slow
def test_hsdp_groups_fail_within_the_timeout(tmp_path):
    """torch gives new groups its default timeout (30 min on gloo): device_mesh passes trainer.timeout_s on."""
    timeout_s, port, log = 4.0, str(free_port()), tmp_path / "log"
    procs: list[subprocess.Popen] = []
    with open(log, "w") as f:
        for rank in range(4):
            env = dict(
                os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
            )  # fmt: skip
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, str(timeout_s)],
                    cwd=ROOT,
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    process_group=procs[0].pid if procs else 0,
                )  # fmt: skip
            )
        try:
            for p in (procs[0], procs[3]):
                p.wait(timeout=120)
        finally:
            os.killpg(procs[0].pid, signal.SIGKILL)
            for p in procs:
                p.wait()
    text = log.read_text()
    for rank, group in (
        (0, {"replicate": [0, 2], "shard": [0, 1]}),
        (3, {"replicate": [1, 3], "shard": [2, 3]}),
    ):
        assert f"rank {rank} groups {json.dumps(group)}" in text, text  # consecutive ranks shard together
    assert procs[0].returncode == 1 and procs[3].returncode == 1, text
    waited = {
        int(r): float(s) for r, s in re.findall(r"^rank (\d) \w+ \[[\d, ]+\] waited ([\d.]+) s", text, re.M)
    }
    assert sorted(waited) == [0, 3], text
    for s in waited.values():
        assert timeout_s - 0.5 < s < timeout_s + 5, text


def test_plan_counts_the_hsdp_shard_not_the_world(tmp_path):
    """perf.plan: with HSDP each rank holds 1/k of the states, not 1/world."""
    from transformers import Qwen2Config

    import actor
    import fsdp
    import perf
    import rollout

    Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=256).save_pretrained(tmp_path)  # fmt: skip
    P = perf.model_shape(str(tmp_path)).params

    def update(world: int, k: int) -> dict:
        model = actor.ModelConfig(path=str(tmp_path), fsdp_config=fsdp.FSDPConfig(hsdp_shard_size=k))
        cfg = SimpleNamespace(
            model=model, actor=actor.ActorConfig(), rollout=rollout.RolloutConfig(),
            data=SimpleNamespace(max_prompt_length=64, max_response_length=64),
        )  # fmt: skip
        return perf.plan(cfg, world_size=world, device_total=2**34).phases["update"]

    assert update(16, 0)["optimizer"] == 8 * P / 16  # plain FSDP: sharded over all 16
    assert update(16, 8)["optimizer"] == 8 * P / 8 and update(16, 8)["params"] == 4 * P / 8  # 2 nodes of 8


if __name__ == "__main__":
    hang_worker(float(sys.argv[1]))
