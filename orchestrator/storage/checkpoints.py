"""Checkpoints under the storage root: uploaded whole or not at all, listed from their manifests.

    checkpoints/<project>/<job_id>/rank-<n>/<name>/<files>      the files, uploaded first
    checkpoints/<project>/<job_id>/manifests/rank-<n>/<name>.json   written last: the commit

A checkpoint without a manifest does not exist for readers, so a crash mid-upload shows nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.envflags import env_flag
from orchestrator.errors import ConfigError
from orchestrator.storage.root import StorageRoot

CHUNK = 8 * 1024 * 1024


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

    @property
    def key(self) -> str:
        return f"{self.job_id}/rank-{self.node_rank}/{self.name}"


_ENV = "ORCHESTRATOR_CHECKPOINT_"


class UploadSettings(BaseModel):
    """How a node's uploader behaves; chosen at push (ORCHESTRATOR_CHECKPOINT_* variables)."""

    concurrency: int = Field(default=8, ge=1)
    bandwidth_mbps: float | None = Field(default=None, gt=0)  # MB/s per node, None: no cap
    settle_s: float = Field(default=0.5, ge=0)  # no write for this long means complete
    delete_local: bool = False
    flush_timeout_s: float = Field(default=600, gt=0)

    @classmethod
    def from_env(cls) -> UploadSettings:
        """Settings from ORCHESTRATOR_CHECKPOINT_*; a bad value is a ConfigError naming it."""
        values: dict[str, object] = {"delete_local": env_flag(f"{_ENV}DELETE_LOCAL")}
        for field in ("concurrency", "bandwidth_mbps", "settle_s", "flush_timeout_s"):
            var = f"{_ENV}{field.upper()}"
            if os.environ.get(var):
                values[field] = os.environ[var]
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            problems = [
                f"{_ENV}{str(err['loc'][0]).upper()}: {err['msg']} (got {err['input']!r})"
                for err in e.errors(include_url=False)
            ]
            raise ConfigError("Invalid checkpoint upload settings:", problems) from None


def files_dir(project: str, job_id: str, rank: int, name: str) -> str:
    return f"checkpoints/{project}/{job_id}/rank-{rank}/{name}"


def manifest_path(project: str, job_id: str, rank: int, name: str) -> str:
    return f"checkpoints/{project}/{job_id}/manifests/rank-{rank}/{name}.json"


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
    ) -> Manifest:
        """Upload a local checkpoint directory, files in parallel, then commit its manifest."""
        settings = settings or UploadSettings()
        throttle = _Throttle(settings.bandwidth_mbps)
        name = local_dir.name
        base = files_dir(project, job_id, rank, name)
        paths = sorted(p for p in local_dir.rglob("*") if p.is_file() and not p.is_symlink())

        def send(path: Path) -> ManifestFile:
            rel = path.relative_to(local_dir).as_posix()
            digest, size = self._copy_up(path, f"{base}/{rel}", throttle)
            return ManifestFile(path=rel, size=size, sha256=digest)

        with ThreadPoolExecutor(max_workers=settings.concurrency) as pool:
            files = list(pool.map(send, paths))
        kind, lora_rank = _checkpoint_type(local_dir)
        manifest = Manifest(
            project=project, job_id=job_id, node_rank=rank, name=name, files=files,
            size_bytes=sum(f.size for f in files), created_at=time.time(),
            checkpoint_type=kind, lora_rank=lora_rank,
        )  # fmt: skip
        self.root.write_bytes(
            manifest_path(project, job_id, rank, name), manifest.model_dump_json().encode()
        )
        return manifest

    def _copy_up(self, local: Path, rel: str, throttle: _Throttle) -> tuple[str, int]:
        """Upload one file and return its sha256 and size.

        Without a bandwidth cap: hash it from the local disk, then let fsspec's `put_file` send it
        (s3fs sends a large file's parts concurrently). With a cap: stream it through the
        throttle, hashing on the way.
        """
        target = self.root.path(rel)
        if self.root.is_local:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
        if throttle.unlimited:
            digest, size = _sha256_of(local)
            self.root.fs.put_file(str(local), target)
            return digest, size
        digest, size = hashlib.sha256(), 0
        with open(local, "rb") as src, self.root.fs.open(target, "wb") as dst:
            while chunk := src.read(CHUNK):
                throttle.take(len(chunk))
                digest.update(chunk)
                dst.write(chunk)
                size += len(chunk)
        return digest.hexdigest(), size

    def is_uploaded(self, project: str, job_id: str, rank: int, name: str) -> bool:
        return self.root.exists(manifest_path(project, job_id, rank, name))

    # --- reading -----------------------------------------------------------------------------

    def list(self, project: str | None = None, job_id: str | None = None) -> list[Manifest]:
        """Complete checkpoints, oldest first."""
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
        """Fetch one checkpoint into `dest` (created), checking every file's sha256."""
        base = files_dir(manifest.project, manifest.job_id, manifest.node_rank, manifest.name)
        dest.mkdir(parents=True, exist_ok=True)
        for f in manifest.files:
            target = dest / f.path
            target.parent.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256()
            with (
                self.root.fs.open(self.root.path(f"{base}/{f.path}"), "rb") as src,
                open(target, "wb") as dst,
            ):
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
                    if progress:
                        progress(len(chunk))
            if digest.hexdigest() != f.sha256:
                raise OSError(f"{manifest.key}/{f.path} does not match its manifest checksum")
        return dest


def _sha256_of(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _checkpoint_type(local_dir: Path) -> tuple[str, int | None]:
    adapter = local_dir / "adapter_config.json"
    if not adapter.is_file():
        return "full", None
    try:
        rank = json.loads(adapter.read_text()).get("r")
    except (OSError, ValueError):
        rank = None
    return "lora", rank if isinstance(rank, int) else None
