"""The one exception type the command line turns into ``raycurate: <message>`` and exit code 2.

Every problem a user can fix (a bad config key, an unreadable input file, a run directory another process holds,
a storage URI that cannot be reached) raises a subclass of :class:`UserError` whose message names the file / key,
what is wrong and what to do.  Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in what the user gave (config, inputs, paths); the message says where and what to do."""


class InputError(UserError, ValueError):
    """An input path or file that cannot be read as a corpus (missing, unsupported, corrupt, empty)."""


class OutputError(UserError):
    """An output folder that cannot be used: another run's outputs, not a folder, not writable, or out of space."""
