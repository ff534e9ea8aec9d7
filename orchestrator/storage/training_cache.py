"""The training cache's durable copy in the storage root, and syncing a node's copy with it.

caches/<team>/projects/<project>/files/<path>    the project cache ($BT_PROJECT_CACHE_DIR)
caches/<team>/projects/<project>/manifest.json   CacheManifest: every file with its version
caches/<team>/team/files/<path>                  the team cache ($BT_TEAM_CACHE_DIR)
caches/<team>/team/manifest.json

A node keeps a working copy (`data/`) and what it last synced (`sync.json`: each file's size,
mtime and the version it had). Seeding brings the copy up to date, fetching only files whose
version changed; write-back sends only files changed on the node since then. Conflict rule: per
file, the last write-back wins; a file changed by two jobs at once keeps the version of the job
that finished last, and files changed by only one of them are never lost.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from orchestrator.storage.root import StorageRoot
from orchestrator.storage.stored import Stored

NO_TEAM = "_default"  # the scope of projects pushed without a team
CONCURRENCY = 8


class CacheFile(Stored):
    size: int
    mtime: float  # when it was last written on the node that wrote it back
    version: str


class CacheManifest(Stored):
    files: dict[str, CacheFile] = Field(default_factory=dict)
    updated_at: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


@dataclass(frozen=True)
class SyncReport:
    files: int = 0  # fetched (seed) or sent (write-back)
    bytes: int = 0
    deleted: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"files": self.files, "bytes": self.bytes, "deleted": self.deleted}


def scope_dir(team: str | None, project: str | None) -> str:
    """The project cache of (team, project), or the team cache when `project` is None."""
    base = f"caches/{team or NO_TEAM}"
    return f"{base}/projects/{project}" if project is not None else f"{base}/team"


class CacheStore:
    """One scope (a project's cache or a team's) in the storage root."""

    def __init__(self, root: StorageRoot, team: str | None, project: str | None) -> None:
        self.root = root
        self.base = scope_dir(team, project)

    def manifest(self) -> CacheManifest:
        try:
            return CacheManifest.model_validate(self.root.read_json(f"{self.base}/manifest.json"))
        except FileNotFoundError:
            return CacheManifest()

    def clear(self) -> CacheManifest:
        """Empty the cache; nodes drop their copies of its files at their next seeding."""
        before = self.manifest()
        self._write_manifest(CacheManifest(updated_at=time.time()))
        if self.root.exists(f"{self.base}/files"):
            self.root.fs.rm(self.root.path(f"{self.base}/files"), recursive=True)
        return before

    def seed(self, copy: LocalCopy) -> SyncReport:
        """Bring the node's copy up to date: fetch what changed, drop what was deleted."""
        durable = self.manifest().files
        synced = copy.synced()
        stale = [p for p, f in durable.items() if not copy.is_current(p, f.version, synced)]

        def fetch(path: str) -> int:
            local = copy.data / path
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = local.with_name(f".{local.name}.{uuid.uuid4().hex[:6]}.seeding")
            self.root.get_file(f"{self.base}/files/{path}", tmp)
            mtime = durable[path].mtime
            os.utime(tmp, (mtime, mtime))
            os.replace(tmp, local)
            return local.stat().st_size

        with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
            sizes = list(pool.map(fetch, stale))
        for path in stale:
            synced[path] = copy.entry(path, durable[path].version)
        # Files deleted from the durable copy (by another job's write-back or `cache delete`) go
        # from this node too, unless changed here since: those are this node's to write back.
        deleted = 0
        for path in [p for p in synced if p not in durable]:
            if copy.unchanged(path, synced[path]):
                (copy.data / path).unlink(missing_ok=True)
                deleted += 1
            del synced[path]
        copy.save(synced)
        return SyncReport(len(stale), sum(sizes), deleted)

    def write_back(self, copy: LocalCopy) -> SyncReport:
        """Send what changed on the node since its last sync; record deletions."""
        synced = copy.synced()
        present = copy.scan()
        changed = [p for p in present if p not in synced or not copy.unchanged(p, synced[p])]
        removed = [p for p in synced if p not in present]
        versions = {p: uuid.uuid4().hex[:16] for p in changed}

        def send(path: str) -> None:
            self.root.put_file(copy.data / path, f"{self.base}/files/{path}")

        with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
            list(pool.map(send, changed))
        if changed or removed:
            manifest = self.manifest()  # read again just before writing: others' changes stay
            for path in changed:
                size, mtime_ns = present[path]
                manifest.files[path] = CacheFile(
                    size=size, mtime=mtime_ns / 1e9, version=versions[path]
                )
            for path in removed:
                manifest.files.pop(path, None)
            manifest.updated_at = time.time()
            self._write_manifest(manifest)
            for path in removed:
                if self.root.exists(f"{self.base}/files/{path}"):
                    self.root.fs.rm(self.root.path(f"{self.base}/files/{path}"))
        for path in changed:
            synced[path] = copy.entry(path, versions[path])
        for path in removed:
            synced.pop(path, None)
        copy.save(synced)
        return SyncReport(len(changed), sum(present[p][0] for p in changed), len(removed))

    def _write_manifest(self, manifest: CacheManifest) -> None:
        self.root.write_json(f"{self.base}/manifest.json", manifest.model_dump(mode="json"))


class LocalCopy:
    """A node's working copy of one scope: `data/` (what jobs see) and `sync.json`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.data = directory / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self._sync = directory / "sync.json"

    def synced(self) -> dict[str, dict]:
        try:
            return json.loads(self._sync.read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def save(self, synced: dict[str, dict]) -> None:
        tmp = self._sync.with_name(f".sync.{uuid.uuid4().hex[:6]}")
        tmp.write_text(json.dumps(synced))
        os.replace(tmp, self._sync)

    def scan(self) -> dict[str, tuple[int, int]]:
        """Every regular file under data/ (symlinks and in-flight seeding files skipped)."""
        found = {}
        for dirpath, _, names in os.walk(self.data):
            for name in names:
                path = Path(dirpath) / name
                if path.is_symlink() or name.endswith(".seeding"):
                    continue
                st = path.stat()
                found[path.relative_to(self.data).as_posix()] = (st.st_size, st.st_mtime_ns)
        return found

    def entry(self, path: str, version: str) -> dict:
        st = (self.data / path).stat()
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "version": version}

    def unchanged(self, path: str, entry: dict) -> bool:
        try:
            st = (self.data / path).stat()
        except FileNotFoundError:
            return True
        return (st.st_size, st.st_mtime_ns) == (entry["size"], entry["mtime_ns"])

    def is_current(self, path: str, version: str, synced: dict[str, dict]) -> bool:
        """This node has that version, or a change of its own made on top of it (kept, to be
        written back)."""
        entry = synced.get(path)
        return entry is not None and entry["version"] == version and (self.data / path).exists()
