"""Run directory layout, atomic writes and the manifest.

``runs/<name>/`` holds ``config.yaml`` (the resolved config), ``manifest.json`` and one folder per stage.  The
manifest records, per stage, ``{status, seconds, config_hash, outputs, metrics}`` and, for the run,
``rows: {input, accepted, rejected}`` with ``input == accepted + rejected``.  Every file is written to a temporary
name in the same folder and renamed into place, so a crash never leaves a half-written output behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

MANIFEST = "manifest.json"


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
    """A run directory and its manifest.

    Args:
        root: ``runs/<name>``; created if missing.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

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
        return {"run": self.root.name, "rows": {}, "stages": {}}

    def save_manifest(self, manifest: dict) -> None:
        atomic_write_json(self.manifest_path, manifest)

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
        manifest = self.load_manifest()
        manifest["stages"][stage] = record
        self.save_manifest(manifest)

    def relative(self, path: str | Path) -> str:
        """``path`` relative to the run root (how outputs are stored in the manifest)."""
        return str(Path(path).resolve().relative_to(self.root))
