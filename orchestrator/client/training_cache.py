"""The training cache as a user sees it from outside a job: list its files, empty it."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.client.audit import audited
from orchestrator.client.connection import storage
from orchestrator.errors import OrchestratorError, ProjectNotFound
from orchestrator.storage import layout
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.projects import ProjectStore
from orchestrator.storage.records import JobRecord
from orchestrator.storage.training_cache import CacheStore


@dataclass(frozen=True)
class CacheEntry:
    path: str
    size_bytes: int
    modified: float


def project_team(project: str, storage_root: str | None = None) -> str | None:
    """The team of the project's most recent job: whose cache `project` (its name or id) means
    by default."""
    latest = _latest_record(project, storage_root)
    return latest.team if latest else None


def _latest_record(project: str, storage_root: str | None) -> JobRecord | None:
    records = [
        r for r in JobStore(storage(storage_root)).records()
        if project in (r.project, r.project_key)
    ]  # fmt: skip
    return max(records, key=lambda r: r.created_at) if records else None


def _key(project: str, storage_root: str | None) -> str:
    """The project's id, which its cache is stored under. A project not registered is one
    pushed before ids existed, whose cache is under its name: such a name was a safe path
    segment, so any other (one with '/', one longer than a file name may be) is no project's."""
    root = storage(storage_root)
    found = ProjectStore(root).resolve(project)
    if found is not None:
        return found.id
    if not layout.is_segment(project):
        raise ProjectNotFound(f"no project named {project!r} in {root.url}")
    return project


def _team(team: str | None, storage_root: str | None) -> str | None:
    """Team names are safe names (spec), a path segment of the cache: any other is no team's."""
    if team is not None and not layout.is_segment(team):
        raise OrchestratorError(f"no team named {team!r} in {storage(storage_root).url}")
    return team


def cache_summary(
    project: str, team: str | None = None, *, storage_root: str | None = None
) -> list[CacheEntry]:
    """Every file of the project's cache (as last written back), sorted by path."""
    key = _key(project, storage_root)
    manifest = CacheStore(storage(storage_root), _team(team, storage_root), key).manifest()
    return [CacheEntry(path, f.size, f.mtime) for path, f in sorted(manifest.files.items())]


def delete_cache(
    project: str, team: str | None = None, *, storage_root: str | None = None
) -> tuple[int, int]:
    """Empty the project's cache; (files, bytes) it held. Nodes drop their copies when next
    seeded, except files a running job has changed since."""
    key = _key(project, storage_root)
    root, team = storage(storage_root), _team(team, storage_root)
    with audited(root, "cache delete", project=project, team=team) as event:
        before = CacheStore(root, team, key).clear()
        event["detail"] = f"{len(before.files)} files, {before.total_bytes} bytes"
    return len(before.files), before.total_bytes
