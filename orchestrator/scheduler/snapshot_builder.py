"""What the policy decides on (`SnapshotBuilder`): the root's entries and quotas beside the
nodes its `ClusterReader` reports, as a `ClusterSnapshot`. The one place a decision reads the
cluster."""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.scheduler.cluster_reader import ClusterReader
from orchestrator.scheduler.cluster_view import snapshot
from orchestrator.scheduler.model import ClusterSnapshot
from orchestrator.storage.queue_store import QueueEntry, Quotas


class SnapshotBuilder:
    """Snapshots of one cluster; `autoscaling`: a job bigger than the nodes now may still fit."""

    def __init__(self, cluster: ClusterReader, autoscaling: bool = False) -> None:
        self.cluster = cluster
        self.autoscaling = autoscaling

    def build(self, entries: Sequence[QueueEntry], quotas: Quotas, now: float) -> ClusterSnapshot:
        return snapshot(list(entries), self.cluster.nodes(), quotas, now,
                        autoscaling=self.autoscaling)  # fmt: skip
