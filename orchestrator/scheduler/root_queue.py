"""The queue of one storage root (`RootQueue`): its entries and quotas in memory, stored in that
root first; each decision of the policy carried out on them.

Controllers `enqueue` their job, poll `admission` until it says admitted (or impossible), say
where Ray `placed` it, and `release` it when the job ends; an admitted job polls `admission`
too, for a `preemption`. Every change is written to the storage root (`QueueStore`) before it
is answered, so a service that is killed and started again rebuilds the same queues: an admitted
job stays admitted (never admitted twice), a queued one stays queued.

Its storage calls ride out an outage for `STORAGE_BUDGET_S` only (a job's own calls wait up to
30 minutes): a root that is down fails its own calls and ticks quickly, and is asked again at
the next tick. The cluster is read through `ClusterReads`, so tests use a fake.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from orchestrator.lifecycle import JobState
from orchestrator.scheduler.cluster_view import snapshot
from orchestrator.scheduler.policy import Decision, Node, SchedulingPolicy, Waiting
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.queue_store import (
    NodeView,
    QueueEntry,
    QueueStore,
    QueueView,
    WaitingView,
)
from orchestrator.storage.records import Failure
from orchestrator.storage.retry import StorageRetry
from orchestrator.storage.root import StorageRoot

STORAGE_BUDGET_S = 10.0  # how long the queue rides out its root's outage before a call fails
IDLE_DROP_S = 60.0  # a root with nothing queued or admitted this long is forgotten (memory)


class ClusterReads(Protocol):
    """What the queue reads from the cluster: Ray's GCS in the service, a fake in tests."""

    def nodes(self) -> list[Node]:
        """Alive nodes, with their capacity and what is free."""

    def live_drivers(self) -> set[str]:
        """The Ray job ids of drivers that are alive (a job's controller is one)."""


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


class RootQueue:
    """The queue of one storage root: its entries and quotas in memory, stored there first."""

    def __init__(
        self, storage_root: str, policy: SchedulingPolicy, cluster: ClusterReads,
        autoscaling: bool = False, storage_budget_s: float = STORAGE_BUDGET_S,
    ) -> None:  # fmt: skip
        self.root = StorageRoot(storage_root, StorageRetry(storage_root, storage_budget_s))
        self.store = QueueStore(self.root)
        self.entries = {e.job_id: e for e in self.store.entries()}  # rebuilt after a restart
        self.quotas = self.store.quotas()
        self.policy = policy
        self.cluster = cluster
        self.autoscaling = autoscaling
        self.last: Decision = Decision()
        self.waiting: dict[str, Waiting] = {}
        self.shown: QueueView | None = None
        self.lock = threading.RLock()  # the calls and the ticking thread
        self.idle_since = time.monotonic()

    # -- the controllers' calls -----------------------------------------------------------------

    def enqueue(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Queue a job (again: its standing, unchanged) and decide at once."""
        job = QueueEntry.model_validate(entry)
        with self.lock:
            if job.job_id not in self.entries:
                self._put(job)
                self._decide()
            return self.admission(job.job_id)

    def admission(self, job_id: str) -> dict[str, Any]:
        with self.lock:
            return asdict(self._standing(job_id))

    def placed(self, job_id: str, nodes: list[str]) -> None:
        """Where Ray put the job's bundles (not always the nodes it was admitted to)."""
        with self.lock:
            entry = self.entries.get(job_id)
            if entry is not None and entry.placed_on != nodes:
                self._put(entry.model_copy(update={"placed_on": list(nodes)}))

    def release(self, job_id: str) -> None:
        """The job ended, was stopped while queued, or left after a preemption."""
        with self.lock:
            if self.entries.pop(job_id, None) is not None:
                self.store.remove(job_id)
                self._decide()

    def requeue(self, job_id: str) -> dict[str, Any]:
        """A preempted job that flushed and let go: back in the queue, keeping its push time."""
        with self.lock:
            entry = self.entries.get(job_id)
            if entry is not None and entry.state == "admitted":
                self._put(entry.model_copy(update={
                    "state": "queued", "placed_on": [], "borrowed": False, "admitted_at": None,
                    "preemption": None,  # preempted_by stays: it starts again after that job
                }))  # fmt: skip
                self._decide()
            return self.admission(job_id)

    # -- what clients ask through the storage root (and tests directly) ---------------------------

    def update_priority(self, job_id: str, priority: int) -> dict[str, Any]:
        with self.lock:
            if not self._reprioritise(job_id, priority):
                raise ValueError(f"job {job_id} is not waiting in the queue: only a queued "
                                 "job's priority can change")  # fmt: skip
            self._decide()
            return self.admission(job_id)

    def view(self) -> dict[str, Any]:
        """The queue as `orchestrator queue` shows it, decided now."""
        with self.lock:
            self._decide()
            return {
                "quotas": self.quotas,
                "entries": [
                    {**e.model_dump(mode="json"), "standing": asdict(self._standing(e.job_id))}
                    for e in self.entries.values()
                ],
            }

    # -- inside ---------------------------------------------------------------------------------

    def tick(self) -> None:
        """What no call brings: requests, quotas, dead controllers, resources freed."""
        for request in self.store.take_requests():
            self._reprioritise(request.job_id, request.priority)  # one that left: dropped
        self.quotas = self.store.quotas()
        self._end_orphans()
        self._decide()

    def _reprioritise(self, job_id: str, priority: int) -> bool:
        entry = self.entries.get(job_id)
        if entry is None or entry.state != "queued":
            return False
        self._put(entry.model_copy(update={"priority": priority}))
        return True

    def _end_orphans(self) -> None:
        """Jobs whose controller died (its Ray driver is gone) end FAILED, and let go."""
        alive = self.cluster.live_drivers()
        for entry in list(self.entries.values()):
            if entry.ray_job_id is None or entry.ray_job_id in alive:
                continue
            self._fail_orphan(entry)
            self.entries.pop(entry.job_id, None)
            self.store.remove(entry.job_id)

    def _fail_orphan(self, entry: QueueEntry) -> None:
        jobs = JobStore(self.root)
        try:
            status = jobs.status(entry.job_id)
        except FileNotFoundError:
            return
        if status.state.is_terminal:  # it recorded its end and died before letting go
            return
        where = "while waiting in the queue" if entry.state == "queued" else (
            f"while {status.state.value}"
        )  # fmt: skip
        cause = (
            f"the job's controller (Ray job {entry.submission_id or entry.job_id}) died "
            f"{where} without recording an end: its Ray job was stopped or killed, or the head "
            "node restarted; what it held was released"
        )
        jobs.put_status(status.moved_to(JobState.FAILED, cause).model_copy(
            update={"failure": Failure(cause=cause)}
        ))  # fmt: skip

    def _put(self, entry: QueueEntry) -> None:
        self.store.put(entry)  # durable first: a restart must find what was answered
        self.entries[entry.job_id] = entry

    def _decide(self) -> None:
        now = time.time()
        snap = snapshot(list(self.entries.values()), self.cluster.nodes(), self.quotas, now,
                        autoscaling=self.autoscaling)  # fmt: skip
        decision = self.policy.decide(snap)
        for i, admit in enumerate(decision.admit):  # apart by 1 us: they started in this order
            self._put(self.entries[admit.job_id].model_copy(update={
                "state": "admitted", "placed_on": list(admit.placed_on),
                "borrowed": admit.borrowed, "admitted_at": now + i * 1e-6, "preempted_by": None,
            }))  # fmt: skip
        for preempt in decision.preempt:
            victim = self.entries.get(preempt.victim)
            if victim is not None and victim.preemption is None:
                self._put(victim.model_copy(update={"preemption": preempt.reason,
                                                    "preempted_by": preempt.for_job}))  # fmt: skip
        for entry in list(self.entries.values()):  # borrowed or not, as of now (rule 1)
            borrowed = entry.job_id in decision.borrowed
            if entry.state == "admitted" and entry.borrowed != borrowed:
                self._put(entry.model_copy(update={"borrowed": borrowed}))
        self.last = decision
        self.waiting = {w.job_id: w for w in decision.waiting}
        self._show(decision, snap.nodes, now)

    def _show(self, decision: Decision, nodes: Sequence[Node], now: float) -> None:
        """queue/view.json for clients, rewritten only when what it says changed."""
        view = QueueView(
            decided_at=now,
            waiting=[
                WaitingView(job_id=w.job_id, position=w.position, reason=w.reason)
                for w in decision.waiting
            ],
            impossible=dict(decision.impossible),
            spared=dict(decision.spared),
            reserved={job: list(nodes) for job, nodes in decision.reserved.items()},
            nodes=[
                NodeView(
                    node_id=n.node_id, capacity=dict(n.capacity.amounts), free=dict(n.free.amounts)
                )
                for n in nodes
            ],
        )
        if self.shown is None or view.model_dump(exclude={"decided_at"}) != self.shown.model_dump(
            exclude={"decided_at"}
        ):
            self.store.write_view(view)
            self.shown = view

    def _standing(self, job_id: str) -> Admission:
        entry = self.entries.get(job_id)
        if entry is None:
            return Admission("unknown")
        if entry.state == "admitted":
            return Admission("admitted", placed_on=tuple(entry.placed_on),
                             borrowed=entry.borrowed, preemption=entry.preemption)  # fmt: skip
        if job_id in self.last.impossible:
            return Admission("impossible", reason=self.last.impossible[job_id])
        if (waiting := self.waiting.get(job_id)) is not None:
            return Admission("queued", waiting.position, waiting.reason)
        return Admission("queued", reason="not yet considered")

    # -- ticking --------------------------------------------------------------------------------

    def start_ticking(self, tick_s: float, forget: Callable[[], None]) -> threading.Event:
        """Its own thread decides every `tick_s`, so a root whose storage hangs holds up no
        other root; after `IDLE_DROP_S` with no job it calls `forget` and ends. Set the event
        returned to end it sooner."""
        stop = threading.Event()
        threading.Thread(target=self._ticking, args=(tick_s, forget, stop), daemon=True,
                         name=f"queue-tick {self.root.url}").start()  # fmt: skip
        return stop

    def _ticking(self, tick_s: float, forget: Callable[[], None], stop: threading.Event) -> None:
        while not stop.wait(tick_s):
            try:
                with self.lock:
                    if self.entries:
                        self.idle_since = time.monotonic()
                        self.tick()
                    elif time.monotonic() - self.idle_since > IDLE_DROP_S:
                        forget()  # its state is all in the storage root
                        return
            except Exception:  # a storage outage, a GCS hiccup: said, and tried again
                traceback.print_exc()
