"""A storage root: any fsspec URL (a local directory, s3://bucket/prefix, gs://bucket/prefix).

Its calls ride out outages (storage/retry.py): a transient error is tried again until the root's
`retry` budget is spent; a permanent one is raised at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from orchestrator import settings
from orchestrator.home import orchestrator_home
from orchestrator.storage.retry import StorageRetry

STORAGE_ROOT_ENV = settings.STORAGE_ROOT.name
# gcsfs's experimental hierarchical-namespace probing hangs for 60 s against GCS emulators; it
# must be off before gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def default_storage_root() -> str:
    """$ORCHESTRATOR_STORAGE_ROOT, else `storage/` under $ORCHESTRATOR_HOME (~/.orchestrator)."""
    return settings.STORAGE_ROOT.get() or str(orchestrator_home() / "storage")


def _storage_options(url: str) -> dict[str, Any]:
    if "://" not in url:
        return {}
    # Other processes write records and log segments: never answer from a stale listing.
    options: dict[str, Any] = {"use_listings_cache": False}
    if url.startswith("gs://") and os.environ.get("STORAGE_EMULATOR_HOST"):
        options["token"] = "anon"  # an emulator (fake-gcs-server) takes no credentials
    return options


class StorageRoot:
    """Paths relative to the root; writes are all-or-nothing for readers."""

    def __init__(self, url: str | os.PathLike[str], retry: StorageRetry | None = None) -> None:
        url = os.fspath(url)
        if "://" not in url or url.startswith("file://"):
            url = str(Path(url.removeprefix("file://")).expanduser().resolve())
        self.url = url.rstrip("/")
        self.fs, self._base = fsspec.core.url_to_fs(self.url, **_storage_options(self.url))
        self._base = self._base.rstrip("/")
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.retry = retry or StorageRetry(self.url)

    def __repr__(self) -> str:
        return f"StorageRoot({self.url!r})"

    def path(self, rel: str) -> str:
        return f"{self._base}/{rel.lstrip('/')}"

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.retry.call(self._write_bytes, rel, data)

    def _write_bytes(self, rel: str, data: bytes) -> None:
        target = self.path(rel)
        if self.is_local:  # object stores' puts are atomic already; a local file needs a rename
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{target}.{uuid.uuid4().hex[:8]}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        else:
            self.fs.pipe_file(target, data)

    def create_bytes(self, rel: str, data: bytes) -> bool:
        """Write `rel` only if nothing is there yet; True if this call created it. Of any number
        of writers racing on several machines, exactly one creates it: the way to commit a
        first-come record. A retry after a lost reply to a put that succeeded sees the object
        and says False, so a caller reads back what is there, never assumes its own bytes."""
        return self.retry.call(self._create_bytes, rel, data)

    def _create_bytes(self, rel: str, data: bytes) -> bool:
        target = self.path(rel)
        try:
            if self.is_local:
                # Written whole to a temp file, then linked in: a link fails if the name exists
                # (O_EXCL would let a reader see the file half-written).
                Path(target).parent.mkdir(parents=True, exist_ok=True)
                tmp = f"{target}.{uuid.uuid4().hex[:8]}.tmp"
                with open(tmp, "wb") as f:
                    f.write(data)
                try:
                    os.link(tmp, target)
                finally:
                    os.unlink(tmp)
            else:
                # A conditional put: S3's `If-None-Match: *`, GCS's `ifGenerationMatch=0`; the
                # store answers 412 if the object exists, which s3fs and gcsfs raise as this.
                self.fs.pipe_file(target, data, mode="create")
        except FileExistsError:
            return False
        return True

    def read_bytes(self, rel: str) -> bytes:
        return self.retry.call(self.fs.cat_file, self.path(rel))

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, json.dumps(obj, indent=1, sort_keys=True).encode())

    def create_json(self, rel: str, obj: Any) -> bool:
        """`create_bytes` of a JSON document: True if this call created `rel`."""
        return self.create_bytes(rel, json.dumps(obj, indent=1, sort_keys=True).encode())

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def exists(self, rel: str) -> bool:
        return self.retry.call(self.fs.exists, self.path(rel))

    def list_names(self, rel: str) -> list[str]:
        """Names directly under `rel` (files and directories); empty if it does not exist."""
        try:
            entries = self.retry.call(self.fs.ls, self.path(rel), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def put_file(self, local: Path, rel: str) -> None:
        self.retry.call(self._put_file, local, rel)

    def _put_file(self, local: Path, rel: str) -> None:
        target = self.path(rel)
        if self.is_local:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{target}.{uuid.uuid4().hex[:8]}.tmp"
            self.fs.put_file(str(local), tmp)
            os.replace(tmp, target)
        else:
            self.fs.put_file(str(local), target)

    def get_file(self, rel: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        self.retry.call(self.fs.get_file, self.path(rel), str(local))

    def remove(self, rel: str, recursive: bool = False) -> None:
        """Delete `rel` (a directory's tree with `recursive`); FileNotFoundError if absent."""
        self.retry.call(self.fs.rm, self.path(rel), recursive=recursive)

    def discard(self, rel: str, recursive: bool = False) -> None:
        """Delete `rel` if it can be, tried once and never retried: for leftovers that are never
        read (a replaced version's files, a failed upload's, a dead node's marker), whose callers
        must not wait out an outage for them, least of all before raising the error that made
        them. docs/architecture.md#storage-outages."""
        with contextlib.suppress(Exception):
            self.fs.rm(self.path(rel), recursive=recursive)

    def sign(self, rel: str, expires_s: int) -> str:
        """A time-limited URL for `rel` (NotImplementedError where the store cannot sign)."""
        return self.retry.call(self.fs.sign, self.path(rel), expiration=expires_s)
