"""flatrl's LoRA layer: wrap nn.Linear modules in place, merge, and export PEFT-loadable adapters.

No peft at runtime; the parameter names and the adapter files match PEFT 0.21's so that a flatrl
adapter loads with `peft.PeftModel.from_pretrained(base, adapter_dir)` and a merged state dict loads
into a plain Hugging Face model (tests/test_lora.py checks both).

    paths = apply_lora(model, rank=8, alpha=16, target_modules="all-linear")  # BEFORE fully_shard
    ...train: only lora_A / lora_B require grad...
    merged = merge_lora_state_dict(full_state_dict, rank=8, alpha=16)         # plain HF keys
    save_adapter(out_dir, full_state_dict, 8, 16, "all-linear", "Qwen/Qwen2.5-0.5B")

The trainers call `start_lora(model, cfg.model)` instead of apply_lora: the run's settings (model.lora_rank,
lora_alpha, target_modules, exclude_modules), or a saved adapter folder's settings and weights
(model.lora_adapter_path, verl's key; `read_adapter_config`, `load_adapter_weights`).

A wrapped `<path>` holds `<path>.base_layer.{weight,bias}` (frozen), `<path>.lora_A.weight` [r, in] and
`<path>.lora_B.weight` [out, r]. PEFT names them `<path>.lora_A.default.weight` in memory (adapter
"default") and `base_model.model.<path>.lora_A.weight` on disk; `adapter_state_dict` writes the latter.

FSDP2: call `apply_lora` before `fully_shard`, which turns parameters into sharded DTensors and hooks
the module tree as it stands; modules swapped in later would be unsharded and unhooked. FSDP2 shards
frozen and trainable parameters side by side (FSDP1 needed `use_orig_params`).

Deviations from PEFT:
1. A string `target_modules` other than "all-linear" is a comma-separated list of suffixes
   ("q_proj,v_proj", for the CLI); PEFT reads such a string as a regex on the full module name (so a saved
   adapter whose target_modules is such a regex is refused). exclude_modules reads a string as PEFT does.
2. One adapter per module; no bias / modules_to_save / DoRA / rsLoRA options (a saved adapter that uses one is
   refused by `read_adapter_config`).
3. lora_A/B take the base layer's dtype. PEFT's default `autocast_adapter_dtype=True` upcasts bf16/fp16
   adapters to fp32; here keep fp32 master weights and let FSDP2's MixedPrecisionPolicy cast for compute.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

ALL_LINEAR = "all-linear"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # PEFT's file names
PEFT_PREFIX = "base_model.model."  # before every tensor name in a saved PEFT adapter
# `<path>.lora_A.weight`, optionally with PEFT's adapter name: `<path>.lora_A.default.weight`.
_LORA_KEY = re.compile(r"^(?P<path>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")


class _LoRAFunction(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T in 4 kernels forward and at most 6 backward (autograd's three nn.Linear, mul
    and add issue about 3x as many ops, host work that bounds the update at small hidden sizes: bench/README.md).
    x [..., in], W [out, in], b [out] or None, A [r, in], B [out, r], s the scaling; gradients for whichever
    input requires one."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None, a: Tensor, bw: Tensor, s: float) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [N, in]
        t = torch.mm(x2, a.t()).mul_(s)  # [N, r], scaled here so the backward needs no extra mul for B
        y = torch.addmm(b, x2, w.t()) if b is not None else torch.mm(x2, w.t())  # [N, out]
        y.addmm_(t, bw.t())
        ctx.save_for_backward(x2, w, a, bw, t)
        ctx.s, ctx.has_bias, ctx.x_shape = s, b is not None, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, g: Tensor):
        x2, w, a, bw, t = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])  # [N, out]
        need_x, need_w, need_b, need_a, need_bw, _ = ctx.needs_input_grad
        gx = gw = gb = ga = gbw = None
        if need_x or need_a:
            gt = torch.mm(g2, bw).mul_(ctx.s)  # [N, r]: d loss / d (x A^T)
            if need_a:
                ga = torch.mm(gt.t(), x2)  # [r, in]
            if need_x:
                gx = torch.mm(g2, w).addmm_(gt, a).view(ctx.x_shape)  # [..., in]
        if need_bw:
            gbw = torch.mm(g2.t(), t)  # [out, r]
        if need_w:
            gw = torch.mm(g2.t(), x2)  # [out, in]
        if need_b and ctx.has_bias:
            gb = g2.sum(0)  # [out]
        return gx, gw, gb, ga, gbw, None


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update: y = W x + b + (B A x) * alpha / r."""

    def __init__(self, base_layer: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {rank}")
        self.base_layer = base_layer
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        w = base_layer.weight  # [out, in]
        kw = {"bias": False, "device": w.device, "dtype": w.dtype}
        self.lora_A = nn.Linear(base_layer.in_features, rank, **kw)  # weight [r, in]
        self.lora_B = nn.Linear(rank, base_layer.out_features, **kw)  # weight [out, r]
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # PEFT's default init (after loralib): A like nn.Linear's default, B = 0 so the wrapped model
        # starts exactly at the base model. peft/tuners/lora/layer.py reset_lora_parameters.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., in] -> [..., out]. Scaling 0 (`disabled`) runs the base layer alone."""
        if self.scaling == 0.0:
            return self.base_layer(x)
        if isinstance(self.lora_dropout, nn.Dropout) and self.training:
            return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        w, b = self.base_layer.weight, self.base_layer.bias
        return _LoRAFunction.apply(x, w, b, self.lora_A.weight, self.lora_B.weight, self.scaling)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling}"


def _parse_targets(target_modules: str | Sequence[str]) -> list[str] | None:
    """None for "all-linear", else the list of module-name suffixes."""
    if isinstance(target_modules, str):
        if target_modules.strip().lower() == ALL_LINEAR:
            return None
        target_modules = target_modules.split(",")
    if not (targets := [t.strip() for t in target_modules if t.strip()]):
        raise ValueError("target_modules is empty; pass 'all-linear' or module-name suffixes like q_proj")
    return targets


def _named(name: str, suffix: str) -> bool:
    """PEFT's module match: the dotted name is `suffix` or ends in `.suffix`."""
    return name == suffix or name.endswith("." + suffix)


def targeted(name: str, targets: list[str] | None, exclude_modules: str | Sequence[str] | None) -> bool:
    """Whether apply_lora wraps the linear module `name`: targets (from _parse_targets, None for all-linear) name
    it and exclude_modules leaves it."""
    chosen = targets is None or any(_named(name, t) for t in targets)
    return chosen and not _excluded(name, exclude_modules)


def _excluded(name: str, exclude_modules: str | Sequence[str] | None) -> bool:
    """PEFT's exclude_modules rule (tuners_utils.check_target_module_exists, verl's check_exclude_modules): a string
    is a regex the whole module name must match (re.fullmatch), a list holds names or name suffixes."""
    if not exclude_modules:
        return False
    if isinstance(exclude_modules, str):
        return re.fullmatch(exclude_modules, name) is not None
    return any(_named(name, e) for e in exclude_modules)


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    target_modules: str | Sequence[str],
    dropout: float = 0.0,
    exclude_modules: str | Sequence[str] | None = None,
) -> list[str]:
    """Replace matching nn.Linear modules by LoRALinear in place and freeze every non-LoRA parameter.

    Call before FSDP2's `fully_shard` (see the module docstring). The output layer is never wrapped,
    so tied input/output embeddings stay tied and frozen.

    Args:
        model: the model to modify, e.g. a Qwen2ForCausalLM.
        rank, alpha: LoRA rank r and alpha; the update is scaled by alpha / r.
        target_modules: "all-linear" (every nn.Linear except the output layer, PEFT's meaning) or a list /
            comma-separated string of suffixes; `s` matches `name == s or name.endswith("." + s)` (PEFT).
        dropout: dropout on the LoRA branch input (PEFT's lora_dropout).
        exclude_modules: modules left unwrapped although target_modules names them (PEFT's and verl's
            exclude_modules): a regex the full module name must match whole (`.*visual.*`), or a list of names /
            suffixes matched as target_modules' are. None or empty: none.

    Returns: the dotted module paths that were wrapped, in named_modules() order.
    Raises: ValueError when nothing is left to wrap (no target matched, or exclude_modules took every match).
    """
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("model already has LoRA layers; apply_lora must run once")
    if isinstance(exclude_modules, str):
        try:
            re.compile(exclude_modules)
        except re.error as e:
            raise ValueError(f"exclude_modules {exclude_modules!r} is not a valid regex: {e}") from None
    targets = _parse_targets(target_modules)
    # The output projection is never a target: `lm_head`, or whatever get_output_embeddings() returns
    # (PEFT's "all-linear" rule, tuners_utils._maybe_include_all_linear_layers).
    get_out = getattr(model, "get_output_embeddings", None)
    out_layer = get_out() if callable(get_out) else None
    excluded = {"lm_head"} | {n for n, m in model.named_modules() if out_layer is not None and m is out_layer}
    linear = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in excluded]
    if targets is None:
        chosen = linear
    else:
        chosen = [(n, m) for n, m in linear if any(_named(n, t) for t in targets)]
    if not chosen:
        avail = sorted({n.rsplit(".", 1)[-1] for n, _ in linear})
        raise ValueError(
            f"target_modules {target_modules!r} matched no nn.Linear module; "
            f"available suffixes: {avail[:12]}{' ...' if len(avail) > 12 else ''}"
        )
    if not (kept := [(n, m) for n, m in chosen if not _excluded(n, exclude_modules)]):
        raise ValueError(
            f"exclude_modules {exclude_modules!r} excludes all {len(chosen)} modules that target_modules "
            f"{target_modules!r} matched (e.g. {chosen[0][0]}): no module is left for LoRA"
        )
    chosen = kept
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(module, rank, alpha, dropout))
    return [n for n, _ in chosen]


def _lora_pairs(state_dict: dict[str, Tensor]) -> dict[str, dict[str, str]]:
    """{module path: {"A": key, "B": key}} for every LoRA module in the state dict."""
    pairs: dict[str, dict[str, str]] = {}
    for key in state_dict:
        m = _LORA_KEY.match(key)
        if m:
            pairs.setdefault(m["path"], {})[m["ab"]] = key
    for path, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA module {path!r} has only lora_{''.join(ab)} in the state dict")
    return pairs


def merge_lora_state_dict(state_dict: dict[str, Tensor], rank: int, alpha: float) -> dict[str, Tensor]:
    """Fold LoRA into the base weights: a LoRA state dict -> a plain Hugging Face state dict.

    For each LoRA module `<path>`: `<path>.weight = base + (B @ A) * alpha / rank` (B [out, r],
    A [r, in]), computed in fp32 and cast back to the base dtype; `<path>.base_layer.bias` becomes
    `<path>.bias`; lora keys are dropped. Other keys pass through unchanged. Pure: inputs untouched.

    Args:
        state_dict: a full (unsharded) state dict of a model after apply_lora.
        rank, alpha: the values given to apply_lora (rank is checked against lora_A's shape).

    Returns: a new dict with the keys the unwrapped model expects.
    """
    merged, used = {}, set()
    for path, ab in _lora_pairs(state_dict).items():
        base_key, bias_key = f"{path}.base_layer.weight", f"{path}.base_layer.bias"
        if base_key not in state_dict:
            raise KeyError(f"LoRA module {path!r} has no {base_key} in the state dict")
        base, lora_a, lora_b = state_dict[base_key], state_dict[ab["A"]], state_dict[ab["B"]]
        if lora_a.shape[0] != rank:
            raise ValueError(f"{ab['A']} has rank {lora_a.shape[0]}, expected {rank}")
        delta = (lora_b.float() @ lora_a.float()) * (alpha / rank)  # [out, r] @ [r, in] -> [out, in]
        merged[f"{path}.weight"] = (base.float() + delta).to(base.dtype)
        if bias_key in state_dict:
            merged[f"{path}.bias"] = state_dict[bias_key]
        used |= {base_key, bias_key, ab["A"], ab["B"]}
    merged.update({k: v for k, v in state_dict.items() if k not in used})
    return merged


def merged_params(named_params: Iterable[tuple[str, Tensor]], scaling: float) -> Iterator[tuple[str, Tensor]]:
    """merge_lora_state_dict for a stream of (name, full tensor) pairs, e.g. fsdp.iter_full_params: each LoRA
    module's merged `<path>.weight` is yielded as soon as its base weight, lora_A and lora_B have passed (they
    come together, in one module's parameters), so at most one module is held. Other names pass through;
    `<path>.base_layer.bias` becomes `<path>.bias`. This is how the RL trainers push a LoRA policy into vLLM.

    Args:
        named_params: (name, tensor) pairs of a model after apply_lora (every lora tensor included).
        scaling: alpha / rank.
    """
    held: dict[str, dict[str, Tensor]] = {}
    for name, t in named_params:
        m = _LORA_KEY.match(name)
        if m is None and name.endswith(".base_layer.weight"):
            path, part = name.removesuffix(".base_layer.weight"), "W"
        elif m is not None:
            path, part = m["path"], m["ab"]
        else:
            yield name.replace(".base_layer.bias", ".bias"), t
            continue
        parts = held.setdefault(path, {})
        parts[part] = t
        if len(parts) == 3:
            del held[path]
            delta = (parts["B"].float() @ parts["A"].float()) * scaling  # [out, r] @ [r, in]
            yield f"{path}.weight", (parts["W"].float() + delta).to(parts["W"].dtype)
    if held:
        raise ValueError(f"LoRA modules without all of base weight, lora_A, lora_B: {sorted(held)[:3]}")


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[None]:
    """The base model inside the block: every LoRALinear's update is scaled by 0 (the RL reference policy)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    saved = [m.scaling for m in layers]
    for m in layers:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, s in zip(layers, saved, strict=True):
            m.scaling = s


def adapter_state_dict(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """The LoRA tensors under PEFT's saved names: `base_model.model.<path>.lora_{A,B}.weight`.

    Args: state_dict, a full state dict of a model after apply_lora (`.default` names accepted).
    Returns: only the lora_A [r, in] / lora_B [out, r] weights, renamed as PEFT's save_pretrained does.
    """
    return {
        f"base_model.model.{path}.lora_{x}.weight": state_dict[key]
        for path, ab in _lora_pairs(state_dict).items()
        for x, key in sorted(ab.items())
    }


def save_adapter(
    out_dir: str | Path,
    state_dict: dict[str, Tensor],
    rank: int,
    alpha: float,
    target_modules: str | Sequence[str],
    base_model_name_or_path: str,
    dropout: float = 0.0,
    exclude_modules: str | Sequence[str] | None = None,
) -> Path:
    """Write a PEFT LoRA adapter folder: adapter_config.json + adapter_model.safetensors.

    Args:
        out_dir: folder to create (existing files are overwritten).
        state_dict: a full state dict of a model after apply_lora; rank, alpha, dropout, exclude_modules: as
            given to it.
        target_modules: as given to apply_lora; written as "all-linear" or as the suffixes that matched a
            wrapped module (PEFT re-matches them, less exclude_modules, against the base model on load).
        base_model_name_or_path: recorded for PEFT / the Hub; PeftModel.from_pretrained(base, dir) ignores it.

    Returns: the output folder.
    """
    weights = adapter_state_dict(state_dict)
    if not weights:
        raise ValueError("state_dict has no lora_A/lora_B weights; was apply_lora called?")
    paths, targets = list(_lora_pairs(state_dict)), _parse_targets(target_modules)
    if targets is not None:  # record only the suffixes that wrapped something
        targets = sorted(t for t in targets if any(_named(p, t) for p in paths))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": ALL_LINEAR if targets is None else targets,
        "exclude_modules": exclude_modules
        if isinstance(exclude_modules, str)
        else list(exclude_modules or []) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": base_model_name_or_path,
    }  # every other LoraConfig field keeps PEFT's default (no DoRA, no rsLoRA, no modules_to_save)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    # safetensors refuses non-contiguous / shared tensors; "format": "pt" is the metadata PEFT writes.
    weights = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    save_file(weights, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


# adapter_config.json fields that change what a PEFT adapter computes and that LoRALinear does not implement:
# each must be absent or hold a value that turns it off (PEFT 0.21's LoraConfig defaults).
_UNSUPPORTED = (
    "use_dora", "use_rslora", "fan_in_fan_out", "lora_bias", "modules_to_save", "rank_pattern", "alpha_pattern",
    "layers_to_transform", "layer_replication", "target_parameters", "trainable_token_indices",
)  # fmt: skip


def read_adapter_config(adapter_dir: str | Path) -> dict[str, Any]:
    """The LoRA settings of a saved PEFT adapter folder (adapter_config.json, as save_adapter and PEFT write it).

    Args: adapter_dir, the folder (adapter_config.json + adapter_model.safetensors).
    Returns: {"rank": r, "alpha": lora_alpha, "target_modules": "all-linear" or a list of names,
        "exclude_modules": a regex, a list or None, "dropout": lora_dropout}.
    Raises: FileNotFoundError for a missing folder or file; ValueError, one line naming the file and the field,
        for an adapter lora.py cannot reproduce (not LoRA, DoRA, rsLoRA, bias, per-module ranks, a regex
        target_modules, ...).
    """
    folder = Path(adapter_dir).expanduser()
    path = folder / ADAPTER_CONFIG
    if not folder.is_dir():
        raise FileNotFoundError(f"LoRA adapter folder {folder} does not exist")
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: a PEFT adapter folder holds {ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}"
        )
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    bad = lambda key, why: ValueError(f"{path}: {key}={cfg.get(key)!r}: {why}")  # noqa: E731
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise bad("peft_type", "not a LoRA adapter")
    for key in _UNSUPPORTED:
        if cfg.get(key) not in (None, False, {}, []):
            raise bad(key, "not supported by flatrl's LoRA (lora.py: plain LoRA only)")
    if cfg.get("bias", "none") != "none":
        raise bad("bias", "not supported by flatrl's LoRA (lora.py: no bias training)")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise bad("r", "want a positive integer rank")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise bad("lora_alpha", "want a positive number")
    targets = cfg.get("target_modules")
    if isinstance(targets, str) and targets.strip().lower() != ALL_LINEAR:
        raise bad(
            "target_modules", "a regex (PEFT's reading of a string); flatrl reads 'all-linear' or a list"
        )
    if not targets or not isinstance(targets, (str, list)):
        raise bad("target_modules", "want 'all-linear' or a list of module names")
    exclude = cfg.get("exclude_modules")
    if exclude is not None and not isinstance(exclude, (str, list)):
        raise bad("exclude_modules", "want a regex or a list of module names")
    dropout = cfg.get("lora_dropout") or 0.0
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise bad("lora_dropout", "want a number in [0, 1)")
    return {"rank": rank, "alpha": float(alpha), "target_modules": targets, "exclude_modules": exclude or None,
            "dropout": float(dropout)}  # fmt: skip


@torch.no_grad()
def load_adapter_weights(model: nn.Module, adapter_dir: str | Path) -> int:
    """Copy a saved PEFT adapter's tensors into the LoRA parameters of `model` (after apply_lora, before
    fully_shard). Strict: every tensor must land on a LoRA parameter of the same shape, and every LoRA parameter
    must get one. Read with safetensors only: the file holds plain tensors, nothing in it can run code.

    Args:
        model: a model after apply_lora with the adapter's own settings (read_adapter_config).
        adapter_dir: the folder; its adapter_model.safetensors names tensors `base_model.model.<module>.lora_A.weight`
            (PEFT's saved names; `.lora_A.default.weight` accepted) holding [r, in] (A) and [out, r] (B).
    Returns: the number of tensors copied (cast to each parameter's dtype).
    Raises: FileNotFoundError for a missing file; ValueError, one line naming the file and the tensor, for a tensor
        that is not a LoRA weight, that no LoRA parameter of the model takes, of another shape, or a LoRA
        parameter that no tensor fills.
    """
    path = Path(adapter_dir).expanduser() / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: a PEFT adapter folder holds {ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}"
        )
    params = {n: p for n, p in model.named_parameters() if _LORA_KEY.match(n)}
    if not params:
        raise ValueError(f"{path}: the model has no LoRA parameters to load it into (apply_lora first)")
    tensors = load_file(str(path))  # safetensors: a header and raw buffers, no pickle
    filled: dict[str, str] = {}
    for key, t in tensors.items():
        m = _LORA_KEY.match(key.removeprefix(PEFT_PREFIX))
        if not key.startswith(PEFT_PREFIX) or m is None:
            raise ValueError(
                f"{path}: tensor {key} is not a LoRA weight ({PEFT_PREFIX}<module>.lora_A.weight)"
            )
        name = f"{m['path']}.lora_{m['ab']}.weight"
        if name not in params:
            raise ValueError(f"{path}: tensor {key} has no LoRA parameter {name} in the model to land on")
        if name in filled:
            raise ValueError(f"{path}: tensors {filled[name]} and {key} both fill {name}")
        if tuple(t.shape) != tuple(params[name].shape):
            raise ValueError(
                f"{path}: tensor {key} has shape {list(t.shape)}, the model's {name} {list(params[name].shape)}"
            )
        params[name].copy_(t)
        filled[name] = key
    if missing := [n for n in params if n not in filled]:
        raise ValueError(
            f"{path}: no tensor for LoRA parameter {missing[0]} ({len(missing)} of {len(params)} missing)"
        )
    return len(filled)


# (start_lora's key, adapter_config.json's field, the run's own setting) of what a saved adapter decides.
_ADOPTED = (
    ("rank", "r", "model.lora_rank"),
    ("alpha", "lora_alpha", "model.lora_alpha"),
    ("target_modules", "target_modules", "model.target_modules"),
    ("exclude_modules", "exclude_modules", "model.exclude_modules"),
    ("dropout", "lora_dropout", "the dropout of fresh adapters"),
)


class LoRASettings(Protocol):
    """The LoRA fields of actor.ModelConfig and sft.SFTModelConfig (the model.* keys)."""

    lora_rank: int
    lora_alpha: float
    target_modules: str | list[str]
    exclude_modules: str | list[str] | None
    lora_adapter_path: str | None


def start_lora(model: nn.Module, cfg: LoRASettings) -> tuple[dict[str, Any], list[str]]:
    """A run's LoRA, before fully_shard: fresh adapters from the run's settings, or a saved PEFT adapter's settings
    and weights when cfg.lora_adapter_path is set. As in verl (PeftModel.from_pretrained(model, lora_adapter_path,
    is_trainable=True)), the adapter's adapter_config.json decides r, lora_alpha, target_modules, exclude_modules
    and lora_dropout: each run value it replaces is said in a note.

    Args: model, the unwrapped model; cfg, its config's LoRA fields.
    Returns: (settings, notes). settings: what checkpoint.py writes to lora.json for shard_merge.py (rank, alpha,
        target_modules as the suffixes wrapped, exclude_modules, dropout); notes: lines for stderr.
    """
    run = {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "target_modules": cfg.target_modules,
           "exclude_modules": cfg.exclude_modules or None, "dropout": 0.0}  # fmt: skip
    settings, notes, path = run, [], cfg.lora_adapter_path
    if path is not None:
        settings = read_adapter_config(path)
        for key, field, ours in _ADOPTED:
            a, b = run[key], settings[key]
            if key == "target_modules":  # "q_proj,v_proj" and ["v_proj", "q_proj"] are the same targets
                a, b = (sorted(t) if t else t for t in (_parse_targets(a), _parse_targets(b)))
            if a != b:
                notes.append(
                    f"model.lora_adapter_path: {Path(path) / ADAPTER_CONFIG} sets {field}={settings[key]!r}, in "
                    f"place of {ours}={run[key]!r} (verl loads the adapter with its own config)"
                )
    wrapped = apply_lora(
        model, settings["rank"], settings["alpha"], settings["target_modules"], settings["dropout"],
        settings["exclude_modules"],
    )  # fmt: skip
    if path is not None:
        load_adapter_weights(model, path)
    return dict(settings, target_modules=sorted({w.rsplit(".", 1)[-1] for w in wrapped})), notes
