"""Config parsing: one frozen dataclass tree per script; YAML files, Hydra-style overrides and tyro flags on top.

`cfg = config.parse(GRPOConfig)`; precedence is tyro flags > overrides > YAML > dataclass defaults:
1. YAML: Hydra's `--config-path DIR --config-name NAME`, then `--config FILE.yaml` (repeatable); the files
   merge in that order, as Hydra merges its configs. `YAMLLoader` reads them: a mapping block given twice is
   merged with a warning naming both lines, a scalar key given twice is an error naming both lines.
2. Hydra-style overrides anywhere in argv (`key=value`, `+key=value`, `~key`; overrides.py has the grammar)
   merge over the YAML, later over earlier.
3. Keys are flatrl's dotted field paths or verl's names: overrides.translate maps, ignores (saying why on
   stderr) or refuses each one by verl_keys.py's tables, and `from_dict` validates the result strictly; it
   becomes tyro's `default=`, so `--help` shows it and tyro flags (`--rollout.n 8`, `--save-freq 5`) win.
4. `--print-config` writes the resolved config as YAML to stdout (nothing else goes there: notes go to stderr)
   and exits 0 before the script touches data or models; loading it back with `--config` gives an equal config.

Strict: an unknown key or a wrong type raises `ConfigError` (a ValueError) naming the source and the dotted
key, e.g. `configs/x.yaml: unknown key 'optim.lrr' (known: lr, betas)`; `parse` exits with that one line.
By field type: float takes ints and numeric strings (PyYAML 1.1 reads `1e-5`, no dot, as a string); int
and bool take only real ints/bools (`yes` is an error); null only where None is allowed; Literal must be
one of its choices; tuple/list from a sequence (fixed tuples length-checked); nested dataclasses from
mappings, overlaid on the parent's default; `Path` from a string, `~` left unexpanded for the script. An
unquoted command-line value (`Unquoted`) is read by the field's type: `experiment_name=0.10` stays text.
`to_dict`/`to_yaml` save the resolved config into runs and checkpoints; `from_dict` reads it back on resume.
`TrainerConfig` holds the loop, logging and checkpoint settings every trainer shares (each script subclasses it).
"""

import argparse
import dataclasses
import importlib.util
import os
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePath
from typing import Annotated, Any, TypeVar

import tyro
import yaml

import overrides

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Range:
    """A bound on a numeric field, written next to it: `lr: Annotated[float, config.POSITIVE] = 1e-5`. `parse`
    checks every such field of the resolved config (`check_ranges`); NaN never passes, infinity only where
    `finite` is False. A field that may be None (off) is checked only when set."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is excluded
    high_open: bool = False
    finite: bool = True

    def allows(self, v: float) -> bool:
        if v != v or (self.finite and v in (float("inf"), float("-inf"))):
            return False
        above = self.low is None or (v > self.low if self.low_open else v >= self.low)
        below = self.high is None or (v < self.high if self.high_open else v <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}" + (
                "" if self.finite else " (inf allowed)"
            )
        return f"{'<' if self.high_open else '<='} {self.high:g}"


POSITIVE = Range(0, low_open=True)
"""> 0 and finite: learning rates, sizes in tokens, coefficients that must act."""
NON_NEGATIVE = Range(0)
""">= 0 and finite: weights that may be switched off with 0."""
AT_LEAST_ONE = Range(1)
"""Counts: batch sizes, epochs, steps, samples per prompt."""
FRACTION = Range(0, 1, low_open=True)
"""In (0, 1]: shares of memory, nucleus mass."""
UNIT = Range(0, 1)
"""In [0, 1]: ratios that may be 0."""
TIMEOUT = Range(0, low_open=True, finite=False)
"""> 0 seconds; inf waits forever."""


def check_ranges(cfg: Any, prefix: str = "") -> None:
    """Raises ConfigError naming the first field of `cfg` (a dataclass tree) whose value is outside its Range:
    `key=value must be <range>`."""
    hints = typing.get_type_hints(type(cfg), include_extras=True)
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            check_ranges(value, key + ".")
            continue
        bounds = [m for m in getattr(hints[f.name], "__metadata__", ()) if isinstance(m, Range)]
        numbers = value if isinstance(value, (list, tuple)) else [value]
        for b in bounds:
            for v in numbers:
                if v is not None and not isinstance(v, bool) and not b.allows(float(v)):
                    raise ConfigError(f"{key}={value!r} must be {b}", key)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Loop length, logging, checkpoints (verl's trainer.*); sft.py and rl.py extend it."""

    default_local_dir: str = "runs/run"
    """Run folder: metrics.jsonl, config.yaml, report.md, global_step_N/ checkpoints."""
    project_name: str = "flatrl"
    """Project name for tensorboard/wandb."""
    experiment_name: str = "run"
    """Run name for tensorboard/wandb."""
    total_epochs: Annotated[int, AT_LEAST_ONE] = 1
    """Passes over the training data (ignored when total_training_steps is set)."""
    total_training_steps: Annotated[int | None, AT_LEAST_ONE] = None
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
    max_ckpt_to_keep: Annotated[int | None, AT_LEAST_ONE] = None
    """Keep only this many newest checkpoints (None: all)."""
    seed: int = 0
    """Seed of the data order (sft.py) and of the trainer's RNGs."""
    timeout_s: Annotated[float, TIMEOUT] = 600.0
    """Collective timeout: a dead rank turns into an error on the others after this long."""
    max_consecutive_skips: Annotated[int, AT_LEAST_ONE] = 5
    """Optimizer steps with a NaN/inf loss or gradient norm are skipped (train/ or actor/skipped_steps); after
    this many in a row the run saves a checkpoint (the weights of the last good step) and stops with an error."""
    resume_allow_changes: tuple[str, ...] = ()
    """On resume, settings (dotted keys; commas allowed) that may differ from the checkpoint's config although
    they change what the run means (model, batch sizes, seeds, data: otherwise an error naming each);
    checkpoint.MAY_CHANGE_ON_RESUME lists those that always may (lr, steps, frequencies, logger, ...)."""
    debug: bool = False
    """Print the memory plan at the start, and each step's per-phase device memory and gradient norm, on the
    console (verl's tutorial runs `debug=true` for this)."""


_OPTIONS_HELP = (
    "--config FILE.yaml (repeatable; or --config-path DIR --config-name NAME) loads overrides; key=value, "
    "+key=value, ~key override them with flatrl's or verl's key names (docs/VERL.md); flags below win over both. "
    "--print-config prints the resolved YAML and exits."
)


class ConfigError(ValueError):
    """A config value that does not fit the dataclass tree; the message names the source and dotted key."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


Source = str | Callable[[str], str]  # a file name, or a function giving each dotted key's origin


def _where(source: Source, key: str) -> str:
    return source(key) if callable(source) else source


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # each arm: `Literal['all', 'auto'] | int`
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is typing.Literal:
        return f"one of {list(typing.get_args(tp))}"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


# ------------------------------------------------------------------------------- strict validation


def _coerce(tp: Any, value: Any, key: str, source: Source, base: Any = None) -> Any:
    """Validate `value` against type `tp`; return it converted (float from str/int, tuple from list, ...)."""
    if isinstance(value, overrides.Unquoted):
        value = value.typed(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = lambda: ConfigError(
        f"{_where(source, key)}: key '{key}' expects {_type_name(tp)}, got {type(value).__name__} {value!r}",
        key,
    )
    if origin is typing.Annotated:  # tyro.conf markers wrap the real type
        return _coerce(args[0], value, key, source, base)
    if tp is Any:  # command-line values inside read as Hydra reads them
        if isinstance(value, Mapping):
            return {k: _coerce(Any, v, f"{key}.{k}", source) for k, v in value.items()}
        if isinstance(value, list):
            return [_coerce(Any, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
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
        raise ConfigError(
            f"{_where(source, key)}: key '{key}' is null but {_type_name(tp)} is not Optional", key
        )
    if origin is typing.Literal:
        # `True == 1`, so compare types too: a bool must not pass for Literal[1].
        if any(value == c and type(value) is type(c) for c in args):
            return value
        raise ConfigError(
            f"{_where(source, key)}: key '{key}' must be one of {list(args)}, got {value!r}", key
        )
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
                raise ConfigError(
                    f"{_where(source, key)}: key '{key}' expects {len(args)} items, got {len(value)}", key
                )
            return tuple(_coerce(a, v, f"{key}[{i}]", source) for i, (a, v) in enumerate(zip(args, value)))  # noqa: B905
        items = [_coerce(args[0] if args else Any, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return items if (origin is list or tp is list) else tuple(items)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise bad()
        kt, vt = args if args else (Any, Any)
        return {_coerce(kt, k, key, source): _coerce(vt, v, f"{key}.{k}", source) for k, v in value.items()}
    raise ConfigError(f"{_where(source, key)}: key '{key}' has unsupported field type {_type_name(tp)}", key)


def _build(cls: type[T], base: T | None, d: Mapping, prefix: str, source: Source) -> T:
    """Build `cls` from mapping `d`, over `base` (an instance) if given, else over the class defaults."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for k in d:
        if k not in fields:
            key = f"{prefix}{k}"
            raise ConfigError(f"{_where(source, key)}: unknown key '{key}' (known: {', '.join(fields)})", key)
    hints = typing.get_type_hints(cls, include_extras=True)
    values = {}
    for name, f in fields.items():
        has_factory = f.default_factory is not dataclasses.MISSING
        if name not in d:
            if base is None and f.default is dataclasses.MISSING and not has_factory:
                key = prefix + name
                raise ConfigError(f"{_where(source, key)}: missing required key '{key}'", key)
            continue
        if base is not None:
            default = getattr(base, name)
        else:
            default = f.default_factory() if has_factory else f.default
        sub_base = default if dataclasses.is_dataclass(default) else None  # overlay nested sections
        values[name] = _coerce(hints[name], d[name], prefix + name, source, sub_base)
    return dataclasses.replace(base, **values) if base is not None else cls(**values)


def from_dict(cls: type[T], d: Mapping, source: Source = "<dict>") -> T:
    """Strictly build a `cls` instance from a nested mapping, over the dataclass defaults.

    Args:
        cls: the (frozen) dataclass tree.
        d: nested mapping of overrides (keys absent keep their defaults).
        source: name used in error messages (usually the YAML file path), or a function of the dotted key.
    Returns: the instance. Raises ConfigError naming the source and the dotted key on any mismatch.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"{_where(source, '')}: top level must be a mapping, got {type(d).__name__}")
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


# ------------------------------------------------------------------------------------ YAML files


def say(line: str) -> None:
    """One line on stderr, from rank 0 only (torchrun starts every rank with the same argv)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


class YAMLLoader(yaml.SafeLoader):
    """yaml.SafeLoader that never loses a repeated key (PyYAML keeps the last one without a word).

    A mapping block given twice at the same level (two `trainer:` blocks) is merged, the later block's keys
    after the earlier's, with a warning on stderr naming both lines; a key whose value is not a mapping
    given twice is a ConfigError naming the file, the key and both lines. `<<` merge keys work as in YAML.
    """

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            self._merge_repeats(node)
        return super().construct_mapping(node, deep=deep)

    def _merge_repeats(self, node: yaml.MappingNode) -> None:
        first: dict[tuple[str, str], int] = {}
        pairs: list[tuple[yaml.Node, yaml.Node]] = []
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                pairs.append((key_node, value_node))
                continue
            ident = (key_node.tag, key_node.value)
            if ident not in first:
                first[ident] = len(pairs)
                pairs.append((key_node, value_node))
                continue
            old_key, old_value = pairs[first[ident]]
            where = f"{key_node.start_mark.name}: '{key_node.value}'"
            lines = f"lines {old_key.start_mark.line + 1} and {key_node.start_mark.line + 1}"
            if isinstance(old_value, yaml.MappingNode) and isinstance(value_node, yaml.MappingNode):
                say(f"warning: {where} is given on {lines}; merged the two blocks")
                merged = yaml.MappingNode(
                    old_value.tag, old_value.value + value_node.value, old_value.start_mark
                )
                pairs[first[ident]] = (old_key, merged)
            else:
                raise ConfigError(f"{where} is set twice, on {lines}; keep one", key_node.value)
        node.value = pairs


def load_yaml(path: str) -> dict:
    """The mapping in YAML file `path` (read with YAMLLoader; an empty file is {})."""
    with open(path) as f:
        # yaml.load(f, YAMLLoader) spelled out: as safe, and test_untrusted's scan refuses yaml.load on sight.
        loader = YAMLLoader(f)
        try:
            raw = loader.get_single_data()
        finally:
            loader.dispose()
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    return raw


# ----------------------------------------------------------------------------------- the command line


def _yaml_files(opts: argparse.Namespace) -> list[str]:
    """Hydra's primary config (--config-path DIR --config-name NAME), then each --config file in order.

    A relative DIR is taken from the working directory; where the file is not there, from verl's trainer folder
    when verl is installed, as Hydra reads verl's `--config-path=config` (relative to verl/trainer/main_ppo.py),
    so verl's own trainer configs load by name. The package is located, never imported."""
    files = list(opts.config)
    if opts.config_name is not None:
        name = (
            opts.config_name if opts.config_name.endswith((".yaml", ".yml")) else opts.config_name + ".yaml"
        )
        if "megatron" in Path(name).stem:
            raise ConfigError(
                f"--config-name {opts.config_name}: flatrl shards with FSDP2 only, so verl's Megatron trainer "
                "configs do not apply; use --config-name ppo_trainer (verl's FSDP config) or drop the option"
            )
        path = Path(opts.config_path or ".") / name
        if not path.is_file() and not path.is_absolute():
            spec = importlib.util.find_spec("verl")
            verl_dir = Path(spec.submodule_search_locations[0]) / "trainer" if spec and spec.origin else None
            if verl_dir is not None and (verl_dir / path).is_file():
                path = verl_dir / path
            else:
                where = (
                    f", nor in verl's {verl_dir}"
                    if verl_dir
                    else " (verl's examples mean verl/trainer/config of an installed verl)"
                )
                raise ConfigError(
                    f"--config-path {opts.config_path or '.'} --config-name {opts.config_name}: {path} is not in "
                    f"the working directory{where}; pass the folder that holds it, or drop both options (flatrl's "
                    "defaults follow verl's)"
                )
        files.insert(0, str(path))
    elif opts.config_path is not None:
        raise ConfigError("--config-path needs --config-name (the YAML file in that folder)")
    return files


_TRUE, _FALSE = {"true", "yes", "on"}, {"false", "no", "off"}


def bool_flags(cls: type, args: list[str]) -> list[str]:
    """tyro's bool flags take no value (`--rollout.engine_process`, `--rollout.no_engine_process`); `args` with
    each `--KEY true|false` or `--KEY=true|false` of a bool field of `cls` (any case, yes/no, on/off) written that
    way, so the command lines of argparse and Hydra habits parse. Any other token is left to tyro."""
    out, i = [], 0
    while i < len(args):
        token = args[i]
        name, eq, value = token.partition("=")
        key = name[2:].replace("-", "_") if name.startswith("--") else ""
        tp = overrides.field_type(cls, key) if key else None
        if typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
        if tp is bool and not eq and i + 1 < len(args) and args[i + 1].lower() in _TRUE | _FALSE:
            value, i = args[i + 1], i + 1
        if tp is bool and value.lower() in _TRUE | _FALSE:
            head, _, leaf = key.rpartition(".")
            token = f"--{key}" if value.lower() in _TRUE else f"--{head + '.' if head else ''}no_{leaf}"
        out.append(token)
        i += 1
    return out


def parse(cls: type[T], argv: list[str] | None = None) -> T:
    """Parse the command line into a `cls` instance: dataclass defaults < YAML < overrides < tyro flags.

    Args:
        cls: the script's frozen dataclass tree (every field needs a default, or a value in the YAML).
        argv: arguments without the program name; None reads `sys.argv[1:]`.
    Returns: the resolved config. Exits 0 after printing it if `--print-config` was given; exits
    with a one-line message on a bad file, key or value.
    """
    # Our options are taken out before tyro sees argv; allow_abbrev=False so `--conf` is not eaten.
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", action="append", default=[])
    pre.add_argument("--config-path", "--config_path", "-cp", dest="config_path", default=None)
    pre.add_argument("--config-name", "--config_name", "-cn", dest="config_name", default=None)
    pre.add_argument("--print-config", action="store_true")
    opts, rest = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    for i, t in enumerate(rest):  # tyro would print a box of "Unrecognized options" with the blank in it
        if not t.strip() and not (i and rest[i - 1].startswith("--")):
            after = f" after {rest[i - 1]!r}" if i else ""
            raise SystemExit(
                f"error: command line argument {t!r}{after} is blank: in a shell script, a backslash before a "
                "space and a comment (`\\  # ...`) passes one and ends the command there; remove the comment"
            )
    given = [m for m in map(overrides.match, rest) if m is not None]
    tyro_args = bool_flags(cls, [t for t in rest if overrides.match(t) is None])
    entries: dict[str, tuple[Any, str]] = {}  # dotted key as the user wrote it -> (value, origin)
    default = None
    try:
        for path in _yaml_files(opts):
            for key, value in overrides.flatten(load_yaml(path)).items():
                overrides.merge_into(entries, key, value, path)
        for m in given:
            key, text = m["key"], m["value"]
            if m["op"] != "~":
                overrides.merge_into(
                    entries, key, overrides.parse_value(text), f"command line '{m.group(0)}'"
                )
                continue
            gone = [k for k in entries if overrides.same_target(k, key, cls)]
            now = overrides.plain(entries[gone[-1]][0]) if gone else None
            if text is not None and gone and overrides.plain(overrides.parse_value(text)) != now:
                raise ConfigError(
                    f"command line '{m.group(0)}': {gone[-1]} is {entries[gone[-1]][0]!r}, not {text}"
                )
            for k in gone:
                del entries[k]
        if entries:
            result = overrides.translate(entries, cls, printing=opts.print_config)
            for line in result.notes:
                say(line)
            try:
                default = from_dict(cls, overrides.unflatten(result.values), source=result.origin)
            except ConfigError as e:
                hint = result.hints.get(e.key or "")
                raise ConfigError(f"{e} ({hint})" if hint else str(e), e.key) from None
    except (OSError, yaml.YAMLError, ValueError) as e:
        raise SystemExit("error: " + " ".join(str(e).split())) from None  # one line (PyYAML's span several)
    doc = "" if (cls.__doc__ or "").startswith(cls.__name__ + "(") else cls.__doc__  # dataclass's stand-in
    cfg = tyro.cli(
        cls, args=tyro_args, default=default, use_underscores=True, description=f"{doc}\n\n{_OPTIONS_HELP}"
    )
    try:
        check_ranges(cfg)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    if opts.print_config:
        sys.stdout.write(to_yaml(cfg))
        sys.stdout.flush()
        raise SystemExit(0)
    return cfg
