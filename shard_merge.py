"""Checkpoint -> Hugging Face model folder that transformers and vLLM load; offline, one process, no PG.

    python shard_merge.py --ckpt-dir runs/x/global_step_100 --out runs/x/hf_100 [--max-shard-size 5GB]
        [--dtype auto|float32|bfloat16|float16] [--adapter-only] [--verify] [--component actor|critic]

Reads flatrl's layout (checkpoint.py): `model/`, a torch.distributed.checkpoint (DCP) of the state dict under
Hugging Face names, and `huggingface/` (config, tokenizer, `lora.json` with LoRA); `--component critic` reads
`critic/model/` and `critic/huggingface/`. Or verl's FSDP layout: `model_world_size_{W}_rank_{R}.pt` (in the
folder or under `actor/`), `fsdp_config.json`, `huggingface/`; DTensor pieces are joined by their placements
(Shard: concatenated in mesh order; Replicate: the mesh origin's), plain tensors on dim 0 as verl's merger
does.

Writes config.json (dtype = the written dtype; architectures filled in, vLLM needs it), the other huggingface/
files, and safetensors shards of at most --max-shard-size (`model.safetensors`, or
`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`). Tensors are read one output shard at a
time, so RAM never holds the model twice. LoRA is merged (lora.merge_lora_state_dict); `--adapter-only` writes
the PEFT adapter instead. Tied embeddings stay tied: the alias (`lm_head.weight`) is dropped once checked
equal to its target. The folder is written as `OUT.tmp` and renamed into place, so `--out` is never
half-written. An --out that is, holds or lies inside the checkpoint (or another checkpoint of its run folder)
is refused, --force or not.

A bad checkpoint or --out ends the CLI with exit code 2 and one stderr line naming the file; a failed --verify
with exit code 1.

`--verify` builds the model from the checkpoint in fp32 (LoRA applied unmerged, lora.apply_lora), loads the
merged folder with from_pretrained in fp32, and compares their logprobs (log_softmax of the logits) on a fixed
probe batch. It passes when the largest |logprob difference| is at most VERIFY_MARGIN (4) times a round-off floor
measured on the same model: the difference that moving every weight by up to one epsilon of the written dtype
makes (`measure`). A fixed tolerance cannot be sound: a correct fp32 LoRA merge of a 30-layer model differs by
1.7e-4 in logits (issue 17), a 2-layer test model's by 2e-6, and the error grows with depth, width and the size
of the logits; bfloat16 output differs by 1e-2 on the test model and 0.5 on that 30-layer one. Logprobs, not
logits: a shift common to every logit changes nothing the model does. The figures the margin rests on are in
docs/RELIABILITY.md: correct merges at 0.16-1.74 times the floor; on the 30-layer model in float32, the bugs
tried at 4.8-366,000 times it. bfloat16 output cannot show a bug smaller than its own rounding (a swapped shard
shows, at 25 times the floor).

Deviations from verl's model_merger:
1. Nothing in a checkpoint can run code: every torch.load is weights_only=True (and mmap=True; DTensors load so
   once torch.distributed.tensor is imported, without a process group), and DCP folders are read through
   checkpoint.read_dcp_metadata / checkpoint.dcp_load (an allowlist for `.metadata`, where torch's reader would
   pickle.load it). FSDP1 ShardedTensor files are not supported.
2. verl LoRA checkpoints (`base_model.model.` keys, lora_train_meta.json) are not merged; flatrl's are.
3. A tensor sharded along two mesh dims (TP) or a Partial placement is refused, not guessed.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import transformers
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor  # importing it lets weights_only torch.load rebuild DTensors

import checkpoint
import lora


@dataclass(frozen=True)
class MergeConfig:
    """Turn a flatrl (DCP) or verl (FSDP .pt) checkpoint into a Hugging Face model folder."""

    ckpt_dir: str
    """Checkpoint folder: RUN/global_step_N (flatrl), or verl's global_step_N or its actor/."""
    out: str
    """Output folder; must be absent or empty unless --force. Never the checkpoint, inside it, a folder holding
    it, or another checkpoint of its run folder (refused even with --force)."""
    max_shard_size: str = "5GB"
    """Largest safetensors file: bytes, or a number with KB/MB/GB (powers of 10) or KiB/MiB/GiB (of 2)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the floating tensors written; auto: huggingface/config.json's dtype, else the checkpoint's."""
    adapter_only: bool = False
    """With LoRA: write only the PEFT adapter (adapter_config.json + adapter_model.safetensors)."""
    verify: bool = False
    """Compare the merged folder's logits with the checkpoint model's; exit 1 above the tolerance."""
    verify_tolerance: float | None = None
    """Largest allowed |logprob difference|; None: VERIFY_MARGIN x the round-off floor measured on this model."""
    component: Literal["actor", "critic"] = "actor"
    """Which model of the checkpoint: the actor (top-level model/) or the PPO critic (critic/)."""
    force: bool = False
    """Replace a non-empty --out."""


# --verify passes up to this many times the measured round-off floor (module docstring, docs/RELIABILITY.md).
VERIFY_MARGIN = 4.0
_CKPT_NAME = re.compile(r"^global_step_\d+(\.tmp|\.old)?$")  # a checkpoint, being written, being deleted
_VERL_RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
# The tensors of one LoRA-wrapped Linear (lora.py's names); they must land in the same load group to merge.
_LORA_PART = re.compile(r"^(?P<path>.+)\.(?:base_layer\.(?:weight|bias)|lora_[AB](?:\.default)?\.weight)$")
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


@dataclass
class Checkpoint:
    """One model of a checkpoint: tensor specs, a loader for any subset of keys, its Hugging Face files."""

    specs: dict[str, tuple[torch.Size, torch.dtype]]  # key -> full (unsharded) shape, stored dtype
    load: Callable[[list[str]], dict[str, Tensor]]  # keys -> full tensors; reads only those keys
    hf_dir: Path
    lora: dict | None  # lora.json: rank, alpha, target_modules, exclude_modules, dropout, base model


def _dcp_loader(model_dir: Path) -> tuple[dict, Callable]:
    """Specs and loader of a DCP folder, after checking that every data file its metadata names is whole."""
    meta_file = model_dir / ".metadata"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{meta_file} is missing: {model_dir} is not a complete DCP checkpoint")
    meta = checkpoint.read_dcp_metadata(meta_file)  # allowlisted unpickling: a hostile file runs nothing
    need: dict[str, int] = {}  # data file -> bytes the metadata says it holds
    for info in meta.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, n in need.items():
        if not (f := model_dir / name).is_file():
            raise FileNotFoundError(f"{f} is missing (listed in {meta_file})")
        if f.stat().st_size < n:
            raise ValueError(f"{f} is truncated: {f.stat().st_size} bytes, {meta_file} needs {n}")
    items = meta.state_dict_metadata.items()
    specs = {k: (m.size, m.properties.dtype) for k, m in items if isinstance(m, TensorStorageMetadata)}

    def load(keys: list[str]) -> dict[str, Tensor]:
        sd = {k: torch.empty(specs[k][0], dtype=specs[k][1]) for k in keys}
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": yes, one process on purpose
            warnings.simplefilter("ignore")
            checkpoint.dcp_load(sd, model_dir, no_dist=True)
        return sd

    return specs, load


def _torch_load(f: Path) -> dict:
    """weights_only (and mmap, so RAM holds only what is used) torch.load of one verl rank file."""
    try:
        return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ValueError(f"{f} cannot be read: truncated or not a torch.save file ({e})") from e


def _unshard(key: str, parts: list, file: Path) -> Tensor:
    """The full tensor from each rank's piece (rank order): by DTensor placements; plain tensors on dim 0."""
    first = parts[0]
    if not isinstance(first, DTensor):
        return first if first.dim() == 0 else torch.cat(parts, dim=0)
    mesh = first.device_mesh.mesh  # [*mesh shape] global ranks
    sharded = [(i, p.dim) for i, p in enumerate(first.placements) if p.is_shard()]
    if len(sharded) > 1 or not all(p.is_shard() or p.is_replicate() for p in first.placements):
        raise ValueError(f"{file}: {key} has placements {first.placements}; one Shard mesh dim at most")
    # rank -> mesh coordinate (flatten() walks the mesh in product()'s row-major order)
    coords = dict(zip(mesh.flatten().tolist(), itertools.product(*map(range, mesh.shape)), strict=True))
    mesh_dim, dim = sharded[0] if sharded else (None, 0)
    # the ranks at coordinate 0 of every other (Replicate) mesh dim, in order along the Shard mesh dim
    keep = [r for r, c in coords.items() if all(x == 0 for i, x in enumerate(c) if i != mesh_dim)]
    keep.sort(key=lambda r: coords[r][mesh_dim] if sharded else 0)
    full = torch.cat([parts[r].to_local() for r in keep], dim=dim)
    if full.shape != first.shape:
        raise ValueError(f"{file}: {key} rebuilt as {tuple(full.shape)}, but it is {tuple(first.shape)}")
    return full


def _verl_loader(root: Path) -> tuple[dict, Callable]:
    """Specs and loader of a verl FSDP folder (model_world_size_W_rank_R.pt), checking the world size."""
    found = sorted(p.name for p in root.iterdir() if _VERL_RANK_FILE.match(p.name))
    sizes = {int(_VERL_RANK_FILE.match(n)[1]) for n in found}
    cfg_file = root / "fsdp_config.json"
    world = json.loads(cfg_file.read_text()).get("world_size") if cfg_file.is_file() else None
    if world is None and len(sizes) != 1:
        raise FileNotFoundError(f"{cfg_file} is missing and {root} holds rank files of several world sizes")
    world = world if world is not None else sizes.pop()
    if sizes - {world}:
        raise ValueError(f"{cfg_file} says world_size {world}, but {root} holds {found}")
    files = [root / f"model_world_size_{world}_rank_{r}.pt" for r in range(world)]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing (world_size {world})")
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)  # "unpickled before PGs": moot
    shards = [_torch_load(f) for f in files]
    for f, sd in zip(files, shards, strict=True):
        if sd.keys() != shards[0].keys():
            raise ValueError(f"{f} holds other keys than {files[0]}")
    specs = {}
    for k, v in shards[0].items():
        plain = not isinstance(v, DTensor) and v.dim() > 0
        shape = torch.Size([sum(sd[k].shape[0] for sd in shards), *v.shape[1:]]) if plain else v.shape
        specs[k] = (shape, v.dtype)

    def load(keys: list[str]) -> dict[str, Tensor]:
        return {k: _unshard(k, [sd[k] for sd in shards], files[0]) for k in keys}

    return specs, load


def open_checkpoint(ckpt_dir: str | Path, component: str = MergeConfig.component) -> Checkpoint:
    """The component's tensors (flatrl DCP or verl rank files) and Hugging Face files in ckpt_dir.

    Raises FileNotFoundError / ValueError naming the missing, truncated or inconsistent file.
    """
    ckpt_dir = Path(ckpt_dir).expanduser()
    root = ckpt_dir if component == "actor" else ckpt_dir / component
    if (root / "model").is_dir():
        specs, load = _dcp_loader(root / "model")
    else:  # verl: rank files under actor/ (critic/), or in the folder given
        verl = [d for d in (ckpt_dir / component, ckpt_dir) if any(d.glob("model_world_size_*"))]
        if not verl:
            raise FileNotFoundError(f"{root / 'model'} does not exist, nor any model_world_size_W_rank_R.pt")
        root = verl[0]
        specs, load = _verl_loader(root)
    hf_dir = root / "huggingface"
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir / 'config.json'} is missing")
    lora_cfg = json.loads((hf_dir / "lora.json").read_text()) if (hf_dir / "lora.json").is_file() else None
    return Checkpoint(specs, load, hf_dir, lora_cfg)


def _parse_size(size: str) -> int:
    """'5GB' -> 5 * 10^9 (Hugging Face's units: GB = 10^9, GiB = 2^30)."""
    if not (m := re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?", size.strip().upper())):
        raise ValueError(f"max_shard_size {size!r}: expected e.g. 5GB, 500MiB or a byte count")
    return int(float(m[1]) * _UNITS[m[2] or "B"])


def _model_class(config: transformers.PretrainedConfig) -> type[transformers.PreTrainedModel]:
    """The class config.architectures names, else the causal LM class of the config's model type."""
    cls = getattr(transformers, (config.architectures or [""])[0], None)
    return cls if cls is not None else transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def _tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Tied parameter name -> the parameter's first name (lm_head.weight -> model.embed_tokens.weight)."""
    first: dict[int, str] = {}
    named = model.named_parameters(remove_duplicate=False)
    return {n: first[id(p)] for n, p in named if first.setdefault(id(p), n) != n}


def _write_model(ckpt: Checkpoint, out: Path, max_bytes: int, dtype: torch.dtype) -> None:
    """Safetensors shards (+ index) and config.json of the merged model, into `out`."""
    config = transformers.AutoConfig.from_pretrained(ckpt.hf_dir)
    with torch.device("meta"):  # names, shapes and tied aliases at no memory cost
        meta_model = _model_class(config)(config)
    aliases = _tied_aliases(meta_model)
    expected = {k: v.shape for k, v in meta_model.state_dict().items() if k not in aliases}
    for alias, target in aliases.items():
        if alias in ckpt.specs and target in ckpt.specs:
            pair = ckpt.load([alias, target])
            if not torch.equal(pair[alias], pair[target]):
                raise ValueError(f"{alias} differs from {target} in the checkpoint, yet the config ties them")
    units: dict[str, list[str]] = {}  # a LoRA module's tensors load together, so they can be merged
    for key in ckpt.specs:
        if key not in aliases:
            m = _LORA_PART.match(key) if ckpt.lora else None
            units.setdefault(m["path"] if m else key, []).append(key)
    shards: list[list[str]] = [[]]
    size = 0
    for keys in units.values():  # Hugging Face's rule: fill to the limit; a bigger tensor gets its own shard
        specs = [ckpt.specs[k] for k in keys if ".lora_" not in k]
        nbytes = sum(s.numel() * (dtype if d.is_floating_point else d).itemsize for s, d in specs)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1] += keys
        size += nbytes

    weight_map: dict[str, str] = {}
    total = 0
    for i, keys in enumerate(shards):
        sd = ckpt.load(keys)
        sd = lora.merge_lora_state_dict(sd, ckpt.lora["rank"], ckpt.lora["alpha"]) if ckpt.lora else sd
        sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
        for k, v in sd.items():
            if k in expected and v.shape != expected[k]:
                raise ValueError(f"{k}: the checkpoint has shape {tuple(v.shape)}, the config {expected[k]}")
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors" if (n := len(shards)) > 1 else "model.safetensors"
        save_file(sd, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(sd, name))
        total += sum(v.numel() * v.element_size() for v in sd.values())
    missing, unexpected = expected.keys() - weight_map.keys(), weight_map.keys() - expected.keys()
    if missing or unexpected:
        raise ValueError(f"checkpoint keys do not fit the config: missing {missing}, extra {unexpected}")
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    hf_config = json.loads((ckpt.hf_dir / "config.json").read_text())
    hf_config.pop("torch_dtype", None)
    hf_config["dtype"] = str(dtype).removeprefix("torch.")
    hf_config.setdefault("architectures", [type(meta_model).__name__])  # vLLM picks its model class by this
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")


def _refuse_out_over_checkpoint(ckpt_dir: Path, out: Path) -> None:
    """ValueError unless `out` leaves the checkpoint and its run folder whole (symlinks resolved).

    The checkpoint is the `global_step_N*` folder at or above ckpt_dir (verl's actor/ sits inside one), else
    ckpt_dir; its run folder is its parent. Refused: `out` equal to the checkpoint or inside it, `out` holding it
    (the run folder or above), and `out` being or lying inside another checkpoint of the run folder. A new
    folder beside the checkpoints (RUN/hf_100) is fine.
    """
    ckpt, target = ckpt_dir.resolve(), out.resolve()
    ckpt = next((p for p in (ckpt, *ckpt.parents) if _CKPT_NAME.match(p.name)), ckpt)
    run = ckpt.parent
    if target == ckpt or ckpt in target.parents:
        raise ValueError(f"--out {out} lies inside the checkpoint {ckpt}; write the merged model elsewhere")
    if target in ckpt.parents:
        raise ValueError(
            f"--out {out} holds the checkpoint {ckpt} (and its run folder {run}); choose a new folder"
        )
    if run in target.parents and _CKPT_NAME.match(target.relative_to(run).parts[0]):
        raise ValueError(f"--out {out} is a checkpoint of the run folder {run}; choose a new folder")


def merge(
    ckpt_dir: str | Path,
    out: str | Path,
    max_shard_size: str = MergeConfig.max_shard_size,
    dtype: str = MergeConfig.dtype,
    adapter_only: bool = MergeConfig.adapter_only,
    component: str = MergeConfig.component,
    force: bool = MergeConfig.force,
) -> Path:
    """Write the Hugging Face folder (with adapter_only: the PEFT adapter folder) of a checkpoint.

    Args:
        ckpt_dir: flatrl RUN/global_step_N, or a verl checkpoint folder (module docstring).
        out: output folder; must be absent or empty unless force.
        max_shard_size, dtype, adapter_only, component, force: as the MergeConfig fields.
    Returns:
        `out` as a Path, complete: it was written as `OUT.tmp` and renamed into place (an existing `out` is
        renamed to `OUT.old` first, and deleted last).
    Raises:
        ValueError when `out` is, contains or lies inside the checkpoint, or is a checkpoint of its run folder
        (force or not: replacing it would delete what is being read); FileExistsError for a non-empty `out`
        without force; FileNotFoundError / ValueError naming a missing or bad checkpoint file.
    """
    out = Path(out).expanduser()
    _refuse_out_over_checkpoint(Path(ckpt_dir).expanduser(), out)
    ckpt = open_checkpoint(ckpt_dir, component)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a folder")
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty; pass --force to replace it")
    if dtype == "auto":  # the config's dtype, else the checkpoint's
        hf_config = json.loads((ckpt.hf_dir / "config.json").read_text())
        dtype = hf_config.get("dtype") or hf_config.get("torch_dtype")
        dtype = dtype or next(str(d)[6:] for _, d in ckpt.specs.values() if d.is_floating_point)
    out_dtype = getattr(torch, dtype)
    tmp, old = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")
    for left in (tmp, old):  # left by a merge that crashed
        shutil.rmtree(left, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if adapter_only:
            if (c := ckpt.lora) is None:
                raise ValueError(f"{ckpt.hf_dir / 'lora.json'} is missing: --adapter-only needs LoRA")
            sd = ckpt.load([k for k in ckpt.specs if ".lora_A." in k or ".lora_B." in k])
            args = c["rank"], c["alpha"], c["target_modules"], c["base_model_name_or_path"]
            more = {"dropout": c.get("dropout", 0.0), "exclude_modules": c.get("exclude_modules")}
            lora.save_adapter(tmp, {k: v.to(out_dtype) for k, v in sd.items()}, *args, **more)
        else:
            _write_model(ckpt, tmp, _parse_size(max_shard_size), out_dtype)
            for f in ckpt.hf_dir.iterdir():  # tokenizer, generation config, chat template, ...
                if f.name not in ("config.json", "lora.json"):
                    (shutil.copytree if f.is_dir() else shutil.copy2)(f, tmp / f.name)
        if out.exists():  # empty, or --force: move it aside first, so `out` is never a half-written folder
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _logprobs(model: torch.nn.Module, ids: Tensor) -> Tensor:
    """log_softmax of the logits, [B, T, V]; a value head's single output (PPO's critic) as it is, [B, T, 1]."""
    logits = model(input_ids=ids).logits
    return logits if logits.shape[-1] == 1 else logits.log_softmax(-1)


@torch.no_grad()
def measure(
    ckpt_dir: str | Path, out: str | Path, component: str = MergeConfig.component
) -> tuple[float, float]:
    """(largest |logprob difference|, round-off floor) of the merged folder against the checkpoint's model.

    The checkpoint's model: huggingface/config.json + the checkpoint tensors in fp32, LoRA applied unmerged
    with lora.apply_lora. The merged folder: from_pretrained in fp32. Both models are held in RAM at once.
    The probe batch: 4 x 32 token ids drawn with seed 0, the same every run.
    The difference: max over batch, positions and vocabulary of |log_softmax(ref) - log_softmax(merged)|
    (for a value head, PPO's critic: of |values_ref - values_merged|).
    The floor: the same difference between the checkpoint's model and a copy of it whose every weight is moved
    by a random relative amount of at most one epsilon of the written dtype (uniform; computed in float64, kept
    in fp32): the size of the error a correct merge makes in each weight (rounding to bfloat16 / float16 when
    written so; fp32 arithmetic when written in float32), carried through all of this model's layers.
    """
    ckpt = open_checkpoint(ckpt_dir, component)
    config = transformers.AutoConfig.from_pretrained(ckpt.hf_dir)
    cls = _model_class(config)
    ref = cls(config).float().eval()
    if c := ckpt.lora:
        lora.apply_lora(
            ref, c["rank"], c["alpha"], c["target_modules"], exclude_modules=c.get("exclude_modules")
        )
    missing, unexpected = ref.load_state_dict(ckpt.load(list(ckpt.specs)), strict=False)
    if set(missing) - _tied_aliases(ref).keys() or unexpected:
        raise ValueError(f"checkpoint does not fit the config: missing {missing}, unexpected {unexpected}")
    merged = cls.from_pretrained(str(out), dtype=torch.float32).eval()
    written = getattr(torch, json.loads((Path(out) / "config.json").read_text())["dtype"])
    ids = torch.randint(0, config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))  # [B, T]
    ref_lp = _logprobs(ref, ids)  # [B, T, V]
    diff = (ref_lp - _logprobs(merged, ids)).abs().max().item()
    del merged
    g, eps = torch.Generator().manual_seed(1), torch.finfo(written).eps
    for p in ref.parameters():
        noise = torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1  # uniform in [-1, 1]
        p.copy_(p.double() * (1 + eps * noise))
    floor = (ref_lp - _logprobs(ref, ids)).abs().max().item()
    print(
        f"verify: max |logprob difference| {diff:.3e}, round-off floor {floor:.3e} ({written}, {tuple(ids.shape)})"
    )
    return diff, floor


def verify(ckpt_dir: str | Path, out: str | Path, component: str = MergeConfig.component) -> float:
    """The largest |logprob difference| of `measure` (for callers that assert a bound of their own)."""
    return measure(ckpt_dir, out, component)[0]


def main(cfg: MergeConfig) -> dict:
    """Merge (and with cfg.verify, check) one checkpoint; returns {"out", "ok"[, "verify/..."]}."""
    if cfg.verify and cfg.adapter_only:
        raise ValueError("--verify compares a merged model folder; it cannot check an --adapter-only output")
    c = cfg
    out = merge(c.ckpt_dir, c.out, c.max_shard_size, c.dtype, c.adapter_only, c.component, c.force)
    print(f"wrote {out}")
    result: dict = {"out": str(out), "ok": True}
    if cfg.verify:
        diff, floor = measure(cfg.ckpt_dir, out, cfg.component)
        tol = cfg.verify_tolerance if cfg.verify_tolerance is not None else VERIFY_MARGIN * floor
        ok = diff <= tol
        result.update(
            {"verify/max_abs_logprob_diff": diff, "verify/floor": floor, "verify/tolerance": tol, "ok": ok}
        )
        how = "--verify-tolerance" if cfg.verify_tolerance is not None else f"{VERIFY_MARGIN:g} x the floor"
        print(f"verify: {'ok' if ok else 'FAILED'}: {diff:.3e} against a tolerance of {tol:.3e} ({how})")
    return result


if __name__ == "__main__":
    import tyro

    cfg = tyro.cli(MergeConfig)
    try:
        ok = main(cfg)["ok"]
    except (OSError, ValueError) as e:  # a bad checkpoint or --out: the error names the file; no traceback
        print(f"shard_merge.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if ok else 1)
