"""Several nodes and HSDP, simulated on one CPU host (nothing here has run on more than one GPU).

- HSDP (fsdp.device_mesh's 2-D mesh: shard within k consecutive ranks, replicate across the groups) gives
  sft.py the losses and gradient norms of plain FSDP and of one process, and its checkpoint resumes on one
  process and merges with shard_merge.py.
- The groups of the 2-D mesh fail within trainer.timeout_s when a peer hangs, as the default group does.
- Two torchrun agents on localhost are two nodes of one job (`--nnodes 2`, one process each, LOCAL_RANK 0 on
  both): sft.py (c10d rendezvous, HSDP across the "nodes") matches one process; grpo.py (static rendezvous with
  --node-rank, vLLM under external_launcher) runs with an exact weight push.
- vLLM tensor parallelism under external_launcher (2 ranks sharing one engine) runs grpo.py with an exact push.

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
from conftest import ROOT, flags, free_port, read_metrics, torchrun
from conftest import VLLM_CPU_ENV as ENV


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
    import checkpoint
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
    assert checkpoint.checkpoint_problem(ckpt) is None
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
    timeout_s, port = 4.0, str(free_port())
    procs: list[subprocess.Popen] = []
    # one log file per rank: two ranks' lines written to one file at the same moment ran together (seen in CI)
    logs = [tmp_path / f"rank{rank}.log" for rank in range(4)]
    for rank in range(4):
        env = dict(
            os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
        )  # fmt: skip
        with open(logs[rank], "w") as f:
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
    text = "\n".join(log.read_text() for log in logs)
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


# ------------------------------------------------------------------------------------ two nodes, one host


def two_nodes(
    script: str, args: list[str], logs: Path, rdzv: str, env: dict | None = None, limit_s: float = 300
):
    """Runs `script` as a job of two torchrun agents on this host, one process each, and waits for both.

    rdzv="c10d": `--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID` (the rendezvous numbers the
    nodes by host name, then agent pid; torchrun ignores --node-rank there). rdzv="static": `--node-rank 0|1
    --master-addr 127.0.0.1 --master-port PORT`. Fails the test unless both agents exit 0 within limit_s.
    """
    port = str(free_port())
    if rdzv == "c10d":
        launch = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"sim{port}"]
    else:
        launch = ["--master-addr", "127.0.0.1", "--master-port", port]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    procs, files = [], []
    for node in (0, 1):
        node_rank = ["--node-rank", str(node)] if rdzv == "static" else []
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", *node_rank, "--nproc-per-node", "1",
               *launch, str(ROOT / script), *args]  # fmt: skip
        files.append(open(logs / f"node{node}.log", "w"))  # noqa: SIM115
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=files[-1], stderr=subprocess.STDOUT)
        )
    deadline = time.monotonic() + limit_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the agent stops its worker
                p.wait(timeout=60)
        for f in files:
            f.close()
    tails = "\n".join(f"--- node {n}:\n" + (logs / f"node{n}.log").read_text()[-4000:] for n in (0, 1))
    assert [p.returncode for p in procs] == [0, 0], tails
    return tails


@pytest.mark.slow
def test_two_nodes_sft_matches_one_process(toy_dir, tmp_path):
    """Two "nodes" of one process, HSDP shard within a node (1) and replicate across: one process's losses."""
    two = tmp_path / "two"
    two.mkdir()
    over = {"model.fsdp_config.hsdp_shard_size": 1, "trainer.total_training_steps": 2}
    two_nodes("sft.py", sft_args(toy_dir, two / "run", **over), two, rdzv="c10d")
    torchrun("sft.py", sft_args(toy_dir, tmp_path / "one", **{"trainer.total_training_steps": 2}), nproc=1)
    for key, tol in (("train/loss", 1e-5), ("train/grad_norm", 1e-4)):
        got, want = by_step(two / "run", key), by_step(tmp_path / "one", key)
        assert sorted(got) == [1, 2], got
        for s in (1, 2):
            assert abs(got[s] - want[s]) < tol * max(1.0, want[s]), (key, s, got[s], want[s])
    state = json.loads((two / "run" / "global_step_2" / "trainer_state.json").read_text())
    assert state["world_size"] == 2


DIGITS_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # the share of digits in the response: an untrained model's samples differ, so groups carry a signal
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
"""


def grpo_args(toy: Path, tmp: Path, **over) -> list[str]:
    """grpo.py for 2 steps on the toy's untrained model: 4 prompts x 4 samples of 16 tokens, digits rewarded."""
    (tmp / "digits.py").write_text(DIGITS_REWARD)
    args = {
        "data.train_files": toy / "rl/train.parquet",
        "data.val_files": "None",
        "data.max_prompt_length": 32,
        "data.max_response_length": 16,
        "data.train_batch_size": 4,
        "model.path": toy / "model",
        "actor.ppo_mini_batch_size": 4,
        "actor.ppo_micro_batch_size_per_gpu": 16,
        "actor.optim.lr": 1e-3,
        "rollout.n": 4,
        "rollout.enforce_eager": "",  # no torch.compile warm-up: ~30 s less per engine on CPU
        "rollout.max_num_seqs": 16,
        "custom_reward_function.path": tmp / "digits.py",
        "custom_reward_function.num_workers": 0,
        "trainer.total_training_steps": 2,
        "trainer.default_local_dir": tmp / "run",
        "trainer.logger": "jsonl",
    }
    return flags(args | over)


def check_grpo_run(run: Path) -> None:
    """Both steps pushed exact weights after a real update, scored every sample, and left a complete checkpoint
    of a 2-rank job."""
    import checkpoint

    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-3, r  # step 2: the engine runs the updated weights
        assert r["reward/errors"] == 0 and 0 < r["reward/mean"] < 1 and r["reward/std"] > 0, r
        assert r["actor/grad_norm"] > 0, r  # the groups carried a signal: the weights moved
    assert checkpoint.checkpoint_problem(run / "global_step_2") is None
    assert json.loads((run / "global_step_2" / "trainer_state.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_two_nodes_grpo_pushes_exact_weights(toy_dir, tmp_path):
    """grpo.py on two "nodes" (static rendezvous, --node-rank): each rank's vLLM engine (external_launcher, tp 1)
    receives the trained weights every step."""
    two_nodes("grpo.py", grpo_args(toy_dir, tmp_path), tmp_path, rdzv="static", env=ENV)
    check_grpo_run(tmp_path / "run")


@pytest.mark.slow
def test_grpo_tensor_parallel_rollout(toy_dir, tmp_path):
    """Two ranks sharing one vLLM engine (rollout.tensor_model_parallel_size 2, external_launcher; both generate
    the group's prompts, rl.Run.next_prompts): the push into the engine's tensor-parallel shards is exact."""
    args = grpo_args(toy_dir, tmp_path, **{"rollout.tensor_model_parallel_size": 2})
    p = torchrun("grpo.py", args, nproc=2, env=ENV)
    check_grpo_run(tmp_path / "run")
    # vLLM logs its engine config: one engine over the 2 ranks, not one engine per rank
    assert "tensor_parallel_size=2," in p.stdout + p.stderr, p.stderr[-4000:]


if __name__ == "__main__":
    hang_worker(float(sys.argv[1]))
