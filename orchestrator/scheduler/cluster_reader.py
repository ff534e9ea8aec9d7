"""What a queue reads from the cluster (`ClusterReader`), and the one place that reads it from
Ray (`RayCluster`, inside the queue service actor): the queue's parts take the seam, so tests
hand them a fake cluster and need no Ray."""

from __future__ import annotations

from typing import Protocol

from orchestrator import ray_private
from orchestrator.scheduler.cluster_view import nodes_from_ray
from orchestrator.scheduler.model import Node


class ClusterReader(Protocol):
    """The cluster as the queue sees it: Ray's GCS in the service, a fake in tests."""

    def nodes(self) -> list[Node]:
        """Alive nodes, with their capacity and what is free."""

    def live_drivers(self) -> set[str]:
        """The Ray job ids of drivers that are alive (a job's controller is one)."""


class RayCluster:
    """The cluster as Ray's GCS tells it, from inside the service actor."""

    def nodes(self) -> list[Node]:
        import ray

        return nodes_from_ray(ray.nodes(), ray_private.available_resources_per_node())

    def live_drivers(self) -> set[str]:
        return {j["JobID"] for j in ray_private.driver_jobs() if not j.get("IsDead")}
