"""What the queue policy decides on and what it decides: the snapshot's jobs and nodes, and the
decision's admissions, preemptions and reasons. Plain values, shared by the policy and the
placement arithmetic in `fitting.py`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from orchestrator.scheduler.resources import Resources


class WithinTeam(str, Enum):
    """Whether a job may preempt lower-priority running jobs of its own team."""

    NEVER = "never"  # Kueue's default for preemption within a queue
    RESUMABLE = "resumable"  # only jobs that checkpoint, which resume where they were
    ALWAYS = "always"  # also jobs without checkpointing, which start over


@dataclass(frozen=True)
class Demand:
    """`nodes` bundles of `bundle`: each on its own node, or all on one when `colocated`."""

    bundle: Resources
    nodes: int = 1
    colocated: bool = False
    total: Resources = field(init=False, repr=False, compare=False)
    key: str = field(init=False, repr=False, compare=False)  # jobs alike share it

    def __post_init__(self) -> None:  # computed once: read thousands of times a decision
        object.__setattr__(self, "total", self.bundle * self.nodes)
        # A string: its hash is kept, and it is hashed in every memo lookup.
        key = f"{sorted(self.bundle.amounts.items())}x{self.nodes}{'c' if self.colocated else ''}"
        object.__setattr__(self, "key", key)


@dataclass(frozen=True)
class QueuedJob:
    job_id: str
    team: str | None
    priority: int
    pushed_at: float
    demand: Demand
    preempted_by: str | None = None  # requeued after giving way to this job


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    team: str | None
    priority: int
    started_at: float
    demand: Demand
    placed_on: tuple[str, ...]  # the node of each bundle
    resumable: bool = False  # checkpoints: a preemption costs it little
    leaving: bool = False  # preempted: what it holds is about to be free
    leaving_for: str | None = None  # the job it was preempted for


@dataclass(frozen=True)
class Node:
    node_id: str
    capacity: Resources
    free: Resources


@dataclass(frozen=True)
class ClusterSnapshot:
    queued: Sequence[QueuedJob]
    running: Sequence[RunningJob]
    nodes: Sequence[Node]
    quotas: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # team -> limits
    now: float = 0.0
    autoscaling: bool = False  # more nodes may come: nothing is impossible


@dataclass(frozen=True)
class Admit:
    job_id: str
    placed_on: tuple[str, ...]
    borrowed: bool


@dataclass(frozen=True)
class Preempt:
    victim: str
    for_job: str
    reason: str  # "preempted by <job>: ..."


class Waiting(NamedTuple):  # a tuple: a decision makes one for each of 1,000 waiting jobs
    job_id: str
    position: int  # 1 = next to start
    reason: str


@dataclass
class Decision:
    admit: list[Admit] = field(default_factory=list)
    preempt: list[Preempt] = field(default_factory=list)
    waiting: list[Waiting] = field(default_factory=list)
    impossible: dict[str, str] = field(default_factory=dict)  # job id -> why
    borrowed: set[str] = field(default_factory=set)  # running and admitted jobs that borrow now
    reserved: dict[str, tuple[str, ...]] = field(default_factory=dict)  # held job -> its nodes
    held: dict[str, tuple[str, ...]] = field(default_factory=dict)  # preempting job -> its room
    served: list[str] = field(default_factory=list)  # every possible job, in rule 2's order
    spared: dict[str, str] = field(default_factory=dict)  # running job -> why it was not preempted
