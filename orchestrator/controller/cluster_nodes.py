"""What a job's controller reads of the cluster's nodes (`ClusterNodes`), and the one place it
reads them from Ray (`RayClusterNodes`): the fault judge and the placement take the seam, so
tests hand them a fake cluster, as the queue's parts take scheduler/cluster_reader.py's.
"""

from __future__ import annotations

import socket
from typing import Any, Protocol

from orchestrator import ray_private

RAYLET_PROBE_S = 1.0  # a connection to a live raylet's port is accepted well within this


class ClusterNodes(Protocol):
    """The nodes as the GCS and their raylets tell them."""

    def table(self) -> list[dict[str, Any]]:
        """Every node as `ray.nodes()` describes it (alive or not; `describe_shortfall` reads
        this shape)."""

    def draining(self) -> dict[str, float]:
        """Nodes being drained (a preemption notice) -> their deadline, epoch seconds (0: none
        given)."""

    def raylet_answers(self, node: dict[str, Any]) -> bool:
        """Whether the node's raylet accepts a connection: a crashed node's does not, long
        before the GCS declares it dead."""


def live(nodes: ClusterNodes) -> dict[str, dict[str, Any]]:
    """The nodes the GCS calls alive, by id."""
    return {n["NodeID"]: n for n in nodes.table() if n.get("Alive")}


def raylet_address(node: dict[str, Any]) -> str:
    """The node's raylet, host:port, from its `ray.nodes()` entry."""
    return f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"


class RayClusterNodes:
    """The cluster as this driver's Ray connection tells it."""

    def table(self) -> list[dict[str, Any]]:
        import ray

        return list(ray.nodes())

    def draining(self) -> dict[str, float]:
        try:
            return {node: ms / 1000 for node, ms in ray_private.draining_nodes().items()}
        except Exception:  # asked again at the next look
            return {}

    def raylet_answers(self, node: dict[str, Any]) -> bool:
        address = (node["NodeManagerAddress"], node["NodeManagerPort"])
        try:
            with socket.create_connection(address, timeout=RAYLET_PROBE_S):
                return True
        except OSError:
            return False
