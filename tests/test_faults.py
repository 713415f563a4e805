"""Fault injection: crashes, damaged checkpoints, NaN/inf steps, out-of-memory errors, dead and hung ranks.

Every test asserts numbers: a crashed-and-resumed run's metrics and weights against an uninterrupted run's, the
checkpoint a resume picks, skipped-step counts and the weights a skip leaves, how long a rank waits for a peer.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import ROOT, free_port, read_metrics
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import checkpoint
import fsdp
import losses
import optim
import sft

torch.set_num_threads(1)  # 2 cores shared with other jobs


@pytest.fixture(scope="module")
def small_sft(toy_dir, tmp_path_factory) -> Path:
    """The first 64 rows of the toy SFT set: 8 steps of 8 sequences per epoch, quick to tokenise."""
    out = tmp_path_factory.mktemp("small") / "train.parquet"
    pq.write_table(pq.read_table(toy_dir / "sft/train.parquet").slice(0, 64), out)
    return out


def sft_args(toy: Path, train: Path, run: Path, steps: int, save_freq: int) -> list[str]:
    return [
        "--data.train_files", str(train), "--data.val_files", "None", "--data.max_length", "64",
        "--data.train_batch_size", "8", "--data.micro_batch_size_per_gpu", "4",
        "--model.partial_pretrain", str(toy / "model"), "--optim.lr", "3e-3", "--optim.warmup_steps_ratio", "0.0",
        "--trainer.default_local_dir", str(run), "--trainer.logger", "console", "jsonl",
        "--trainer.total_training_steps", str(steps), "--trainer.save_freq", str(save_freq),
    ]  # fmt: skip


def sft_cfg(toy: Path, train: Path, run: Path, **trainer) -> sft.SFTConfig:
    """The same run as sft_args, as a config for sft.main in this process."""
    return sft.SFTConfig(
        data=sft.SFTDataConfig(
            train_files=str(train),
            val_files=None,
            max_length=64,
            train_batch_size=8,
            micro_batch_size_per_gpu=4,
        ),
        model=sft.SFTModelConfig(partial_pretrain=str(toy / "model")),
        optim=sft.SFTOptimConfig(lr=3e-3, warmup_steps_ratio=0.0),
        trainer=sft.SFTTrainerConfig(default_local_dir=str(run), logger=["jsonl"], **trainer),
    )


def dcp_tensors(folder: Path, tmp: Path) -> dict:
    """A DCP folder (model/ or optim/) as one plain state dict."""
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / f"{folder.parent.name}_{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=True)


# ---------------------------------------------------------------------------------------- crash anywhere


def launch(script: str, args: list[str], log_file) -> list[subprocess.Popen]:
    """Both ranks of a 2-rank job in one process group, so os.killpg takes the whole job down at once, like a
    lost node. (torchrun puts each worker in its own session, where killing torchrun leaves them running.)"""
    port = str(free_port())
    procs: list[subprocess.Popen] = []
    for rank in (0, 1):
        env = dict(
            os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / script), *args],
                cwd=ROOT,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                process_group=procs[0].pid if procs else 0,
            )  # fmt: skip
        )
    return procs


def run_job(script: str, args: list[str], log: Path, trigger=None, limit_s: float = 240) -> bool:
    """Runs a 2-rank job until it exits (it must succeed) or `trigger()` is true: then SIGKILL to every rank.

    Returns True if it was killed."""
    with open(log, "w") as log_file:
        procs = launch(script, args, log_file)
        deadline = time.monotonic() + limit_s
        try:
            while any(p.poll() is None for p in procs):
                if trigger is not None and trigger():
                    os.killpg(procs[0].pid, signal.SIGKILL)
                    return True
                assert time.monotonic() < deadline, (
                    f"{script} ran past {limit_s} s:\n{log.read_text()[-3000:]}"
                )
                time.sleep(0.005)
        finally:
            if any(p.poll() is None for p in procs):
                os.killpg(procs[0].pid, signal.SIGKILL)
            for p in procs:
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], log.read_text()[-5000:]
    return False


def logged_step(log: Path) -> int:
    """The last `step k/N` console line this job printed (0 before the first)."""
    steps = re.findall(r"^step (\d+)/", log.read_text(), flags=re.M)
    return int(steps[-1]) if steps else 0


def after_step(log: Path, k: int, delay_s: float):
    """A trigger: true `delay_s` after the job logs step k, or as soon as it logs step k + 1, whichever comes first
    (without that bound a fast host ran from step 3 to the end of a 10-step job within the delay, and the "kill"
    hit a finished run)."""
    fire_at: list[float] = []

    def trigger() -> bool:
        done = logged_step(log)
        if not fire_at and done >= k:
            fire_at.append(time.monotonic() + delay_s)
        return bool(fire_at) and (time.monotonic() >= fire_at[0] or done > k)

    return trigger


def newest_complete(run: Path) -> int:
    ckpts = checkpoint.list_checkpoints(run)
    complete = [int(p.name.split("_")[-1]) for p in ckpts if not checkpoint.checkpoint_problem(p)]
    return max(complete, default=0)


@pytest.mark.slow
def test_crash_anywhere_then_resume_equals_an_uninterrupted_run(toy_dir, small_sft, tmp_path):
    """SIGKILL a 2-rank run three times (mid checkpoint write, then at seeded random moments after a step), resume
    with resume_mode=auto each time: the metrics of steps 1..10 and the final weights equal an uninterrupted
    run's. 10 steps cross an epoch (8 per epoch) and the cosine schedule, so data order, RNG, optimizer and
    scheduler state must all come back."""
    steps, save_freq = 10, 2
    ref, run = tmp_path / "ref", tmp_path / "crashed"
    run_job("sft.py", sft_args(toy_dir, small_sft, ref, steps, save_freq), tmp_path / "ref.log")
    args = sft_args(toy_dir, small_sft, run, steps, save_freq)
    rng = random.Random(5)

    # Kill 1: during the n-th checkpoint write, after its model/ (or optim/) DCP files are on disk.
    n, part = rng.choice([1, 2]), rng.choice(["model", "optim"])
    tmp_dir = run / f"global_step_{n * save_freq}.tmp"
    assert run_job(
        "tests/sft_slow_save.py",
        args,
        tmp_path / "kill1.log",
        lambda: (tmp_dir / part / ".metadata").exists(),
    )
    assert tmp_dir.is_dir() and not (tmp_dir / checkpoint.MANIFEST).exists()  # killed mid-write ...
    assert not (run / f"global_step_{n * save_freq}").exists()  # ... so that step has no checkpoint
    assert newest_complete(run) == (n - 1) * save_freq

    # Kills 2 and 3: at a random moment up to 0.4 s after a random step, before the next step's line (mid step,
    # mid save, or in between).
    kills = []
    for i in (2, 3):
        start = newest_complete(run)
        k, delay = rng.randint(start + 1, min(start + 3, steps - 1)), rng.uniform(0.0, 0.4)
        log = tmp_path / f"kill{i}.log"
        assert run_job("sft.py", args, log, after_step(log, k, delay)), f"kill {i} came too late"
        assert ("resumed from" in log.read_text()) == (start > 0)
        kills.append((start, k, round(delay, 3), logged_step(log)))
    run_job("sft.py", args, tmp_path / "final.log")
    print("kills (resumed from, target step, delay s, last logged step):", kills)

    want, got = read_metrics(ref), read_metrics(run)
    assert [r["step"] for r in got] == list(
        range(1, steps + 1)
    )  # each step once: lines after a resume dropped
    for a, b in zip(want, got, strict=True):
        assert abs(a["train/loss"] - b["train/loss"]) < 1e-6, (a, b)
        assert abs(a["train/grad_norm"] - b["train/grad_norm"]) < 1e-6 * a["train/grad_norm"], (a, b)
        assert (a["train/lr"], a["train/num_tokens"], a["train/epoch"]) == (
            b["train/lr"], b["train/num_tokens"], b["train/epoch"],
        )  # fmt: skip
    final = f"global_step_{steps}"
    w_ref, w_run = (
        dcp_tensors(ref / final / "model", tmp_path),
        dcp_tensors(run / final / "model", tmp_path / "r"),
    )
    assert w_ref.keys() == w_run.keys() and len(w_ref) > 10
    assert all(torch.equal(w_ref[k], w_run[k]) for k in w_ref)


# ---------------------------------------------------------------------------------- damaged checkpoints


def _first_param(model: torch.nn.Module) -> torch.Tensor:
    return next(iter(fsdp.iter_full_params(model)))[1].clone()


BREAKS = [
    ("model/.metadata", "delete"),
    ("model/__0_0.distcp", "truncate"),
    ("optim/__0_0.distcp", "delete"),
    ("trainer_state.json", "delete"),
    ("rng/rank_0.pt", "truncate"),
    ("manifest.json", "delete"),
]


def _break(ckpt: Path, name: str, how: str) -> Path:
    f = ckpt / name
    if how == "delete":
        f.unlink()
    else:
        os.truncate(f, f.stat().st_size // 2)
    return f


def test_damaged_checkpoint_is_named_and_resume_falls_back(toy_dir, tmp_path, one_rank, capsys):
    model = fsdp.shard_model(fsdp.load_model(str(toy_dir / "model")), one_rank.device, fsdp.FSDPConfig())
    optimizer, _ = optim.build(model.parameters(), optim.OptimConfig(lr=1e-2), total_steps=10)
    pristine, weights = tmp_path / "pristine", {}
    for step in (1, 2, 3):
        sum(p.square().sum() for p in model.parameters()).backward()
        optimizer.step()
        optimizer.zero_grad()
        weights[step] = _first_param(model)
        checkpoint.save_checkpoint(pristine, step, model, optimizer, {"marker": step})
    manifest = json.loads((pristine / "global_step_3" / checkpoint.MANIFEST).read_text())
    assert {"model/.metadata", "optim/.metadata", "trainer_state.json", "rng/rank_0.pt"} <= manifest.keys()
    assert manifest["model/__0_0.distcp"] > 1_000_000  # the toy model's weights, in fp32
    assert checkpoint.resolve_resume(pristine, "auto") == pristine / "global_step_3"

    for i, (name, how) in enumerate(BREAKS):
        run = tmp_path / f"run{i}"
        shutil.copytree(pristine, run)
        bad = _break(run / "global_step_3", name, how)
        capsys.readouterr()
        assert checkpoint.resolve_resume(run, "auto") == run / "global_step_2", name
        out = capsys.readouterr().out
        assert str(bad) in out and f"fell back to {run / 'global_step_2'}" in out, out
        with pytest.raises(ValueError, match=re.escape(str(bad))):  # a path given explicitly: no fallback
            checkpoint.resolve_resume(run, str(run / "global_step_3"))
        with pytest.raises(ValueError, match=re.escape(str(bad))):
            checkpoint.load_checkpoint(run / "global_step_3", model, optimizer)

    # Two damaged: back two. The fallback loads: weights and trainer state of step 1.
    run = tmp_path / "two"
    shutil.copytree(pristine, run)
    _break(run / "global_step_3", "model/__0_0.distcp", "truncate")
    _break(run / "global_step_2", "trainer_state.json", "delete")
    resume = checkpoint.resolve_resume(run, "auto")
    assert resume == run / "global_step_1"
    assert checkpoint.load_checkpoint(resume, model, optimizer)["marker"] == 1
    assert torch.equal(_first_param(model), weights[1]) and not torch.equal(weights[1], weights[3])
    _break(run / "global_step_1", "rng/rank_0.pt", "delete")
    with pytest.raises(ValueError, match="no complete checkpoint"):  # starting over would hide the damage
        checkpoint.resolve_resume(run, "auto")
    with pytest.raises(FileNotFoundError, match="global_step_9"):
        checkpoint.resolve_resume(run, str(run / "global_step_9"))

    # An unfinished write (.tmp) is never a candidate; keep_last deletes without leaving half folders.
    run = tmp_path / "keep"
    shutil.copytree(pristine, run)
    shutil.copytree(run / "global_step_3", run / "global_step_4.tmp")
    assert checkpoint.resolve_resume(run, "auto") == run / "global_step_3"
    checkpoint.save_checkpoint(run, 4, model, optimizer, {"marker": 4}, keep_last=2)
    assert sorted(p.name for p in run.iterdir()) == ["global_step_3", "global_step_4"]
    assert checkpoint.checkpoint_problem(run / "global_step_4") is None


# ---------------------------------------------------------------------------------------- NaN and inf


def test_skip_guard_counts_and_stops():
    nan, inf = float("nan"), float("inf")
    guard = optim.SkipGuard(max_consecutive=2)
    steps = [(1.0, 1.0), (nan, 1.0), (1.0, inf), (1.0, 1.0), (2.0, nan), (-inf, 2.0), (1.0, 1.0)]
    taken, skipped, stop = [], [], []
    for loss, norm in steps:
        taken.append(guard.take_step(loss, norm))
        skipped.append(guard.skipped)
        stop.append(guard.stop)
    assert taken == [True, False, False, True, False, False, True]
    assert skipped == [0, 1, 2, 2, 3, 4, 4]
    assert stop == [False, False, True, False, False, True, False]
    resumed = optim.SkipGuard(2)
    resumed.load_state_dict({"skipped": 3, "consecutive": 1})
    assert (
        not resumed.take_step(nan, 1.0)
        and resumed.stop
        and resumed.state_dict() == {"skipped": 4, "consecutive": 2}
    )
    with pytest.raises(ValueError, match=">= 1"):
        optim.SkipGuard(0)


def test_nan_and_inf_steps_are_skipped_then_the_run_stops(
    toy_dir, small_sft, tmp_path, monkeypatch, one_rank
):
    """NaN/inf injected into the logprobs of chosen steps (1 rank, 2 micro-batches a step): those steps do not
    update the weights, are counted, and 3 in a row stop the run with a checkpoint of the last good weights."""
    bad = {2: float("nan"), 4: float("inf"), 7: float("nan"), 8: float("inf"), 9: float("nan")}
    real, calls = losses.forward_logprobs, []

    def poisoned(model, batch, labels, *args, **kwargs):
        lp, ent, raw = real(model, batch, labels, *args, **kwargs)
        calls.append(len(calls) // 2 + 1)  # the step this forward belongs to
        return (lp * bad[calls[-1]] if calls[-1] in bad else lp), ent, raw

    monkeypatch.setattr(losses, "forward_logprobs", poisoned)
    run = tmp_path / "run"
    cfg = sft_cfg(toy_dir, small_sft, run, total_training_steps=12, save_freq=3, max_consecutive_skips=3)
    with pytest.raises(
        RuntimeError, match=r"step 9: .* last 3 steps in a row .*global_step_9 holds those of step 6"
    ):
        sft.main(cfg)

    m = read_metrics(run)
    assert [r["step"] for r in m] == list(range(1, 10)) and len(calls) == 18
    assert [r["train/skipped_steps"] for r in m] == [0, 1, 1, 2, 2, 2, 3, 4, 5]
    assert [r["train/loss"] is None for r in m] == [s in bad for s in range(1, 10)]  # NaN/inf -> null
    assert [r["train/grad_norm"] is None for r in m] == [s in bad for s in range(1, 10)]
    names = [p.name for p in checkpoint.list_checkpoints(run)]
    assert names == ["global_step_3", "global_step_6", "global_step_9"]
    w3, w6, w9 = (dcp_tensors(run / f"global_step_{s}" / "model", tmp_path) for s in (3, 6, 9))
    assert all(torch.equal(w6[k], w9[k]) for k in w6)  # steps 7-9 changed nothing
    assert not all(torch.equal(w3[k], w6[k]) for k in w3)  # steps 5 and 6 did update
    adam = dcp_tensors(run / "global_step_9" / "optim", tmp_path)["state"]
    assert {float(s["step"]) for s in adam.values()} == {4.0}  # AdamW stepped at 1, 3, 5, 6 only
    state = json.loads((run / "global_step_9" / "trainer_state.json").read_text())
    assert state["skips"] == {"skipped": 5, "consecutive": 3} and state["scheduler"]["last_epoch"] == 9


# -------------------------------------------------------------------------------------- out of memory


def test_explain_oom_catches_once_and_only_out_of_memory():
    settings = {"rollout.gpu_memory_utilization": 0.5, "data.micro_batch_size_per_gpu": 4}
    vllm_errors = [
        "No available memory for the cache blocks. Try increasing `gpu_memory_utilization`",
        "To serve at least one request with the model's max seq len (4096), (2.5 GiB KV cache is needed, "
        "which is larger than the available KV cache memory (1.0 GiB).",
        "Free memory on device cuda:0 (3.1/79.1 GiB) on startup is less than desired GPU memory utilization",
    ]
    for text in vllm_errors:
        with pytest.raises(RuntimeError) as exc, fsdp.explain_oom("engine start", settings):
            raise ValueError(text)
        msg = str(exc.value)
        assert msg.startswith("out of memory in engine start (no CUDA device") and text[:40] in msg
        assert "--rollout.gpu_memory_utilization (now 0.5), --data.micro_batch_size_per_gpu (now 4)" in msg
        assert isinstance(exc.value.__cause__, ValueError)
    with (
        pytest.raises(RuntimeError) as exc,
        fsdp.explain_oom("outer", {}),
        fsdp.explain_oom("inner", settings),
    ):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert str(exc.value).count("out of memory in") == 1 and "out of memory in inner" in str(exc.value)
    for err in (ValueError("bad value"), RuntimeError("other"), KeyError("k")):  # passed through unchanged
        with pytest.raises(type(err)) as exc, fsdp.explain_oom("x", settings):
            raise err
        assert exc.value is err
    # The RL trainers append the run's memory plan (perf.plan), built only once the error happened.
    calls = []
    with (
        pytest.raises(RuntimeError) as exc,
        fsdp.explain_oom("update", settings, plan=lambda: calls.append(1) or "PLAN"),
    ):
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert calls == [1] and str(exc.value).endswith("The memory plan of this run:\nPLAN")
    with pytest.raises(RuntimeError) as exc, fsdp.explain_oom("update", settings, plan=lambda: 1 / 0):
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert "no memory plan: ZeroDivisionError" in str(exc.value)  # a broken plan never hides the real error


def test_out_of_memory_in_a_step_is_reported_once(toy_dir, small_sft, tmp_path, monkeypatch, one_rank):
    real, calls = losses.forward_logprobs, []

    def oom_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # step 2, first micro-batch
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(losses, "forward_logprobs", oom_on_third)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError) as exc:
        sft.main(sft_cfg(toy_dir, small_sft, run, total_training_steps=4))
    msg = str(exc.value)
    assert msg.startswith("out of memory in sft step 2 (no CUDA device"), msg
    for flag in ("data.micro_batch_size_per_gpu (now 4)", "data.max_length (now 64)",
                 "model.enable_gradient_checkpointing (now True)", "model.fsdp_config.cpu_offload (now False)"):  # fmt: skip
        assert f"--{flag}" in msg, flag
    assert "Tried to allocate 20.00 GiB" in msg and isinstance(exc.value.__cause__, torch.OutOfMemoryError)
    assert len(calls) == 3  # no retry
    assert [r["step"] for r in read_metrics(run)] == [1]


# ------------------------------------------------------------------------------------ dead and hung ranks


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["die", "hang"])
def test_a_dead_or_hung_rank_is_an_error_within_the_timeout(tmp_path, mode):
    timeout_s = 4.0
    log = tmp_path / "log"
    start = time.monotonic()
    with open(log, "w") as log_file:
        procs = launch("tests/dead_rank.py", [mode, str(timeout_s)], log_file)
        try:
            procs[0].wait(timeout=120)  # rank 0's exit; rank 1 sleeps on in the hang case
        finally:
            os.killpg(procs[0].pid, signal.SIGKILL)
            for p in procs:
                p.wait()
    text = log.read_text()
    assert procs[0].returncode == 1, text
    assert text.count("mesh group is the default group: True") == 2, text  # FSDP uses the timed group
    waited = float(re.search(r"waited ([\d.]+) s", text).group(1))
    if mode == "hang":
        assert timeout_s - 0.5 < waited < timeout_s + 5, text
    else:
        assert waited < timeout_s + 5, text
    print(f"{mode}: rank 0 failed after {waited:.2f} s; the job took {time.monotonic() - start:.1f} s")


def test_sigterm_saves_at_the_step_boundary(toy_dir, tmp_path):
    """SIGTERM mid-run (grpo.py on the toy model, the hf engine, one process): the run finishes the step it is in,
    saves global_step_N for it, exits 128 + 15 naming it; the same command resumes from N to the end, and every
    step appears once in metrics.jsonl."""
    run = tmp_path / "grpo"
    cmd = [
        sys.executable, str(ROOT / "grpo.py"),
        "--data.train_files", str(toy_dir / "rl/train.parquet"), "--data.val_files", "None",
        "--data.train_batch_size", "4", "--data.max_prompt_length", "32", "--data.max_response_length", "8",
        "--model.path", str(toy_dir / "model"), "--rollout.name", "hf", "--rollout.n", "2",
        "--actor.ppo_mini_batch_size", "4", "--custom_reward_function.num_workers", "0",
        "--trainer.default_local_dir", str(run), "--trainer.logger", "jsonl",
        "--trainer.total_training_steps", "40", "--trainer.resume_mode", "auto",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    saved = checkpoint.list_checkpoints(run)
    assert len(saved) == 1 and checkpoint.checkpoint_problem(saved[0]) is None
    stopped_at = int(saved[0].name.split("_")[-1])
    assert 2 <= stopped_at < 40 and f"stopped by signal 15 after step {stopped_at}" in out
    assert max(r["step"] for r in read_metrics(run)) == stopped_at  # it finished that step, not the next

    cmd[cmd.index("--trainer.total_training_steps") + 1] = str(stopped_at + 2)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    steps = [r["step"] for r in read_metrics(run) if "reward/mean" in r]
    assert steps == list(range(1, stopped_at + 3)), steps


def test_resume_takes_a_new_lr_and_refuses_a_new_batch_size(toy_dir, small_sft, tmp_path, one_rank, capsys):
    """Resuming with another optim.lr: the first resumed step runs at the new lr (the restored schedule used to
    bring back the saved base lr), and the change is printed; another data.train_batch_size (which rows a step
    sees) is one error naming it with both values, unless trainer.resume_allow_changes names it."""
    import dataclasses

    run = tmp_path / "sft"
    sft.main(sft_cfg(toy_dir, small_sft, run, total_training_steps=2, save_freq=2))
    cfg = sft_cfg(toy_dir, small_sft, run, total_training_steps=3, save_freq=2)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=1e-3))
    sft.main(cfg)
    lrs = {r["step"]: r["train/lr"] for r in read_metrics(run) if "train/lr" in r}
    # the new run's cosine schedule (3 steps) at step 3 times the new peak lr (the old peak would give 7.5e-4)
    assert lrs[1] == pytest.approx(3e-3) and lrs[3] == pytest.approx(
        1e-3 * optim.lr_factor(2, 3, cfg.optim)
    ), lrs
    assert "changed on resume: optim.lr: 0.003 -> 0.001" in capsys.readouterr().out

    bigger = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_batch_size=16))
    bigger = dataclasses.replace(bigger, trainer=dataclasses.replace(bigger.trainer, total_training_steps=4))
    with pytest.raises(ValueError, match=r"data.train_batch_size: 8 -> 16"):
        sft.main(bigger)
    allowed = dataclasses.replace(bigger.trainer, resume_allow_changes=("data.train_batch_size",))
    assert sft.main(dataclasses.replace(bigger, trainer=allowed))["global_step"] == 4


def test_model_path_may_name_a_flatrl_checkpoint(toy_dir, small_sft, tmp_path, one_rank):
    """verl's tutorial hands an SFT checkpoint to GRPO as model.path. A flatrl RUN/global_step_N (or RUN, for its
    newest complete checkpoint) is exported once to RUN/hf_global_step_N (shard_merge.py) and loaded from there:
    grpo.py evaluates it (the hf engine, in process) with the weights and greedy responses of the model
    shard_merge.py writes by hand, and a second run reuses the export."""
    import json

    import grpo
    import rl
    import rollout
    import scoring
    import shard_merge

    run = tmp_path / "sft"
    sft.main(sft_cfg(toy_dir, small_sft, run, total_training_steps=2, save_freq=2))
    by_hand = shard_merge.merge(run / "global_step_2", tmp_path / "by_hand")

    def evaluate(model_path: Path, out: Path) -> list[str]:
        cfg = grpo.GRPOConfig(
            data=rl.RLDataConfig(
                train_files=str(toy_dir / "rl/train.parquet"),
                val_files=str(toy_dir / "rl/val.parquet"),
                max_prompt_length=32,
                max_response_length=8,
            ),
            model=grpo.actor.ModelConfig(path=str(model_path)),
            rollout=rollout.RolloutConfig(name="hf"),
            custom_reward_function=scoring.RewardConfig(num_workers=0),
            trainer=rl.RLTrainerConfig(default_local_dir=str(out), val_only=True, logger=["jsonl"]),
        )
        grpo.main(cfg)
        rows = (out / "val_generations" / "step_0.jsonl").read_text().splitlines()
        return [json.loads(r)["response"] for r in rows]

    from_ckpt = evaluate(run / "global_step_2", tmp_path / "a")
    assert (run / "hf_global_step_2" / "config.json").is_file()
    assert from_ckpt == evaluate(by_hand, tmp_path / "b")
    from safetensors.torch import load_file

    exported, merged = (load_file(d / "model.safetensors") for d in (run / "hf_global_step_2", by_hand))
    assert exported.keys() == merged.keys() and all(torch.equal(exported[k], merged[k]) for k in merged)
    stamp = (run / "hf_global_step_2" / "config.json").stat().st_mtime
    assert evaluate(run, tmp_path / "c") == from_ckpt  # the run folder: its newest checkpoint, export reused
    assert (run / "hf_global_step_2" / "config.json").stat().st_mtime == stamp
