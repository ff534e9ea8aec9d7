"""A job's nodes as one object, as the controller sees them: the `NodeGroup` protocol, how a
rank's commands ended (`RankRun`), and the errors of placing and preparing nodes.

The controller (controller.py) decides what happens and records it; a node group places the
job's placement group, starts its agents, rendezvous and uploaders, prepares the nodes, runs and
follows the commands, stops and releases (`RayNodeGroup`, ray_node_group.py). Tests give the
controller a fake node group (tests/test_controller.py), as Ray Train swaps its worker group for
a dummy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from orchestrator.agents.messages import (
    CacheWrittenBack,
    CommandsEnded,
    PreparedNode,
    PrepareRequest,
)
from orchestrator.agents.rank_program import StartRequest
from orchestrator.controller.checkpointing import RankEnding, Uploaders
from orchestrator.controller.failure_policy import Fault
from orchestrator.errors import last_line
from orchestrator.lifecycle import JobState
from orchestrator.storage.records import Failure


class NodeGroupError(Exception):
    """The nodes could not be placed or prepared; the message says why (internal: the job's
    cause)."""


class NodeLostError(NodeGroupError):
    """A rank's agent died (its node or its worker) while the node group asked it something."""


@dataclass
class RankRun:
    """One rank's commands as they run: how they ended, or how the rank was lost."""

    rank: int
    ended: CommandsEnded | None = None
    lost: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def failed(self) -> bool:
        return self.done.is_set() and (
            self.lost is not None or (self.ended is not None and self.ended.exit_code != 0)
        )

    def ending(self, state: JobState | None) -> RankEnding:
        """How the commands ended, for the rank's uploader; `state`: the job's end, for a rank
        still running."""
        ended = self.ended if self.done.is_set() else None
        if ended is None:
            how = "the job was stopped" if state == JobState.STOPPED else "the job ended"
            if self.lost is not None:
                how = f"rank {self.rank} was lost"
            return RankEnding(self.rank, clean=False, how=how)
        how = f"rank {self.rank}'s command exited with code {ended.exit_code}"
        if ended.stopped:
            how = f"the job was stopped (exit code {ended.exit_code})"
        return RankEnding(self.rank, clean=ended.exit_code == 0, how=how, at=ended.ended_at)

    def failure(self) -> Failure:
        if self.lost is not None:
            return Failure(cause=f"rank {self.rank} was lost: {short_error(self.lost)}",
                           node_rank=self.rank)  # fmt: skip
        assert self.ended is not None
        code, command = self.ended.exit_code, self.ended.command
        why = f", {self.ended.why}" if self.ended.why else ""
        return Failure(
            cause=f"rank {self.rank}: command exited with code {code}{why}: {command}",
            exit_code=code,
            command=command,
            node_rank=self.rank,
            last_lines=list(self.ended.last_lines),
        )


class NodeGroup(Protocol):
    """What the controller asks of a job's nodes, in this order."""

    uploaders: Uploaders | None  # one checkpoint uploader per rank, with checkpointing
    runs: list[RankRun]  # one per rank once the commands start
    cache_affinity: str | None  # where the job was placed for its training cache, and why

    def reserve(
        self,
        timeout_s: float,
        on_pending: Callable[[str], None],
        check_stop: Callable[[], None],
    ) -> None:
        """Place the job; `on_pending(reason)` each time the reason it waits changes.
        NodeGroupError when it cannot be placed within `timeout_s`."""

    def placed_nodes(self) -> list[str]:
        """The node of each rank's bundle, as reserved."""

    def create(self) -> None:
        """Start the agents (and the rendezvous and uploaders) in the placed bundles."""

    def prepare(
        self,
        request: PrepareRequest,
        check_stop: Callable[[], None],
        ranks: list[int] | None = None,
    ) -> list[PreparedNode]:
        """Every rank prepared (or just `ranks`), in rank order; NodeGroupError naming the
        first failure."""

    def start(self, requests: list[StartRequest], on_lines: Callable[[list[str]], None]) -> None:
        """Start each rank's commands (a new attempt: a new rendezvous); their lines go to
        `on_lines` as they come."""

    def stop(self, grace_s: float) -> str | None:
        """Stop the commands (SIGTERM, SIGKILL after `grace_s`) on every rank still there; an
        error to say, if any."""

    def draining(self) -> dict[int, float]:
        """Ranks whose node is being drained (a preemption notice), with the node's deadline
        (epoch seconds; 0: none given)."""

    def fault_of(self, run: RankRun) -> Fault:
        """Why a rank ended: its node lost or preempted, its agent lost, or its command failed."""

    def lost_elsewhere(self) -> Fault | None:
        """A lost or draining node or agent among all ranks, if any: a command that failed
        because a peer vanished is that peer's fault, not the command's."""

    def replace(
        self,
        ranks: list[int],
        timeout_s: float,
        on_pending: Callable[[str], None],
        check_stop: Callable[[], None],
    ) -> None:
        """New agents for `ranks`, once Ray has placed their bundles again (a lost node's on
        another node). NodeGroupError when not within `timeout_s`."""

    def write_back_cache(
        self, leader_node_id: str, wait_s: float | None
    ) -> CacheWrittenBack | None:
        """Rank 0's training cache changes back to the storage root; its counts, or None when
        not waited for."""

    def release(self, keep_checkpoints: bool) -> None:
        """Clean the nodes and end the agents, helpers and placement group."""


def short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {last_line(e)}"
