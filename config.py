"""Config parsing: one frozen dataclass tree per script, tyro on the command line, strict YAML underneath.

Every entry script does `cfg = config.parse(SFTConfig)`. Precedence is CLI > YAML > dataclass defaults:

1. `--config FILE.yaml` (anywhere in argv) is read with `yaml.safe_load`, optionally remapped by the
   script's `yaml_hook`, then validated strictly by `from_dict` into an instance of the tree.
2. That instance becomes tyro's `default=`, so `--help` shows the YAML values as defaults and any CLI flag
   (`--optim.lr 3e-5`) overrides it. Flags keep the field names (`--save_freq`; tyro also accepts `--save-freq`).
3. `--print-config` prints the resolved config as YAML (the same nested keys; feeding it back through
   `--config` gives an equal config) and exits 0 before the script touches data or models.

Strict means: an unknown key or a value of the wrong type raises `ConfigError` (a ValueError) naming the
file and the full dotted key, e.g. `configs/x.yaml: unknown key 'optim.lrr' (known: lr, betas)`; `parse`
turns it into a one-line `SystemExit` message. Coercions, all by field type:
- float: ints and numeric strings are accepted, since PyYAML 1.1 reads `1e-5` (no dot) as a string;
- int: a real int only (not a bool, not a string); bool: a real bool only (`yes`/`"true"` are errors);
- `None` (`~`/`null`) only where the type allows None; Literal values must be one of the choices;
- tuple/list from a YAML sequence (length checked for fixed tuples); nested dataclasses from mappings,
  overlaid on the parent's default for that field; `Path` from a string, with `~` left unexpanded.

`move_keys` is for `yaml_hook`s that map a foreign layout (verl's `actor_rollout_ref.actor...`) onto ours.
`to_dict`/`to_yaml` save the resolved config into runs and checkpoints; `from_dict` reads it back on resume.
"""

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

_OPTIONS_HELP = (
    "Config files: --config FILE.yaml loads overrides (strict; CLI flags still win); "
    "--print-config prints the resolved config as YAML and exits."
)


class ConfigError(ValueError):
    """A config value that does not fit the dataclass tree; the message names the source and dotted key."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, key: str, source: str, base: Any = None) -> Any:
    """Validate `value` against type `tp`; return it converted (float from str/int, tuple from list, ...)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = lambda: ConfigError(f"{source}: key '{key}' expects {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is typing.Annotated:  # tyro.conf markers wrap the real type
        return _coerce(args[0], value, key, source, base)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise bad()
        errors = []
        for arm in args:
            if arm is type(None):
                continue
            try:
                return _coerce(arm, value, key, source, base if dataclasses.is_dataclass(base) else None)
            except ConfigError as e:
                errors.append(str(e).split(": ", 1)[1])
        raise ConfigError(f"{source}: key '{key}' matches no arm of {_type_name(tp)}: " + "; ".join(errors))
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
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:  # PyYAML 1.1 reads `1e-5` (no dot) as a string
                return float(value)
            except ValueError:
                pass
        raise bad()
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad()
    if isinstance(tp, type) and issubclass(tp, PurePath):
        if isinstance(value, (str, PurePath)):
            return tp(value)  # `~` stays as given; scripts expand it where they use the path
        raise bad()
    if origin in (tuple, list, Sequence) or tp in (tuple, list):
        if isinstance(value, (str, Mapping)) or not isinstance(value, Sequence):
            raise bad()
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{source}: key '{key}' expects {len(args)} items, got {len(value)}")
            return tuple(_coerce(a, v, f"{key}[{i}]", source) for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return list(items) if (origin is list or tp is list) else tuple(items)
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
        if name in d:
            if base is not None:
                default = getattr(base, name)
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = None if f.default is dataclasses.MISSING else f.default
            sub_base = default if dataclasses.is_dataclass(default) else None
            values[name] = _coerce(hints[name], d[name], prefix + name, source, sub_base)
        elif base is None and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{source}: missing required key '{prefix}{name}'")
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


def move_keys(d: Mapping, moves: Mapping[str, str | None]) -> dict:
    """Return a deep copy of `d` with dotted keys moved: `{"actor_rollout_ref.actor.optim": "optim"}`.

    A destination of None drops the key (an explicit "we ignore this"). A source that is absent is skipped.
    Moving a mapping onto an existing mapping merges them; overwriting an existing leaf is a ValueError.
    Parents left empty by a move are removed, so only unmapped keys remain for strict validation to flag.
    """
    out = copy.deepcopy(dict(d))
    for src, dst in moves.items():
        *parents, leaf = src.split(".")
        chain, node = [], out
        for p in parents:
            if not isinstance(node.get(p), dict):
                break
            chain.append((node, p))
            node = node[p]
        else:
            if leaf not in node:
                continue
            value = node.pop(leaf)
            for parent, p in reversed(chain):  # prune parents the move emptied
                if not parent[p]:
                    del parent[p]
            if dst is not None:
                _merge_into(out, dst.split("."), value, src, dst)
    return out


def _merge_into(root: dict, path: list[str], value: Any, src: str, dst: str) -> None:
    node = root
    for p in path[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"move_keys: cannot move '{src}' to '{dst}': '{p}' is not a mapping")
    leaf = path[-1]
    if leaf not in node:
        node[leaf] = value
    elif isinstance(node[leaf], dict) and isinstance(value, dict):
        for k, v in value.items():
            _merge_into(node[leaf], [k], v, f"{src}.{k}", f"{dst}.{k}")
    else:
        raise ValueError(f"move_keys: moving '{src}' would overwrite existing '{dst}'")


def _pop_options(argv: list[str]) -> tuple[list[str], str | None, bool]:
    """Remove `--config FILE` / `--config=FILE` and `--print-config` from argv (tyro never sees them)."""
    rest, path, print_cfg, i = [], None, False, 0
    while i < len(argv):
        a = argv[i]
        if a == "--print-config":
            print_cfg = True
        elif a == "--config" or a.startswith("--config="):
            if path is not None:
                raise SystemExit("error: --config given more than once")
            if a == "--config":
                if i + 1 >= len(argv):
                    raise SystemExit("error: --config needs a YAML file path")
                i += 1
                path = argv[i]
            else:
                path = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return rest, path, print_cfg


def parse(cls: type[T], argv: list[str] | None = None, yaml_hook: Callable[[dict], dict] | None = None) -> T:
    """Parse the command line into a `cls` instance: dataclass defaults < `--config` YAML < CLI flags.

    Args:
        cls: the script's frozen dataclass tree (every field needs a default, or a value in the YAML).
        argv: arguments without the program name; None reads `sys.argv[1:]`.
        yaml_hook: maps the raw YAML mapping to ours before validation (see `move_keys`).
    Returns: the resolved config. Exits 0 after printing it if `--print-config` was given; exits
    with a one-line message on a bad YAML file.
    """
    rest, path, print_cfg = _pop_options(list(sys.argv[1:] if argv is None else argv))
    default = None
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
    doc = cls.__doc__ or ""
    doc = "" if doc.startswith(cls.__name__ + "(") else doc  # skip the signature dataclass puts there
    cfg = tyro.cli(cls, args=rest, default=default, use_underscores=True, description=f"{doc}\n\n{_OPTIONS_HELP}")
    if print_cfg:
        sys.stdout.write(to_yaml(cfg))
        sys.stdout.flush()
        raise SystemExit(0)
    return cfg
