"""What one attempt runs on (`GroupPlan`): its ranks, each rank's bundle and program, how the
bundles are spread, and where the programs run. A `PlanPolicy` decides it for every attempt
from the spec and the plan before, as Ray Train v2's ScalingPolicy decides a worker group's
size; the placement and the rank group are built from the plan, never from the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from orchestrator.agents.rank_program import RankProgram, program_for
from orchestrator.agents.runtimes import JobRuntime, runtime_for
from orchestrator.spec.placement import bundles_for, strategy_for
from orchestrator.storage.records import JobRecord


@dataclass(frozen=True)
class RankPlan:
    """One rank: the resources its bundle reserves and what it runs."""

    rank: int
    bundle: dict[str, float]
    program: RankProgram

    @property
    def agent_share(self) -> dict[str, float]:
        """What the rank's agent holds of its bundle: all of it (its commands' processes use
        it), or nothing where the program's own workers take the bundle (Ray Train's)."""
        if getattr(self.program, "lends_bundle", False):
            return {"CPU": 0, "memory": 0}
        return dict(self.bundle)


@dataclass(frozen=True)
class GroupPlan:
    """One attempt's ranks, their placement strategy (STRICT_SPREAD, PACK) and runtime."""

    attempt: int
    ranks: tuple[RankPlan, ...]
    strategy: str
    runtime: JobRuntime

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def bundles(self) -> list[dict[str, float]]:
        return [rank.bundle for rank in self.ranks]

    def describe(self) -> str:
        """What the ranks run, for the job's log: "2 command(s)"."""
        kinds = dict.fromkeys(rank.program.describe() for rank in self.ranks)
        return " and ".join(kinds)


class PlanPolicy(Protocol):
    """Decides each attempt's plan: the first from the spec, the next from what came before."""

    def plan(self, attempt: int, last: GroupPlan | None) -> GroupPlan: ...


class SpecPlan:
    """Every attempt as the spec asks: `node_count` ranks, one bundle each, all running the
    job's program (a fixed size: the first elastic policy replaces this one)."""

    def __init__(self, record: JobRecord) -> None:
        self.record = record

    def plan(self, attempt: int, last: GroupPlan | None = None) -> GroupPlan:
        job = self.record.spec.job
        program = program_for(job)
        ranks = tuple(
            RankPlan(rank, bundle, program) for rank, bundle in enumerate(bundles_for(job.compute))
        )
        strategy = strategy_for(job.compute, colocate=self.record.colocate_ranks)
        return GroupPlan(attempt, ranks, strategy, runtime_for(job))
