"""What a job's attempts ask of the one who holds its nodes and its place in the queue.

`Attempts` decides (run again, replace a rank, give way, end); the port acts. The controller is
the port in a job; a test can hand `Attempts` a fake of it, as Ray Train's controller is handed a
fake worker group.
"""

from __future__ import annotations

from typing import Protocol

from orchestrator.agents.messages import PreparedNode
from orchestrator.controller.job_nodes import JobNodes
from orchestrator.controller.plan import GroupPlan
from orchestrator.lifecycle import JobState
from orchestrator.storage.records import Failure


class RunPort(Protocol):
    @property
    def nodes(self) -> JobNodes:
        """The job's nodes now: others after `requeue`."""

    def preemption(self) -> str | None:
        """Why the queue wants the job's nodes back, once it does."""

    def replace(self, ranks: list[int]) -> None:
        """Place lost `ranks` again, PENDING meanwhile; GroupError if there is no room."""

    def prepare(self, ranks: list[int]) -> list[PreparedNode]:
        """Prepare replaced `ranks` as every rank was first; RankLostError if one goes again,
        GroupError if the prepare fails."""

    def requeue(self, reason: str, keep_checkpoints: bool, plan: GroupPlan) -> None:
        """Give the nodes back (keeping unstored checkpoints on them if asked), wait in the
        queue again, then place and prepare every rank of `plan` anew, as the first start
        did."""

    def complete(self) -> None:
        """Every rank of the last attempt ended well: the job ends COMPLETED."""

    def fail(self, state: JobState, failure: Failure) -> None:
        """The job ends badly, in `state` (FAILED, PREEMPTED), for `failure`."""
