"""Run directory layout, atomic writes and the manifest.

``runs/<name>/`` holds ``config.yaml``, ``manifest.json`` (per stage ``{status, seconds, config_hash, outputs,
metrics}``, the run's row accounting) and one folder per stage.  :func:`atomic_file`, :func:`atomic_write_json` and
:func:`atomic_dir` write under a temp name and rename, so a crash leaves nothing half-written; :func:`open_run_dir`
returns a :class:`RunDir`, mirrors a storage URI (:mod:`raycurate.storage`; the manifest is the commit point,
``_scratch/`` never travels) and takes one writer's ``flock`` (:func:`acquire_lock`, :class:`RunDirError` names the
holder), removing a killed run's temp folders.  :func:`check_stage_name` and :func:`inside` keep a tampered
manifest inside the run.  Decisions: docs/design.md, "Run directory and resume"; docs/data.md; docs/cluster.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

from raycurate import storage
from raycurate.errors import UserError

log = logging.getLogger("raycurate")

MANIFEST = "manifest.json"
CONFIG = "config.yaml"
SCRATCH = "_scratch"  # local only: never uploaded, never downloaded
MIRRORS = ".cache/raycurate/run-mirrors"
LOCK = ".lock"
STAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # no leading '_' / '.': those names are internal
RESERVED = frozenset({MANIFEST, CONFIG, SCRATCH, LOCK, "report.html"})  # run-root entries that are never stages
_TEMP_NAME = re.compile(r"^\.[^/]+\.(tmp|old-[0-9-]+|[0-9]+\.download)$")
_HELD: dict[Path, tuple[Any, int]] = {}  # run root -> (open lock file, id of the thread holding it)


class RunDirError(UserError):
    """The run directory cannot be used: not a folder, not writable, held by another process, or tampered."""


def check_stage_name(stage: str) -> str:
    """``stage`` if it is a safe stage folder name, else RunDirError.

    Allowed: letters, digits, ``_ . -``, starting with a letter or digit, and not a reserved run-root entry
    (:data:`RESERVED`).  Internal folders such as ``_scratch`` (training checkpoints, loaded on resume) and
    dot-files are therefore never stages, so a (remote) manifest naming them cannot make a run download into them.
    """
    if not isinstance(stage, str) or not STAGE_NAME.match(stage) or stage.lower() in RESERVED:
        raise RunDirError(f"stage name {stage!r} is not allowed (letters, digits, '_', '.', '-' only, starting with "
                          "a letter or digit, not an internal name such as _scratch); a manifest naming it was "
                          "written by something other than raycurate: check where it came from")
    return stage


def parse_manifest(data: str | bytes, where: str) -> dict:
    """A manifest's text parsed and checked for the shape raycurate writes, else one clear RunDirError.

    Shape: a JSON object whose ``stages`` (default empty) maps stage names to objects (their ``outputs`` and
    ``metrics``, when present, objects too) and whose ``rows``, when present, is an object.

    Args:
        data: The file's contents.
        where: The file's path or URI (named in the error).
    """
    fix = "it was edited, truncated or written by something else: restore it, or start a new run directory"
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RunDirError(f"{where} is not valid JSON ({exc}); {fix}") from None
    problem = None
    if not isinstance(manifest, dict):
        problem = f"is a JSON {type(manifest).__name__}, not an object"
    elif not isinstance(manifest.setdefault("stages", {}), dict):
        problem = f"has 'stages' as a {type(manifest['stages']).__name__}, not an object"
    elif not isinstance(manifest.get("rows", {}), dict):
        problem = f"has 'rows' as a {type(manifest['rows']).__name__}, not an object"
    else:
        for name, record in manifest["stages"].items():
            if not isinstance(record, dict) or not all(isinstance(record.get(k, {}), dict)
                                                       for k in ("outputs", "metrics")):
                problem = f"has a malformed record for stage {name!r}"
                break
    if problem is not None:
        raise RunDirError(f"{where} {problem}; {fix}")
    return manifest


def inside(root: Path, path: str | Path) -> Path:
    """``root / path`` normalised, after checking it stays under ``root`` (no ``..`` or absolute escape).

    The check is lexical: symlinks are not followed, because raycurate's own outputs may be links that point
    outside the run on purpose (``base_model/model`` links to the model cache or the committed checkpoint).
    """
    full = Path(os.path.normpath(root / path))
    if full != root and not full.is_relative_to(root):
        raise RunDirError(f"path {str(path)!r} points outside the run directory {root}; the manifest was altered "
                          "or written by something else: check where it came from")
    return full


def _holder(lock_file: Path) -> str:
    try:
        info = json.loads(lock_file.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} (since {info.get('since', '?')})"


def acquire_lock(root: Path) -> None:
    """Take the exclusive writer lock of ``root`` for this thread (re-entrant within the thread).

    The ``flock`` is taken on a file opened by this call, so a second thread of the same process (two API calls
    on one workspace from a thread pool) is refused like a second process.

    Raises:
        RunDirError: Another process or thread holds it; the message names its pid and host.
    """
    held = _HELD.get(root)
    if held is not None and held[1] == threading.get_ident():
        return
    lock_file = root / LOCK
    fh = open(lock_file, "a+", encoding="utf-8")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        fh.close()
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            holder = "another thread of this process" if held is not None else _holder(lock_file)
            raise RunDirError(f"run directory {root} is in use by {holder}; wait for it to finish, or "
                              "give this run another name (run.name / --out / workdir=)") from None
        raise
    fh.seek(0)
    fh.truncate()
    fh.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "since": time.strftime("%Y-%m-%dT%H:%M:%S")}))
    fh.flush()
    _HELD[root] = (fh, threading.get_ident())


def release_lock(root: str | Path) -> None:
    """Release this thread's writer lock of one run directory (a no-op when it holds none); the Python API
    calls it when a call ends, so a notebook does not keep its workspaces locked."""
    root = Path(root).resolve()
    held = _HELD.get(root)
    if held is not None and held[1] == threading.get_ident():
        del _HELD[root]
        _unlock(held[0])


def _unlock(fh: Any) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    fh.close()


def release_locks() -> None:
    """Release every run-directory lock this process holds (the CLI calls it when a command ends)."""
    for root, (fh, _) in list(_HELD.items()):
        _unlock(fh)
        _HELD.pop(root, None)


def remove_stale_temps(root: Path) -> list[str]:
    """Delete temp folders / files a killed writer left in ``root`` (``.<stage>.*.tmp`` and the like).

    Only safe while holding the writer lock: then no other process can be writing them.
    """
    removed = []
    for entry in root.iterdir():
        if _TEMP_NAME.match(entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry.name)
    if removed:
        log.info("removed %d stale temp entr%s from %s: %s", len(removed), "y" if len(removed) == 1 else "ies",
                 root, ", ".join(sorted(removed)[:5]))
    return removed


def _make_root(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunDirError(f"run directory {root} (or a folder above it) is a file; choose another --out / "
                          "run.name, or move the file") from None
    except NotADirectoryError:
        raise RunDirError(f"a parent of run directory {root} is a file; choose another --out / run.runs_dir") \
            from None
    except OSError as exc:
        raise RunDirError(f"cannot create run directory {root}: {exc.strerror or exc}; choose a writable "
                          "--out / run.runs_dir") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise RunDirError(f"run directory {root} is not writable by this user; choose a writable --out / "
                          "run.runs_dir or fix its permissions")


@contextlib.contextmanager
def atomic_file(path: str | Path, *, fsync: bool = False) -> Iterator[Path]:
    """Yield a fresh temp file name beside ``path``; on success it is renamed onto ``path``, on error removed.

    For writers that create the file themselves (``pq.write_table(table, tmp)``, ``open(tmp, "w")``).  Each call
    gets its own name (``.<name>.<pid>-<random>.tmp``), so racing writers of one path (a retried Ray task and
    its earlier attempt) never share a temp file; the last rename wins and readers see a complete file.

    Args:
        path: Destination; its parent folders are created.
        fsync: Flush the written file to disk before the rename.

    Yields:
        The temp path (not created yet) to write.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON atomically."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temp folder beside ``path``; on success it replaces ``path`` whole, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}-{time.time_ns()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class RunDir:
    """A run directory and its manifest, optionally persisted to remote storage.

    Args:
        root: ``runs/<name>`` (with ``remote``: the local mirror folder); created if missing.
        remote: The run's storage URI (``s3://bucket/runs/<name>``, ...).  When given, the manifest, the
            config and finished stages are downloaded into ``root`` now, and every stage recorded ``done``,
            every manifest save and :meth:`sync` upload to it.  ``None``: a plain local run directory.
        lock: Take the exclusive writer lock (and clean stale temp folders) before anything else; readers
            (``inspect``, ``report`` of a local run, Ray workers) pass False.
    """

    def __init__(self, root: str | Path, remote: str | None = None, lock: bool = False):
        self.root = Path(root).resolve()
        _make_root(self.root)
        if lock:
            acquire_lock(self.root)
            remove_stale_temps(self.root)
        self.remote = None if remote is None else storage.Location.parse(remote).checked()
        self.forced_stages: frozenset[str] = frozenset()
        if self.remote is not None:
            self._pull()

    def force(self, stages: Iterable[str]) -> None:
        """Re-run these stages even when their outputs are current (``run.force``; ``all`` = every stage)."""
        self.forced_stages = frozenset(stages)

    def is_forced(self, stage: str) -> bool:
        """Whether ``stage`` must re-run because the user forced it (``run.force=[stage]`` or ``[all]``)."""
        return "all" in self.forced_stages or stage in self.forced_stages

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    def stage_dir(self, stage: str) -> Path:
        """Folder that holds one stage's outputs (the name is checked: no path escapes the run root)."""
        return inside(self.root, check_stage_name(stage))

    def path_of(self, relative: str | Path) -> Path:
        """``root / relative`` for a path recorded in the manifest, checked to stay under the root."""
        return inside(self.root, relative)

    def load_manifest(self) -> dict:
        """The manifest, or an empty skeleton for a new run."""
        if self.manifest_path.exists():
            return parse_manifest(self.manifest_path.read_bytes(), str(self.manifest_path))
        skeleton: dict[str, Any] = {"run": self.root.name, "rows": {}, "stages": {}}
        if self.remote is not None:
            skeleton["storage"] = self.remote.display
        return skeleton

    def save_manifest(self, manifest: dict) -> None:
        atomic_write_json(self.manifest_path, manifest)
        self._push_file(MANIFEST)

    def update_manifest(self, **sections: Any) -> dict:
        """Merge top-level sections (e.g. ``rows=...``) into the manifest and save it."""
        manifest = self.load_manifest()
        manifest.update(sections)
        self.save_manifest(manifest)
        return manifest

    def stage_record(self, stage: str) -> dict | None:
        return self.load_manifest()["stages"].get(stage)

    def stage_is_current(self, stage: str, config_hash: str, upstream: tuple[str, ...] | list[str] = ()) -> bool:
        """True when ``stage`` finished with this config hash, every output it listed still exists, and no
        upstream stage has finished again since it started (a re-run upstream invalidates it)."""
        record = self.stage_record(stage)
        if not record or record.get("status") != "done" or record.get("config_hash") != config_hash:
            return False
        if not all(self.path_of(rel).exists() for rel in record.get("outputs", {}).values()):
            return False
        for name in upstream:
            up = self.stage_record(name) or {}
            if up.get("finished", 0) > record.get("started", 0):
                return False
        return True

    def record_stage(self, stage: str, record: dict) -> None:
        """Save ``stage``'s record; with remote storage a ``done`` stage's folder is uploaded before the manifest."""
        if self.remote is not None and record.get("status") == "done":
            log.info("stage %-14s uploading to %s", stage, self.remote.child(stage).display)
            storage.upload_dir(self.stage_dir(stage), self.remote.child(stage))
        manifest = self.load_manifest()
        manifest["stages"][stage] = record
        self.save_manifest(manifest)

    def sync(self) -> None:
        """Upload the files directly in the run root (config, report, manifest last); a no-op for a local run.

        Stage folders upload when they finish; ``_scratch/`` and other folders stay local.
        """
        if self.remote is None:
            return
        names = [p.name for p in self.root.iterdir() if p.is_file() and not p.name.startswith(".")]
        for name in sorted(names, key=lambda n: (n == MANIFEST, n)):
            self._push_file(name)

    def relative(self, path: str | Path) -> str:
        """``path`` relative to the run root (how outputs are stored in the manifest)."""
        path = Path(path)
        located = path.parent.resolve() / path.name  # the final link (e.g. base_model/model) is not followed
        return str(inside(self.root, located).relative_to(self.root))

    def _push_file(self, name: str) -> None:
        if self.remote is not None:
            storage.upload_file(self.root / name, self.remote.child(name))

    def _pull(self) -> None:
        """Make the mirror match the remote: its manifest and config, and every finished stage the mirror lacks.

        A stage folder is downloaded unless the mirror's own previous manifest holds the very same record (then
        the folder is that execution's output already).  A remote without a manifest is a new run: a stale
        mirror manifest is dropped so nothing is skipped that the remote does not hold.
        """
        assert self.remote is not None
        before = self.load_manifest()["stages"] if self.manifest_path.exists() else {}
        if not storage.is_file(self.remote.child(MANIFEST)):
            if self.manifest_path.exists():
                log.warning("%s has no manifest; dropping the stale local mirror manifest %s",
                            self.remote.display, self.manifest_path)
                self.manifest_path.unlink()
            return
        for name in (MANIFEST, CONFIG):
            if storage.is_file(self.remote.child(name)):
                tmp = self.root / f".{name}.{os.getpid()}.download"
                try:
                    storage.download(self.remote.child(name), tmp)
                    os.replace(tmp, self.root / name)
                finally:
                    tmp.unlink(missing_ok=True)
        stages = self.load_manifest().get("stages") or {}
        for stage in stages:
            check_stage_name(stage)  # before anything is deleted or written for it
        for stage, record in stages.items():
            if record.get("status") != "done" or (before.get(stage) == record and self.stage_dir(stage).exists()):
                continue
            log.info("stage %-14s downloading from %s", stage, self.remote.child(stage).display)
            with atomic_dir(self.stage_dir(stage)) as tmp:
                if storage.exists(self.remote.child(stage)):
                    storage.download(self.remote.child(stage), tmp)


def open_run_dir(runs_dir: str | Path, name: str, local_dir: str | Path | None = None, lock: bool = True) -> RunDir:
    """``<runs_dir>/<name>``: a local run directory, or, when ``runs_dir`` is a storage URI, a local mirror of it.

    Args:
        runs_dir: Local folder or storage URI holding run directories (``run.runs_dir``).
        name: The run name (``run.name``).
        local_dir: Folder holding local mirrors of remote runs (``run.local_dir``); default
            ``.cache/raycurate/run-mirrors/<sha of runs_dir>``.  Ignored for a local ``runs_dir``.
        lock: Take the exclusive writer lock (the default: every command that writes into a run).

    Raises:
        RunDirError: The folder cannot be created or written, another process holds it, or ``name`` is empty.
    """
    if not name or name in (".", "..") or "/" in name:
        raise RunDirError(f"run name {name!r} is not a folder name; give --out / run.name such as runs/my_run")
    if not storage.is_uri(runs_dir):
        return RunDir(Path(runs_dir) / name, lock=lock)
    runs_dir = str(runs_dir)
    key = storage.strip_userinfo(runs_dir)  # the mirror folder name never depends on credentials
    mirror = Path(local_dir) if local_dir else Path(MIRRORS) / hashlib.sha256(key.encode()).hexdigest()[:16]
    return RunDir(mirror / name, remote=storage.Location.parse(runs_dir).child(name).uri, lock=lock)
