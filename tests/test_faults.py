"""Fault injection: crashes, damaged checkpoints, NaN/inf steps, out-of-memory errors, dead and hung ranks.

Every test asserts numbers: a crashed-and-resumed run's metrics and weights against an uninterrupted run's, the
checkpoint a resume picks, skipped-step counts and the weights a skip leaves, how long a rank waits for a peer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import fsdp
import optim

torch.set_num_threads(1)  # 2 cores shared with other jobs


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
        fsdp.save_checkpoint(pristine, step, model, optimizer, {"marker": step})
    manifest = json.loads((pristine / "global_step_3" / fsdp.MANIFEST).read_text())
    assert {"model/.metadata", "optim/.metadata", "trainer_state.json", "rng/rank_0.pt"} <= manifest.keys()
    assert manifest["model/__0_0.distcp"] > 1_000_000  # the toy model's weights, in fp32
    assert fsdp.resolve_resume(pristine, "auto") == pristine / "global_step_3"

    for i, (name, how) in enumerate(BREAKS):
        run = tmp_path / f"run{i}"
        shutil.copytree(pristine, run)
        bad = _break(run / "global_step_3", name, how)
        capsys.readouterr()
        assert fsdp.resolve_resume(run, "auto") == run / "global_step_2", name
        out = capsys.readouterr().out
        assert str(bad) in out and f"fell back to {run / 'global_step_2'}" in out, out
        with pytest.raises(ValueError, match=re.escape(str(bad))):  # a path given explicitly: no fallback
            fsdp.resolve_resume(run, str(run / "global_step_3"))
        with pytest.raises(ValueError, match=re.escape(str(bad))):
            fsdp.load_checkpoint(run / "global_step_3", model, optimizer)

    # Two damaged: back two. The fallback loads: weights and trainer state of step 1.
    run = tmp_path / "two"
    shutil.copytree(pristine, run)
    _break(run / "global_step_3", "model/__0_0.distcp", "truncate")
    _break(run / "global_step_2", "trainer_state.json", "delete")
    resume = fsdp.resolve_resume(run, "auto")
    assert resume == run / "global_step_1"
    assert fsdp.load_checkpoint(resume, model, optimizer)["marker"] == 1
    assert torch.equal(_first_param(model), weights[1]) and not torch.equal(weights[1], weights[3])
    _break(run / "global_step_1", "rng/rank_0.pt", "delete")
    with pytest.raises(ValueError, match="no complete checkpoint"):  # starting over would hide the damage
        fsdp.resolve_resume(run, "auto")
    with pytest.raises(FileNotFoundError, match="global_step_9"):
        fsdp.resolve_resume(run, str(run / "global_step_9"))

    # An unfinished write (.tmp) is never a candidate; keep_last deletes without leaving half folders.
    run = tmp_path / "keep"
    shutil.copytree(pristine, run)
    shutil.copytree(run / "global_step_3", run / "global_step_4.tmp")
    assert fsdp.resolve_resume(run, "auto") == run / "global_step_3"
    fsdp.save_checkpoint(run, 4, model, optimizer, {"marker": 4}, keep_last=2)
    assert sorted(p.name for p in run.iterdir()) == ["global_step_3", "global_step_4"]
    assert fsdp.checkpoint_problem(run / "global_step_4") is None
