"""Typed configs from YAML: a mapping of plain data checked against a dataclass, field by field (nested dataclasses,
unions, literals, tuples), and ``key=value`` overrides with dotted keys. Every error is a ``ConfigError`` naming the
key (``rollout.group_size: expected an int, got 'eight'``) or the file, line and column of a YAML syntax error."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config that cannot run, naming the key at fault."""


Need = typing.Callable[[bool, str, str], None]


def requirement(section: str = "") -> Need:
    """``need(ok, key, why)``: a ``ConfigError`` naming ``section.key`` (``key`` alone for the top level) where ``ok``
    is false; each config section validates its own fields with one."""
    prefix = f"{section}." if section else ""

    def need(ok: bool, key: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"{prefix}{key}: {why}")

    return need


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` as type ``tp`` or a ConfigError naming ``key``; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return build(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, key)
            except ConfigError as err:
                errors.append(str(err))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        reasons = [e.removeprefix(f"{key}: ") for e in errors]  # each option's own reason, the key said once
        raise ConfigError(f"{key}: {' and '.join(reasons)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or type(value) not in {type(c) for c in choices}:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an int, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")  # a bug in the config classes, not the file


def build(cls: type, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key (known: {', '.join(sorted(names))})")
    return cls(**{name: _coerce(value, hints[name], prefix + name) for name, value in data.items()})


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node = child
    node[leaf] = value


def apply_overrides(tree: dict, overrides: list[str]) -> None:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{item}: overrides are key=value, e.g. rollout.group_size=16")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        set_dotted(tree, key.strip(), value)


def read_yaml_mapping(path: str | Path, flag: str, what: str) -> dict:
    """The mapping a YAML file holds (empty for an empty file), or a ConfigError that names ``flag``, the file and,
    for a syntax error, its line and column; ``what``: what the mapping should hold, for the message."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{flag}: {path} does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{flag}: {_yaml_error(path, err)}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{flag}: {path}: cannot read ({err.__class__.__name__}: {err})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{flag}: {path} must hold {what}")
    return tree


def _yaml_error(path: Path, err: yaml.YAMLError) -> str:
    """``path:line:column: what`` of a YAML error, on one line (yaml's own message spans several)."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    what = " ".join(str(x) for x in (getattr(err, "context", None), getattr(err, "problem", None)) if x) or str(err)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    return f"{where}: not valid YAML: {' '.join(what.split())}"
