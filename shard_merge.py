"""Checkpoint -> Hugging Face model folder that transformers and vLLM load (offline, one process, no process group).

    python shard_merge.py --ckpt-dir runs/x/global_step_100 --out runs/x/hf_step_100 \\
        [--max-shard-size 5GB] [--dtype auto|float32|bfloat16|float16] [--adapter-only] [--verify] \\
        [--component actor|critic] [--force]

Reads either layout:
- flatrl (fsdp.py): `model/` is a torch.distributed.checkpoint (DCP) of the model state dict under Hugging Face
  key names, `huggingface/` the config, tokenizer and, with LoRA, `lora.json`. `--component critic` reads
  `critic/model/` and `critic/huggingface/` instead.
- verl FSDP: `model_world_size_{W}_rank_{R}.pt` for R in 0..W-1 (in the folder itself or under `actor/` /
  `critic/`), `fsdp_config.json` and `huggingface/`. Each file holds one rank's shard: DTensors (placements
  Shard or Replicate per mesh dim; Shard shards are concatenated in mesh order, Replicate takes coordinate 0)
  or plain tensors (concatenated on dim 0, what verl's own merger does).

Writes config.json (dtype set to the written dtype, architectures filled in), generation_config.json and the
tokenizer files copied from huggingface/, and safetensors shards of at most --max-shard-size each
(`model.safetensors`, or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`). Tensors are read
one output shard at a time, so RAM holds one shard (plus its fp32 source), never two copies of the model. With
LoRA the adapters are merged into the base weights (lora.merge_lora_state_dict); `--adapter-only` writes just
the PEFT adapter (adapter_config.json + adapter_model.safetensors). Tied embeddings stay tied: the alias
(`lm_head.weight`) is dropped after checking it equals the weight it is tied to. The output is assembled in a
hidden sibling folder and renamed into place, so an interrupted merge never leaves a folder that looks complete.

`--verify` rebuilds the model from the checkpoint (LoRA applied unmerged via lora.apply_lora), loads the merged
folder with from_pretrained in fp32, runs both on a fixed probe batch and exits non-zero if the largest absolute
logit difference exceeds --verify-tolerance (default by output dtype: 1e-4 for float32; for bfloat16/float16
the weights themselves are rounded, 8/11 significant bits, and that error compounds over layers, so the default
is 0.5/0.1: loose enough for a round-off floor of a few tenths on real models' ~20-wide logits, tight enough
to catch a mis-ordered shard or a missing merge, which move logits by whole units).

Deviations from verl's model_merger:
1. Every torch.load uses weights_only=True (and mmap=True); DTensors load that way once torch.distributed.tensor
   is imported, no process group needed. ShardedTensor (FSDP1 with SHARDED_STATE_DICT) is not supported.
2. verl's LoRA checkpoints (`base_model.model.` keys, lora_train_meta.json) are not merged; flatrl's are.
3. TP meshes (a tensor sharded along more than one mesh dim) and Partial placements are refused, not guessed.
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
import torch.distributed.checkpoint as dcp
import transformers
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor  # importing it lets weights_only torch.load rebuild DTensors

import lora


@dataclass(frozen=True)
class MergeConfig:
    """Turn a flatrl (DCP) or verl (FSDP .pt) checkpoint into a Hugging Face model folder."""

    ckpt_dir: str
    """Checkpoint folder: RUN/global_step_N (flatrl), or verl's global_step_N or global_step_N/actor."""
    out: str
    """Output folder; must be absent or empty unless --force."""
    max_shard_size: str = "5GB"
    """Largest safetensors file: an int (bytes) or a number with KB/MB/GB (10^3..) or KiB/MiB/GiB (2^10..)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the floating tensors written; auto = huggingface/config.json's dtype, else the checkpoint's."""
    adapter_only: bool = False
    """With LoRA: write only the PEFT adapter (adapter_config.json + adapter_model.safetensors)."""
    verify: bool = False
    """Compare the merged folder's logits with the checkpoint model's on a probe batch; exit 1 above tolerance."""
    verify_tolerance: float | None = None
    """Largest allowed |logit difference|; None: 1e-4 for float32, 0.5 bfloat16, 0.1 float16 (module docstring)."""
    component: Literal["actor", "critic"] = "actor"
    """Which model of the checkpoint: the actor (top-level model/) or the PPO critic (critic/)."""
    force: bool = False
    """Replace a non-empty --out."""


# Default --verify tolerances by written dtype; the module docstring explains the numbers.
VERIFY_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.5, torch.float16: 0.1}
_VERL_RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
# The tensors of one LoRA-wrapped Linear (lora.py's names); they must land in the same load group to merge.
_LORA_PART = re.compile(r"^(?P<path>.+)\.(?:base_layer\.(?:weight|bias)|lora_[AB](?:\.default)?\.weight)$")
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


@dataclass
class Checkpoint:
    """One model of a checkpoint: tensor specs, a loader for any subset of keys, and its Hugging Face files."""

    specs: dict[str, tuple[torch.Size, torch.dtype]]  # key -> full (unsharded) shape, stored dtype
    load: Callable[[list[str]], dict[str, Tensor]]  # keys -> full tensors (only those keys are read)
    hf_dir: Path
    lora: dict | None  # lora.json: rank, alpha, target_modules, base_model_name_or_path


def _dcp_loader(model_dir: Path) -> tuple[dict, Callable]:
    """Specs and loader of a DCP folder, after checking every data file the metadata names is whole."""
    meta_file = model_dir / ".metadata"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{meta_file} is missing: {model_dir} is not a complete DCP checkpoint")
    try:
        meta = dcp.FileSystemReader(str(model_dir)).read_metadata()
    except Exception as e:
        raise ValueError(f"{meta_file} cannot be read ({type(e).__name__}: {e})") from e
    need: dict[str, int] = {}  # data file -> bytes the metadata says it holds
    for info in meta.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, n in need.items():
        f = model_dir / name
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing (listed in {meta_file})")
        if f.stat().st_size < n:
            raise ValueError(f"{f} is truncated: {f.stat().st_size} bytes, {meta_file} needs at least {n}")
    specs = {
        k: (m.size, m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }

    def load(keys: list[str]) -> dict[str, Tensor]:
        sd = {k: torch.empty(specs[k][0], dtype=specs[k][1]) for k in keys}
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": intended, we are one process
            warnings.simplefilter("ignore")
            dcp.load(sd, storage_reader=dcp.FileSystemReader(str(model_dir)), no_dist=True)
        return sd

    return specs, load


def _torch_load(f: Path) -> dict:
    """torch.load(weights_only=True, mmap=True) of one verl rank file; errors name the file."""
    logging.getLogger("torch.distributed.device_mesh").setLevel(
        logging.ERROR
    )  # "unpickled before PGs" is moot
    try:
        return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ValueError(
            f"{f} cannot be read, truncated or not a torch.save file ({type(e).__name__}: {e})"
        ) from e


def _unshard(key: str, parts: list, files: list[Path]) -> Tensor:
    """The full tensor from each rank's piece (rank order): DTensor placements decide, plain tensors cat on dim 0."""
    first = parts[0]
    if not isinstance(first, DTensor):
        return first if first.dim() == 0 else torch.cat(parts, dim=0)
    mesh = first.device_mesh.mesh  # [*mesh shape] of global ranks
    bad = [p for p in first.placements if not (p.is_shard() or p.is_replicate())]
    sharded = [(i, p.dim) for i, p in enumerate(first.placements) if p.is_shard()]
    if bad or len(sharded) > 1:
        raise ValueError(
            f"{files[0]}: {key} has placements {first.placements}; only one Shard mesh dim supported"
        )
    # rank -> its mesh coordinate; mesh.flatten() walks the mesh in the same row-major order as product()
    coords = dict(zip(mesh.flatten().tolist(), itertools.product(*map(range, mesh.shape)), strict=True))
    mesh_dim, dim = sharded[0] if sharded else (None, 0)
    keep = [r for r, c in coords.items() if all(c[i] == 0 for i in range(mesh.dim()) if i != mesh_dim)]
    keep.sort(key=lambda r: coords[r][mesh_dim] if mesh_dim is not None else 0)
    full = torch.cat([parts[r].to_local() for r in keep], dim=dim) if sharded else parts[keep[0]].to_local()
    if full.shape != first.shape:
        raise ValueError(
            f"{files[0]}: {key} rebuilt as {tuple(full.shape)}, DTensor says {tuple(first.shape)}"
        )
    return full


def _verl_loader(root: Path) -> tuple[dict, Callable]:
    """Specs and loader of a verl FSDP folder (model_world_size_W_rank_R.pt files), checking the world size."""
    found = sorted(p.name for p in root.iterdir() if _VERL_RANK_FILE.match(p.name))
    sizes = {int(_VERL_RANK_FILE.match(n)[1]) for n in found}
    cfg_file = root / "fsdp_config.json"
    world = json.loads(cfg_file.read_text()).get("world_size") if cfg_file.is_file() else None
    if world is None and len(sizes) != 1:
        raise FileNotFoundError(
            f"{root}: expected model_world_size_W_rank_R.pt files of one W, found {found}"
        )
    world = world if world is not None else sizes.pop()
    if sizes - {world}:
        raise ValueError(f"{cfg_file} says world_size {world}, but {root} holds {found}")
    files = [root / f"model_world_size_{world}_rank_{r}.pt" for r in range(world)]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing (world_size {world})")
    shards = [_torch_load(f) for f in files]
    for f, sd in zip(files[1:], shards[1:], strict=True):
        if sd.keys() != shards[0].keys():
            raise ValueError(f"{f} holds different keys than {files[0]}")
    specs = {}
    for k, v in shards[0].items():
        if isinstance(v, DTensor) or v.dim() == 0:
            specs[k] = (v.shape, v.dtype)
        else:
            specs[k] = (torch.Size([sum(sd[k].shape[0] for sd in shards), *v.shape[1:]]), v.dtype)

    def load(keys: list[str]) -> dict[str, Tensor]:
        return {k: _unshard(k, [sd[k] for sd in shards], files) for k in keys}

    return specs, load


def open_checkpoint(ckpt_dir: str | Path, component: str = MergeConfig.component) -> Checkpoint:
    """Find the component's tensors (flatrl DCP or verl .pt files) and Hugging Face files in ckpt_dir.

    Raises FileNotFoundError / ValueError naming the missing, truncated or inconsistent file.
    """
    ckpt_dir = Path(ckpt_dir).expanduser()
    root = ckpt_dir if component == "actor" else ckpt_dir / component
    if (root / "model").is_dir():
        specs, load = _dcp_loader(root / "model")
    else:  # verl: rank files under actor/ (critic/), or in the folder given
        verl = [
            d for d in (ckpt_dir / component, ckpt_dir) if d.is_dir() and any(d.glob("model_world_size_*.pt"))
        ]
        if not verl:
            raise FileNotFoundError(
                f"{root / 'model'} does not exist and no model_world_size_W_rank_R.pt files either"
            )
        root = verl[0]
        specs, load = _verl_loader(root)
    hf_dir = root / "huggingface"
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir / 'config.json'} is missing (the checkpoint's huggingface/ folder)")
    lora_file = hf_dir / "lora.json"
    lora_cfg = json.loads(lora_file.read_text()) if lora_file.is_file() else None
    return Checkpoint(specs, load, hf_dir, lora_cfg)


def _parse_size(size: str) -> int:
    """'5GB' -> 5_000_000_000 (Hugging Face's units: GB = 10^9, GiB = 2^30)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", size.upper())
    if not m:
        raise ValueError(f"max_shard_size {size!r}: expected e.g. 5GB, 500MiB or a byte count")
    return int(float(m[1]) * _UNITS[m[2] or "B"])


def _model_class(config: transformers.PretrainedConfig) -> type[transformers.PreTrainedModel]:
    """The class config.architectures names, else the causal LM class of the config's model type."""
    arch = (config.architectures or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    return cls if cls is not None else transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def _out_dtype(dtype: str, hf_config: dict, ckpt: Checkpoint) -> torch.dtype:
    """auto: the config's dtype (or torch_dtype), else the checkpoint's first floating dtype."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if name := hf_config.get("dtype") or hf_config.get("torch_dtype"):
        return getattr(torch, name)
    return next((d for _, d in ckpt.specs.values() if d.is_floating_point), torch.float32)


def _write_model(ckpt: Checkpoint, out: Path, max_bytes: int, dtype: torch.dtype) -> None:
    """Safetensors shards (+ index) and config.json of the merged model into `out`."""
    config = transformers.AutoConfig.from_pretrained(ckpt.hf_dir)
    with torch.device("meta"):  # key names, shapes and tied aliases for free: no memory, no init
        meta_model = _model_class(config)(config)
    first_name: dict[int, str] = {}
    aliases: dict[
        str, str
    ] = {}  # tied name -> the name it is tied to (lm_head.weight -> embed_tokens.weight)
    for name, p in meta_model.named_parameters(remove_duplicate=False):
        aliases.update({name: first_name[id(p)]} if id(p) in first_name else {})
        first_name.setdefault(id(p), name)
    expected = {k: v.shape for k, v in meta_model.state_dict().items() if k not in aliases}
    for alias, target in aliases.items():
        if alias in ckpt.specs and target in ckpt.specs:
            pair = ckpt.load([alias, target])
            if not torch.equal(pair[alias], pair[target]):
                raise ValueError(f"{alias} differs from {target} in the checkpoint, yet the config ties them")

    units: dict[str, list[str]] = {}  # load unit (a LoRA module's tensors stay together) -> keys
    for key in ckpt.specs:
        if key not in aliases:
            m = _LORA_PART.match(key) if ckpt.lora else None
            units.setdefault(m["path"] if m else key, []).append(key)
    shards: list[list[str]] = [[]]
    size = 0
    for keys in units.values():
        nbytes = sum(
            ckpt.specs[k][0].numel()
            * (dtype if ckpt.specs[k][1].is_floating_point else ckpt.specs[k][1]).itemsize
            for k in keys
            if ".lora_" not in k
        )
        if (
            shards[-1] and size + nbytes > max_bytes
        ):  # Hugging Face's rule: a too-big tensor gets its own shard
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
                raise ValueError(
                    f"{k}: checkpoint gives shape {tuple(v.shape)}, the config needs {expected[k]}"
                )
        fname = (
            "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        save_file(sd, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(sd, fname))
        total += sum(v.numel() * v.element_size() for v in sd.values())
        del sd
    missing, unexpected = (
        sorted(expected.keys() - weight_map.keys()),
        sorted(weight_map.keys() - expected.keys()),
    )
    if missing or unexpected:
        raise ValueError(
            f"checkpoint keys do not match {type(meta_model).__name__}: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    hf_config = json.loads((ckpt.hf_dir / "config.json").read_text())
    hf_config.pop("torch_dtype", None)
    hf_config["dtype"] = str(dtype).removeprefix("torch.")
    hf_config.setdefault("architectures", [type(meta_model).__name__])  # vLLM picks its model class by this
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")


def merge(
    ckpt_dir: str | Path,
    out: str | Path,
    max_shard_size: str = MergeConfig.max_shard_size,
    dtype: str = MergeConfig.dtype,
    adapter_only: bool = MergeConfig.adapter_only,
    component: str = MergeConfig.component,
    force: bool = MergeConfig.force,
) -> Path:
    """Write the Hugging Face folder (or, with adapter_only, the PEFT adapter) of a checkpoint.

    Args:
        ckpt_dir: flatrl RUN/global_step_N, or a verl checkpoint folder (see the module docstring).
        out: output folder; must be absent or empty unless force.
        max_shard_size, dtype, adapter_only, component, force: as the MergeConfig fields.
    Returns:
        `out` as a Path, complete (written to a hidden sibling and renamed into place).
    """
    ckpt = open_checkpoint(ckpt_dir, component)
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise FileExistsError(f"{out} exists and is not empty; pass --force to replace it")
    hf_config = json.loads((ckpt.hf_dir / "config.json").read_text())
    out_dtype = _out_dtype(dtype, hf_config, ckpt)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if adapter_only:
            if ckpt.lora is None:
                raise ValueError(
                    f"{ckpt.hf_dir / 'lora.json'} is missing: --adapter-only needs a LoRA checkpoint"
                )
            sd = ckpt.load([k for k in ckpt.specs if ".lora_A." in k or ".lora_B." in k])
            sd = {k: v.to(out_dtype) for k, v in sd.items()}
            c = ckpt.lora
            lora.save_adapter(
                tmp, sd, c["rank"], c["alpha"], c["target_modules"], c["base_model_name_or_path"]
            )
        else:
            _write_model(ckpt, tmp, _parse_size(max_shard_size), out_dtype)
            for f in ckpt.hf_dir.iterdir():  # tokenizer, generation config, chat template, ...
                if f.name not in ("config.json", "lora.json"):
                    (shutil.copytree if f.is_dir() else shutil.copy2)(f, tmp / f.name)
        if out.exists():  # empty, or force: move the old one aside first so `out` is never half-written
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def probe_batch(vocab_size: int) -> Tensor:
    """Fixed token ids for --verify: 4 sequences of 32, seeded so every run compares the same inputs."""
    return torch.randint(0, vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))  # [B, T]


@torch.no_grad()
def verify(ckpt_dir: str | Path, out: str | Path, component: str = MergeConfig.component) -> float:
    """Largest |logit difference| on probe_batch between the checkpoint model and the merged folder.

    The checkpoint model is built from huggingface/config.json and the checkpoint tensors in fp32 (LoRA applied
    with lora.apply_lora, unmerged); the merged folder is loaded with from_pretrained in fp32. Holds both models
    in RAM. Returns the max over all positions and vocabulary entries of |logits_ckpt - logits_merged|.
    """
    ckpt = open_checkpoint(ckpt_dir, component)
    config = transformers.AutoConfig.from_pretrained(ckpt.hf_dir)
    cls = _model_class(config)
    ref = cls(config).float()
    if ckpt.lora:
        lora.apply_lora(ref, ckpt.lora["rank"], ckpt.lora["alpha"], ckpt.lora["target_modules"])
    missing, unexpected = ref.load_state_dict(ckpt.load(list(ckpt.specs)), strict=False)
    tied = {n for n, _ in ref.named_parameters(remove_duplicate=False)} - {
        n for n, _ in ref.named_parameters()
    }
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"checkpoint does not fit the config: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    merged = cls.from_pretrained(str(out), dtype=torch.float32)
    ids = probe_batch(config.vocab_size)  # [B, T]
    diff = (
        (ref.eval()(input_ids=ids).logits - merged.eval()(input_ids=ids).logits).abs().max().item()
    )  # [B, T, V]
    print(f"verify: max |logit difference| {diff:.3e} over {tuple(ids.shape)} probe tokens")
    return diff


def main(cfg: MergeConfig) -> dict:
    """Merge (and with cfg.verify, check) one checkpoint; returns {"out", "verify/max_abs_logit_diff", "ok"}."""
    out = merge(
        cfg.ckpt_dir, cfg.out, cfg.max_shard_size, cfg.dtype, cfg.adapter_only, cfg.component, cfg.force
    )
    result: dict = {"out": str(out), "ok": True}
    print(f"wrote {out}")
    if cfg.verify:
        if cfg.adapter_only:
            raise ValueError("--verify compares a merged folder; it cannot check an --adapter-only output")
        written = getattr(torch, json.loads((out / "config.json").read_text())["dtype"])
        tol = cfg.verify_tolerance if cfg.verify_tolerance is not None else VERIFY_TOLERANCE[written]
        diff = verify(cfg.ckpt_dir, out, cfg.component)
        result.update({"verify/max_abs_logit_diff": diff, "verify/tolerance": tol, "ok": diff <= tol})
        print(f"verify: {'ok' if diff <= tol else 'FAILED'} (tolerance {tol:g} for {written})")
    return result


if __name__ == "__main__":
    import tyro

    sys.exit(0 if main(tyro.cli(MergeConfig))["ok"] else 1)
