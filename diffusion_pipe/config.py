"""Typed, frozen params: `params.yaml` sections load into dataclasses, and bad input names its key.

Every section of `params.yaml` is a frozen dataclass. Loading is strict: an unknown key is an error that
names the closest valid key, a wrong type names the key, the value and the expected type. YAML is read as
YAML 1.2 (ruamel), so `1e-4` is a number, as DVC reads it too.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from diffusion_pipe.errors import UserError

T = TypeVar("T")


class ConfigError(UserError):
    """A param is missing, unknown or of the wrong type; the message names it and says how to fix it."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric param may take: `lo` to `hi` (None: unbounded), each end closed unless marked open.

    A params class lists one per numeric field in its `RANGES` class variable; `from_dict` checks them (every item
    of a tuple field) at load, before the class's own checks, so a bad value fails at once with the key's name
    instead of minutes later inside training.
    """

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: float) -> bool:
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return False
        return not (self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi)))

    def __str__(self) -> str:
        lo = "(-inf" if self.lo is None else ("(" if self.lo_open else "[") + f"{self.lo:g}"
        hi = "inf)" if self.hi is None else f"{self.hi:g}" + (")" if self.hi_open else "]")
        return f"{lo}, {hi}"


def _check_range(rule: Range, value: Any, where: str) -> None:
    items = value if isinstance(value, tuple) else (value,)
    for i, v in enumerate(items):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v not in rule:
            at = f"{where}[{i}]" if isinstance(value, tuple) else where
            raise ConfigError(f"{at}: {v:g} is out of range {rule}")


def load_yaml(path: str | Path) -> Any:
    """Read a YAML 1.2 document into plain Python objects (dict, list, str, int, float, bool, None)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found")
    yaml = YAML(typ="safe", pure=True)
    try:
        with path.open("r", encoding="utf-8") as fh:
            data = yaml.load(fh)
    except YAMLError as exc:  # a syntax error or a key written twice: where, and what the parser saw
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}; fix the file and run again") from None
    return {} if data is None else data


def _closest(name: str, options: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(options))}"


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return f"mapping ({tp.__name__})"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; convert lists to tuples and mappings to dataclasses."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(
            f"{where}: got {value!r}, expected {' or '.join(_type_name(a) for a in args)}"
        )
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{where}: got {value!r}, expected one of {_type_name(tp)}")
        return value
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: got {value!r}, expected a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{where}: got {value!r}, expected a list of {len(args)} items")
        return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: got {value!r}, expected bool (true or false)")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: got {value!r}, expected int")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: got {value!r}, expected float (a number such as 1.0e-4)")
        if not math.isfinite(value):  # YAML's .nan and .inf: no param means either
            raise ConfigError(f"{where}: got {value!r}, expected a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: got {value!r}, expected str")
        return value
    raise TypeError(f"{where}: unsupported annotation {tp!r}")  # a bug in a params class, not user input


def from_dict(cls: type[T], data: Any, where: str) -> T:
    """Build the frozen dataclass `cls` from a mapping, strictly; `where` names it in errors ('train')."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: got {data!r}, expected a mapping of keys to values")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise ConfigError(f"{where}.{key}: unknown key{_closest(str(key), fields)}")
    hints = typing.get_type_hints(cls)
    ranges: dict[str, Range] = getattr(cls, "RANGES", {})
    kwargs = {}
    for name, field in fields.items():
        key = f"{where}.{name}"
        if name in data:
            kwargs[name] = _coerce(hints[name], data[name], key)
            if name in ranges:
                _check_range(ranges[name], kwargs[name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key}: required key is missing; add it to params.yaml")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as exc:  # __post_init__ validation
        raise ConfigError(f"{where}: {exc}") from None


def to_dict(obj: Any) -> Any:
    """The plain (JSON-able) form of a params dataclass, tuples as lists."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def flatten(obj: object, prefix: str = "") -> dict[str, object]:
    """Dotted paths to leaf values: {"params": {"train": {"seed": 0}}} -> {"params.train.seed": 0}. Items of a
    list of mappings or lists are indexed as `[i]`; a list of plain values is one leaf."""
    if isinstance(obj, dict) and obj:
        out: dict[str, object] = {}
        for key in sorted(obj):
            out.update(flatten(obj[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        out = {}
        for i, value in enumerate(obj):
            out.update(flatten(value, f"{prefix}[{i}]"))
        return out
    return {prefix: obj}


def changed_params(old: dict, new: dict, selections: typing.Iterable[str]) -> list[str]:
    """`key: old -> new` for every leaf under `selections` (section names or dotted keys, as a dvc.yaml `params:`
    list names them; "" for all of them) whose value differs between two `to_dict` forms of params. Pure."""
    def pick(tree: dict, selection: str) -> object:
        for part in selection.split(".") if selection else ():
            tree = tree.get(part) if isinstance(tree, dict) else None
        return tree

    changes = []
    for selection in selections:
        a, b = flatten(pick(old, selection), selection), flatten(pick(new, selection), selection)
        changes += [f"{key}: {a.get(key)!r} -> {b.get(key)!r}" for key in sorted(a.keys() | b.keys())
                    if a.get(key) != b.get(key)]
    return changes


def load_section(cls: type[T], params_path: str | Path, section: str) -> T:
    """Load one top-level section of a params file into `cls`; other sections are left unread."""
    data = load_yaml(params_path)
    if not isinstance(data, dict):
        raise ConfigError(f"{params_path}: expected a mapping of sections at the top level")
    return from_dict(cls, data.get(section), section)
