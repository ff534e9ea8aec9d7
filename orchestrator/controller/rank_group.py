"""A job's ranks as the controller sees them: the `RankGroup` protocol, each rank's run
(`RankRun`), the typed poll of the whole group (`GroupPoll`, like Ray Train v2's
WorkerGroupPollStatus), and the errors of preparing and placing ranks.

The Ray mechanics are `RayRankGroup` (ray_rank_group.py); the controller's tests hand it a fake
group (tests/test_controller.py), as Ray Train's controller tests hand theirs a dummy.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from orchestrator.agents.messages import (
    CacheWrittenBack,
    CommandsEnded,
    OutputLines,
    PreparedNode,
    PrepareRequest,
    StoredCheckpoint,
)
from orchestrator.agents.rank_program import StartRequest
from orchestrator.controller.checkpointing import RankEnding, Uploaders
from orchestrator.controller.plan import GroupPlan
from orchestrator.errors import last_line
from orchestrator.lifecycle import JobState
from orchestrator.storage.metrics import MetricsSample
from orchestrator.storage.records import Failure


class GroupError(Exception):
    """The ranks could not be placed or prepared; the message says why (internal: the job's
    cause)."""


class RankLostError(GroupError):
    """A rank's agent died (its node or its worker) while the group asked it something."""


class RankState(str, enum.Enum):
    RUNNING = "running"
    ENDED = "ended"  # its program ended, with an exit code
    LOST = "lost"  # its agent or its node went before the program ended


@dataclass
class RankRun:
    """One rank's program as it runs: how it ended, or how the rank was lost."""

    rank: int
    ended: CommandsEnded | None = None
    lost: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    last_output_at: float | None = None  # when it last printed (epoch seconds)

    @property
    def failed(self) -> bool:
        return self.done.is_set() and (
            self.lost is not None or (self.ended is not None and self.ended.exit_code != 0)
        )

    def ending(self, state: JobState | None) -> RankEnding:
        """How the program ended, for the rank's uploader; `state`: the job's end, for a rank
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

    def poll(
        self, last_checkpoint: StoredCheckpoint | None = None, sample: MetricsSample | None = None
    ) -> RankPoll:
        if not self.done.is_set():
            state = RankState.RUNNING
        else:
            state = RankState.LOST if self.lost is not None else RankState.ENDED
        failure = self.failure() if self.failed else None
        return RankPoll(self.rank, state, self.ended, self.lost, self.last_output_at,
                        last_checkpoint, sample, failure)  # fmt: skip


@dataclass(frozen=True)
class RankPoll:
    """One rank at one poll."""

    rank: int
    state: RankState
    ended: CommandsEnded | None = None
    lost: BaseException | None = None
    last_output_at: float | None = None
    last_checkpoint: StoredCheckpoint | None = None  # the newest its uploader stored
    last_sample: MetricsSample | None = None  # its processes' CPU, memory, GPUs, as last seen
    failure: Failure | None = None  # what the job's failure says if this rank's end ends it

    @property
    def failed(self) -> bool:
        return self.failure is not None


@dataclass(frozen=True)
class GroupPoll:
    """The whole group at one poll: every rank, and what its checkpoint uploaders said."""

    at: float  # epoch seconds
    ranks: tuple[RankPoll, ...]
    checkpoint_lines: tuple[str, ...] = ()  # the uploaders' new events, to be said
    over_volume: str | None = None  # a rank's checkpoint directory is over volume_size_gib

    @property
    def ended(self) -> bool:
        """Every rank's program has ended or the rank is lost."""
        return all(r.state != RankState.RUNNING for r in self.ranks)

    @property
    def failed(self) -> RankPoll | None:
        """The rank whose end ends the attempt: a lost one first, else the first that failed."""
        lost = next((r for r in self.ranks if r.state == RankState.LOST), None)
        return lost or next((r for r in self.ranks if r.failed), None)


def poll_runs(
    runs: list[RankRun],
    uploaders: Uploaders | None,
    samples: dict[int, MetricsSample] | None = None,
) -> GroupPoll:
    """A poll of `runs` (with each rank's latest resource sample in `samples`) and, at most
    once a second, of their uploaders."""
    lines: list[str] = []
    over = None
    stored: dict[int, StoredCheckpoint] = {}
    if uploaders is not None:
        lines, over = uploaders.poll()
        stored = uploaders.last_stored
    samples = samples or {}
    ranks = tuple(run.poll(stored.get(run.rank), samples.get(run.rank)) for run in runs)
    return GroupPoll(time.time(), ranks, tuple(lines), over)


def follow(items: object, run: RankRun, on_lines: Callable[[list[str]], None]) -> None:
    """Consume a rank's stream (`OutputLines` as they come, then `CommandsEnded`) into `run`:
    its lines to `on_lines`, a long line's pieces (`OutputLines.continues`) joined first. An
    error of the stream is the rank lost. Plain iteration: Ray's stream is one such iterable."""
    held = ""
    try:
        for item in items:  # type: ignore[attr-defined]
            if isinstance(item, OutputLines):
                run.last_output_at = time.time()
                lines = list(item.lines)
                lines[0], held = held + lines[0], ""
                if item.continues:
                    held = lines.pop()
                if lines:
                    on_lines(lines)
            else:
                run.ended = item
    except Exception as e:
        run.lost = e
    finally:
        run.done.set()


class RankGroup(Protocol):
    """What the controller asks of a job's ranks, in this order: create, prepare, then per
    attempt start, poll and wait until it ends, stop; replace lost ranks; release."""

    uploaders: Uploaders | None  # one checkpoint uploader per rank, with checkpointing
    runs: list[RankRun]  # one per rank once an attempt starts
    node_ids: dict[int, str]  # rank -> the node it was prepared on

    def create(self, plan: GroupPlan) -> None:
        """Start the agents (and the rendezvous and uploaders) in the plan's placed bundles."""

    def prepare(
        self,
        request: PrepareRequest,
        check_stop: Callable[[], None],
        ranks: list[int] | None = None,
    ) -> list[PreparedNode]:
        """Every rank prepared (or just `ranks`), in rank order; GroupError naming the first
        failure, RankLostError when a rank's agent died meanwhile."""

    def start(self, requests: list[StartRequest], on_lines: Callable[[list[str]], None]) -> None:
        """Start each rank's program (a new attempt: a new rendezvous); their lines go to
        `on_lines` as they come."""

    def poll(self) -> GroupPoll:
        """Every rank now: running, ended, or lost."""

    def wait(self, timeout_s: float) -> None:
        """Until a rank's program ends, or `timeout_s`."""

    def stacks(self, timeout_s: float) -> dict[int, str]:
        """Every running rank's Python stacks now (node/stacks.py), asked of all at once; the
        ranks that answered within `timeout_s`."""

    def stop(self, grace_s: float) -> str | None:
        """Stop the programs (SIGTERM, SIGKILL after `grace_s`) on every rank still there; an
        error to say, if any."""

    def drop(self, ranks: list[int]) -> None:
        """End lost ranks' agents, before their bundles are placed again."""

    def replace(self, ranks: list[int]) -> None:
        """New agents for `ranks`, in their bundles as placed again."""

    def write_back_cache(
        self, leader_node_id: str, wait_s: float | None
    ) -> CacheWrittenBack | None:
        """Rank 0's training cache changes back to the storage root; its counts, or None when
        not waited for."""

    def release(self, keep_checkpoints: bool) -> None:
        """Clean the nodes and end the agents and helpers."""


def short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {last_line(e)}"
