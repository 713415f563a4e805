"""Checkpoints: write, check, pick and load `RUN/global_step_N/` with torch.distributed.checkpoint (DCP).

Used by sft.py and rl.py (grpo.py, ppo.py); shard_merge.py reads the same layout offline to export a
Hugging Face folder. The layout of one checkpoint:
    global_step_N/
        model/              DCP of the model state dict (Hugging Face key names): `.metadata` + `__R_0.distcp`
        optim/              DCP of the optimizer state (absent when saved without an optimizer)
        huggingface/        config, generation config, tokenizer (and lora.json with LoRA), for shard_merge.py
        critic/             PPO: the critic's own model/, optim/ and huggingface/ (`extra` in save_checkpoint)
        trainer_state.json  step, data position, scheduler, world size, the resolved config, run info
        rng/rank_R.pt       each rank's python, torch and CUDA RNG states
        manifest.json       every other file's size in bytes, written last (after every rank finished)
Every rank writes its own DCP shards and RNG file; rank 0 writes the rest.

Crash safety. A run can die at any instruction (a preempted node, an out-of-memory kill), and a resume must
never start from a checkpoint that is only partly on disk, nor silently start over:
1. A checkpoint is written as `global_step_N.tmp/` and renamed to `global_step_N/` (os.replace, atomic on one
   filesystem) only after a barrier, when every rank has finished writing. A `.tmp` folder is never listed nor
   resumed from; the next save of the same step deletes it.
2. manifest.json is written last, by rank 0 after that barrier: the size of every other file. A checkpoint is
   complete only when its manifest exists and every file it names has that size (`checkpoint_problem`: a few
   stat calls, no reading, so checking a many-GB checkpoint is instant). That also catches damage done after
   the write (a truncated shard, a deleted file) that the rename alone cannot.
3. `resolve_resume("auto")` takes the newest complete checkpoint, naming the bad file of each newer one it
   skips; an explicit path must be complete; checkpoints that exist but are all incomplete are an error
   (starting over would hide the damage).
4. A checkpoint is deleted (keep_last, or a re-save of the same step) by renaming it to `global_step_N.old/`
   first, so a crash halfway through a delete never leaves a half-deleted folder under a checkpoint's name.
DCP reshards on load, so a run saved on W ranks resumes on any number of ranks.

Refused at save, before anything is written: a model with a NaN or inf parameter (ValueError naming the first
one: a checkpoint of broken weights would be resumed from and merged), and a disk with less free space than the
state dicts' tensors (OSError ENOSPC "no space left on PATH", with the bytes needed and free). A write that fails
on a full disk anyway (DCP wraps the OSError; torch.save says "unexpected pos N vs M") raises the same error and
deletes its `.tmp` folder.

Untrusted checkpoints. torch's DCP reader unpickles `.metadata` with a plain `pickle.load` and the non-tensor
values (the optimizer's param_groups: lr, betas...) with `torch.load(weights_only=False)`, so a hostile checkpoint
could run code on load. Every DCP read in flatrl goes through `dcp_load` / `read_dcp_metadata` instead:
- `.metadata` is unpickled by an allowlist (`DCP_METADATA_GLOBALS`: DCP's metadata classes, torch.Size, dtypes,
  the layout decoder, paths, builtin containers); any other global is refused with `UnsafeCheckpointError`
  naming the file and the global (module.name), before anything it names is imported or called.
- non-tensor values are unpickled with `torch.load(weights_only=True)` (torch's allowlist for torch.save data).
- tensor data was already read by DCP with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import io
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import config
import fsdp
import log
import optim
from fsdp import print0

# Exactly `global_step_N`: an unfinished `.tmp` write and a `.old` folder being deleted never match.
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
MANIFEST = "manifest.json"
# A write that failed with less than this free on the disk failed for want of space (the error may not say so).
_FULL_BYTES = 64 * 2**20


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Every `global_step_N/` folder under `run_dir`, oldest first, complete or not (`checkpoint_problem`).

    A `global_step_N.tmp/` folder is an unfinished write and is never listed.
    """
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def checkpoint_problem(path: str | Path) -> str | None:
    """Why `path` is not a complete checkpoint, naming the first bad file; None when it is complete.

    Compares every file against the sizes in manifest.json (a few stat calls, no reading): a missing
    manifest, a missing file (DCP `.metadata`, a `__R_0.distcp` shard, trainer_state.json, rng/rank_R.pt)
    or a file of another size (truncated) is reported with its path.
    """
    path = Path(path).expanduser()
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"{manifest} is missing (the write did not finish, or the checkpoint predates manifests)"
    try:
        sizes = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        return f"{manifest} is unreadable ({e})"
    for name, size in sizes.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} has {f.stat().st_size} bytes, the manifest says {size} (truncated or overwritten)"
    return None


def resolve_resume(run_dir: str | Path, resume_mode: str) -> Path | None:
    """The checkpoint to resume from.

    Args:
        run_dir: the run folder holding `global_step_N/` checkpoints.
        resume_mode: `auto`: the newest complete checkpoint in run_dir (None if there is none); an incomplete
            newer one is skipped with a message naming its bad file. `disable`: None. Else a checkpoint path,
            which must be complete (no fallback).
    Returns:
        the checkpoint folder, or None to start from scratch.
    Raises:
        FileNotFoundError / ValueError naming the missing or bad file: a given path that is not a complete
        checkpoint, or `auto` when checkpoints exist but none is complete (starting over would hide that).
    """
    if resume_mode == "disable":
        return None
    if resume_mode != "auto":
        path = Path(resume_mode).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"resume_mode={resume_mode!r}: {path} does not exist")
        if problem := checkpoint_problem(path):
            raise ValueError(f"resume_mode={resume_mode!r} is not a complete checkpoint: {problem}")
        return path
    ckpts = list_checkpoints(run_dir)
    skipped = []
    for ckpt in reversed(ckpts):
        if problem := checkpoint_problem(ckpt):
            print0(f"resume: skipping {ckpt.name}: {problem}")
            skipped.append(ckpt.name)
            continue
        if skipped:
            print0(f"resume: fell back to {ckpt} (newer ones are incomplete: {', '.join(skipped)})")
        return ckpt
    if ckpts:
        raise ValueError(
            f"no complete checkpoint in {run_dir} ({len(ckpts)} incomplete, see above); "
            "pass trainer.resume_mode=disable to start over"
        )
    return None


def as_hf_model(path: str) -> str:
    """A model path the trainers can load: a flatrl checkpoint (RUN/global_step_N, or a run folder RUN for its
    newest complete one) becomes its Hugging Face folder RUN/hf_global_step_N, exported once by shard_merge.py
    (LoRA merged), as verl's tutorial hands an SFT checkpoint to GRPO; anything else (a folder, a hub id) comes
    back as given. Ranks that ask at once wait on a file lock for one export; a checkpoint re-saved after its
    export is exported again."""
    p = Path(path).expanduser()
    if not p.is_dir() or (p / "config.json").is_file():
        return path
    ckpt = p if (p / MANIFEST).is_file() else (resolve_resume(p, "auto") if list_checkpoints(p) else None)
    if ckpt is None:
        return path
    if problem := checkpoint_problem(ckpt):
        raise ValueError(f"model path {path} is not a complete checkpoint: {problem}")
    out = ckpt.parent / f"hf_{ckpt.name}"
    with open(ckpt.parent / f".hf_{ckpt.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        exported = (out / "config.json").is_file()
        if not exported or (out / "config.json").stat().st_mtime < (ckpt / MANIFEST).stat().st_mtime:
            print(f"model path {path}: exporting checkpoint {ckpt} to {out} (shard_merge.py)", flush=True)
            merge = [sys.executable, str(Path(__file__).with_name("shard_merge.py")), "--ckpt-dir", str(ckpt)]
            done = subprocess.run([*merge, "--out", str(out), "--force"], capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                raise ValueError(f"model path {path}: exporting {ckpt} failed: {tail[0]}")
    return str(out)


def _remove_checkpoint(path: Path) -> None:
    """Renames away, then deletes: a crash halfway through never leaves a half-deleted `global_step_N/`."""
    doomed = path.with_name(path.name + ".old")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trainer_state: dict[str, Any],
    hf_files: dict[str, Any] | None = None,
    keep_last: int | None = None,
    extra: dict[str, tuple[nn.Module, torch.optim.Optimizer | None, dict[str, Any]]] | None = None,
) -> Path:
    """Writes RUN/global_step_N/ from every rank (collective) and returns its path.

    Args:
        trainer_state: JSON-serialisable state (data position, scheduler, config...), written by rank 0.
        hf_files: {"config": PretrainedConfig, "tokenizer": tokenizer, "generation_config": ..., "lora": dict}
            saved under huggingface/ by rank 0 so the checkpoint is self-describing for shard_merge.py.
        keep_last: delete the oldest checkpoints beyond this many, counted by name (None keeps all).
        extra: more models in the same checkpoint, each in its own sub-folder with its model/, optim/ and
            huggingface/: {"critic": (critic, critic_optimizer, critic_hf_files)} for PPO. `load_checkpoint`
            with prefix="critic" reads one back, `shard_merge.py --component critic` exports it.
    """
    rank = dist.get_rank()
    run_dir = Path(run_dir).expanduser()
    final = run_dir / f"global_step_{step}"
    tmp = run_dir / f"global_step_{step}.tmp"
    parts = {"": (model, optimizer, hf_files or {})} | (extra or {})
    if bad := _first_non_finite({prefix: m for prefix, (m, _, _) in parts.items()}):
        raise ValueError(f"refusing to save {final}: parameter {bad} holds NaN or inf; nothing was written")
    # Sharded views of this rank's tensors (no copy), computed once: sized here, written below.
    state_dicts = {
        prefix: (get_model_state_dict(m), get_optimizer_state_dict(m, opt) if opt is not None else None)
        for prefix, (m, opt, _) in parts.items()
    }
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)  # left by a crash during an earlier write of this step
    needed = fsdp.all_reduce(sum(_nbytes(sd) for pair in state_dicts.values() for sd in pair), "sum")
    free = fsdp.all_reduce(shutil.disk_usage(_existing(run_dir)).free, "min")
    if needed > free:
        raise _no_space(run_dir, needed, free)
    if rank == 0:
        tmp.mkdir(parents=True)
    fsdp.barrier()
    try:
        for prefix, (m_sd, opt_sd) in state_dicts.items():
            base = tmp / prefix if prefix else tmp
            dcp.save(m_sd, checkpoint_id=str(base / "model"))
            if opt_sd is not None:
                dcp.save(opt_sd, checkpoint_id=str(base / "optim"))
            if rank == 0:
                _save_hf_files(base / "huggingface", parts[prefix][2])
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(_rng_state(), tmp / "rng" / f"rank_{rank}.pt")
        if rank == 0:
            state = dict(trainer_state, global_step=step, world_size=dist.get_world_size())
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2, default=str))
    except (OSError, RuntimeError, CheckpointException) as e:
        # DCP wraps the write's OSError, and torch.save's zip writer reports a full disk as
        # "unexpected pos N vs M": either way, say so when the disk is what ran out.
        free = shutil.disk_usage(_existing(tmp)).free
        if _is_enospc(e) or free < _FULL_BYTES:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # never resumed from; give the space back now
            raise _no_space(run_dir, needed, free) from e
        raise
    fsdp.barrier()
    if rank == 0:
        # Written last, once every rank's files are closed: sizes to check a later resume against.
        sizes = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        (tmp / MANIFEST).write_text(json.dumps(sizes, indent=1))
        if final.exists():
            _remove_checkpoint(final)
        os.replace(tmp, final)
        if keep_last is not None:
            for old in list_checkpoints(run_dir)[:-keep_last]:
                _remove_checkpoint(old)
    fsdp.barrier()
    return final


def _first_non_finite(models: dict[str, nn.Module]) -> str | None:
    """Name of the first parameter holding NaN or inf on any rank (`critic/` prefixed for extras), else None.

    Collective: one all-reduce of the first bad index, so every rank raises together.
    """
    names, flags = [], []
    for prefix, m in models.items():
        for name, p in m.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p  # this rank's shard
            names.append(f"{prefix}/{name}" if prefix else name)
            flags.append(torch.isfinite(local.detach()).all())
    if not flags:
        return None
    bad = (~torch.stack(flags)).nonzero()  # one device sync for all parameters
    first = fsdp.all_reduce(bad[0, 0].item() if len(bad) else len(names), "min")
    return names[int(first)] if first < len(names) else None


def _nbytes(state_dict: dict[str, Any] | None) -> int:
    """Bytes of this rank's tensors in a (nested) state dict: what its DCP shard will hold, about."""
    if state_dict is None:
        return 0
    total = 0
    for v in state_dict.values():
        if isinstance(v, dict):
            total += _nbytes(v)
        elif isinstance(v, torch.Tensor):
            t = v.to_local() if isinstance(v, DTensor) else v
            total += t.numel() * t.element_size()
    return total


def _existing(path: Path) -> Path:
    """`path` or its nearest existing ancestor (what shutil.disk_usage can be asked about)."""
    return next(p for p in (path, *path.parents) if p.exists())


def _is_enospc(e: BaseException) -> bool:
    """True when e, its cause, or a rank's failure inside DCP's CheckpointException is an ENOSPC OSError."""
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    if isinstance(e, CheckpointException):
        return any(_is_enospc(exc) for exc, _ in e.failures.values())
    return e.__cause__ is not None and _is_enospc(e.__cause__)


def _no_space(run_dir: Path, needed: float, free: float) -> OSError:
    return OSError(
        errno.ENOSPC,
        f"no space left on {_existing(run_dir)}: the checkpoint needs about {_size(needed)} (its tensors), "
        f"{_size(free)} are free; free some space or lower trainer.max_ckpt_to_keep",
    )


def _size(nbytes: float) -> str:
    """1536 -> '1.5 KiB'; bytes, KiB, MiB or GiB, whichever reads best."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} bytes"


def trainer_state(
    cfg: Any,
    sampler: Any,
    scheduler: Any,
    guard: optim.SkipGuard,
    results: dict,
    sampler_state: dict | None = None,
    **more: Any,
) -> dict:
    """The JSON state every trainer saves beside its weights (sft.py, dpo.py, rl.save): the data position (the
    sampler's, or `sampler_state` where the trainer drew a batch it has not trained on yet), the lr schedule, the
    skip counters, the results so far, the resolved config and the run's versions; `more` adds a script's own
    keys (rl.save's `extra`)."""
    return dict(
        sampler=sampler_state if sampler_state is not None else sampler.state_dict(),
        scheduler=scheduler.state_dict(),
        skips=guard.state_dict(),
        results=results,
        config=config.to_dict(cfg),
        run_info=log.run_info(),
        **more,
    )


def restore_trainer_state(
    state: dict, sampler: Any, scheduler: Any, guard: optim.SkipGuard
) -> tuple[int, dict]:
    """Puts back what `trainer_state` saved (a checkpoint without skip counters, from before they existed, starts
    them at 0) and returns (global step, results so far)."""
    sampler.load_state_dict(state["sampler"])
    optim.resume_schedule(scheduler, state["scheduler"])
    guard.load_state_dict(state.get("skips", {"skipped": 0, "consecutive": 0}))
    return state["global_step"], state.get("results", {})


def load_checkpoint(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, prefix: str = ""
) -> dict[str, Any]:
    """Loads model (and optimizer) state saved by `save_checkpoint`, resharding to this job's world size.

    Restores this rank's RNG states when the checkpoint has them for this rank. Returns trainer_state.json.
    Raises ValueError naming the file when the checkpoint is incomplete (see `checkpoint_problem`), and
    UnsafeCheckpointError naming the file and the global when a pickle in it refers to anything outside the
    allowlists (module docstring: untrusted checkpoints); nothing of it is loaded then.
    """
    path = Path(path)
    if problem := checkpoint_problem(path):
        raise ValueError(f"cannot load checkpoint {path}: {problem}")
    base = path / prefix if prefix else path
    model_sd = get_model_state_dict(model)
    if problem := _model_mismatch(model_sd, read_dcp_metadata(base / "model" / ".metadata")):
        which = f"{prefix} model" if prefix else "model"
        raise ValueError(
            f"cannot resume from {base / 'model'}: the checkpoint's {which} differs from the one built from "
            f"the config ({which}.path, LoRA settings): {problem}"
        )
    dcp_load(model_sd, base / "model")
    set_model_state_dict(model, model_sd)
    if optimizer is not None:
        optim_sd = get_optimizer_state_dict(model, optimizer)
        dcp_load(optim_sd, base / "optim")
        set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(strict=True))
    # A rank the saved run did not have (resumed on more ranks) keeps the state seed_everything gave it.
    # weights_only: a checkpoint may come from someone else, and a full unpickle can run code.
    rng_file = path / "rng" / f"rank_{dist.get_rank()}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return json.loads((path / "trainer_state.json").read_text())


def _model_mismatch(state_dict: dict[str, Any], meta: Metadata) -> str | None:
    """How a model state dict and a checkpoint's DCP metadata differ (shapes, keys on one side only), or None."""
    stored = {
        k: tuple(m.size) for k, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)
    }
    # a DTensor's .shape is the full (unsharded) one, as the metadata's
    ours = {k: tuple(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    shapes = [
        f"{k} {stored[k]} in the checkpoint, {ours[k]} in the model"
        for k in ours
        if k in stored and stored[k] != ours[k]
    ]
    parts = []
    for what, keys in (
        ("tensors differ in shape", shapes),
        ("model tensors are not in the checkpoint", sorted(ours.keys() - stored.keys())),
        ("checkpoint tensors are not in the model", sorted(stored.keys() - ours.keys())),
    ):
        if keys:
            parts.append(f"{len(keys)} {what} (first: {keys[0]})")
    return "; ".join(parts) or None


# Settings a resumed run may change (dotted keys, fnmatch patterns): they take effect and are printed. The
# second half changes only how the same math is computed (memory, speed, layout). Every other setting changes
# what the run means (the model, the data and its order, batch sizes, seeds, the objective), so changing it on
# resume is an error unless trainer.resume_allow_changes names it.
MAY_CHANGE_ON_RESUME = tuple(
    """
    trainer.total_epochs trainer.total_training_steps trainer.save_freq trainer.test_freq trainer.logger
    trainer.project_name trainer.experiment_name trainer.default_local_dir trainer.resume_mode
    trainer.resume_allow_changes trainer.max_ckpt_to_keep trainer.timeout_s trainer.max_consecutive_skips
    trainer.val_before_train trainer.val_only trainer.plan *optim.lr data.val_files
    *micro_batch_size_per_gpu *max_token_len_per_gpu *use_dynamic_bsz *use_remove_padding
    *enable_gradient_checkpointing *attn_implementation *fsdp_config.* actor.old_logprobs_from_update
    rollout.gpu_memory_utilization rollout.free_cache_engine rollout.enforce_eager rollout.max_num_seqs
    rollout.max_num_batched_tokens rollout.sleep_level rollout.cpu_kvcache_space_gb rollout.enable_prefix_caching
    rollout.enable_chunked_prefill rollout.tensor_model_parallel_size rollout.timeout_s
    rollout.logprob_check_prompts rollout.logprob_check_tokens rollout.generate_threads rollout.logprob_diff_tol
    rollout.val_kwargs.*
    custom_reward_function.num_workers custom_reward_function.timeout_s
    """.split()
)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(
    stored: dict[str, Any], new: dict[str, Any], allowed: set[str]
) -> tuple[list[str], list[str]]:
    """Compares the config a checkpoint was saved with (trainer_state.json's "config") with a resumed run's.

    Args:
        stored, new: nested config dicts (config.to_dict).
        allowed: dotted keys the user lets change anyway (trainer.resume_allow_changes).
    Returns:
        (errors, changed), each a list of "key: old -> new" lines. errors: settings outside
        MAY_CHANGE_ON_RESUME and `allowed` that differ, and names in `allowed` that are no config key.
        changed: the differences that take effect, including keys only one side has (a config from another
        flatrl version: "<absent>" on the other side).
    """
    old_flat, new_flat = _flatten(stored), _flatten(new)
    errors = [
        f"{k}: not a config key (trainer.resume_allow_changes)" for k in sorted(allowed - new_flat.keys())
    ]
    changed = []
    for key in sorted(old_flat.keys() | new_flat.keys()):
        old, cur = old_flat.get(key, "<absent>"), new_flat.get(key, "<absent>")
        if old == cur:
            continue
        line = f"{key}: {old!r} -> {cur!r}"
        free = key in allowed or any(fnmatch.fnmatchcase(key, p) for p in MAY_CHANGE_ON_RESUME)
        absent = key not in old_flat or key not in new_flat
        (changed if free or absent else errors).append(line)
    return errors, changed


def check_resume_config(path: str | Path, new: dict[str, Any], allowed: Iterable[str] = ()) -> list[str]:
    """Compares checkpoint `path`'s stored config with a resumed run's (config_changes), before anything loads.

    Args:
        path: the checkpoint (its trainer_state.json holds the config it was saved with).
        new: the resumed run's resolved config, config.to_dict(cfg).
        allowed: trainer.resume_allow_changes; an item may hold several keys separated by commas.
    Returns:
        the changes that take effect, each printed (rank 0) as "changed on resume: key old -> new".
    Raises:
        ValueError, one line naming the checkpoint and each forbidden change with its old and new value.
    """
    stored = json.loads((Path(path) / "trainer_state.json").read_text()).get("config", {})
    keys = {k.strip() for item in allowed for k in item.split(",") if k.strip()}
    errors, changed = config_changes(stored, new, keys)
    if errors:
        raise ValueError(
            f"resume from {path}: settings differ from the checkpoint's and would change what the run means: "
            f"{'; '.join(errors)} (pass --trainer.resume_allow_changes KEY,... to accept them)"
        )
    for line in changed:
        print0(f"changed on resume: {line}")
    return changed


def _rng_state() -> dict[str, Any]:
    """This rank's python, torch and (on GPU) CUDA RNG states, so a resumed run draws the same numbers."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    """Restores what `_rng_state` saved; a CUDA state is skipped on a machine without CUDA."""
    version, internal, gauss = state["python"]  # random.setstate insists on a tuple for the internal state
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _save_hf_files(out: Path, files: dict[str, Any]) -> None:
    """Writes save_checkpoint's `hf_files` (whichever are given) into `out`, as shard_merge.py reads them."""
    out.mkdir(parents=True, exist_ok=True)
    if files.get("config") is not None:
        files["config"].save_pretrained(out)
    if files.get("generation_config") is not None:
        files["generation_config"].save_pretrained(out)
    if files.get("tokenizer") is not None:
        files["tokenizer"].save_pretrained(out)
    if files.get("lora"):
        (out / "lora.json").write_text(json.dumps(files["lora"], indent=2))


# ------------------------------------------------------------------ reading DCP files without running code


class UnsafeCheckpointError(ValueError):
    """A checkpoint file whose pickle refers to a global outside the allowlist (it could run code if loaded)."""


# Every global a DCP `.metadata` pickle may refer to: module -> names. Listed by unpickling real flatrl
# checkpoints (model/ and optim/, torch 2.13) with a find_class that records its calls; dtypes are admitted by
# name (`_DTYPES`). Each is a plain data class or a lookup: constructing one runs no code of the file's choosing.
DCP_METADATA_GLOBALS: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "ChunkStorageMetadata",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # torch.strided etc. by name; it returns a torch.layout or raises
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id: the folder the writer saw
    "pathlib._local": {"PosixPath", "PurePosixPath"},  # the same classes on Python 3.13+
    "builtins": {"set", "frozenset", "complex", "slice"},
    "collections": {"OrderedDict"},
}
_DTYPES = {name for name, v in vars(torch).items() if isinstance(v, torch.dtype)}  # float32, bfloat16, ...


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only DCP_METADATA_GLOBALS and torch dtypes; anything else is refused."""

    def __init__(self, f: io.BufferedReader, file: Path) -> None:
        super().__init__(f)
        self.file = file

    def find_class(self, module: str, name: str) -> Any:
        # Exact (module, name) pairs only: a dotted name ("torch.load" under an admitted module) never matches.
        if name in DCP_METADATA_GLOBALS.get(module, ()) or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.file}: refused to unpickle {module}.{name}: DCP metadata holds only "
            "checkpoint.DCP_METADATA_GLOBALS (a hostile or foreign file; it was not loaded)"
        )


def read_dcp_metadata(file: str | Path) -> Metadata:
    """The DCP `Metadata` in `file` (a `.metadata`), unpickled through the DCP_METADATA_GLOBALS allowlist.

    Raises UnsafeCheckpointError naming the file and the refused global (module.name); ValueError naming the file
    when it is not a readable pickle of DCP Metadata.
    """
    file = Path(file)
    try:
        with open(file, "rb") as f:
            meta = _MetadataUnpickler(f, file).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:
        raise ValueError(f"{file} cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(meta, Metadata):
        raise ValueError(f"{file} holds a {type(meta).__name__}, not DCP Metadata")
    return meta


class SafeFileSystemReader(dcp.FileSystemReader):
    """dcp.FileSystemReader whose read_metadata unpickles through read_dcp_metadata (never pickle.load)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # torch >= 2.9 asks for `__R.metadata` when a save ran without collectives
        meta = read_dcp_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
        # As torch's reader does: stamp this read's id on the metadata (DCP's load logging reads it).
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values are unpickled with torch.load(weights_only=True).

    DefaultLoadPlanner.load_bytes uses weights_only=False on bytes straight from the checkpoint. Here the value is
    loaded under torch's weights-only allowlist first, and the parent gets a torch.save of that checked value,
    so its own bookkeeping (where the value goes in the nested state dict) stays torch's.
    """

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            meta = getattr(self, "metadata", None)  # set by set_up_planner
            info = meta.storage_data.get(read_item.storage_index) if meta is not None else None
            file = self.folder / info.relative_path if info is not None else self.folder
            refused = m[1] if (m := re.search(r"GLOBAL (\S+)", str(e))) else "a global outside the allowlist"
            raise UnsafeCheckpointError(
                f"{file}: refused to unpickle {refused} in the value of {read_item.dest_index.fqn}: "
                "a checkpoint's non-tensor values are plain Python values (it was not loaded)"
            ) from None
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        super().load_bytes(read_item, buf)


def dcp_load(state_dict: dict[str, Any], folder: str | Path, no_dist: bool = False) -> None:
    """dcp.load of the DCP folder into state_dict (in place), with no pickle able to run code.

    The metadata is read (and refused) here first, so a refusal is one UnsafeCheckpointError naming the file and
    the global, not DCP's fallback to per-rank metadata and its wrapped traceback. Then dcp.load reads through
    SafeFileSystemReader and _SafeLoadPlanner. Collective unless no_dist (one process, no process group).
    """
    folder = Path(folder)
    reader = SafeFileSystemReader(str(folder))
    reader.read_metadata()
    try:
        dcp.load(state_dict, storage_reader=reader, planner=_SafeLoadPlanner(folder), no_dist=no_dist)
    except CheckpointException as e:  # a refusal inside DCP's collective steps: raise it alone, one line
        unsafe = [exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeCheckpointError)]
        if unsafe:
            raise unsafe[0] from None
        raise
