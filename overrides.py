"""The keys a user gives, in YAML files and on the command line, and the dataclass fields they set.

1. The command line (`match`, `parse_value`): Hydra's override grammar. `key=value`, `+key=value`,
   `++key=value` (all three set the key) and `~key` / `~key=value` (back to the default); values read as
   Hydra reads them: null, true/false in any case, ints (1_000), floats (1e-6, .5, inf), quoted strings,
   `[a, 'b c']` lists, `{k: v}` dicts. An unquoted scalar stays `Unquoted` text until the field's type is known
   (config._coerce): `experiment_name=0.10` is text, `lr=1e-6` a float. A top-level comma is a Hydra sweep
   (it needs --multirun), so it is an error, as in Hydra.
2. Merging (`merge_into`): YAML files and then the overrides go into one ordered dict of dotted keys as Hydra
   merges configs: a value replaces what lay under its key, a mapping merges key by key, the latest wins.
3. Translation (`translate`): each key, verl's name or flatrl's, is looked up (`lookup`) in the table of the
   script's verl entry point (verl_keys.py, which says what each rule does), then as a flatrl field, then as a
   plain prefix move (`actor_rollout_ref.actor.X` -> `actor.X`); anything else is an error naming it. Two
   pairs are read together: `trainer.n_gpus_per_node` x `trainer.nnodes` is checked against the launched world
   size (WORLD_SIZE), and `trainer.resume_mode=resume_path` with `trainer.resume_from_path=P` becomes
   `trainer.resume_mode=P`. With a verl table, a null for a field that cannot be None is verl's "unset":
   flatrl's default applies. OmegaConf interpolations (`${a.b}`, `${oc.select:a.b,default}`,
   `${oc.env:NAME}`, `${.sibling}`) are resolved against the keys given, then flatrl's defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

import verl_keys

# ------------------------------------------------------------------------------- values from the CLI


class Unquoted(str):
    """An unquoted command-line value: its text, and `value`, what Hydra reads it as (None, a bool, an int,
    a float, or the text itself). The field's type decides which one a config gets (`typed`)."""

    value: Any

    def __new__(cls, text: str) -> Unquoted:
        obj = super().__new__(cls, text)
        obj.value = _primitive(text)
        return obj

    def typed(self, tp: Any) -> Any:
        """The text for a str / Path field (or a Literal choice it spells), else Hydra's reading."""
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Annotated:
            return self.typed(args[0])
        text = str.__str__(self)  # a plain str, so YAML dumps and equality behave
        if origin in (typing.Union, types.UnionType):
            if self.value is None and type(None) in args:
                return None
            return text if str in args else self.value
        if tp is str or (isinstance(tp, type) and issubclass(tp, PurePath)):
            return text
        if origin is typing.Literal and text in args:
            return text
        return self.value


_UINT = r"(?:0|[1-9](?:_?[0-9])*)"  # Hydra's INT without a sign: no leading zeros, `_` between digits
_DIGITS = r"[0-9](?:_?[0-9])*"
_INT = re.compile(rf"[+-]?{_UINT}")
_FLOAT = re.compile(
    rf"[+-]?(?:(?:{_UINT}?\.{_DIGITS}|{_UINT}\.)(?:[eE][+-]?{_DIGITS})?|{_UINT}[eE][+-]?{_DIGITS}|inf|nan)",
    re.IGNORECASE,
)


def _primitive(text: str) -> Any:
    """Hydra's reading of an unquoted primitive: null, true/false (any case), int (1_000 too), float (1e-6,
    .5, inf, nan), else the text."""
    low = text.lower()
    if low == "null":
        return None
    if low in ("true", "false"):
        return low == "true"
    if _INT.fullmatch(text):
        return int(text.replace("_", ""))
    if _FLOAT.fullmatch(text):
        return float(text.replace("_", ""))
    return text


class _ValueParser:
    """Recursive descent over Hydra's value grammar: element = primitive | quoted | [list] | {dict}."""

    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"cannot read value {self.text!r} at character {self.pos + 1}: {what}")

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def element(self, stops: str) -> Any:
        self.skip_ws()
        c = self.text[self.pos] if self.pos < len(self.text) else ""
        if c == "[":
            return self.container("]", stops, keyed=False)
        if c == "{":
            return self.container("}", stops, keyed=True)
        if c in ("'", '"'):
            return self.quoted(c, stops)
        return self.unquoted(stops)

    def quoted(self, quote: str, stops: str) -> str:
        self.pos += 1
        out = []
        while self.pos < len(self.text) and self.text[self.pos] != quote:
            # Hydra's escapes: only backslashes before a quote pair up (2n: n of them, then the closing quote;
            # 2n + 1: n and a literal quote); every other backslash is kept, so a regex's `\.` arrives as written.
            run = 0  # backslashes from here
            while self.text.startswith("\\", self.pos + run):
                run += 1
            if run and self.text.startswith(quote, self.pos + run):
                out.append("\\" * (run // 2) + quote * (run % 2))
                self.pos += run + run % 2
                continue
            out.append(self.text[self.pos : self.pos + max(run, 1)])
            self.pos += max(run, 1)
        if self.pos >= len(self.text):
            raise self.error(f"no closing {quote}")
        self.pos += 1
        self.skip_ws()
        if self.pos < len(self.text) and self.text[self.pos] not in stops:
            raise self.error("text after a quoted string")
        return "".join(out)

    def unquoted(self, stops: str) -> Unquoted:
        start, depth = self.pos, 0
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if self.text.startswith("${", self.pos):
                depth += 1
                self.pos += 1
            elif c == "}" and depth:
                depth -= 1
            elif depth == 0 and (c in stops or c in "[{"):
                break
            elif c == "(" and depth == 0:
                raise self.error("Hydra functions (choice(), range(), int(), ...) are not supported")
            self.pos += 1
        text = self.text[start : self.pos].strip()
        if depth == 0 and self.pos < len(self.text) and self.text[self.pos] in "[{":
            raise self.error("a bracket inside an unquoted value; quote it")
        return Unquoted(text)

    def container(self, close: str, stops: str, keyed: bool) -> list | dict:
        self.pos += 1
        items: list = []
        pairs: dict = {}
        self.skip_ws()
        if self.text.startswith(close, self.pos):
            self.pos += 1
            return pairs if keyed else items
        while True:
            if keyed:
                colon = self.text.find(":", self.pos)
                if colon < 0:
                    raise self.error("a dict entry needs 'key: value'")
                k = self.text[self.pos : colon].strip().strip("'\"")
                self.pos = colon + 1
                pairs[k] = self.element("," + close)
            else:
                items.append(self.element("," + close))
            self.skip_ws()
            c = self.text[self.pos] if self.pos < len(self.text) else ""
            self.pos += 1
            if c == close:
                break
            if c != ",":
                raise self.error(f"expected ',' or {close!r}")
        self.skip_ws()
        if self.pos < len(self.text) and self.text[self.pos] not in stops:
            raise self.error(f"text after {close!r}")
        return pairs if keyed else items


def parse_value(text: str) -> Any:
    """A command-line override's value as Hydra reads it: `null`, `True`, `1_000`, `1e-6`, `'quoted'`,
    `[a, 'b c', 3]`, `{k: v}`; unquoted scalars come back as `Unquoted` (see `plain`). A top-level comma is a
    Hydra sweep (which needs --multirun), so it is an error, as in Hydra."""
    p = _ValueParser(text)
    value = p.element(",")
    if p.pos < len(text):
        raise ValueError(
            f"value {text!r} has a comma outside brackets (a Hydra sweep, which needs --multirun): write a "
            "list as [a,b] or quote the text"
        )
    return value


def plain(value: Any) -> Any:
    """`value` with every `Unquoted` replaced by Hydra's reading of it (lists and dicts walked)."""
    if isinstance(value, Unquoted):
        return value.value
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------------------- merging


_OVERRIDE = re.compile(
    r"(?P<op>~|\+\+|\+)?(?P<key>[A-Za-z_][\w-]*(?:\.[\w-]+)*)(?:(?P<eq>=)(?P<value>.*))?", re.S
)


def match(token: str) -> re.Match | None:
    """The match of a Hydra override (`key=value`, `+key=value`, `++key=value`, `~key`, `~key=value`), or None
    for a token that is not one (a tyro flag or its value)."""
    m = _OVERRIDE.fullmatch(token)
    if m is None or (m["op"] != "~" and m["eq"] is None):
        return None
    return m


def flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; empty mappings stay as leaves."""
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def unflatten(flat: Mapping[str, Any]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _under(key: str, root: str) -> bool:
    return key == root or key.startswith(root + ".")


def merge_into(entries: dict[str, tuple[Any, str]], key: str, value: Any, origin: str) -> None:
    """Hydra's merge of one value: it replaces the key, whatever lay under it, and a scalar above it; a
    non-empty mapping merges leaf by leaf. The key moves to the end (the latest setting wins later).
    A text value and the keys under the same name live side by side: that is Hydra's choice of a config group
    and the overrides of its keys (verl's `engine=fsdp engine.strategy=fsdp2`), read each by its own rule."""
    choice = isinstance(plain(value), str)
    for old in [k for k in entries if _under(k, key) or _under(key, k)]:
        group_keys_stay = choice and old != key and _under(old, key)
        group_choice_stays = old != key and _under(key, old) and isinstance(plain(entries[old][0]), str)
        if not (group_keys_stay or group_choice_stays):
            del entries[old]
    items = flatten(value, key + ".") if isinstance(value, Mapping) and value else {key: value}
    for k, v in items.items():
        entries[k] = (v, origin)


# ---------------------------------------------------------------------------------- the dataclass tree


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def field_type(cls: type, key: str) -> Any | None:
    """The type of dotted field `key` in dataclass tree `cls`, or None if there is no such field. Under a
    `dict[str, V]` field any name is a key of V (custom_reward_function.reward_kwargs.alpha)."""
    tp: Any = cls
    parts = key.split(".")
    for i, part in enumerate(parts):
        if typing.get_origin(tp) is dict:
            value = typing.get_args(tp)[1] if typing.get_args(tp) else Any
            return value if i == len(parts) - 1 or value is Any else None  # Any: nested mappings too
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            return None
        names = {f.name for f in dataclasses.fields(tp) if f.init}
        if part not in names:
            return None
        tp = _hints(tp)[part]
    return tp


def _optional(tp: Any) -> bool:
    return type(None) in typing.get_args(tp) or tp is Any


def _fields_under(cls: type, key: str) -> list[str] | None:
    """Field names of the section at dotted `key` ("" for the top), or None if it is not a section."""
    tp = cls if not key else field_type(cls, key)
    if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
        return None
    return [f.name for f in dataclasses.fields(tp) if f.init]


def _default(cls: type, key: str) -> Any:
    value: Any = cls()
    for part in key.split("."):
        value = getattr(value, part)
    return value


def table_for(cls: type) -> tuple[dict[str, verl_keys.Rule], dict[str, str]]:
    """The rules and prefix moves for a script's config: fsdp_sft_trainer's for a tree with
    model.partial_pretrain (sft.py), main_ppo's for one with actor and rollout (grpo.py; ppo.py has a critic)."""
    if field_type(cls, "model.partial_pretrain") is not None:
        return verl_keys.SFT, {}
    if field_type(cls, "actor") is not None and field_type(cls, "rollout") is not None:
        return verl_keys.RL | (
            verl_keys.PPO if field_type(cls, "critic") is not None else verl_keys.GRPO
        ), verl_keys.RL_PREFIXES
    return {}, {}


def _rule(key: str, table: Mapping[str, verl_keys.Rule]) -> verl_keys.Rule | None:
    """The table's rule for `key`: its own entry, else the longest `prefix.*` entry above it."""
    if key in table:
        return table[key]
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        rule = table.get(".".join(parts[:n]) + ".*")
        if rule is not None:
            return rule
    return None


def _moved(key: str, prefixes: Mapping[str, str]) -> str:
    for src, dst in prefixes.items():
        if key.startswith(src):
            return dst + key[len(src) :]
    return key


def _lookup(key: str, cls: type) -> verl_keys.Rule | None:
    """The rule for user key `key`: the table's own entry, a flatrl field, a prefix move onto one, or the
    table's `prefix.*` entry above it (None: unknown)."""
    table, prefixes = table_for(cls)
    if key in table:
        return table[key]
    if table and key.rsplit(".", 1)[-1] == "_target_":
        return verl_keys.HYDRA_TARGET
    if field_type(cls, key) is not None:
        return verl_keys.Map(key)
    moved = _moved(key, prefixes)
    if moved != key and field_type(cls, moved) is not None:
        return verl_keys.Map(moved)
    return _rule(key, table)


def targets(key: str, cls: type) -> list[str]:
    """The flatrl fields a user key sets (strong and weak), [] for an ignored key; ValueError if unknown."""
    rule = _lookup(key, cls)
    if rule is None:
        raise ValueError(_unknown(key, cls, table_for(cls)[0]))
    if isinstance(rule, verl_keys.Map):
        return [t for t in (*rule.to, *rule.weak) if field_type(cls, t) is not None]
    return []


def same_target(a: str, b: str, cls: type) -> bool:
    """Whether user key `a` is `b`, lies under it, or sets a field `b` sets or one under it (for `~b`)."""
    if a == b or a.startswith(b + "."):
        return True
    tb = targets(b, cls)
    try:
        ta = targets(a, cls)
    except ValueError:
        return False
    return any(x == y or x.startswith(y + ".") for x in ta for y in tb)


def _unknown(key: str, cls: type, table: Mapping[str, verl_keys.Rule]) -> str:
    parts = key.split(".")
    for n in range(len(parts) - 1, -1, -1):
        names = _fields_under(cls, ".".join(parts[:n]))
        if names is not None and (n > 0 or not table):
            return f"unknown key '{key}' (known: {', '.join(names)})"
    known = [k.removesuffix(".*") for k in table] + _all_fields(cls)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    maybe = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown key '{key}': neither a flatrl key nor a verl key flatrl knows (docs/VERL.md){maybe}"


def _all_fields(cls: type, prefix: str = "") -> list[str]:
    out = []
    for name in _fields_under(cls, prefix.rstrip(".")) or []:
        key = prefix + name
        out += _all_fields(cls, key + ".") if _fields_under(cls, key) is not None else [key]
    return out


# ------------------------------------------------------------------------------------- translation


def _text(value: Any) -> str:
    """A value as a note shows it: strings bare, the rest as JSON (null, true, [..])."""
    if isinstance(value, str):
        return str.__str__(value)
    return json.dumps(plain(value))


def _same(a: Any, b: Any) -> bool:
    """Equality where a bool never equals a number, and NaN equals NaN (one value written twice)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b or (a != a and b != b)


_INTERP = re.compile(r"\$\{([^${}]*)\}")


@dataclass
class Result:
    """What `translate` made of the keys: flatrl values by dotted field, and what to say."""

    values: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    hints: dict[str, str] = field(default_factory=dict)

    def origin(self, key: str) -> str:
        """Where the value of dotted field `key` (or the nearest section around it) came from."""
        key = re.sub(r"\[\d+\]", "", key)
        parts = key.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in self.origins:
                return self.origins[".".join(parts[:n])]
        under = [o for k, o in self.origins.items() if k.startswith(key + ".")]
        return under[0] if under else "<config>"

    def note(self, line: str) -> None:
        if line not in self.notes:
            self.notes.append(line)


@dataclass
class _Write:
    key: str
    value: Any
    origin: str
    weak: bool


def translate(entries: Mapping[str, tuple[Any, str]], cls: type, printing: bool = False) -> Result:
    """flatrl field values for the keys a user gave, by the rules of `table_for(cls)` (module docstring).

    Args:
        entries: dotted key as written (verl's or flatrl's) -> (value, origin), Hydra-merged, latest last.
        cls: the script's config class.
        printing: --print-config: a world-size mismatch is a note, not an error.
    Returns: a Result (values to validate, their origins, the notes for stderr, hints for errors).
    Raises: ValueError naming the origin and key of an unknown key, or of a value that cannot be honoured.
    """
    table, prefixes = table_for(cls)
    out = Result(hints={k: v for k, v in verl_keys.HINTS.items() if field_type(cls, k) is not None})
    entries = dict(entries)
    if table:
        _pairs(entries, out, printing)
    writes: list[_Write] = []
    resolved: dict[str, Any] = {}

    def lookup(ref: str, key: str, default: str | None, depth: int) -> Any:
        """The value a `${ref}` in `key`'s value stands for."""
        if ref.startswith("."):  # relative: `.x` is a sibling of key, `..x` one level up
            dots = len(ref) - len(ref.lstrip("."))
            ref = ".".join(key.split(".")[:-dots] + [ref[dots:]])
        if ref in entries:
            return resolve(ref, entries[ref][0], depth + 1)
        try:
            fields = targets(ref, cls)
        except ValueError:
            fields = []
        for f in fields:
            if f in resolved:
                return resolved[f]
        if fields:
            return _default(cls, fields[0])
        if default is not None:
            return plain(parse_value(default))
        raise ValueError(
            f"{entries[key][1]}: {key}: ${{{ref}}} names a key that is neither given nor flatrl's"
        )

    def resolve(key: str, value: Any, depth: int = 0) -> Any:
        if not isinstance(value, str) or "${" not in value:
            return value
        if depth > 8:
            raise ValueError(f"{entries[key][1]}: {key}: interpolations nest too deep (a loop?)")

        def one(expr: str) -> Any:
            name, _, arg = expr.partition(":")
            if not arg:
                return lookup(expr, key, None, depth)
            ref, _, default = arg.partition(",")
            if name == "oc.env":
                if ref in os.environ or default:
                    return os.environ.get(ref, default)
                raise ValueError(f"{entries[key][1]}: {key}: environment variable {ref} is not set")
            if name == "oc.select":
                return lookup(ref, key, default or "null", depth)
            raise ValueError(
                f"{entries[key][1]}: {key}: the resolver '{name}:' in {value!r} is not supported; write the value"
            )

        whole = _INTERP.fullmatch(value.strip())
        if whole:
            return one(whole[1])
        return _INTERP.sub(lambda m: _text(one(m[1])), value)

    def take(key: str, value: Any, origin: str) -> None:
        """Apply `key`'s rule to its value (interpolations resolved), adding writes and notes."""
        rule = _lookup(key, cls)
        if rule is None:
            raise ValueError(f"{origin}: {_unknown(key, cls, table)}")
        if isinstance(rule, verl_keys.Ignore):
            out.note(f"ignored: {key}={_text(value)} ({rule.why})")
            return
        value = resolve(key, value)
        if isinstance(rule, verl_keys.Only):
            if any(_same(plain(value), v) for v in rule.values):
                out.note(f"ignored: {key}={_text(value)} ({rule.why})")
                return
            raise ValueError(f"{origin}: {key}={_text(value)} cannot be honoured: {rule.why}")
        if isinstance(rule, verl_keys.Pair):
            raise ValueError(f"{origin}: {key}: {rule.why}")  # _pairs takes these out first
        strong = [t for t in rule.to if field_type(cls, t) is not None]
        weak = [t for t in rule.weak if field_type(cls, t) is not None]
        unset = (
            plain(value) is None or plain(value) == "???"
        )  # OmegaConf's MISSING, as in `rollout.name: ???`
        if table and unset and not all(_optional(field_type(cls, t)) for t in strong + weak):
            out.note(f"ignored: {key}={_text(value)} (verl's 'unset': flatrl's default applies)")
            return
        if rule.convert is not None:
            try:
                value = rule.convert(plain(value))
            except ValueError as e:
                raise ValueError(f"{origin}: {key}={_text(value)}: {e}") from None
        if not strong + weak:
            raise ValueError(
                f"{origin}: {key}: none of its flatrl fields {rule.to + rule.weak} is in this script"
            )
        if strong + weak not in ([_moved(key, prefixes)], [key]):
            why = f" ({rule.why})" if rule.why else ""
            out.note(f"mapped: {key} -> {', '.join(strong + weak)}{why}")
        writes.extend(_Write(t, value, origin, weak=False) for t in strong)
        writes.extend(_Write(t, value, origin, weak=True) for t in weak)

    later = []
    for key, (value, origin) in entries.items():
        if isinstance(value, str) and "${" in value and not isinstance(_lookup(key, cls), verl_keys.Ignore):
            later.append((key, value, origin))  # after the plain values, which interpolations may name
            continue
        take(key, value, origin)
    resolved.update(_settle(writes, out))
    for key, value, origin in later:
        take(key, value, origin)
    out.values = _settle(writes, out)
    return out


def _settle(writes: list[_Write], out: Result) -> dict[str, Any]:
    """One value per field: the latest strong write (two from one file that disagree are an error), else the
    latest weak one."""
    values: dict[str, Any] = {}
    by_field: dict[str, list[_Write]] = {}
    for w in writes:
        by_field.setdefault(w.key, []).append(w)
    for key, ws in by_field.items():
        strong = [w for w in ws if not w.weak]
        chosen = (strong or ws)[-1]
        clash = [
            w for w in strong if w.origin == chosen.origin and not _same(plain(w.value), plain(chosen.value))
        ]
        if clash:
            raise ValueError(
                f"{chosen.origin}: two keys set {key} to different values ({_text(clash[0].value)} and "
                f"{_text(chosen.value)}); keep one"
            )
        values[key] = chosen.value
        out.origins[key] = chosen.origin
    return values


def _pairs(entries: dict[str, tuple[Any, str]], out: Result, printing: bool) -> None:
    """Takes out and reads the keys that go together: the world size, verl's resume_path mode, and verl 0.7's
    rollout_correction.rollout_is (with its threshold, whose default 2.0 is verl's)."""
    nodes = entries.pop("trainer.nnodes", None)
    gpus = entries.pop("trainer.n_gpus_per_node", None)
    if nodes is not None or gpus is not None:
        n_nodes = plain(nodes[0]) if nodes else 1  # verl's defaults for the one not given
        n_gpus = plain(gpus[0]) if gpus else 8
        origin = (gpus or nodes)[1]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (n_nodes, n_gpus)):
            raise ValueError(f"{origin}: trainer.nnodes / trainer.n_gpus_per_node must be positive integers")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        launched = (
            f"WORLD_SIZE={os.environ['WORLD_SIZE']}"
            if "WORLD_SIZE" in os.environ
            else "one process (WORLD_SIZE unset)"
        )
        out.note(
            f"ignored: trainer.n_gpus_per_node={n_gpus}, trainer.nnodes={n_nodes} (torchrun sets the ranks; "
            f"checked against WORLD_SIZE)"
        )
        if n_nodes * n_gpus != world:
            msg = (
                f"{origin}: trainer.n_gpus_per_node={n_gpus} x trainer.nnodes={n_nodes} = {n_nodes * n_gpus} ranks, "
                f"but this was launched as {launched}: launch with torchrun --nnodes {n_nodes} --nproc_per_node "
                f"{n_gpus} (or drop the two keys)"
            )
            if not printing:
                raise ValueError(msg)
            out.note(f"note: {msg}")
    _rollout_correction(entries, out)
    mode = entries.get("trainer.resume_mode")
    path = entries.pop("trainer.resume_from_path", None)
    if mode is not None and plain(mode[0]) == "resume_path":
        if path is None or plain(path[0]) is None:
            raise ValueError(f"{mode[1]}: trainer.resume_mode=resume_path needs trainer.resume_from_path")
        entries["trainer.resume_mode"] = path
        out.note("mapped: trainer.resume_mode=resume_path, trainer.resume_from_path -> trainer.resume_mode")
    elif path is not None:
        out.note(
            f"ignored: trainer.resume_from_path={_text(path[0])} (read only with trainer.resume_mode=resume_path)"
        )


def _rollout_correction(entries: dict[str, tuple[Any, str]], out: Result) -> None:
    """verl 0.7+'s algorithm.rollout_correction.rollout_is=token (truncated IS, TIS) becomes verl 0.6's
    algorithm.rollout_is + rollout_is_threshold (+ rollout_is_batch_normalize), and rollout_rs with its threshold
    algorithm.rollout_rs + rollout_rs_threshold, and bypass_mode with loss_type (or verl 0.6's use_policy_gradient,
    reinforce when true) algorithm.rollout_bypass + rollout_loss_type, which each script's table then honours
    (grpo.py) or refuses (ppo.py); a threshold or loss type alone, set in every verl trainer config, is read only
    with its mode."""
    level = entries.pop("algorithm.rollout_correction.rollout_is", None)
    threshold = entries.pop("algorithm.rollout_correction.rollout_is_threshold", None)
    normalize = entries.pop("algorithm.rollout_correction.rollout_is_batch_normalize", None)
    rs = entries.pop("algorithm.rollout_correction.rollout_rs", None)
    rs_threshold = entries.pop("algorithm.rollout_correction.rollout_rs_threshold", None)
    bypass = entries.pop("algorithm.rollout_correction.bypass_mode", None)
    loss_type = entries.pop("algorithm.rollout_correction.loss_type", None)
    use_pg = entries.pop("algorithm.rollout_correction.use_policy_gradient", None)
    needs_logprobs = None
    if bypass is None or plain(bypass[0]) in (None, False):
        for key, given, default in (
            ("loss_type", loss_type, "ppo_clip"),
            ("use_policy_gradient", use_pg, False),
        ):
            if given is not None and plain(given[0]) not in (None, default):
                out.note(
                    f"ignored: algorithm.rollout_correction.{key}={_text(given[0])} (read only with "
                    "algorithm.rollout_correction.bypass_mode=true)"
                )
    else:
        entries["algorithm.rollout_bypass"] = bypass
        kind = plain(loss_type[0]) if loss_type is not None and plain(loss_type[0]) is not None else None
        if use_pg is not None and plain(use_pg[0]) not in (None, False):  # verl 0.6's name for reinforce
            if kind not in (None, "reinforce"):
                raise ValueError(
                    f"{use_pg[1]}: algorithm.rollout_correction.use_policy_gradient={_text(use_pg[0])} (verl 0.6's "
                    f"loss_type=reinforce) contradicts algorithm.rollout_correction.loss_type={kind}"
                )
            kind = "reinforce"
        if kind is not None:
            entries["algorithm.rollout_loss_type"] = (kind, (loss_type or use_pg)[1])
        out.note(
            "mapped: algorithm.rollout_correction.bypass_mode, loss_type -> algorithm.rollout_bypass, "
            "algorithm.rollout_loss_type"
            + (" (use_policy_gradient=true: reinforce)" if use_pg is not None and plain(use_pg[0]) else "")
        )
        needs_logprobs = bypass[1]
    if rs is None or plain(rs[0]) is None:
        if rs_threshold is not None and plain(rs_threshold[0]) is not None:
            out.note(
                f"ignored: algorithm.rollout_correction.rollout_rs_threshold={_text(rs_threshold[0])} (read only "
                "with algorithm.rollout_correction.rollout_rs)"
            )
    else:
        entries["algorithm.rollout_rs"] = (str(plain(rs[0])), rs[1])
        if rs_threshold is not None and plain(rs_threshold[0]) is not None:
            entries["algorithm.rollout_rs_threshold"] = (str(plain(rs_threshold[0])), rs_threshold[1])
        out.note(
            "mapped: algorithm.rollout_correction.rollout_rs, rollout_rs_threshold -> algorithm.rollout_rs, "
            "algorithm.rollout_rs_threshold"
        )
        needs_logprobs = rs[1]
    if level is None or plain(level[0]) is None:
        for key, given in (("rollout_is_threshold", threshold), ("rollout_is_batch_normalize", normalize)):
            if given is not None and plain(given[0]) not in (None, False):
                out.note(
                    f"ignored: algorithm.rollout_correction.{key}={_text(given[0])} (read only with "
                    "algorithm.rollout_correction.rollout_is)"
                )
    else:
        if plain(level[0]) not in ("token", "sequence"):
            raise ValueError(
                f"{level[1]}: algorithm.rollout_correction.rollout_is={_text(level[0])} cannot be honoured: flatrl "
                "weighs each token or each sequence (token, sequence), truncated as TIS"
            )
        entries["algorithm.rollout_is"] = (True, level[1])
        entries["algorithm.rollout_is_level"] = (plain(level[0]), level[1])
        entries["algorithm.rollout_is_threshold"] = threshold or (2.0, level[1])
        if normalize is not None:
            entries["algorithm.rollout_is_batch_normalize"] = normalize
        out.note(
            f"mapped: algorithm.rollout_correction.rollout_is={plain(level[0])}, rollout_is_threshold -> "
            "algorithm.rollout_is, rollout_is_level, algorithm.rollout_is_threshold"
            + ("" if threshold else " (2.0, verl's default)")
            + (", rollout_is_batch_normalize" if normalize is not None else "")
        )
        needs_logprobs = level[1]
    if needs_logprobs is not None and "rollout.logprob_check_prompts" not in entries:
        entries["rollout.logprob_check_prompts"] = (-1, needs_logprobs)  # the correction reads every sample's
        out.note(
            "set: rollout.logprob_check_prompts=-1 (the rollout correction needs every sample's engine logprobs)"
        )
