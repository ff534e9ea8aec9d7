"""The training cache's durable copy in the storage root, and syncing a node's copy with it.

caches/<team>/projects/<project>/manifest.json     CacheManifest: every file with its version
caches/<team>/projects/<project>/objects/<version> one file's content at one version
caches/<team>/projects/<project>/nodes/<node id>.json  nodes holding a copy (cache affinity)
caches/<team>/team/manifest.json, objects/          the team cache ($BT_TEAM_CACHE_DIR)

A node keeps a working copy (`data/`) and what it last synced (`sync.json`: each file's size,
mtime and the version it had). Seeding brings the copy up to date, fetching only files whose
version changed; write-back sends only files changed on the node since then. Conflict rule: per
file, the last write-back wins; a file changed by two jobs at once keeps the version of the job
that finished last, and files changed by only one of them are kept (unless two write-backs
write the manifest at the same instant: object stores offer no lock, see docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from orchestrator.storage.parallel import parallel_map
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.stored import Stored

NO_TEAM = "_default"  # the scope of projects pushed without a team
CONCURRENCY = 8
NEVER_SYNCED = frozenset({"huggingface/token", "huggingface/stored_tokens"})


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
        if self.root.exists(f"{self.base}/objects"):
            self.root.remove(f"{self.base}/objects", recursive=True)
        return before

    def seed(self, copy: LocalCopy) -> SyncReport:
        """Bring the node's copy up to date: fetch what changed, drop what was deleted.

        A file this node changed (or deleted, or created) since its last sync stays as it is:
        it is this node's to write back.
        """
        durable = self.manifest().files
        synced = copy.synced()
        stale = []
        for path, f in durable.items():
            entry = synced.get(path)
            if entry is None:
                if not (copy.data / path).exists():
                    stale.append(path)
            elif not copy.changed_here(path, entry) and entry["version"] != f.version:
                stale.append(path)

        def fetch(path: str) -> int:
            local = copy.data / path
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = local.with_name(f".{local.name}.{uuid.uuid4().hex[:6]}.seeding")
            try:
                self.root.get_file(self._object(durable[path].version), tmp)
            except FileNotFoundError:  # replaced by a write-back finishing now: next time
                return -1
            mtime = durable[path].mtime
            os.utime(tmp, (mtime, mtime))
            os.replace(tmp, local)
            synced[path] = copy.entry(path, durable[path].version)
            return local.stat().st_size

        sizes = [n for n in parallel_map(fetch, stale, CONCURRENCY) if n >= 0]
        # Files deleted from the durable copy (by another job's write-back or `cache delete`) go
        # from this node too, unless changed here since.
        deleted = 0
        for path in [p for p in synced if p not in durable]:
            if not copy.changed_here(path, synced[path]):
                (copy.data / path).unlink(missing_ok=True)
                deleted += 1
            del synced[path]
        copy.save(synced)
        return SyncReport(len(sizes), sum(sizes), deleted)

    def write_back(self, copy: LocalCopy) -> SyncReport:
        """Send what changed on the node since its last sync; record deletions.

        Each upload is a new object named by its version, so a concurrent write-back or seeding
        never sees a half-replaced file; superseded objects go once the manifest no longer
        names them.
        """
        synced = copy.synced()
        present = copy.scan()
        changed = [p for p, st in present.items() if p not in synced or _stat(synced[p]) != st]
        removed = [p for p in synced if p not in present]
        versions = {p: uuid.uuid4().hex[:16] for p in changed}

        def send(path: str) -> None:
            self.root.put_file(copy.data / path, self._object(versions[path]))

        parallel_map(send, changed, CONCURRENCY)
        if changed or removed:
            manifest = self.manifest()  # read again just before writing: others' changes stay
            superseded = [manifest.files[p].version for p in [*changed, *removed]
                          if p in manifest.files]  # fmt: skip
            for path in changed:
                size, mtime_ns = present[path]
                manifest.files[path] = CacheFile(
                    size=size, mtime=mtime_ns / 1e9, version=versions[path]
                )
            for path in removed:
                manifest.files.pop(path, None)
            manifest.updated_at = time.time()
            self._write_manifest(manifest)
            for version in superseded:
                with contextlib.suppress(FileNotFoundError):
                    self.root.remove(self._object(version))
        for path in changed:  # as scanned: a file changed during its upload is sent again
            size, mtime_ns = present[path]
            synced[path] = {"size": size, "mtime_ns": mtime_ns, "version": versions[path]}
        for path in removed:
            synced.pop(path, None)
        copy.save(synced)
        return SyncReport(len(changed), sum(present[p][0] for p in changed), len(removed))

    def mark_holder(self, node_id: str) -> None:
        """Note that `node_id` holds a current copy (read for cache affinity)."""
        self.root.write_json(f"{self.base}/nodes/{node_id}.json", {"at": time.time()})

    def holders(self, alive: set[str]) -> list[str]:
        """The nodes in `alive` that have held a copy, most recent first. Markers of nodes no
        longer alive are dropped (node ids do not come back)."""
        stamped = []
        for name in self.root.list_names(f"{self.base}/nodes"):
            node_id = name.removesuffix(".json")
            if node_id not in alive:
                self.root.discard(f"{self.base}/nodes/{name}")
                continue
            with contextlib.suppress(Exception):
                stamped.append((self.root.read_json(f"{self.base}/nodes/{name}")["at"], node_id))
        return [node_id for _, node_id in sorted(stamped, reverse=True)]

    def _object(self, version: str) -> str:
        return f"{self.base}/objects/{version}"

    def _write_manifest(self, manifest: CacheManifest) -> None:
        self.root.write_json(f"{self.base}/manifest.json", manifest.model_dump(mode="json"))


def _stat(entry: dict) -> tuple[int, int]:
    return entry["size"], entry["mtime_ns"]


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
        """Every regular file under data/, but links, files being seeded, and Hugging Face login
        tokens (HF_HOME may point into the cache: a token must not travel with it)."""
        found = {}
        for dirpath, _, names in os.walk(self.data):
            for name in names:
                path = Path(dirpath) / name
                rel = path.relative_to(self.data).as_posix()
                if path.is_symlink() or name.endswith(".seeding") or rel in NEVER_SYNCED:
                    continue
                with contextlib.suppress(FileNotFoundError):  # deleted while we looked
                    st = path.stat()
                    found[rel] = (st.st_size, st.st_mtime_ns)
        return found

    def entry(self, path: str, version: str) -> dict:
        st = (self.data / path).stat()
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "version": version}

    def changed_here(self, path: str, entry: dict) -> bool:
        """Changed or deleted on this node since it last synced `path`."""
        try:
            st = (self.data / path).stat()
        except FileNotFoundError:
            return True
        return (st.st_size, st.st_mtime_ns) != _stat(entry)
