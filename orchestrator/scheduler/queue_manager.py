"""Which jobs of one root wait and which run (`QueueManager`): the changes controllers and
clients ask for, the policy's decisions carried out on the entries, and each job's standing
(`Admission`) as the last decision left it. No lock and no cluster here: `RootQueue` holds
the lock, `SnapshotBuilder` reads the cluster."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from orchestrator.scheduler.model import Decision, Waiting
from orchestrator.scheduler.queue_ledger import QueueLedger
from orchestrator.storage.queue_store import QueueEntry, QueueStore, Quotas


class Standing(str, enum.Enum):
    QUEUED = "queued"  # with its position and why
    ADMITTED = "admitted"  # on which nodes, borrowed or not
    IMPOSSIBLE = "impossible"  # fits the cluster not even when it is empty
    UNKNOWN = "unknown"  # not in the queue (let go of, or never queued)


@dataclass(frozen=True)
class Admission:
    """Where a job stands, as the queue service answers it; `preemption`, "preempted by <job>:
    why", once an admitted job is asked to leave."""

    state: Standing
    position: int | None = None
    reason: str = ""
    placed_on: tuple[str, ...] = ()
    borrowed: bool = False
    preemption: str | None = None


class QueueManager:
    """One root's queued and admitted jobs, its teams' quotas, and the last decision."""

    def __init__(self, store: QueueStore) -> None:
        self.store = store
        self.ledger = QueueLedger(store)  # rebuilt after a restart
        self.quotas: Quotas = store.quotas()
        self.last: Decision = Decision()
        self.waiting: dict[str, Waiting] = {}

    def entries(self) -> list[QueueEntry]:
        return self.ledger.all()

    # -- what controllers and clients ask -----------------------------------------------------

    def add(self, job: QueueEntry) -> bool:
        """Queue a job; False when it is queued already (its standing is unchanged, but a
        controller that comes to a job pushed before is recorded as its driver)."""
        entry = self.ledger.get(job.job_id)
        if entry is None:
            self.ledger.put(job)
            return True
        if job.ray_job_id is not None and entry.ray_job_id != job.ray_job_id:
            self.ledger.update(entry, ray_job_id=job.ray_job_id, submission_id=job.submission_id)
        return False

    def placed(self, job_id: str, nodes: list[str]) -> None:
        entry = self.ledger.get(job_id)
        if entry is not None and entry.placed_on != nodes:
            self.ledger.update(entry, placed_on=list(nodes))

    def release(self, job_id: str) -> bool:
        """The job leaves the queue; whether it was in it."""
        return self.ledger.remove(job_id)

    def requeue(self, job_id: str) -> bool:
        """An admitted job back in the queue, keeping its push time; whether it was admitted."""
        entry = self.ledger.get(job_id)
        if entry is None or entry.state != "admitted":
            return False
        self.ledger.update(
            entry, state="queued", placed_on=[], borrowed=False, admitted_at=None,
            preemption=None,  # preempted_by stays: it starts again after that job
        )  # fmt: skip
        return True

    def reprioritise(self, job_id: str, priority: int) -> bool:
        """Only a queued job's priority changes; whether it did."""
        entry = self.ledger.get(job_id)
        if entry is None or entry.state != "queued":
            return False
        self.ledger.update(entry, priority=priority)
        return True

    def reload_quotas(self) -> None:
        """`capacity set` writes the quotas to the storage root: read at each tick."""
        self.quotas = self.store.quotas()

    # -- what the policy decided --------------------------------------------------------------

    def carry_out(self, decision: Decision, now: float) -> None:
        """Admissions, preemption requests and who borrows now, each stored before it counts."""
        for i, admit in enumerate(decision.admit):  # apart by 1 us: they started in this order
            self.ledger.update(
                self.ledger[admit.job_id], state="admitted", placed_on=list(admit.placed_on),
                borrowed=admit.borrowed, admitted_at=now + i * 1e-6, preempted_by=None,
            )  # fmt: skip
        started = {a.job_id for a in decision.admit}
        for entry in self.ledger.all():  # the job each gave way to has started: it waits no more
            if entry.state == "queued" and entry.preempted_by in started:
                self.ledger.update(entry, preempted_by=None)
        for preempt in decision.preempt:
            victim = self.ledger.get(preempt.victim)
            if victim is not None and victim.preemption is None:
                self.ledger.update(victim, preemption=preempt.reason,
                                   preempted_by=preempt.for_job)  # fmt: skip
        for entry in self.ledger.all():  # borrowed or not, as of now (rule 1)
            borrowed = entry.job_id in decision.borrowed
            if entry.state == "admitted" and entry.borrowed != borrowed:
                self.ledger.update(entry, borrowed=borrowed)
        self.last = decision
        self.waiting = {w.job_id: w for w in decision.waiting}

    def standing(self, job_id: str) -> Admission:
        entry = self.ledger.get(job_id)
        if entry is None:
            return Admission(Standing.UNKNOWN)
        if entry.state == "admitted":
            return Admission(Standing.ADMITTED, placed_on=tuple(entry.placed_on),
                             borrowed=entry.borrowed, preemption=entry.preemption)  # fmt: skip
        if job_id in self.last.impossible:
            return Admission(Standing.IMPOSSIBLE, reason=self.last.impossible[job_id])
        if (waiting := self.waiting.get(job_id)) is not None:
            return Admission(Standing.QUEUED, waiting.position, waiting.reason)
        return Admission(Standing.QUEUED, reason="not yet considered")


@dataclass(frozen=True)
class ViewedEntry:
    entry: QueueEntry
    standing: Admission


@dataclass(frozen=True)
class QueueView:
    """A root's queue as the service sees it now: quotas, and each entry with its standing."""

    quotas: Quotas
    entries: tuple[ViewedEntry, ...]
