"""Checkpoints under the storage root: uploaded whole or not at all, listed from their manifests.

    checkpoints/<project>/<job_id>/rank-<n>/<name>/v<k>/<files>   version k's files, uploaded first
    checkpoints/<project>/<job_id>/manifests/rank-<n>/<name>.json  written last: the commit

A checkpoint without a manifest does not exist for readers, so a crash mid-upload shows nothing.
A checkpoint uploaded again (rewritten in place) goes to the next version; readers keep seeing
the previous one until the new manifest replaces it in one write.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from fsspec import AbstractFileSystem
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator import settings
from orchestrator.errors import ConfigError, UnsupportedFeatureError
from orchestrator.storage.local_checkpoint import LocalFile, Snapshot, snapshot, top_snapshot
from orchestrator.storage.parallel import parallel_map
from orchestrator.storage.retry import describe
from orchestrator.storage.root import StorageRoot

CHUNK = 8 * 1024 * 1024
DOWNLOAD_CONCURRENCY = 8


class ManifestFile(BaseModel):
    path: str  # relative, posix
    size: int
    sha256: str


class Manifest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    project: str
    job_id: str
    node_rank: int
    name: str
    files: list[ManifestFile]
    size_bytes: int
    created_at: float  # when the upload finished
    checkpoint_type: str = "full"  # "lora" when adapter_config.json is present
    lora_rank: int | None = None
    # Each upload of a name is a new version beside the last; the manifest names the one to read.
    version: int | None = None  # None: written before versions, files directly under <name>/
    # False: stored as it was when its writer died before it settled; never loaded as "latest".
    complete: bool = True
    incomplete_reason: str | None = None
    source: str | None = None  # fingerprint of the local directory it was uploaded from
    # Its files were the top-level files of $BT_CHECKPOINT_DIR: a retry restores them there.
    top_level: bool = False
    # A Ray Train checkpoint's part: the node ranks whose workers wrote a part of it, as Train's
    # commit said (whole once each has stored its part).
    train_parts: list[int] | None = None

    @property
    def key(self) -> str:
        return f"{self.job_id}/rank-{self.node_rank}/{self.name}"

    @property
    def files_dir(self) -> str:
        return files_dir(self.project, self.job_id, self.node_rank, self.name, self.version)

    @property
    def bookkeeping(self) -> bool:
        """Files at the top that only keep a trainer's books of its directory checkpoints (Ray
        Train's checkpoint manager, DeepSpeed's `latest` tag): stored, since a resumed run
        reads them, but never a job's "latest" checkpoint to load, nor a model to deploy."""
        return self.top_level and bool(self.files) and {f.path for f in self.files} <= BOOKKEEPING


_ENV = "ORCHESTRATOR_CHECKPOINT_"
# What trainers write at the top of a checkpoint directory about the checkpoints in it: Ray
# Train (`checkpoint_manager_snapshot.json`, the storage check's marker) and DeepSpeed (`latest`,
# the tag to load, and the `zero_to_fp32.py` it copies beside its checkpoints).
BOOKKEEPING = frozenset(
    {"checkpoint_manager_snapshot.json", ".validate_storage_marker", "latest", "zero_to_fp32.py"}
)


class UploadSettings(BaseModel):
    """How a node's uploader behaves; chosen at push (ORCHESTRATOR_CHECKPOINT_* variables)."""

    concurrency: int = Field(default=8, ge=1)
    bandwidth_mbps: float | None = Field(default=None, gt=0)  # MB/s per node, None: no cap
    settle_s: float = Field(default=0.5, ge=0)  # no change for this long means complete
    # How long a checkpoint a known writer has not finished (docs) waits before it settles anyway.
    format_wait_s: float = Field(default=60, ge=0)
    delete_local: bool = False
    flush_timeout_s: float = Field(default=600, gt=0)
    temporary_patterns: tuple[str, ...] = ()  # more names (globs) writers rename when done

    @classmethod
    def from_env(cls) -> UploadSettings:
        """Settings from ORCHESTRATOR_CHECKPOINT_*; a bad value is a ConfigError naming it."""
        values: dict[str, object] = {"delete_local": settings.CHECKPOINT_DELETE_LOCAL.get()}
        for field in ("concurrency", "bandwidth_mbps", "settle_s", "format_wait_s",
                      "flush_timeout_s"):  # fmt: skip
            var = f"{_ENV}{field.upper()}"
            if os.environ.get(var):
                values[field] = os.environ[var]
        patterns = settings.CHECKPOINT_TEMPORARY_PATTERNS.get()
        values["temporary_patterns"] = tuple(p.strip() for p in patterns.split(",") if p.strip())
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            problems = [
                f"{_ENV}{str(err['loc'][0]).upper()}: {err['msg']} (got {err['input']!r})"
                for err in e.errors(include_url=False)
            ]
            raise ConfigError("Invalid checkpoint upload settings:", problems) from None


def files_dir(project: str, job_id: str, rank: int, name: str, version: int | None = None) -> str:
    """Where one version of a checkpoint's files lives (None: written before versions)."""
    base = f"checkpoints/{project}/{job_id}/rank-{rank}/{name}"
    return base if version is None else f"{base}/v{version}"


def manifest_path(project: str, job_id: str, rank: int, name: str) -> str:
    return f"checkpoints/{project}/{job_id}/manifests/rank-{rank}/{name}.json"


class CheckpointChanged(OSError):
    """A file of the checkpoint changed or vanished while it was being uploaded (internal: the
    uploader abandons that upload and says so)."""


class _Throttle:
    """A shared byte budget per second across the upload threads (None: unlimited)."""

    def __init__(self, mbps: float | None) -> None:
        self._rate = mbps * 1e6 if mbps else None
        self._lock = threading.Lock()
        self._next = time.monotonic()

    @property
    def unlimited(self) -> bool:
        return self._rate is None

    def take(self, nbytes: int) -> None:
        if self._rate is None:
            return
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + nbytes / self._rate
            wait = self._next - now - nbytes / self._rate
        if wait > 0:
            time.sleep(wait)


class CheckpointStore:
    def __init__(self, root: StorageRoot) -> None:
        self.root = root

    # --- writing -----------------------------------------------------------------------------

    def upload(
        self,
        local_dir: Path,
        project: str,
        job_id: str,
        rank: int,
        settings: UploadSettings | None = None,
        *,
        seen: Snapshot | None = None,
        replaces: Manifest | None = None,
        incomplete_reason: str | None = None,
        name: str | None = None,
        top_level: bool = False,
        train_parts: list[int] | None = None,
    ) -> Manifest:
        """Upload a local checkpoint as a new version, files in parallel, then commit it.
        `name`: the checkpoint's, `local_dir.name` unless given (the top-level files').

        `seen` is the snapshot judged complete (default: taken now); the files uploaded are
        exactly its files, and one that changed or vanished since raises CheckpointChanged with
        nothing of this version left behind. The manifest is written last: until then readers
        see `replaces` (the version stored before), whose files are removed once it is replaced.
        """
        settings = settings or UploadSettings()
        seen = seen or (top_snapshot(local_dir) if top_level else snapshot(local_dir))
        name = name or local_dir.name
        version = (replaces.version or 0) + 1 if replaces is not None else 1
        base = files_dir(project, job_id, rank, name, version)
        throttle = _Throttle(settings.bandwidth_mbps)
        kind, lora_rank = _checkpoint_type(seen)

        def send(local: LocalFile) -> ManifestFile:
            return self._send(local, f"{base}/{local.rel}", throttle)

        try:
            files = parallel_map(send, seen.files, settings.concurrency)
        except BaseException:
            self._remove_dir(base)
            raise
        manifest = Manifest(
            project=project, job_id=job_id, node_rank=rank, name=name, files=files,
            size_bytes=sum(f.size for f in files), created_at=time.time(),
            checkpoint_type=kind, lora_rank=lora_rank, version=version,
            complete=incomplete_reason is None, incomplete_reason=incomplete_reason,
            source=seen.fingerprint, top_level=top_level, train_parts=train_parts,
        )  # fmt: skip
        self._commit(manifest)
        if replaces is not None:
            self._remove_files(replaces)
        return manifest

    def mark_incomplete(self, manifest: Manifest, reason: str) -> Manifest:
        """Re-commit a stored checkpoint as incomplete (its writer died before it settled)."""
        marked = manifest.model_copy(update={"complete": False, "incomplete_reason": reason})
        self._commit(marked)
        return marked

    def _commit(self, manifest: Manifest) -> None:
        path = manifest_path(manifest.project, manifest.job_id, manifest.node_rank, manifest.name)
        self.root.write_bytes(path, manifest.model_dump_json().encode())

    def _send(self, local: LocalFile, rel: str, throttle: _Throttle) -> ManifestFile:
        """Upload one file and return its entry, if it is still the file the snapshot saw;
        tried again through an outage (storage/retry.py)."""
        target = self.root.path(rel)
        if self.root.is_local:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
        return self.root.retry.call(self._send_once, local, target, throttle)

    def _send_once(self, local: LocalFile, target: str, throttle: _Throttle) -> ManifestFile:
        """Without a bandwidth cap: hash the file from the local disk, then let fsspec's
        `put_file` send it (s3fs sends a large file's parts concurrently). With a cap: stream it
        through the throttle, hashing on the way. Its size, mtime and inode are checked before
        and after; only the local file vanishing is CheckpointChanged (a missing bucket is not).
        """
        try:
            with open(local.path, "rb") as src:
                _check_unchanged(local, os.fstat(src.fileno()))
                if throttle.unlimited:
                    digest, size = _sha256_of(src)
                    self.root.fs.put_file(local.path, target)
                else:
                    digest, size = _stream(src, self.root.fs, target, throttle)
            _check_unchanged(local, os.stat(local.path))
        except FileNotFoundError as e:
            if os.path.exists(local.path):
                raise  # the storage root's: its bucket is gone
            raise CheckpointChanged(f"{local.rel} vanished during the upload") from e
        return ManifestFile(path=local.rel, size=size, sha256=digest)

    def _remove_files(self, manifest: Manifest) -> None:
        """Delete a replaced version's files (best effort: a leftover is never read)."""
        if manifest.version is not None:
            self._remove_dir(manifest.files_dir)
            return
        for f in manifest.files:
            self.root.discard(f"{manifest.files_dir}/{f.path}")

    def _remove_dir(self, rel: str) -> None:
        self.root.discard(rel, recursive=True)  # tried once: never hides what went wrong

    # --- reading -----------------------------------------------------------------------------

    def signed_urls(self, manifest: Manifest, expires_s: int) -> list[tuple[ManifestFile, str]]:
        """A time-limited URL for each of a checkpoint's files, where the store can sign them
        (S3 and GCS with credentials that may sign; a local directory cannot)."""
        if self.root.is_local:
            raise UnsupportedFeatureError(
                f"the storage root {self.root.url} is a local directory: it cannot make URLs. "
                "Use `orchestrator checkpoints download`, or a storage root on S3 or GCS"
            )
        try:
            return [
                (f, self.root.sign(f"{manifest.files_dir}/{f.path}", expires_s))
                for f in manifest.files
            ]
        except NotImplementedError:
            raise UnsupportedFeatureError(
                f"the storage root {self.root.url} cannot sign URLs (its filesystem, "
                f"{type(self.root.fs).__name__}, does not support it)"
            ) from None
        except Exception as e:
            raise UnsupportedFeatureError(
                f"the storage root {self.root.url} could not sign URLs ({describe(e)}): signing "
                "needs credentials that may sign (a GCS service account key, S3 keys)"
            ) from e

    def manifest(self, project: str, job_id: str, rank: int, name: str) -> Manifest | None:
        """The committed manifest of one checkpoint, or None."""
        try:
            data = self.root.read_bytes(manifest_path(project, job_id, rank, name))
        except FileNotFoundError:
            return None
        return Manifest.model_validate(json.loads(data))

    def list(self, project: str | None = None, job_id: str | None = None) -> list[Manifest]:
        """Committed checkpoints, complete or not, oldest first."""
        projects = [project] if project else self.root.list_names("checkpoints")
        found: list[Manifest] = []
        for p in projects:
            jobs = [job_id] if job_id else self.root.list_names(f"checkpoints/{p}")
            for j in jobs:
                for rank_dir in self.root.list_names(f"checkpoints/{p}/{j}/manifests"):
                    for name in self.root.list_names(f"checkpoints/{p}/{j}/manifests/{rank_dir}"):
                        if name.endswith(".json"):
                            rel = f"checkpoints/{p}/{j}/manifests/{rank_dir}/{name}"
                            found.append(
                                Manifest.model_validate(json.loads(self.root.read_bytes(rel)))
                            )
        return sorted(found, key=lambda m: (m.created_at, m.node_rank))

    def download(
        self,
        manifest: Manifest,
        dest: Path,
        progress: Callable[[int], None] | None = None,
    ) -> Path:
        """Fetch one checkpoint into `dest` (created), checking every file's sha256.

        A version replaced while it is read (its files removed) is read again as the new one.
        """
        for _ in range(3):
            try:
                return self._download(manifest, dest, progress)
            except FileNotFoundError:
                current = self.manifest(
                    manifest.project, manifest.job_id, manifest.node_rank, manifest.name
                )
                if current is None or current.version == manifest.version:
                    raise
                manifest = current
        return self._download(manifest, dest, progress)

    def _download(
        self, manifest: Manifest, dest: Path, progress: Callable[[int], None] | None
    ) -> Path:
        dest.mkdir(parents=True, exist_ok=True)

        def fetch(f: ManifestFile) -> None:
            self.root.retry.call(self._fetch, manifest, f, dest / f.path, progress)

        parallel_map(fetch, manifest.files, DOWNLOAD_CONCURRENCY)
        return dest

    def _fetch(
        self,
        manifest: Manifest,
        f: ManifestFile,
        target: Path,
        progress: Callable[[int], None] | None,
    ) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        with (
            self.root.fs.open(self.root.path(f"{manifest.files_dir}/{f.path}"), "rb") as src,
            open(target, "wb") as dst,
        ):
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                dst.write(chunk)
                if progress:
                    progress(len(chunk))
        if digest.hexdigest() != f.sha256:
            raise OSError(f"{manifest.key}/{f.path} does not match its manifest checksum")


def _check_unchanged(local: LocalFile, st: os.stat_result) -> None:
    if (st.st_size, st.st_mtime_ns, st.st_ino) != local.stamp:
        raise CheckpointChanged(f"{local.rel} changed during the upload")


def _stream(
    src: BinaryIO, fs: AbstractFileSystem, target: str, throttle: _Throttle
) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with fs.open(target, "wb") as dst:
        while chunk := src.read(CHUNK):
            throttle.take(len(chunk))
            digest.update(chunk)
            dst.write(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _sha256_of(src: BinaryIO) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    while chunk := src.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def _checkpoint_type(seen: Snapshot) -> tuple[str, int | None]:
    adapter = next((f for f in seen.files if f.rel == "adapter_config.json"), None)
    if adapter is None:
        return "full", None
    try:
        rank = json.loads(Path(adapter.path).read_text()).get("r")
    except (OSError, ValueError):
        rank = None
    return "lora", rank if isinstance(rank, int) else None
