"""The controller's side of the training cache: where to place the job, and what moved.

The seeding and write-back themselves happen on the nodes (`TrainingCacheSeeder`); this module
decides which nodes the job would like (require_cache_affinity), builds each agent's request,
and turns the agents' answers into the status and the log.
"""

from __future__ import annotations

from orchestrator.agents.messages import CacheRequest, CacheWrittenBack, PreparedNode
from orchestrator.sizes import human_bytes
from orchestrator.spec.training import DEFAULT_MOUNT_BASE_PATH
from orchestrator.storage.records import CacheNode, CacheStatus, JobRecord
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.training_cache import CacheStore

NODE_ID_LABEL = "ray.io/node-id"


def cache_enabled(record: JobRecord) -> bool:
    cache = record.spec.job.runtime.cache_config
    return cache is not None and cache.enabled


def cache_request(record: JobRecord) -> CacheRequest | None:
    """What every agent's `prepare` gets for the cache, or None without one."""
    cache = record.spec.job.runtime.cache_config
    if cache is None or not cache.enabled:
        return None
    return CacheRequest(
        team=record.team,
        project=record.project_key,
        mount_base_path=cache.mount_base_path,
        # Baseten's default (written out or not: a stored record cannot tell) is relocated.
        explicit_base=cache.mount_base_path != DEFAULT_MOUNT_BASE_PATH,
        legacy_hf=cache.enable_legacy_hf_mount,
    )


def affinity_selector(
    record: JobRecord, node_count: int, alive: set[str]
) -> tuple[list[dict[str, str]] | None, str | None]:
    """Bundle label selectors that keep the job on `alive` nodes holding its cache, or None
    and why not (None for a job without a cache)."""
    cache = record.spec.job.runtime.cache_config
    if cache is None or not cache.enabled:
        return None, None
    if not cache.require_cache_affinity:
        return None, "require_cache_affinity is off: placed anywhere"
    store = CacheStore(StorageRoot(record.storage_root), record.team, record.project_key)
    held = store.holders(alive)
    if not held:
        return None, "no live node holds the project's cache yet: placed anywhere"
    if len(held) < node_count:
        return None, (
            f"{len(held)} live node(s) hold the project's cache, the job needs {node_count}: "
            "placed anywhere"
        )
    return [{NODE_ID_LABEL: f"in({','.join(held)})"}] * node_count, None


def seeding_status(prepared: list[PreparedNode], affinity: str | None) -> CacheStatus:
    """The status's `cache` from the agents' prepare results."""
    nodes = []
    shared = False
    for info in prepared:
        seeded = info.cache
        assert seeded is not None
        shared = shared or seeded.shared
        parts = (seeded.project.fetched, seeded.team.fetched)
        nodes.append(
            CacheNode(
                rank=info.rank,
                node_id=info.node_id,
                had_copy=seeded.project.had_copy,
                files_seeded=sum(p.files for p in parts),
                bytes_seeded=sum(p.bytes for p in parts),
                files_deleted=sum(p.deleted for p in parts),
                seconds=seeded.seconds,
            )
        )
    return CacheStatus(shared=shared, affinity=affinity, nodes=nodes)


def seeding_lines(status: CacheStatus) -> list[str]:
    lines = []
    for n in status.nodes:
        copy = "had a copy" if n.had_copy else "no copy before"
        lines.append(
            f"rank {n.rank}: training cache ready in {n.seconds:.2f} s ({copy}; fetched "
            f"{n.files_seeded} file(s), {human_bytes(n.bytes_seeded)}; removed {n.files_deleted})"
        )
    return lines


def write_back_line(result: CacheWrittenBack) -> tuple[dict[str, int], str]:
    parts = (result.project.as_dict(), result.team.as_dict())
    total = {k: sum(p[k] for p in parts) for k in ("files", "bytes", "deleted")}
    line = (
        f"training cache written back by rank 0 in {result.seconds:.2f} s: "
        f"{total['files']} file(s), {human_bytes(total['bytes'])} sent, {total['deleted']} removed"
    )
    return total, line
