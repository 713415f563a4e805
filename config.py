"""Config parsing: one frozen dataclass tree per script, tyro on the command line, strict YAML underneath.

`cfg = config.parse(SFTConfig)`; precedence is CLI > YAML > dataclass defaults:
1. `--config FILE.yaml` (anywhere in argv) is read with `yaml.safe_load`, remapped by the script's optional
   `yaml_hook`, and validated strictly by `from_dict`; the instance becomes tyro's `default=`, so `--help`
   shows the YAML values and CLI flags (`--optim.lr 3e-5`; `--save_freq` or `--save-freq`) override them.
2. `--print-config` prints the resolved config as YAML (same nested keys; loading it back with `--config`
   gives an equal config) and exits 0 before the script touches data or models.

Strict: an unknown key or a wrong type raises `ConfigError` (a ValueError) naming the source and the dotted
key, e.g. `configs/x.yaml: unknown key 'optim.lrr' (known: lr, betas)`; `parse` exits with that one line.
By field type: float takes ints and numeric strings (PyYAML 1.1 reads `1e-5`, no dot, as a string); int
and bool take only real ints/bools (`yes` is an error); null only where None is allowed; Literal must be
one of its choices; tuple/list from a sequence (fixed tuples length-checked); nested dataclasses from
mappings, overlaid on the parent's default; `Path` from a string, `~` left unexpanded for the script.
`move_keys` helps a `yaml_hook` map a foreign layout (verl's `actor_rollout_ref.actor...`) onto ours.
`to_dict`/`to_yaml` save the resolved config into runs and checkpoints; `from_dict` reads it back on resume.
`TrainerConfig` holds the loop, logging and checkpoint settings every trainer shares (each script subclasses it).
"""

import argparse
import copy
import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import PurePath
from typing import Any, TypeVar

import tyro
import yaml

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Loop length, logging, checkpoints (verl's trainer.*); sft.py and rl.py extend it."""

    default_local_dir: str = "runs/run"
    """Run folder: metrics.jsonl, config.yaml, report.md, global_step_N/ checkpoints."""
    project_name: str = "flatrl"
    """Project name for tensorboard/wandb."""
    experiment_name: str = "run"
    """Run name for tensorboard/wandb."""
    total_epochs: int = 1
    """Passes over the training data (ignored when total_training_steps is set)."""
    total_training_steps: int | None = None
    """Stop after this many steps."""
    logger: list[str] = dataclasses.field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks: console, jsonl, tensorboard, wandb."""
    save_freq: int = -1
    """Checkpoint every N steps (-1: only at the end)."""
    test_freq: int = -1
    """Validate every N steps (-1: only before and after training)."""
    resume_mode: str = "auto"
    """auto: newest complete checkpoint in default_local_dir; disable: start fresh; or a checkpoint path.
    metrics.jsonl keeps the lines up to the step resumed from (none on a fresh start)."""
    max_ckpt_to_keep: int | None = None
    """Keep only this many newest checkpoints (None: all)."""
    seed: int = 0
    """Seed of the data order (sft.py) and of the trainer's RNGs."""
    timeout_s: float = 600.0
    """Collective timeout: a dead rank turns into an error on the others after this long."""
    max_consecutive_skips: int = 5
    """Optimizer steps with a NaN/inf loss or gradient norm are skipped (train/ or actor/skipped_steps); after
    this many in a row the run saves a checkpoint (the weights of the last good step) and stops with an error."""


_OPTIONS_HELP = "--config FILE.yaml loads overrides (CLI flags still win); --print-config prints YAML, exits."


class ConfigError(ValueError):
    """A config value that does not fit the dataclass tree; the message names the source and dotted key."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, key: str, source: str, base: Any = None) -> Any:
    """Validate `value` against type `tp`; return it converted (float from str/int, tuple from list, ...)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = lambda: ConfigError(
        f"{source}: key '{key}' expects {_type_name(tp)}, got {type(value).__name__} {value!r}"
    )
    if origin is typing.Annotated:  # tyro.conf markers wrap the real type
        return _coerce(args[0], value, key, source, base)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        sub_base = base if dataclasses.is_dataclass(base) else None
        if len(arms) == 1:  # Optional[X]: X's own error message is the clearest
            return _coerce(arms[0], value, key, source, sub_base)
        for arm in arms:
            try:
                return _coerce(arm, value, key, source, sub_base)
            except ConfigError:
                pass
        raise bad()
    if value is None:
        raise ConfigError(f"{source}: key '{key}' is null but {_type_name(tp)} is not Optional")
    if origin is typing.Literal:
        # `True == 1`, so compare types too: a bool must not pass for Literal[1].
        if any(value == c and type(value) is type(c) for c in args):
            return value
        raise ConfigError(f"{source}: key '{key}' must be one of {list(args)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise bad()
        return _build(tp, base, value, key + ".", source)
    if tp in (bool, int, float, str):
        if isinstance(value, bool) != (tp is bool):  # bool subclasses int: never let one pass for the other
            raise bad()
        if tp is float and isinstance(value, (int, str)):
            try:  # PyYAML 1.1 reads `1e-5` (no dot) as a string
                return float(value)
            except ValueError:
                raise bad() from None
        if isinstance(value, tp):
            return value
        raise bad()
    if isinstance(tp, type) and issubclass(tp, PurePath):
        if isinstance(value, (str, PurePath)):
            return tp(value)  # `~` stays as given; scripts expand it where they use the path
        raise bad()
    if origin in (tuple, list) or tp in (tuple, list):
        if isinstance(value, (str, Mapping)) or not isinstance(value, Sequence):
            raise bad()
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{source}: key '{key}' expects {len(args)} items, got {len(value)}")
            return tuple(_coerce(a, v, f"{key}[{i}]", source) for i, (a, v) in enumerate(zip(args, value)))  # noqa: B905
        items = [_coerce(args[0] if args else Any, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return items if (origin is list or tp is list) else tuple(items)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise bad()
        kt, vt = args if args else (Any, Any)
        return {_coerce(kt, k, key, source): _coerce(vt, v, f"{key}.{k}", source) for k, v in value.items()}
    raise ConfigError(f"{source}: key '{key}' has unsupported field type {_type_name(tp)}")


def _build(cls: type[T], base: T | None, d: Mapping, prefix: str, source: str) -> T:
    """Build `cls` from mapping `d`, over `base` (an instance) if given, else over the class defaults."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for k in d:
        if k not in fields:
            raise ConfigError(f"{source}: unknown key '{prefix}{k}' (known: {', '.join(fields)})")
    hints = typing.get_type_hints(cls, include_extras=True)
    values = {}
    for name, f in fields.items():
        has_factory = f.default_factory is not dataclasses.MISSING
        if name not in d:
            if base is None and f.default is dataclasses.MISSING and not has_factory:
                raise ConfigError(f"{source}: missing required key '{prefix}{name}'")
            continue
        if base is not None:
            default = getattr(base, name)
        else:
            default = f.default_factory() if has_factory else f.default
        sub_base = default if dataclasses.is_dataclass(default) else None  # overlay nested sections
        values[name] = _coerce(hints[name], d[name], prefix + name, source, sub_base)
    return dataclasses.replace(base, **values) if base is not None else cls(**values)


def from_dict(cls: type[T], d: Mapping, source: str = "<dict>") -> T:
    """Strictly build a `cls` instance from a nested mapping, over the dataclass defaults.

    Args:
        cls: the (frozen) dataclass tree.
        d: nested mapping of overrides (keys absent keep their defaults).
        source: name used in error messages, usually the YAML file path.
    Returns: the instance. Raises ConfigError naming `source` and the dotted key on any mismatch.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(d).__name__}")
    return _build(cls, None, d, "", source)


def to_dict(cfg: Any) -> Any:
    """Config instance -> nested dict of plain YAML/JSON types (tuples become lists, paths strings)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Mapping):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, PurePath):
        return str(cfg)
    return cfg


def to_yaml(cfg: Any) -> str:
    """Config instance -> YAML text that `from_dict(cls, yaml.safe_load(text))` turns back into an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def _flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; empty mappings stay as leaves."""
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def move_keys(d: Mapping, moves: Mapping[str, str | None]) -> dict:
    """Return a copy of `d` with dotted keys moved, e.g. `{"actor_rollout_ref.actor.optim": "optim"}`.

    A source names a leaf or a whole section; absent sources are skipped; a destination of None drops the
    key (an explicit "we ignore this"). A section moved onto an existing one merges into it; writing over an
    existing value is a ValueError. Sections a move empties disappear, so strict validation flags only the
    keys no move mentions. Keys are treated as strings and must not contain dots themselves.
    """
    flat = _flatten(copy.deepcopy(dict(d)))
    for src, dst in moves.items():
        for key in [k for k in flat if k == src or k.startswith(src + ".")]:
            value = flat.pop(key)
            if dst is None:
                continue
            new = dst + key[len(src) :]
            if any(k == new or k.startswith(new + ".") or new.startswith(k + ".") for k in flat):
                raise ValueError(f"move_keys: moving '{key}' would overwrite existing '{new}'")
            flat[new] = value
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def parse(cls: type[T], argv: list[str] | None = None, yaml_hook: Callable[[dict], dict] | None = None) -> T:
    """Parse the command line into a `cls` instance: dataclass defaults < `--config` YAML < CLI flags.

    Args:
        cls: the script's frozen dataclass tree (every field needs a default, or a value in the YAML).
        argv: arguments without the program name; None reads `sys.argv[1:]`.
        yaml_hook: maps the raw YAML mapping to ours before validation (see `move_keys`).
    Returns: the resolved config. Exits 0 after printing it if `--print-config` was given; exits
    with a one-line message on a bad YAML file.
    """
    # Our two options are taken out before tyro sees argv; allow_abbrev=False so `--conf` is not eaten.
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--print-config", action="store_true")
    opts, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    path, default = opts.config, None
    if path is not None:
        try:
            with open(path) as f:
                raw = yaml.safe_load(f)
            raw = {} if raw is None else raw
            if yaml_hook is not None and isinstance(raw, dict):
                raw = yaml_hook(raw)
            default = from_dict(cls, raw, source=path)
        except (OSError, yaml.YAMLError, ValueError) as e:
            raise SystemExit(f"error: {e}") from None
    doc = "" if (cls.__doc__ or "").startswith(cls.__name__ + "(") else cls.__doc__  # dataclass's stand-in
    cfg = tyro.cli(
        cls, args=rest, default=default, use_underscores=True, description=f"{doc}\n\n{_OPTIONS_HELP}"
    )
    if opts.print_config:
        sys.stdout.write(to_yaml(cfg))
        sys.stdout.flush()
        raise SystemExit(0)
    return cfg
