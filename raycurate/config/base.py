"""Building blocks for typed config sections.

Every config section is a ``@dataclass`` whose fields are declared with :func:`option`, so each field carries a
description (shown by ``raycurate run --help-config``) and, optionally, its allowed values.  Validation of YAML
and ``key=value`` overrides against these dataclasses lives in :mod:`raycurate.config.loader`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Callable, Sequence


def option(
    default: Any,
    help: str,
    *,
    choices: Sequence[Any] | None = None,
    items: Sequence[Any] | Callable[[Any], bool] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    runtime_only: bool = False,
    hashed: bool = True,
) -> Any:
    """Declare a config field with a description and optional allowed values.

    Args:
        default: Default value. Lists, dicts and nested config sections are copied per instance.
        help: One-sentence description of what the field controls.
        choices: Allowed values; anything else is rejected with the list of choices.
        items: For a list field: the allowed item values (a sequence, named in errors), or a predicate that says
            whether one item is allowed (its docstring's first line names the allowed values in errors).
        ge / gt / le / lt: Bounds of a number field (``None`` values of an optional field are not checked).
        runtime_only: The field changes how fast or how robustly a stage runs, never what it produces (threads,
            CPU reservations, retries, logging): stage hashes see its default instead of its value, so changing it
            neither re-runs a finished stage nor orphans a killed training's checkpoints.
        hashed: False for a ``runtime_only`` field added after stages were hashed: hashes omit it (its default
            would still be a new key), so finished runs stay current.

    Returns:
        A ``dataclasses.field`` carrying ``help``, ``choices``, ``items`` and ``bounds`` in its metadata.
    """
    if not hashed and not runtime_only:
        raise ValueError("only a runtime_only option can be left out of stage hashes")
    bounds = {name: value for name, value in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if value is not None}
    items = tuple(items) if items is not None and not callable(items) else items
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None, "items": items,
                "bounds": bounds, "runtime_only": runtime_only, "hashed": hashed}
    if isinstance(default, (list, dict, set)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=functools.partial(copy.deepcopy, default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
