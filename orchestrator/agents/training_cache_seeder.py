"""The cache seeder: one actor per node keeping its copies of training caches in step.

Before a job's commands start, each node's seeder brings the node's copy of the project cache
and the team cache up to date from the storage root (only what changed). After the job, the
leader's seeder writes the node's changes back. With `ORCHESTRATOR_SHARED_CACHE_DIR` (a
filesystem every node mounts) the copies live there instead: every node of a job sees the same
files, and seeding after the first node's finds nothing to do.
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from orchestrator import actor_names, settings
from orchestrator.agents.messages import CacheCopy, CacheSeeded, CacheWrittenBack
from orchestrator.agents.services import shared_actor, this_node_id
from orchestrator.home import orchestrator_home
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.training_cache import NO_TEAM, CacheStore, LocalCopy

SHARED_CACHE_DIR_ENV = settings.SHARED_CACHE_DIR.name
NODE_TRAINING_CACHE_DIR_ENV = settings.TRAINING_CACHE_DIR.name


def copies_dir() -> Path:
    shared = settings.SHARED_CACHE_DIR.get()
    if shared:
        return Path(shared)
    # Not in the node root (a temp dir by default): a cleaner emptying it would look like the
    # job deleting those files, and the write-back would delete them for everyone.
    home = orchestrator_home() / "training-cache"
    return Path(settings.TRAINING_CACHE_DIR.get() or home)


class TrainingCacheSeeder:
    """A threaded Ray actor pinned to its node; its state is on disk (LocalCopy)."""

    def __init__(self) -> None:
        self.base = copies_dir()
        self.shared = bool(settings.SHARED_CACHE_DIR.get())

    def seed(self, storage_root: str, team: str | None, project: str) -> CacheSeeded:
        """Update this node's copies; their directories and what it took."""
        started = time.monotonic()
        root = StorageRoot(storage_root)
        copies = []
        for proj in (project, None):  # the project's cache, then the team's
            copy_dir = self._copy_dir(team, proj)
            with _locked(copy_dir):
                copy = LocalCopy(copy_dir)
                had_copy = bool(copy.synced())
                report = CacheStore(root, team, proj).seed(copy)
            copies.append(CacheCopy(str(copy.data), had_copy, report))
        self._mark_holder(root, team, project)
        seconds = round(time.monotonic() - started, 3)
        return CacheSeeded(self.shared, copies[0], copies[1], seconds)

    def write_back(self, storage_root: str, team: str | None, project: str) -> CacheWrittenBack:
        started = time.monotonic()
        root = StorageRoot(storage_root)
        reports = []
        for proj in (project, None):
            copy_dir = self._copy_dir(team, proj)
            with _locked(copy_dir):
                reports.append(CacheStore(root, team, proj).write_back(LocalCopy(copy_dir)))
        self._mark_holder(root, team, project)
        return CacheWrittenBack(reports[0], reports[1], round(time.monotonic() - started, 3))

    def _copy_dir(self, team: str | None, project: str | None) -> Path:
        team_dir = self.base / (team or NO_TEAM)
        return team_dir / "projects" / project if project is not None else team_dir / "team"

    def _mark_holder(self, root: StorageRoot, team: str | None, project: str) -> None:
        if self.shared:
            return  # every node sees the shared copy: no node is preferred
        CacheStore(root, team, project).mark_holder(this_node_id())


def cache_seeder_here() -> Any:
    """This node's seeder actor, started on first use."""
    return shared_actor(
        TrainingCacheSeeder, cache_seeder_name(this_node_id()), pinned_here=True, max_concurrency=8
    )


cache_seeder_name = actor_names.training_cache_seeder


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """One sync of a copy at a time, across jobs, actors and (on a shared filesystem) nodes."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
