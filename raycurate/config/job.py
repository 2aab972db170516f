"""One way to build a job config, shared by the CLI (``raycurate run / demo / train``) and the Python API
(``raycurate.ingest``, ``bridge_select``, ``curate``, ...): :func:`build_job_config`.

Layers, later ones win: the job file (or every key's default), each mapping of ``layers`` (dotted keys or nested
sections, merged key by key), ``overrides`` (``key=value`` strings with YAML values: the command line), ``keys``
(dotted keys, None left out: an API call's keywords), then ``pipeline``.  So ``raycurate run job.yaml
curate.keep_fraction=0.5`` and ``raycurate.curate(rows, keep_fraction=0.5)`` set the same key the same way and
pass the same checks (:func:`raycurate.config.loader.from_dict`).  :func:`check_keyword_types` checks an API
call's keywords that are not config keys (``workdir``, ``online``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raycurate.config.loader import ConfigError, apply_overrides, from_dict, override_keys, read_yaml, to_dict
from raycurate.errors import UserError

if TYPE_CHECKING:
    from raycurate.config.schema import JobConfig


def merge_setting(target: dict, key: str, value: Any) -> None:
    """Set a dotted ``key`` (``train.lr``) or merge a section mapping into ``target`` (in place).

    A mapping merges key by key into a section that is already a mapping (``{"train": {"lr": 1e-4}}`` keeps the
    other ``train`` keys); a config dataclass counts as its mapping; anything else replaces the value.

    Raises:
        UserError: A dotted key runs through a value that is not a section.
    """
    *parents, leaf = key.split(".")
    node = target
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"{key}: '{part}' is not a config section")
    value = to_dict(value) if dataclasses.is_dataclass(value) else value
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        for sub_key, sub_value in value.items():
            merge_setting(node[leaf], str(sub_key), sub_value)
    else:
        node[leaf] = value


def _set_keys(layer: Mapping[str, Any]) -> set[str]:
    """The dotted keys a layer sets (a section mapping's keys one level down), for saying where a key came from."""
    keys: set[str] = set()
    for section, values in layer.items():
        if isinstance(values, dict):
            keys.update(f"{section}.{key}" for key in values)
        else:
            keys.add(str(section))
    return keys


def build_job_config(job: str | os.PathLike | None = None, *, layers: Sequence[Mapping[str, Any]] = (),
                     overrides: Sequence[str] = (), keys: Mapping[str, Any] | None = None,
                     pipeline: str | None = None, source: str | None = None,
                     command_line: bool = False) -> JobConfig:
    """The validated :class:`~raycurate.config.schema.JobConfig` of a command or an API call.

    Args:
        job: A job YAML; None starts from the defaults.
        layers: Setting mappings merged in order (:func:`merge_setting`): the CLI's flags (``--data``, ``--out``),
            the API's preparation sections of the result a call continues, its defaults, ``config=`` and section
            keywords.  They are copied, never modified.
        overrides: ``key=value`` strings (YAML values), applied after the layers.
        keys: Dotted keys set last (an API call's explicit keywords); None values are left out.
        pipeline: The pipeline, set after everything else (None: as the job / layers / overrides say).
        source: What errors name (default: the job file, else ``command line``).
        command_line: The layers, overrides and keys come from a command line: each problem then says whether its
            key came from the job file (``[in jobs/x.yaml]``) or the command line (``[from the command line]``).

    Raises:
        ConfigError: Every unknown key, wrong type, out-of-range value and failed cross-field check, in one
            message naming ``source``.
        FileNotFoundError: ``job`` does not exist.
    """
    from raycurate.config.schema import JobConfig

    data = read_yaml(Path(job)) if job is not None else {}
    flagged: set[str] = set()
    for layer in layers:
        flagged |= _set_keys(layer)
        for key, value in copy.deepcopy(dict(layer)).items():
            merge_setting(data, str(key), value)
    data = apply_overrides(data, list(overrides))
    for key, value in (keys or {}).items():
        if value is not None:
            flagged.add(key)
            merge_setting(data, key, copy.deepcopy(value))
    if pipeline is not None:
        data["pipeline"] = pipeline
    if source is None:
        source = str(job) if job is not None else "command line"
    overridden = override_keys(list(overrides)) | flagged if command_line else None
    return from_dict(JobConfig, data, source=source, overridden=overridden)


def check_keyword_types(call: str, **values: tuple[Any, type | tuple[type, ...]]) -> None:
    """Check the types of a call's keywords that are not config keys (``online``, ``name``, ``workdir``, ...).

    Args:
        call: The call's name (named in the error).
        **values: keyword -> ``(value, allowed type(s))``; None is always allowed.

    Raises:
        ConfigError: Every keyword of the wrong type, in one message, before anything runs.
    """
    problems = []
    for key, (value, allowed) in values.items():
        allowed = allowed if isinstance(allowed, tuple) else (allowed,)
        if value is None or (isinstance(value, allowed) and (bool not in allowed or isinstance(value, bool))):
            continue
        names = " or ".join("path" if t is os.PathLike else t.__name__ for t in allowed)
        problems.append(f"{key} must be a {names}, got {type(value).__name__} {value!r:.60}")
    if problems:
        raise ConfigError(f"raycurate.{call}()", problems)
