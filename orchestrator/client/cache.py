"""The training cache as a user sees it from outside a job: list its files, empty it."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.client.connection import storage
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.training_cache import CacheStore


@dataclass(frozen=True)
class CacheEntry:
    path: str
    size_bytes: int
    modified: float


def project_team(project: str, storage_root: str | None = None) -> str | None:
    """The team of the project's most recent job: whose cache `project` means by default."""
    records = [r for r in JobStore(storage(storage_root)).records() if r.project == project]
    return max(records, key=lambda r: r.created_at).team if records else None


def cache_summary(
    project: str, team: str | None = None, *, storage_root: str | None = None
) -> list[CacheEntry]:
    """Every file of the project's cache (as last written back), sorted by path."""
    manifest = CacheStore(storage(storage_root), team, project).manifest()
    return [CacheEntry(path, f.size, f.mtime) for path, f in sorted(manifest.files.items())]


def delete_cache(
    project: str, team: str | None = None, *, storage_root: str | None = None
) -> tuple[int, int]:
    """Empty the project's cache; (files, bytes) it held. Nodes drop their copies when next
    seeded, except files a running job has changed since."""
    before = CacheStore(storage(storage_root), team, project).clear()
    return len(before.files), before.total_bytes
