"""Building blocks for typed config sections.

Every config section is a ``@dataclass`` whose fields are declared with :func:`option`, so each field carries a
description (shown by ``raycurate run --help-config``) and, optionally, its allowed values.  Validation of YAML
and ``key=value`` overrides against these dataclasses lives in :mod:`raycurate.config.loader`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Sequence


def option(default: Any, help: str, *, choices: Sequence[Any] | None = None) -> Any:
    """Declare a config field with a description and optional allowed values.

    Args:
        default: Default value. Lists, dicts and nested config sections are copied per instance.
        help: One-sentence description of what the field controls.
        choices: Allowed values; anything else is rejected with the list of choices.

    Returns:
        A ``dataclasses.field`` carrying ``help`` and ``choices`` in its metadata.
    """
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None}
    if isinstance(default, (list, dict, set)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda d=default: copy.deepcopy(d), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
