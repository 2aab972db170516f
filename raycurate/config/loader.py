"""Load typed configs from YAML plus ``key=value`` overrides, rejecting unknown keys and wrong types.

:func:`load_config` reports every problem of a file and its overrides in one :class:`ConfigError`, each naming the
dotted key, what was given, what is allowed and its origin (an unknown key gets the closest valid one). Checks:
types, ``choices``, list items, ranges (:func:`raycurate.config.base.option`), each section's ``config_problems()``::

    ConfigError: jobs/demo.yaml has 2 problems: (1) train.zero_stage: 5 is not one of [0, 1, 2, 3] [in
    jobs/demo.yaml]; (2) train.lrr: unknown key (did you mean train.lr?) [from the command line]

Also :func:`config_hash`, :func:`dump_yaml`, :func:`config_help`; decisions in docs/design.md, "Config".
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from raycurate.errors import UserError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")  # a config section class


class ConfigError(UserError, ValueError):
    """A config file or override does not match the typed schema; the message is one line listing every problem."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        listed = problems[0] if len(problems) == 1 else "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
        super().__init__(f"{source} has {len(problems)} problem{'s' if len(problems) != 1 else ''}: {listed}")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is None:
        return getattr(tp, "__name__", str(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    args = ", ".join(_type_name(a) for a in typing.get_args(tp))
    return f"{origin.__name__}[{args}]"


def _coerce(value: Any, tp: Any, key: str, problems: list[str], root: type | None = None) -> Any:
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
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a mapping of {tp.__name__} fields, got {type(value).__name__}")
            return tp()
        return _build(tp, value, key, problems, root)
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


def _number_problem(value: Any, bounds: dict[str, float]) -> str | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if value != value:  # NaN
        return f"{value!r} is not a number"
    tests = {"ge": (value >= bounds.get("ge", value), ">="), "gt": (value > bounds.get("gt", value - 1), ">"),
             "le": (value <= bounds.get("le", value), "<="), "lt": (value < bounds.get("lt", value + 1), "<")}
    failed = [f"{op} {bounds[name]}" for name, (ok, op) in tests.items() if name in bounds and not ok]
    return f"{value!r} must be {' and '.join(failed)}" if failed else None


def _items_problem(value: Any, items: Any) -> str | None:
    if not isinstance(value, list):
        return None
    if callable(items):
        bad = [v for v in value if not items(v)]
        allowed = (items.__doc__ or "").strip().splitlines()[0] if items.__doc__ else "see --help-config"
    else:
        bad = [v for v in value if v not in items]
        allowed = f"one of {list(items)}"
    if not bad:
        return None
    hints = [f"{v!r} -> {m[0]!r}" for v in bad if isinstance(v, str) and not callable(items)
             for m in [difflib.get_close_matches(v, [str(i) for i in items], n=1)] if m]
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    return f"{', '.join(repr(v) for v in bad)} not allowed{hint}; each item must be {allowed}"


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass, sections included (``train``, ``train.lr``, ...)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(all_keys(hints[f.name], key + "."))
    return keys


def _suggest(key: str, name: str, siblings: list[str], root: type | None) -> str:
    """`` (did you mean train.lr?)`` for the closest sibling, or a key of the same name in another section."""
    prefix = key[: -len(name)]
    close = difflib.get_close_matches(name, siblings, n=1, cutoff=0.6)
    if close:
        return f" (did you mean {prefix}{close[0]}?)"
    if root is not None:
        leaves = [k for k in all_keys(root) if k.rsplit(".", 1)[-1] == name]
        if not leaves:
            leaves = difflib.get_close_matches(key, all_keys(root), n=1, cutoff=0.75)
        if leaves:
            return f" (did you mean {leaves[0]}?)"
    return ""


def _build(cls: type[T], data: dict, prefix: str, problems: list[str], root: type | None = None) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    before = len(problems)
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            where = f"'{prefix}'" if prefix else "the top level"
            hint = _suggest(key, str(name), list(fields), root)
            problems.append(f"{key}: unknown key{hint}; allowed keys in {where}: {', '.join(sorted(fields))}")
            continue
        value = _coerce(value, hints[name], key, problems, root)
        meta = fields[name].metadata
        choices = meta.get("choices")
        if choices is not None and value is not None and value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{key}: {value!r} is not one of {list(choices)}{hint}")
        for check in (_number_problem(value, meta.get("bounds") or {}),
                      _items_problem(value, meta["items"]) if meta.get("items") else None):
            if check:
                problems.append(f"{key}: {check}")
        kwargs[name] = value
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        problems.append(f"{prefix or cls.__name__}: {exc}")
        return cls()
    if len(problems) == before and hasattr(obj, "config_problems"):
        problems.extend(obj.config_problems())
    return obj


def _origin(problem: str, source: str, overridden: set[str]) -> str:
    key = problem.split(":", 1)[0].split("[", 1)[0].strip()
    parts = key.split(".")
    from_cli = any(".".join(parts[:i]) in overridden for i in range(1, len(parts) + 1))
    return f"{problem} [from the command line]" if from_cli else f"{problem} [in {source}]"


def from_dict(cls: type[T], data: dict | None, source: str = "config", overridden: set[str] | None = None,
              prefix: str = "") -> T:
    """Build and validate a config dataclass from a plain mapping.

    Args:
        cls: The config dataclass.
        data: Plain mapping (YAML + overrides).
        source: The file it came from (named in errors).
        overridden: Dotted keys set on the command line; when given, each problem says whether its key came from
            ``source`` or the command line.
        prefix: Dotted name of the section ``cls`` is (``"data"`` when a command builds only that section), so
            errors name the full key.

    Raises:
        ConfigError: listing every unknown key, wrong type, disallowed value, out-of-range number and failed
            cross-field check found.
    """
    problems: list[str] = []
    if data is not None and not isinstance(data, dict):
        raise ConfigError(source, [f"top level must be a mapping of sections, got {type(data).__name__}"])
    obj = _build(cls, data or {}, prefix, problems, root=cls)
    if problems:
        if overridden is not None:
            problems = [_origin(p, source, overridden) for p in problems]
        raise ConfigError(source, problems)
    return obj


def override_keys(overrides: list[str]) -> set[str]:
    """The dotted keys that ``key=value`` overrides set (for saying where a bad key came from)."""
    return {text.split("=", 1)[0].strip() for text in overrides if "=" in text}


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into its key path and a YAML-parsed value."""
    if "=" not in text:
        raise ConfigError("command line", [f"{text!r}: overrides look like key=value, e.g. train.lr=1e-4 (a path "
                                           "or a job file goes before the overrides)"])
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(part.strip() for part in path):
        raise ConfigError("command line", [f"{text!r}: empty key; overrides look like section.key=value"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError, OverflowError) as exc:  # ValueError: a date-like value such as 0000-00-00
        detail = str(exc).replace("\n", " ")
        raise ConfigError("command line", [f"{key.strip()}: value {raw!r} is not valid YAML ({detail}); quote it"]) \
            from None
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of ``data`` with each ``key=value`` override set (intermediate mappings created)."""
    out = copy.deepcopy(data)
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
    except (UnicodeDecodeError, IsADirectoryError, PermissionError) as exc:  # before ValueError: a subclass
        raise ConfigError(str(path), [f"cannot be read as a YAML text file ({exc}); pass a job YAML file"]) from None
    except (yaml.YAMLError, ValueError, OverflowError) as exc:  # ValueError: a date-like value such as 0000-00-00
        detail = " ".join(str(exc).split())
        raise ConfigError(str(path), [f"not valid YAML: {detail}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), [f"top level must be a mapping of sections (pipeline:, data:, train: ...), "
                                      f"got a {type(data).__name__}; see jobs/*.yaml"])
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Load ``cls`` from an optional YAML file and ``key=value`` overrides (overrides win)."""
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, overrides or [])
    return from_dict(cls, data, source=str(path) if path else "command line", overridden=override_keys(overrides or []))


def to_dict(obj: Any, *, runtime_defaults: bool = False) -> Any:
    """Plain-data view of a config (for YAML dumps and hashing).

    Args:
        runtime_defaults: Put every ``runtime_only`` field (:func:`raycurate.config.base.option`) at its default:
            what a stage's result depends on.  Defaults rather than omission keep the hashes of configs that never
            set one; fields declared ``hashed=False`` (runtime-only fields added later) are left out.
    """
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(_default_of(f) if runtime_defaults and f.metadata.get("runtime_only")
                                else getattr(obj, f.name), runtime_defaults=runtime_defaults)
                for f in dataclasses.fields(obj) if not (runtime_defaults and f.metadata.get("hashed") is False)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v, runtime_defaults=runtime_defaults) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v, runtime_defaults=runtime_defaults) for k, v in obj.items()}
    return obj


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # type: ignore[operator]


def config_hash(*parts: Any) -> str:
    """Stable short hash of config sections (dataclasses or plain data), blind to ``runtime_only`` fields."""
    blob = json.dumps([to_dict(p, runtime_defaults=True) for p in parts], sort_keys=True, default=str)
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
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, key + "."))
            continue
        default = _default_of(f)
        help_text = f.metadata.get("help", "")
        if f.metadata.get("choices"):
            help_text += f" (one of {list(f.metadata['choices'])})"
        rows.append((key, _type_name(tp), default, help_text))
    return rows


def _yaml_flow(value: Any) -> str:
    """A default as it would be written in a job file or an override (``null``, ``true``, ``[bds, bridge]``)."""
    if isinstance(value, float):
        return repr(value)  # 2e-05, not YAML's 2.0e-05
    text = yaml.safe_dump(to_dict(value), default_flow_style=True, width=10_000, sort_keys=False).strip()
    return text.removesuffix("...").strip()


def _allowed(meta: dict) -> str:
    """What a field allows beyond its type: its choices or number range (empty when anything of its type goes)."""
    if meta.get("choices"):
        return "one of " + ", ".join(_yaml_flow(c) for c in meta["choices"])
    bounds = meta.get("bounds") or {}
    ops = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return " and ".join(f"{ops[name]} {bounds[name]:g}" for name in ops if name in bounds)


def config_sections(cls: type) -> dict[str, str]:
    """``{section: its description}`` of the top-level sections of a config dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(hints[f.name])}


def config_help(cls: type, section: str | None = None, width: int = 100) -> str:
    """Readable text listing the keys of ``cls`` (the job config): each with its type, default, allowed values and
    description, grouped under their sections.

    Args:
        section: A section (``curate``), a nested one (``eval.pool``) or one key (``train.lr``); None lists all.
        width: Line width the descriptions are wrapped to.

    Raises:
        UserError: ``section`` is no section or key of ``cls`` (the message lists the sections).
    """
    import textwrap

    sections = config_sections(cls)
    keys = all_keys(cls)
    if section is not None and section not in keys:
        close = difflib.get_close_matches(section, keys, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UserError(f"--help-config: {section!r} is no config section or key{hint}; sections: "
                        f"{', '.join(sections)}")
    hints_of: dict[str, Any] = {}

    def fields(owner: type, prefix: str) -> list[tuple[str, Any, dataclasses.Field]]:
        """The leaf keys of ``owner``: its own first, then each nested section's (one heading per section)."""
        rows, nested = [], []
        owner_hints = typing.get_type_hints(owner)
        for f in dataclasses.fields(owner):
            tp = owner_hints[f.name]
            key = f"{prefix}{f.name}"
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                hints_of[key] = f.metadata.get("help", "")
                nested.extend(fields(tp, key + "."))
            else:
                rows.append((key, tp, f))
        return rows + nested

    def wrap(text: str, indent: str) -> list[str]:
        return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent) if text else []

    lines: list[str] = []
    if section is None:
        lines += wrap("Every key of a job file. Set one in the YAML (section: {key: value}) or on the command line "
                      "as section.key=value, e.g. train.lr=1e-4; `--help-config SECTION` shows one section: "
                      f"{', '.join(sections)}.", "")
    current = None
    for key, tp, f in fields(cls, ""):
        if section is not None and key != section and not key.startswith(section + "."):
            continue
        group = key.rsplit(".", 1)[0] if "." in key else ""
        if group != current:
            current = group
            lines.append("")
            lines += wrap(f"{group}: {hints_of.get(group, '')}" if group else "Top level:", "")
        allowed = _allowed(dict(f.metadata))
        type_name = _type_name(tp).replace(" | NoneType", " or null").replace(" | ", " or ")
        lines.append(f"  {key}  ({type_name}, default {_yaml_flow(_default_of(f))}"
                     f"{'; ' + allowed if allowed else ''})")
        lines += wrap(f.metadata.get("help", ""), "      ")
    return "\n".join(lines).lstrip("\n") + "\n"
