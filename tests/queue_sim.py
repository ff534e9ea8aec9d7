"""A cluster that carries out the queue policy's decisions, without Ray: what the queue service
and the controllers do between two decisions, in one process.

Admitted jobs run on the nodes they were given; a preempted job leaves at the next step and is
queued again keeping its push time, remembering whom it gave way to; jobs end when a test says.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from orchestrator.scheduler.policy import (
    ClusterSnapshot,
    Decision,
    Demand,
    Node,
    QueuedJob,
    RunningJob,
    SchedulingPolicy,
)
from orchestrator.scheduler.resources import Resources


@dataclass
class SimCluster:
    capacity: dict[str, Resources]
    quotas: dict[str, dict[str, float]] = field(default_factory=dict)
    policy: SchedulingPolicy = field(default_factory=SchedulingPolicy)
    now: float = 0.0
    queued: dict[str, QueuedJob] = field(default_factory=dict)
    running: dict[str, RunningJob] = field(default_factory=dict)
    resumable: dict[str, bool] = field(default_factory=dict)  # job -> it checkpoints
    pushed_at: dict[str, float] = field(default_factory=dict)  # kept through a requeue
    foreign: dict[str, Resources] = field(default_factory=dict)  # work that is not the queue's
    preemptions: list[tuple[str, str]] = field(default_factory=list)  # (victim, for job)
    last: Decision | None = None
    last_snapshot: ClusterSnapshot | None = None  # what `last` was decided on

    def push(self, job_id: str, team: str | None, demand: Demand, priority: int = 0,
             resumable: bool = True) -> None:  # fmt: skip
        self.queued[job_id] = QueuedJob(job_id, team, priority, self.now, demand)
        self.resumable[job_id] = resumable
        self.pushed_at[job_id] = self.now

    def end(self, job_id: str) -> None:
        self.running.pop(job_id, None)
        self.queued.pop(job_id, None)

    def snapshot(self) -> ClusterSnapshot:
        used: dict[str, Resources] = {}
        for job in self.running.values():
            for node in job.placed_on:
                used[node] = used.get(node, Resources()) + job.demand.bundle
        nodes = [
            Node(n, cap, cap - used.get(n, Resources()) - self.foreign.get(n, Resources()))
            for n, cap in self.capacity.items()
        ]
        return ClusterSnapshot(list(self.queued.values()), list(self.running.values()), nodes,
                               self.quotas, self.now)  # fmt: skip

    def step(self) -> Decision:
        """Jobs preempted last time leave (queued again), then one decision, carried out."""
        self.requeue_leaving()
        self.last_snapshot = self.snapshot()
        return self.carry_out(self.policy.decide(self.last_snapshot))

    def requeue_leaving(self) -> None:
        for job in [r for r in self.running.values() if r.leaving]:
            del self.running[job.job_id]
            self.queued[job.job_id] = QueuedJob(job.job_id, job.team, job.priority,
                                                self.pushed_at[job.job_id], job.demand,
                                                preempted_by=job.leaving_for)  # fmt: skip

    def carry_out(self, decision: Decision) -> Decision:
        for i, admit in enumerate(decision.admit):  # started in this order, as the service has
            job = self.queued.pop(admit.job_id)
            self.running[job.job_id] = RunningJob(
                job.job_id,
                job.team,
                job.priority,
                self.now + i * 1e-6,
                job.demand,
                admit.placed_on,
                resumable=self.resumable.get(job.job_id, True),
            )
        started = {a.job_id for a in decision.admit}
        for job_id, job in self.queued.items():  # as the service: it waits for that job no more
            if job.preempted_by in started:
                self.queued[job_id] = replace(job, preempted_by=None)
        for p in decision.preempt:
            self.running[p.victim] = replace(self.running[p.victim], leaving=True,
                                             leaving_for=p.for_job)  # fmt: skip
            self.preemptions.append((p.victim, p.for_job))
        self.last = decision
        return decision


def gpus(count: int, cpus: int | None = None, nodes: int = 1) -> Demand:
    """`nodes` x (`count` H100, `cpus` CPUs (4 per GPU unless given))."""
    return Demand(Resources.of(H100=count, CPU=4 * count if cpus is None else cpus), nodes)


def cpus(count: int) -> Demand:
    return Demand(Resources.of(CPU=count))
