"""The queue service: one detached actor per cluster (`orchestrator-queue`) that admits jobs.

Controllers `enqueue` their job and poll `admission` until it says admitted (or impossible),
and `release` it when the job ends. Every change is written to the storage root
(`QueueStore`) before it is answered, so a service that is killed and started again rebuilds
the same queue: an admitted job stays admitted (never admitted twice), a queued one stays
queued. Decisions are taken on each change and, while anyone polls, at most every `TICK_S`
(resources free up without a call: a job's placement group going away, a node joining).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from orchestrator.scheduler.cluster_view import nodes_from_ray, snapshot
from orchestrator.scheduler.policy import DEFAULT_HOLD_AFTER_S, Decision, SchedulingPolicy
from orchestrator.storage.queue_store import QueueEntry, QueueStore
from orchestrator.storage.root import StorageRoot

QUEUE_SERVICE_NAME = "orchestrator-queue"
TICK_S = 1.0


@dataclass(frozen=True)
class Admission:
    """Where a job stands: `queued` (with its position and why), `admitted` (on which nodes,
    borrowed or not; `preemption`, "preempted by <job>: why", once it is asked to leave),
    `impossible`, or `unknown`."""

    state: str
    position: int | None = None
    reason: str = ""
    placed_on: tuple[str, ...] = ()
    borrowed: bool = False
    preemption: str | None = None


class QueueService:
    def __init__(
        self, storage_root: str, hold_after_s: float = DEFAULT_HOLD_AFTER_S,
        autoscaling: bool = False,
    ) -> None:  # fmt: skip
        self.store = QueueStore(StorageRoot(storage_root))
        self.entries = {e.job_id: e for e in self.store.entries()}  # rebuilt after a restart
        self.quotas = self.store.quotas()
        self.policy = SchedulingPolicy(hold_after_s)
        self.autoscaling = autoscaling
        self.last: Decision = Decision()
        self.decided_at = 0.0

    def enqueue(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Queue a job (again: its standing, unchanged) and decide at once."""
        job = QueueEntry.model_validate(entry)
        if job.job_id not in self.entries:
            self.store.put(job)
            self.entries[job.job_id] = job
            self._decide()
        return self.admission(job.job_id)

    def admission(self, job_id: str) -> dict[str, Any]:
        if time.monotonic() - self.decided_at >= TICK_S:
            self._decide()
        return asdict(self._standing(job_id))

    def release(self, job_id: str) -> None:
        """The job ended, was stopped while queued, or left after a preemption."""
        if self.entries.pop(job_id, None) is not None:
            self.store.remove(job_id)
            self._decide()

    def requeue(self, job_id: str) -> dict[str, Any]:
        """A preempted job that flushed and let go: back in the queue, keeping its push time."""
        entry = self.entries.get(job_id)
        if entry is not None and entry.state == "admitted":
            self._put(entry.model_copy(update={
                "state": "queued", "placed_on": [], "borrowed": False, "admitted_at": None,
                "preemption": None,
            }))  # fmt: skip
            self._decide()
        return self.admission(job_id)

    def update_priority(self, job_id: str, priority: int) -> dict[str, Any]:
        entry = self.entries.get(job_id)
        if entry is None or entry.state != "queued":
            raise ValueError(f"job {job_id} is not waiting in the queue: only a queued job's "
                             "priority can change")  # fmt: skip
        self._put(entry.model_copy(update={"priority": priority}))
        self._decide()
        return self.admission(job_id)

    def set_quota(self, team: str, limits: dict[str, float] | None) -> dict[str, Any]:
        self.quotas = self.store.set_quota(team, limits)
        self._decide()
        return self.quotas

    def view(self) -> dict[str, Any]:
        """Everything `orchestrator queue` and `capacity view` show."""
        self._decide()
        return {
            "quotas": self.quotas,
            "entries": [
                {**e.model_dump(mode="json"), "standing": asdict(self._standing(e.job_id))}
                for e in self.entries.values()
            ],
        }

    # -- inside ---------------------------------------------------------------------------------

    def _put(self, entry: QueueEntry) -> None:
        self.store.put(entry)  # durable first: a restart must find what was answered
        self.entries[entry.job_id] = entry

    def _decide(self) -> None:
        import ray

        nodes = nodes_from_ray(ray.nodes(), ray._private.state.available_resources_per_node())
        now = time.time()
        snap = snapshot(list(self.entries.values()), nodes, self.quotas, now,
                        autoscaling=self.autoscaling)  # fmt: skip
        decision = self.policy.decide(snap)
        for admit in decision.admit:
            self._put(self.entries[admit.job_id].model_copy(update={
                "state": "admitted", "placed_on": list(admit.placed_on),
                "borrowed": admit.borrowed, "admitted_at": now,
            }))  # fmt: skip
        for preempt in decision.preempt:
            victim = self.entries.get(preempt.victim)
            if victim is not None and victim.preemption is None:
                self._put(victim.model_copy(update={"preemption": preempt.reason}))
        self.last, self.decided_at = decision, time.monotonic()

    def _standing(self, job_id: str) -> Admission:
        entry = self.entries.get(job_id)
        if entry is None:
            return Admission("unknown")
        if entry.state == "admitted":
            return Admission("admitted", placed_on=tuple(entry.placed_on),
                             borrowed=entry.borrowed, preemption=entry.preemption)  # fmt: skip
        if job_id in self.last.impossible:
            return Admission("impossible", reason=self.last.impossible[job_id])
        for waiting in self.last.waiting:
            if waiting.job_id == job_id:
                return Admission("queued", waiting.position, waiting.reason)
        return Admission("queued", reason="not yet considered")


def start_queue_service(
    storage_root: str, hold_after_s: float = DEFAULT_HOLD_AFTER_S, autoscaling: bool = False
) -> Any:
    """The cluster's queue service, started on this node (the head) if it is not running; the
    arguments count only for the call that starts it."""
    from orchestrator.agents.services import shared_actor

    return shared_actor(QueueService, QUEUE_SERVICE_NAME, pinned_here=True, max_concurrency=1,
                        args=(storage_root, hold_after_s, autoscaling))  # fmt: skip
