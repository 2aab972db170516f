"""Run directory layout, atomic writes and the manifest.

``runs/<name>/`` holds ``config.yaml`` (the resolved config), ``manifest.json`` and one folder per stage.  The
manifest records, per stage, ``{status, seconds, config_hash, outputs, metrics}`` and, for the run,
``rows: {input, accepted, rejected}`` with ``input == accepted + rejected``.  Every file is written to a temporary
name in the same folder and renamed into place, so a crash never leaves a half-written output behind.

When ``run.runs_dir`` is a storage URI (``s3://bucket/prefix``, ``gs://...``, ``file:///...``; see
:mod:`raycurate.storage`) the run works in a local mirror folder and persists to the URI: a stage's folder is
uploaded when it is recorded ``done`` and the manifest after it (the manifest is the commit point), and a run
opened on a fresh machine downloads the manifest and every finished stage first, so it skips them.  ``_scratch/``
(mid-stage training checkpoints) is never uploaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from raycurate import storage

log = logging.getLogger("raycurate")

MANIFEST = "manifest.json"
CONFIG = "config.yaml"
SCRATCH = "_scratch"
MIRRORS = ".cache/raycurate/run-mirrors"


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
    """

    def __init__(self, root: str | Path, remote: str | None = None):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.remote = None if remote is None else storage.Location.parse(remote).checked()
        if self.remote is not None:
            self._pull()

    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    def stage_dir(self, stage: str) -> Path:
        """Folder that holds one stage's outputs."""
        return self.root / stage

    def load_manifest(self) -> dict:
        """The manifest, or an empty skeleton for a new run."""
        if self.manifest_path.exists():
            return json.loads(self.manifest_path.read_text())
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
        if not all((self.root / rel).exists() for rel in record.get("outputs", {}).values()):
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
        return str(Path(path).resolve().relative_to(self.root))

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
        for stage, record in self.load_manifest()["stages"].items():
            if record.get("status") != "done" or (before.get(stage) == record and self.stage_dir(stage).exists()):
                continue
            log.info("stage %-14s downloading from %s", stage, self.remote.child(stage).display)
            with atomic_dir(self.stage_dir(stage)) as tmp:
                if storage.exists(self.remote.child(stage)):
                    storage.download(self.remote.child(stage), tmp)


def open_run_dir(runs_dir: str | Path, name: str, local_dir: str | Path | None = None) -> RunDir:
    """``<runs_dir>/<name>``: a local run directory, or, when ``runs_dir`` is a storage URI, a local mirror of it.

    Args:
        runs_dir: Local folder or storage URI holding run directories (``run.runs_dir``).
        name: The run name (``run.name``).
        local_dir: Folder holding local mirrors of remote runs (``run.local_dir``); default
            ``.cache/raycurate/run-mirrors/<sha of runs_dir>``.  Ignored for a local ``runs_dir``.
    """
    if not storage.is_uri(runs_dir):
        return RunDir(Path(runs_dir) / name)
    runs_dir = str(runs_dir)
    mirror = Path(local_dir) if local_dir else Path(MIRRORS) / hashlib.sha256(runs_dir.encode()).hexdigest()[:16]
    return RunDir(mirror / name, remote=storage.Location.parse(runs_dir).child(name).uri)
