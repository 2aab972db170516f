"""Run storage on any pyarrow filesystem (local path, ``file://``, ``s3://``, ``gs://``, ``hdfs://``, ...), no Ray.

A :class:`Location` is a URI that ``pyarrow.fs.FileSystem.from_uri`` accepts (query parameters included, e.g.
``s3://bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http``) or a local path; the helpers copy one file or
folder between it and the local disk (used by :mod:`raycurate.rundir`), and :func:`redact` / :func:`scrub` keep
credentials out of messages::

    loc = Location.parse("s3://bucket/runs").child("demo")
    upload_dir("runs-mirror/demo/ingest", loc.child("ingest"))   # replaces the remote folder's contents
    download(loc.child("manifest.json"), "runs-mirror/demo/manifest.json")
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import uuid
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit, urlunsplit

import pyarrow.fs as pafs

from raycurate.errors import UserError

CONFIG_KEY = "run.runs_dir"
OBJECT_STORES = {"s3", "gcs"}  # an object appears whole once written, so writes need no temp name + rename


class StorageError(UserError, RuntimeError):
    """A location could not be parsed or reached; the message names the URI (redacted) and what to do."""


def is_uri(location: str | os.PathLike) -> bool:
    """True when ``location`` has a URI scheme (``s3://...``, ``file:///...``), False for a plain path."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]+://", str(location)) is not None


def strip_userinfo(uri: str) -> str:
    """``uri`` without ``user:secret@`` in its authority (query kept); a plain path unchanged."""
    if not is_uri(uri):
        return uri
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def redact(uri: str) -> str:
    """``uri`` without user info (``KEY:SECRET@``) and without its query string (which may carry endpoints or
    keys): the only form of a URI that is ever printed, logged, saved in a manifest / config or uploaded."""
    if not is_uri(uri):
        return uri
    return urlunsplit(urlsplit(strip_userinfo(uri))._replace(query=""))


def secrets_of(uri: str) -> list[str]:
    """The credential-bearing pieces of ``uri`` (its user info and query values), longest first."""
    if not is_uri(uri):
        return []
    parts = urlsplit(uri)
    found = []
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        found += [userinfo, *userinfo.split(":")]
    for pair in parts.query.split("&"):
        found.append(pair.partition("=")[2])
    return sorted({s for s in found if len(s) >= 4}, key=len, reverse=True)


def scrub(text: str, uri: str) -> str:
    """``text`` (say, an exception message that quotes ``uri``) with every secret of ``uri`` replaced by ``***``."""
    text = text.replace(uri, redact(uri))
    for secret in secrets_of(uri):
        text = text.replace(secret, "***")
    return text


def split_name(location: str | os.PathLike) -> tuple[str, str]:
    """``(parent, name)`` of a URI or path: ``s3://b/runs/x?q=1`` -> ``("s3://b/runs?q=1", "x")``."""
    location = str(location)
    if not is_uri(location):
        path = Path(location)
        return str(path.parent), path.name
    parts = urlsplit(location)
    parent, _, name = parts.path.rstrip("/").rpartition("/")
    return urlunsplit(parts._replace(path=parent)), name


@dataclasses.dataclass(frozen=True)
class Location:
    """A folder or file on a pyarrow filesystem.

    Attributes:
        uri: The URI (or local path) as the user gave it, children joined onto its path.
        fs: The filesystem.
        path: The path inside ``fs``.
    """

    uri: str
    fs: pafs.FileSystem
    path: str

    @classmethod
    def parse(cls, uri: str | os.PathLike, key: str = CONFIG_KEY) -> Location:
        """Resolve ``uri`` with ``FileSystem.from_uri``; a plain path is a ``LocalFileSystem`` path.

        Args:
            uri: A URI or local path.
            key: The config key the value came from (named in errors).

        Raises:
            StorageError: Unknown scheme, bad query parameter or a filesystem pyarrow was built without.
        """
        uri = str(uri)
        if not is_uri(uri):
            return cls(uri, pafs.LocalFileSystem(), str(Path(uri).resolve()))
        try:
            fs, path = pafs.FileSystem.from_uri(uri)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, ValueError or OSError here
            raise StorageError(
                f"{key}={redact(uri)!r} is not a storage URI pyarrow can open ({scrub(str(exc), uri)}); use a local "
                f"path or a URI such as s3://bucket/prefix, gs://bucket/prefix, hdfs://host/path or file:///abs/path"
            ) from None
        return cls(uri, fs, path.rstrip("/"))

    def child(self, *names: str) -> Location:
        """The location ``names`` below this one (joined onto the URI's path, keeping its query)."""
        rel = "/".join(names)
        if is_uri(self.uri):
            parts = urlsplit(self.uri)
            uri = urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{rel}"))
        else:
            uri = os.path.join(self.uri, *names)
        return Location(uri, self.fs, f"{self.path}/{rel}")

    def checked(self) -> Location:
        """This location, after checking that it can be reached and that its bucket exists (object stores).

        Raises:
            StorageError: The bucket is missing, or the filesystem cannot be reached or read.
        """
        exists(self)
        if self.fs.type_name in OBJECT_STORES:
            bucket = self.path.split("/", 1)[0]
            if not exists(Location(self.uri, self.fs, bucket)):
                raise StorageError(f"bucket {bucket!r} of {CONFIG_KEY}={self.display!r} does not exist; create it "
                                   f"(e.g. `aws s3 mb s3://{bucket}`) or point {CONFIG_KEY} at an existing one")
        return self

    @property
    def display(self) -> str:
        """The URI without its query string."""
        return redact(self.uri)


@contextlib.contextmanager
def _errors(action: str, loc: Location) -> Iterator[None]:
    """Turn pyarrow's I/O errors into a :class:`StorageError` that names the URI and the likely fixes."""
    try:
        yield
    except OSError as exc:
        raise StorageError(
            f"could not {action} {loc.display}: {scrub(str(exc), loc.uri)}. Check that the bucket or folder exists and "
            f"that this machine has credentials for it (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for s3://, "
            f"GOOGLE_APPLICATION_CREDENTIALS for gs://), or set {CONFIG_KEY} to a local path"
        ) from None


def exists(loc: Location) -> bool:
    """Whether a file or folder is at ``loc``."""
    with _errors("check", loc):
        return loc.fs.get_file_info(loc.path).type != pafs.FileType.NotFound


def is_file(loc: Location) -> bool:
    """Whether a file is at ``loc``."""
    with _errors("check", loc):
        return loc.fs.get_file_info(loc.path).type == pafs.FileType.File


def list_files(loc: Location) -> list[str]:
    """Paths of every file below ``loc``, relative to it (an empty list when the folder is missing)."""
    with _errors("list", loc):
        infos = loc.fs.get_file_info(pafs.FileSelector(loc.path, allow_not_found=True, recursive=True))
    return sorted(i.path[len(loc.path) + 1:] for i in infos if i.type == pafs.FileType.File)


def read_bytes(loc: Location) -> bytes:
    """The contents of the file at ``loc``."""
    with _errors("read", loc), loc.fs.open_input_stream(loc.path) as fh:
        return fh.read()


def read_text(loc: Location) -> str:
    """The text of the file at ``loc``."""
    return read_bytes(loc).decode("utf-8")


def _local() -> pafs.LocalFileSystem:
    return pafs.LocalFileSystem()


def upload_file(local: str | Path, loc: Location) -> None:
    """Copy the local file ``local`` to ``loc``; readers never see a half-written file.

    On object stores a written object appears whole; elsewhere the file is written to a temp name and renamed.
    """
    object_store = loc.fs.type_name in OBJECT_STORES
    target = loc.path if object_store else f"{loc.path}.{uuid.uuid4().hex}.tmp"
    with _errors("write", loc):
        if not object_store:
            loc.fs.create_dir(loc.path.rsplit("/", 1)[0], recursive=True)
        pafs.copy_files(str(Path(local).resolve()), target, source_filesystem=_local(),
                        destination_filesystem=loc.fs, use_threads=False)
        if target != loc.path:
            loc.fs.move(target, loc.path)


def upload_dir(local: str | Path, loc: Location) -> None:
    """Replace the contents of the remote folder ``loc`` with the local folder ``local`` (no stale files remain).

    Not atomic: callers publish a commit record (the manifest) after it returns.
    """
    with _errors("write", loc):
        loc.fs.delete_dir_contents(loc.path, missing_dir_ok=True)
        loc.fs.create_dir(loc.path, recursive=True)
        if any(Path(local).iterdir()):
            pafs.copy_files(str(Path(local).resolve()), loc.path, source_filesystem=_local(),
                            destination_filesystem=loc.fs)


def download(loc: Location, local: str | Path) -> None:
    """Copy the file or folder at ``loc`` to the local path ``local`` (parent folders are created)."""
    Path(local).parent.mkdir(parents=True, exist_ok=True)
    with _errors("read", loc):
        pafs.copy_files(loc.path, str(Path(local).resolve()), source_filesystem=loc.fs,
                        destination_filesystem=_local())
