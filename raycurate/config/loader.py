"""Load typed configs from YAML plus ``key=value`` overrides, rejecting unknown keys and wrong types.

All problems in one file are collected and reported together, each naming the dotted key, what was given and what
is allowed, so a user fixes a config in one pass::

    ConfigError: jobs/demo.yaml has 2 problems:
      - train.zero_stage: 5 is not one of [0, 1, 2, 3]
      - data.strickt: unknown key; allowed keys in 'data': input, strict, ...
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override does not match the typed schema."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source} has {len(problems)} problem{'s' if len(problems) != 1 else ''}:\n{lines}")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is None:
        return getattr(tp, "__name__", str(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    args = ", ".join(_type_name(a) for a in typing.get_args(tp))
    return f"{origin.__name__}[{args}]"


def _coerce(value: Any, tp: Any, key: str, problems: list[str]) -> Any:
    """Check ``value`` against type ``tp``; return the (lightly coerced) value or record a problem."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            trial: list[str] = []
            out = _coerce(value, arg, key, trial)
            if not trial:
                return out
        problems.append(f"{key}: {value!r} is not of type {_type_name(tp)}")
        return value
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            problems.append(f"{key}: {value!r} is not one of {list(allowed)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            problems.append(f"{key}: expected a list ({_type_name(tp)}), got {type(value).__name__} {value!r}")
            return value
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{key}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a mapping ({_type_name(tp)}), got {type(value).__name__} {value!r}")
            return value
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        return {
            _coerce(k, key_tp, f"{key}.<key>", problems): _coerce(v, val_tp, f"{key}.{k}", problems)
            for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a mapping of {tp.__name__} fields, got {type(value).__name__}")
            return tp()
        return _build(tp, value, key, problems)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-3" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is bool and not isinstance(value, bool):
        problems.append(f"{key}: expected true or false, got {value!r}")
        return value
    if tp in (int, float, str) and (not isinstance(value, tp) or (tp is int and isinstance(value, bool))):
        problems.append(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    return value


def _build(cls: type[T], data: dict, prefix: str, problems: list[str]) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            where = f"'{prefix}'" if prefix else "the top level"
            problems.append(f"{key}: unknown key; allowed keys in {where}: {', '.join(sorted(fields))}")
            continue
        value = _coerce(value, hints[name], key, problems)
        choices = fields[name].metadata.get("choices")
        if choices is not None and value is not None and value not in choices:
            problems.append(f"{key}: {value!r} is not one of {list(choices)}")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        problems.append(f"{prefix or cls.__name__}: {exc}")
        return cls()


def from_dict(cls: type[T], data: dict | None, source: str = "config") -> T:
    """Build and validate a config dataclass from a plain mapping.

    Raises:
        ConfigError: listing every unknown key, wrong type and disallowed value found.
    """
    problems: list[str] = []
    obj = _build(cls, data or {}, "", problems)
    if problems:
        raise ConfigError(source, problems)
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into its key path and a YAML-parsed value."""
    if "=" not in text:
        raise ConfigError("command line", [f"{text!r}: overrides look like key=value, e.g. train.lr=1e-4"])
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of ``data`` with each ``key=value`` override set (intermediate mappings created)."""
    out = json.loads(json.dumps(data))
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError("command line", [f"{text!r}: '{part}' is not a section"])
        node[path[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict:
    """Read a YAML mapping, with errors that name the file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"config file {path} does not exist; see jobs/ for examples")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [f"not valid YAML: {exc}"]) from exc
    if not isinstance(data, dict):
        raise ConfigError(str(path), ["top level must be a mapping of sections"])
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Load ``cls`` from an optional YAML file and ``key=value`` overrides (overrides win)."""
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, overrides or [])
    return from_dict(cls, data, source=str(path) if path else "command line")


def to_dict(obj: Any) -> Any:
    """Plain-data view of a config (for YAML dumps and hashing)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def config_hash(*parts: Any) -> str:
    """Stable short hash of config sections (dataclasses or plain data)."""
    blob = json.dumps([to_dict(p) for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def dump_yaml(obj: Any) -> str:
    """YAML text of a config, keys in declaration order."""
    return yaml.safe_dump(to_dict(obj), sort_keys=False)


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every field, recursing into nested sections."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, key + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f.metadata.get("help", "")
        if f.metadata.get("choices"):
            help_text += f" (one of {list(f.metadata['choices'])})"
        rows.append((key, _type_name(tp), default, help_text))
    return rows
