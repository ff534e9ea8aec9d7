"""The node cache: one actor per node keeping mirrored weight sets on local disk.

A node agent asks it for each of its job's sets during DEPLOYING. A set already here (a node
hit) is handed over at once; otherwise it comes from the cluster cache (a shared filesystem, when
the cluster has one) or from the mirror in the storage root, and stays here for the next job
until the budget needs its room (least recently used first, never while a job uses it).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from orchestrator import actor_names, settings
from orchestrator.agents.messages import Delivered
from orchestrator.agents.services import actor_alive, shared_actor, this_node_id
from orchestrator.home import orchestrator_home
from orchestrator.storage.parallel import parallel_map
from orchestrator.storage.records import DeliveryTier
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.weight_set_cache import WeightSetCache
from orchestrator.storage.weights import WeightSet, copy_concurrency, file_path

NODE_CACHE_DIR_ENV = settings.NODE_CACHE_DIR.name
NODE_CACHE_GIB_ENV = settings.NODE_CACHE_GIB.name
CLUSTER_CACHE_DIR_ENV = settings.CLUSTER_CACHE_DIR.name
CLUSTER_CACHE_GIB_ENV = settings.CLUSTER_CACHE_GIB.name
GIB = 1024**3


class WeightCache:
    """A threaded Ray actor pinned to its node; its state lives on disk (see WeightSetCache)."""

    def __init__(self) -> None:
        # Not in the node root (a temp dir by default): caches must outlive reboots and cleaners.
        directory = Path(settings.NODE_CACHE_DIR.get() or orchestrator_home() / "weights-cache")
        self.node = WeightSetCache(directory, _budget(directory, settings.NODE_CACHE_GIB))
        shared = settings.CLUSTER_CACHE_DIR.get()
        self.cluster = (
            WeightSetCache(Path(shared), _budget(Path(shared), settings.CLUSTER_CACHE_GIB))
            if shared
            else None
        )
        self._locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)

    def deliver(self, storage_root: str, weight_set: WeightSet, holder: str) -> Delivered:
        """The local directory holding the set's files, and where they came from.

        `holder` (the asking agent's actor name) keeps the set from eviction until `release`.
        """
        ws = weight_set
        started = time.monotonic()
        with self._locks[ws.key]:  # one fill per set on this node; the others wait for it
            if (hit := self.node.get(ws.key, holder)) is not None:
                return _delivered(hit, DeliveryTier.NODE, 0, started)
            tier, fill = DeliveryTier.MIRROR, _from_mirror(StorageRoot(storage_root), ws)
            if self.cluster is not None:
                shared = self.cluster.get(ws.key, holder)
                if shared is None:
                    shared = self.cluster.put(
                        ws.key, ws.total_bytes, fill, holder, actor_alive
                    ).path
                else:
                    tier = DeliveryTier.CLUSTER
                fill = _from_directory(shared, ws)
            put = self.node.put(ws.key, ws.total_bytes, fill, holder, actor_alive)
            if self.cluster is not None:
                self.cluster.release(holder)
            return _delivered(
                put.path, tier, ws.total_bytes, started, tuple(put.evicted), put.over_budget
            )

    def release(self, holder: str) -> None:
        self.node.release(holder)
        if self.cluster is not None:
            self.cluster.release(holder)


def weight_cache_here() -> Any:
    """This node's cache actor, started on first use; it outlives jobs, as its disk does."""
    name = actor_names.weight_cache(this_node_id())
    return shared_actor(WeightCache, name, pinned_here=True, max_concurrency=16)


def _delivered(
    path: Path, tier: DeliveryTier, copied: int, started: float,
    evicted: tuple[str, ...] = (), over_budget: bool = False,
) -> Delivered:  # fmt: skip
    seconds = round(time.monotonic() - started, 3)
    return Delivered(str(path), tier, copied, seconds, evicted, over_budget)


def _from_mirror(root: StorageRoot, ws: WeightSet) -> Any:
    def fill(dest: Path) -> None:
        def one(path: str) -> None:
            root.get_file(file_path(ws.key, path), dest / path)

        parallel_map(one, [f.path for f in ws.files], copy_concurrency())
        _check_sizes(dest, ws)

    return fill


def _from_directory(source: Path, ws: WeightSet) -> Any:
    def fill(dest: Path) -> None:
        shutil.copytree(source, dest, copy_function=shutil.copyfile)
        _check_sizes(dest, ws)

    return fill


def _check_sizes(dest: Path, ws: WeightSet) -> None:
    for f in ws.files:
        size = (dest / f.path).stat().st_size
        if size != f.size:
            raise RuntimeError(f"{ws.source}: {f.path} arrived with {size} bytes, not {f.size}")


def _budget(directory: Path, env: settings.Setting[float | None]) -> int:
    """From `env` (GiB), else 80% of what the cache could use when it starts: the disk's free
    space plus what the cache already holds (a restart must not shrink it)."""
    if (value := env.get()) is not None:
        return int(value * GIB)
    held = WeightSetCache(directory, 0).usage()["used_bytes"]
    return int((shutil.disk_usage(directory).free + held) * 0.8)
