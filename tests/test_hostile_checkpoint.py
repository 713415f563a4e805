"""A hostile checkpoint runs no code, wherever flatrl reads one (issue 22 item 1).

A real checkpoint (actor + PPO critic, each with model/ and optim/) is saved by checkpoint.save_checkpoint, then
one file is replaced by a pickle whose reduce creates a marker file, and the manifest is refreshed so the
checkpoint looks complete. Each payload is first shown to be live (a plain unpickle creates the marker); then
every reading place must refuse it with one error line naming the file and the refused global, and the marker
must not exist:
- `.metadata` of model/, optim/, critic/model/, critic/optim/ through checkpoint.load_checkpoint (resume);
- a non-tensor optimizer value (param_groups.0.lr) pointed at a hostile torch.save blob, through load_checkpoint;
- model/.metadata and critic/model/.metadata through shard_merge (merge + --verify, in process and the CLI).
"""

from __future__ import annotations

import io
import json
import operator
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import tyro
from conftest import ROOT

import checkpoint
import fsdp
import optim
import shard_merge

torch.set_num_threads(1)


class Call:
    """Pickles as `fn(*args)`: what a hostile checkpoint would hold."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def payloads(marker: Path, real_meta) -> dict[str, tuple[bytes, str]]:
    """name -> (pickle bytes, the global the refusal must name). "open" creates `marker` and returns a file
    object; "then_real" creates it and then returns the genuine metadata, so an unguarded load goes on working."""
    opener = Call(open, str(marker), "w")
    return {
        "open": (pickle.dumps(opener), "io.open"),
        "then_real": (pickle.dumps(Call(operator.itemgetter(1), (opener, real_meta))), "operator.itemgetter"),
    }


def refresh_manifest(ckpt: Path) -> None:
    """Rewrite manifest.json with the current sizes, so the tampered checkpoint passes checkpoint_problem."""
    sizes = {str(f.relative_to(ckpt)): f.stat().st_size for f in sorted(ckpt.rglob("*")) if f.is_file()}
    sizes.pop(checkpoint.MANIFEST, None)
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(sizes))
    assert checkpoint.checkpoint_problem(ckpt) is None


def build(model_dir: Path, device: torch.device):
    """A sharded model and its AdamW after one step (so optim/ holds state and param_groups)."""
    model = fsdp.shard_model(fsdp.load_model(str(model_dir)), device, fsdp.FSDPConfig())
    optimizer, _ = optim.build(model.parameters(), optim.OptimConfig(lr=1e-2), total_steps=10)
    sum(p.square().sum() for p in model.parameters()).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


@pytest.fixture
def saved(tiny_qwen2, one_rank, tmp_path):
    """(checkpoint folder, actor, actor optimizer, critic, critic optimizer) of a genuine save."""
    actor, actor_opt = build(tiny_qwen2, one_rank.device)
    critic, critic_opt = build(tiny_qwen2, one_rank.device)
    with torch.no_grad():
        for p in critic.parameters():
            p.mul_(0.5)  # a model other than the actor, so a mixed-up load would show
    files = {"config": actor.config}
    extra = {"critic": (critic, critic_opt, files)}
    ckpt = checkpoint.save_checkpoint(
        tmp_path / "run", 1, actor, actor_opt, {"marker": 1}, files, extra=extra
    )
    return ckpt, actor, actor_opt, critic, critic_opt


def first_param(model: torch.nn.Module) -> torch.Tensor:
    return next(model.parameters()).full_tensor().detach().clone()


def test_genuine_checkpoint_loads_and_merges(saved, tmp_path):
    ckpt, actor, actor_opt, critic, critic_opt = saved
    want_actor, want_critic = first_param(actor), first_param(critic)
    with torch.no_grad():
        for p in [*actor.parameters(), *critic.parameters()]:
            p.zero_()
    for group in actor_opt.param_groups:
        group["lr"] = 0.5
    state = checkpoint.load_checkpoint(ckpt, actor, actor_opt)
    checkpoint.load_checkpoint(ckpt, critic, critic_opt, prefix="critic")
    assert state["marker"] == 1
    assert torch.equal(first_param(actor), want_actor) and torch.equal(first_param(critic), want_critic)
    assert actor_opt.param_groups[0]["lr"] == 1e-2  # a non-tensor value, through the weights-only planner
    assert actor_opt.state[next(actor.parameters())]["exp_avg"].abs().sum() > 0
    for component in ("actor", "critic"):
        args = [
            "--ckpt-dir",
            str(ckpt),
            "--out",
            str(tmp_path / component),
            "--component",
            component,
            "--verify",
        ]
        result = shard_merge.main(tyro.cli(shard_merge.MergeConfig, args=args))
        assert result["ok"] and result["verify/max_abs_logprob_diff"] < 1e-5


def assert_refused(excinfo: pytest.ExceptionInfo, file: Path, refused: str, marker: Path) -> None:
    msg = str(excinfo.value)
    assert isinstance(excinfo.value, checkpoint.UnsafeCheckpointError), msg
    assert str(file) in msg and refused in msg and "\n" not in msg, msg
    assert not marker.exists()


@pytest.mark.parametrize("payload", ["open", "then_real"])
def test_hostile_metadata_is_refused_everywhere(saved, tmp_path, payload):
    ckpt, actor, actor_opt, critic, critic_opt = saved
    marker = tmp_path / "pwned"
    for sub in ("model", "optim", "critic/model", "critic/optim"):
        meta_file = ckpt / sub / ".metadata"
        real = checkpoint.read_dcp_metadata(meta_file)
        data, refused = payloads(marker, real)[payload]
        live = pickle.loads(data)  # unsafe on purpose: the payload runs under a plain unpickle
        assert marker.exists() and (payload == "open" or isinstance(live, type(real)))
        marker.unlink()
        pristine = meta_file.read_bytes()
        meta_file.write_bytes(data)
        refresh_manifest(ckpt)
        model, opt, prefix = (
            (critic, critic_opt, "critic") if sub.startswith("critic") else (actor, actor_opt, "")
        )
        with pytest.raises(ValueError) as e:
            checkpoint.load_checkpoint(ckpt, model, opt, prefix=prefix)
        assert_refused(e, meta_file, refused, marker)
        if sub.endswith("model"):
            component = "critic" if prefix else "actor"
            args = [
                "--ckpt-dir",
                str(ckpt),
                "--out",
                str(tmp_path / "hf"),
                "--component",
                component,
                "--verify",
            ]
            with pytest.raises(ValueError) as e:
                shard_merge.main(tyro.cli(shard_merge.MergeConfig, args=args))
            assert_refused(e, meta_file, refused, marker)
            assert not (tmp_path / "hf").exists()
        meta_file.write_bytes(pristine)
    refresh_manifest(ckpt)
    checkpoint.load_checkpoint(ckpt, actor, actor_opt)  # restored: loads again


def test_hostile_metadata_cli(saved, tmp_path):
    """`python shard_merge.py ... --verify`: exit 2 and one stderr line naming the file and the global."""
    ckpt = saved[0]
    marker, meta_file = tmp_path / "pwned", ckpt / "model" / ".metadata"
    data, refused = payloads(marker, checkpoint.read_dcp_metadata(meta_file))["then_real"]
    meta_file.write_bytes(data)
    cmd = [
        sys.executable,
        str(ROOT / "shard_merge.py"),
        "--ckpt-dir",
        str(ckpt),
        "--out",
        str(tmp_path / "hf"),
    ]
    p = subprocess.run([*cmd, "--verify"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert str(meta_file) in last and refused in last and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_hostile_optimizer_value_is_refused(saved, tmp_path):
    """Metadata of genuine classes only, pointing param_groups.0.lr at a torch.save of the payload: DCP's own
    planner would torch.load it with weights_only=False."""
    ckpt, actor, actor_opt, _, _ = saved
    marker = tmp_path / "pwned"
    blob = io.BytesIO()
    torch.save(Call(open, str(marker), "w"), blob)
    evil = ckpt / "optim" / "evil.distcp"
    evil.write_bytes(blob.getvalue())
    meta_file = ckpt / "optim" / ".metadata"
    meta = checkpoint.read_dcp_metadata(meta_file)
    [index] = [i for i in meta.storage_data if i.fqn == "param_groups.0.lr"]
    info = meta.storage_data[index]
    info.relative_path, info.offset, info.length = evil.name, 0, len(blob.getvalue())
    meta_file.write_bytes(pickle.dumps(meta))
    checkpoint.read_dcp_metadata(meta_file)  # the metadata itself is admitted
    refresh_manifest(ckpt)
    with pytest.raises(ValueError) as e:
        checkpoint.load_checkpoint(ckpt, actor, actor_opt)
    assert_refused(e, evil, "io.open", marker)
    assert "param_groups.0.lr" in str(e.value)
