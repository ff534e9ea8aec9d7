"""The queue service: one detached actor per cluster (`orchestrator-queue`, on the head) that
admits jobs, with one queue per storage root (`RootQueue`).

Controllers `enqueue` their job, poll `admission` until it says admitted (or impossible), say
where Ray `placed` it, and `release` it when the job ends; an admitted job polls `admission`
too, for a `preemption`. Every change is written to the storage root (`QueueStore`) before it
is answered, so a service that is killed and started again rebuilds the same queues: an admitted
job stays admitted (never admitted twice), a queued one stays queued.

A thread decides every `TICK_S` besides each change: resources free up without a call (a
placement group going away, a node joining), clients' requests arrive as files (`capacity set`,
`update --priority`), and a controller may die without a word: its Ray driver gone, its job is
ended FAILED with the cause and what it held is released. Each root has its own lock, so a
storage root that hangs (an outage) holds up only its own queue.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from orchestrator.lifecycle import JobState
from orchestrator.scheduler import QUEUE_SERVICE_NAME
from orchestrator.scheduler.cluster_view import nodes_from_ray, snapshot
from orchestrator.scheduler.policy import (
    DEFAULT_HOLD_AFTER_S,
    Decision,
    Node,
    SchedulingPolicy,
    Waiting,
)
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.queue_store import (
    NodeView,
    QueueEntry,
    QueueStore,
    QueueView,
    WaitingView,
)
from orchestrator.storage.records import Failure
from orchestrator.storage.root import StorageRoot

TICK_S = 1.0
IDLE_DROP_S = 60.0  # a root with nothing queued or admitted this long is forgotten (memory)
IDLE_EXIT_S = 3600.0  # no root at all this long: the actor ends; the next job starts it again


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
        self, storage_root: str, hold_after_s: float = DEFAULT_HOLD_AFTER_S,
        autoscaling: bool = False,
    ) -> None:  # fmt: skip
        self.root = StorageRoot(storage_root)
        self.store = QueueStore(self.root)
        self.entries = {e.job_id: e for e in self.store.entries()}  # rebuilt after a restart
        self.quotas = self.store.quotas()
        self.policy = SchedulingPolicy(hold_after_s)
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
                    "preemption": None,
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
        import ray

        drivers = {j["JobID"]: j for j in ray._private.state.jobs()}
        for entry in list(self.entries.values()):
            if entry.ray_job_id is None:
                continue
            driver = drivers.get(entry.ray_job_id)
            if driver is not None and not driver.get("IsDead"):
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


class QueueService:
    """The cluster's queue service: every call names its storage root's queue."""

    def __init__(
        self, hold_after_s: float = DEFAULT_HOLD_AFTER_S, autoscaling: bool = False,
        tick_s: float = TICK_S,
    ) -> None:  # fmt: skip
        self.hold_after_s, self.autoscaling, self.tick_s = hold_after_s, autoscaling, tick_s
        self.queues: dict[str, RootQueue] = {}
        self.lock = threading.Lock()  # the dict only
        threading.Thread(target=self._ticking, name="queue-tick", daemon=True).start()

    def enqueue(self, root: str, entry: dict[str, Any]) -> dict[str, Any]:
        return self._queue(root).enqueue(entry)

    def admission(self, root: str, job_id: str) -> dict[str, Any]:
        return self._queue(root).admission(job_id)

    def placed(self, root: str, job_id: str, nodes: list[str]) -> None:
        self._queue(root).placed(job_id, nodes)

    def release(self, root: str, job_id: str) -> None:
        self._queue(root).release(job_id)

    def requeue(self, root: str, job_id: str) -> dict[str, Any]:
        return self._queue(root).requeue(job_id)

    def update_priority(self, root: str, job_id: str, priority: int) -> dict[str, Any]:
        return self._queue(root).update_priority(job_id, priority)

    def view(self, root: str) -> dict[str, Any]:
        return self._queue(root).view()

    def _queue(self, root: str) -> RootQueue:
        with self.lock:
            queue = self.queues.get(root)
        if queue is None:  # read from the storage root outside the dict's lock
            fresh = RootQueue(root, self.hold_after_s, self.autoscaling)
            with self.lock:
                queue = self.queues.setdefault(root, fresh)
        return queue

    def _ticking(self) -> None:
        alone_since = time.monotonic()
        while True:
            time.sleep(self.tick_s)
            with self.lock:
                queues = list(self.queues.items())
            for root, queue in queues:
                try:
                    with queue.lock:
                        if queue.entries:
                            queue.idle_since = time.monotonic()
                            queue.tick()
                        elif time.monotonic() - queue.idle_since > IDLE_DROP_S:
                            with self.lock:
                                del self.queues[root]  # its state is all in the storage root
                except Exception:  # a storage outage, a GCS hiccup: said, and tried again
                    traceback.print_exc()
            with self.lock:
                if self.queues:
                    alone_since = time.monotonic()
                elif time.monotonic() - alone_since > IDLE_EXIT_S:
                    break
        import ray

        ray.kill(ray.get_runtime_context().current_actor)  # its name is free for the next one


def start_queue_service(
    hold_after_s: float = DEFAULT_HOLD_AFTER_S, autoscaling: bool = False, tick_s: float = TICK_S
) -> Any:
    """The cluster's queue service, started on this node (the head) if it is not running; the
    arguments count only for the call that starts it."""
    import ray

    from orchestrator.agents.services import NAMESPACE, shared_actor

    try:  # found by name: a GCS lookup, without exporting the class from this driver (~40 ms)
        return ray.get_actor(QUEUE_SERVICE_NAME, namespace=NAMESPACE)
    except ValueError:
        pass

    return shared_actor(QueueService, QUEUE_SERVICE_NAME, pinned_here=True, max_concurrency=16,
                        args=(hold_after_s, autoscaling, tick_s))  # fmt: skip
