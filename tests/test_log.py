"""log.py: jsonl round trip, rank-0-only writes, backend errors, console ETA, Timer, run_info, run files."""

import importlib.metadata
import json
import math
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import log  # noqa: E402


def test_jsonl_lines_parse_back(tmp_path, capsys):
    logger = log.Logger(tmp_path / "run", backends=("jsonl",))
    logger.log({"train/loss": torch.tensor(1.25), "train/lr": 2e-5, "perf/n": 3}, step=1)
    logger.log({"train/loss": float("nan"), "val/score": torch.tensor([0.5], dtype=torch.float64)}, step=2)
    logger.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert rows == [
        {"step": 1, "train/loss": 1.25, "train/lr": 2e-5, "perf/n": 3.0},
        {"step": 2, "train/loss": None, "val/score": 0.5},  # NaN is written as null
    ]
    assert "NaN" not in lines[1]
    assert capsys.readouterr().out == ""  # no console backend chosen

    logger = log.Logger(tmp_path / "run", backends=("jsonl",))  # a resumed run appends
    logger.log({"train/loss": 0.75}, step=3)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["train/loss"] == 0.75


def test_resumed_run_drops_lines_after_its_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps({"step": s, "train/loss": 1.0 / (s + 1)}) for s in range(6)]  # step 0 = val before
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "train/lo')  # cut by a SIGKILL
    logger = log.Logger(run, backends=("jsonl",), keep_until_step=3)  # resumed from global_step_3
    logger.log({"train/loss": 0.5}, step=4)
    logger.close()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and rows[-1]["train/loss"] == 0.5
    assert rows[3]["train/loss"] == 0.25
    assert "dropped 3 lines after step 3" in capsys.readouterr().out
    log.Logger(run, backends=("jsonl",), rank=1, keep_until_step=-1).close()  # only rank 0 touches the file
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 5
    log.Logger(run, backends=("jsonl",), keep_until_step=-1).close()  # a fresh start
    assert (run / "metrics.jsonl").read_text() == ""


def test_only_rank0_writes(tmp_path, capsys):
    logger = log.Logger(tmp_path / "run1", backends=("console", "jsonl"), rank=1, total_steps=10)
    logger.log({"train/loss": 1.0}, step=1)
    logger.close()
    assert not (tmp_path / "run1").exists()
    assert capsys.readouterr().out == ""
    logger = log.Logger(tmp_path / "run0", backends=("console", "jsonl"), rank=0, total_steps=10)
    logger.log({"train/loss": 1.0}, step=1)
    logger.close()
    assert (tmp_path / "run0" / "metrics.jsonl").read_text().count("\n") == 1
    assert capsys.readouterr().out == "step 1/10 | loss 1\n"


@pytest.mark.parametrize("rank", [0, 1])
def test_unknown_backend(tmp_path, rank):
    with pytest.raises(ValueError) as exc:
        log.Logger(tmp_path, backends=("console", "wandbb"), rank=rank)
    assert "'wandbb'" in str(exc.value)
    assert "console, jsonl, tensorboard, wandb" in str(exc.value)


def test_console_line_and_eta(tmp_path, monkeypatch, capsys):
    clock = iter([100.0, 120.0])
    monkeypatch.setattr(log.time, "monotonic", lambda: next(clock))
    logger = log.Logger(tmp_path, backends=("console",), total_steps=100)
    logger.log({"train/loss": 2.0, "train/lr": 2e-5, "perf/tokens_per_s": 12345.0, "other": 7}, step=10)
    logger.log({"train/loss": 1.5}, step=20)
    # 20 s for 10 steps = 2 s/step; 80 steps left -> 160 s.
    assert capsys.readouterr().out.splitlines() == [
        "step 10/100 | loss 2 | lr 2e-05 | tok/s 1.234e+04",
        "step 20/100 | loss 1.5 | eta 2m40s",
    ]
    assert log._fmt_duration(3 * 3600 + 7 * 60 + 5) == "3h07m"


def test_timer_accumulates_with_fake_clock():
    ticks = iter([0.0, 1.5, 10.0, 10.25, 20.0, 23.0])
    syncs = []
    timer = log.Timer(clock=lambda: next(ticks), sync=lambda: syncs.append(1))
    with timer("gen"):
        pass
    with timer("gen"):
        pass
    with pytest.raises(RuntimeError), timer("train"):  # time is charged even when the phase raises
        raise RuntimeError("boom")
    assert timer.pop() == {"timing_s/gen": 1.75, "timing_s/train": 3.0}
    assert len(syncs) == 6
    assert timer.pop() == {}  # pop resets


def test_timer_real_clock():
    timer = log.Timer()
    with timer("sleep"):
        time.sleep(0.05)
    t = timer.pop()["timing_s/sleep"]
    assert 0.04 < t < 2.0


def test_run_info(tmp_path, monkeypatch):
    vllm_loaded = "vllm" in sys.modules
    info = log.run_info()
    assert ("vllm" in sys.modules) == vllm_loaded  # metadata only, never an import
    repo = Path(log.__file__).resolve().parent
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert info["commit"] == (head.stdout.strip() if head.returncode == 0 else "unknown")
    assert isinstance(info["dirty"], bool)
    assert info["versions"]["torch"] == importlib.metadata.version("torch") == torch.__version__
    assert info["versions"]["tyro"] == importlib.metadata.version("tyro")
    assert info["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert info["argv"] == sys.argv and info["hostname"] and info["date"][:2] == "20"

    # Outside any git repository: commit "unknown", dirty unknown.
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.setattr(log, "__file__", str(tmp_path / "sub" / "log.py"))
    (tmp_path / "sub").mkdir()
    info = log.run_info()
    assert info["commit"] == "unknown" and info["dirty"] is None
    # A copied tree (the GPU machine's) names its commit through FLATRL_COMMIT, over any .git it carries.
    monkeypatch.setattr(log, "__file__", str(repo / "log.py"))
    monkeypatch.setenv("FLATRL_COMMIT", "7bd685f")
    info = log.run_info()
    assert info["commit"] == "7bd685f" and info["dirty"] is None


def test_write_run_files(tmp_path):
    log.write_run_files(tmp_path / "run" / "ckpt_5", "optim:\n  lr: 1.0e-05\n")
    folder = tmp_path / "run" / "ckpt_5"
    assert (folder / "config.yaml").read_text() == "optim:\n  lr: 1.0e-05\n"
    info = json.loads((folder / "run_info.json").read_text())
    assert set(info) == {"commit", "dirty", "argv", "versions", "hostname", "date"}


def test_optional_backends_are_wired(tmp_path, monkeypatch):
    """tensorboard and wandb are not installed here: fake modules check the calls flatrl makes."""
    calls = []

    class FakeWriter:
        def __init__(self, log_dir):
            calls.append(("tb_dir", log_dir))

        def add_scalar(self, name, value, step):
            calls.append(("tb", name, value, step))

        def close(self):
            calls.append(("tb_close",))

    class FakeRun:
        def log(self, values, step):
            calls.append(("wandb", values, step))

        def finish(self):
            calls.append(("wandb_finish",))

    fake_wandb = types.ModuleType("wandb")
    fake_wandb.init = lambda **kw: calls.append(("wandb_init", kw)) or FakeRun()
    fake_tb = types.ModuleType("torch.utils.tensorboard")
    fake_tb.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake_tb)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc -> no key -> offline

    logger = log.Logger(
        tmp_path, backends=("tensorboard", "wandb"), project="p", experiment="e", config={"a": 1}
    )
    logger.log({"train/loss": torch.tensor(0.5)}, step=4)
    logger.close()
    init = calls[1][1]
    assert calls[0] == ("tb_dir", str(tmp_path / "tensorboard"))
    assert init["mode"] == "offline" and init["project"] == "p" and init["name"] == "e"
    assert init["config"] == {"a": 1}
    assert calls[2:] == [
        ("tb", "train/loss", 0.5, 4),
        ("wandb", {"train/loss": 0.5}, 4),
        ("tb_close",),
        ("wandb_finish",),
    ]
    assert math.isclose(calls[2][2], 0.5)
