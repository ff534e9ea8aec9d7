"""A job's nodes as its controller holds them (`JobNodes`): where the ranks are placed, the
ranks themselves, and the judge of what a fault was, made together for each placement (the
first, and again after the queue gave the job's nodes to another job)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.controller.cluster_nodes import RayClusterNodes
from orchestrator.controller.fault_judge import FaultJudge
from orchestrator.controller.placement import Placement
from orchestrator.controller.rank_group import RankGroup
from orchestrator.controller.ray_rank_group import RayRankGroup
from orchestrator.storage.records import JobRecord


@dataclass
class JobNodes:
    placement: Placement
    group: RankGroup
    judge: FaultJudge

    def release(self, keep_checkpoints: bool) -> None:
        """Clean the nodes and end the agents and helpers, then give the bundles back."""
        self.group.release(keep_checkpoints)
        self.placement.release()


NodesFactory = Callable[[JobRecord, Callable[[str], None]], JobNodes]


def ray_job_nodes(record: JobRecord, say: Callable[[str], None]) -> JobNodes:
    """The job's nodes on the Ray cluster this controller runs in."""
    cluster = RayClusterNodes()
    placement = Placement(record, say, cluster)
    return JobNodes(placement, RayRankGroup(record, say, placement, cluster), FaultJudge(cluster))
