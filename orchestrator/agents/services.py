"""Long-lived actors shared by every job on a cluster: one per cluster, or one per node.

The weight mirror, the node caches, the cache seeders and the secret store keep their state on
disk (or in the storage root), so a detached, named actor found or started on first use is all
they need; Ray's `get_if_exists` makes concurrent first uses agree on one.
"""

from __future__ import annotations

import functools
from typing import Any

from orchestrator import actor_names

NAMESPACE = actor_names.NAMESPACE


def this_node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


@functools.cache
def actor_class(cls: type) -> Any:
    """`ray.remote(cls)`, made once a process: each `ray.remote` of a class exports it to the
    GCS again, about 40 ms before its actor is even asked for, at every job's start."""
    import ray

    return ray.remote(cls)


def actor_alive(name: str) -> bool:
    """Whether the actor `name` (a job's node agent, say) still exists."""
    import ray

    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def shared_actor(
    cls: type, name: str, *, max_concurrency: int, pinned_here: bool = False,
    on_node: str | None = None, args: tuple = (), max_restarts: int = 0,
) -> Any:  # fmt: skip
    """The detached actor `name` of class `cls`, started if it is not running.

    `pinned_here` keeps it on the caller's node, `on_node` on that one: for actors that look
    after a node's disk.
    `max_restarts`: how often Ray starts it again when its process dies (-1: always).
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {
        "name": name,
        "namespace": NAMESPACE,
        "lifetime": "detached",
        "get_if_exists": True,
        "num_cpus": 0,
        "max_concurrency": max_concurrency,
        "max_restarts": max_restarts,
    }
    if node := on_node or (this_node_id() if pinned_here else None):
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    return actor_class(cls).options(**options).remote(*args)
