"""checkpoint.save_checkpoint refuses what must not be written (issue 22): a model with NaN or inf parameters
(named, before anything is written), and a disk too small for it (no space left on <path>, and how much is
needed), whether the shortage is seen before the write or only when the write fails."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest
import torch

import checkpoint
import fsdp
import optim

torch.set_num_threads(1)
Usage = namedtuple("Usage", "total used free")


def build(model_dir, device):
    model = fsdp.shard_model(fsdp.load_model(str(model_dir)), device, fsdp.FSDPConfig())
    optimizer, _ = optim.build(model.parameters(), optim.OptimConfig(lr=1e-2), total_steps=10)
    sum(p.square().sum() for p in model.parameters()).backward()
    optimizer.step()  # AdamW state: 2 fp32 tensors per parameter
    return model, optimizer


def param(model, name: str) -> torch.Tensor:
    return dict(model.named_parameters())[name].to_local()


def test_non_finite_parameters_are_refused_before_anything_is_written(tiny_qwen2, one_rank, tmp_path):
    actor, actor_opt = build(tiny_qwen2, one_rank.device)
    critic, critic_opt = build(tiny_qwen2, one_rank.device)
    run = tmp_path / "run"
    extra = {"critic": (critic, critic_opt, {})}
    with torch.no_grad():
        param(critic, "model.norm.weight")[3] = float("inf")
    with pytest.raises(ValueError, match=r"parameter critic/model\.norm\.weight holds NaN or inf"):
        checkpoint.save_checkpoint(run, 1, actor, actor_opt, {}, extra=extra)
    with torch.no_grad():
        param(critic, "model.norm.weight")[3] = 1.0
        param(actor, "model.layers.0.mlp.up_proj.weight")[5, 2] = float("nan")
        param(actor, "lm_head.weight")[0, 0] = float("nan")  # a later one: the first is named
    with pytest.raises(ValueError, match=r"parameter model\.layers\.0\.mlp\.up_proj\.weight holds") as e:
        checkpoint.save_checkpoint(run, 1, actor, actor_opt, {}, extra=extra)
    assert "global_step_1" in str(e.value) and not run.exists()
    with torch.no_grad():
        param(actor, "model.layers.0.mlp.up_proj.weight")[5, 2] = 0.0
        param(actor, "lm_head.weight")[0, 0] = 0.0
    ckpt = checkpoint.save_checkpoint(run, 1, actor, actor_opt, {}, extra=extra)
    assert checkpoint.checkpoint_problem(ckpt) is None


def test_full_disk_is_named_with_the_size_needed(tiny_qwen2, one_rank, tmp_path, monkeypatch):
    model, optimizer = build(tiny_qwen2, one_rank.device)
    tensors = 3 * sum(p.numel() * 4 for p in model.parameters())  # weights + exp_avg + exp_avg_sq, fp32
    run = tmp_path / "run"
    real_usage = shutil.disk_usage
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(OSError, match=rf"no space left on {tmp_path}: the checkpoint needs about") as e:
        checkpoint.save_checkpoint(run, 1, model, optimizer, {})
    assert e.value.errno == errno.ENOSPC and "1000 bytes are free" in str(e.value)
    needed_kib = float(str(e.value).split("needs about ")[1].split(" KiB")[0])
    assert tensors / 1024 <= needed_kib < 1.05 * tensors / 1024  # the tensors, plus the step counters
    assert not run.exists()  # refused before anything was written

    # The disk fills during the write: torch.save's zip writer says "unexpected pos", DCP wraps OSErrors.
    free = {"now": 10**12}
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: Usage(10**12, 0, free["now"]))
    real_save = checkpoint.dcp.save

    def fill_up(state_dict, checkpoint_id):
        real_save(state_dict, checkpoint_id=checkpoint_id)
        free["now"] = 4096
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint.dcp, "save", fill_up)
    with pytest.raises(OSError, match="no space left on") as e:
        checkpoint.save_checkpoint(run, 1, model, optimizer, {})
    assert "unexpected pos" in str(e.value.__cause__) and "4.0 KiB are free" in str(e.value)
    assert list(run.iterdir()) == []  # the partial global_step_1.tmp is deleted, giving the space back

    def fail(state_dict, checkpoint_id):  # the same RuntimeError with room to spare: not a full disk
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 704 vs 598")

    free["now"] = 10**12
    monkeypatch.setattr(checkpoint.dcp, "save", fail)
    with pytest.raises(RuntimeError, match="unexpected pos"):  # raised as it is
        checkpoint.save_checkpoint(run, 1, model, optimizer, {})
    monkeypatch.setattr(checkpoint.dcp, "save", real_save)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", real_usage)
    ckpt = checkpoint.save_checkpoint(run, 1, model, optimizer, {})  # the stale .tmp is replaced
    assert checkpoint.checkpoint_problem(ckpt) is None and sorted(p.name for p in run.iterdir()) == [
        ckpt.name
    ]
