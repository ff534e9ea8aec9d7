"""The queue service: one detached actor per cluster (`orchestrator-queue`, on the head) that
keeps one queue per storage root (`RootQueue`, scheduler/root_queue.py) and reads the cluster
from Ray (`RayCluster`, scheduler/cluster_reader.py) unless handed another `ClusterReader`.

Each root ticks on its own thread (requests, quotas, dead controllers, resources freed without a
call) and has its own lock, and its storage calls give up after a short budget: one storage root
that hangs (an outage) holds up only its own queue; every other root admits as before.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from orchestrator.scheduler import QUEUE_SERVICE_NAME
from orchestrator.scheduler.cluster_reader import ClusterReader, RayCluster
from orchestrator.scheduler.policy import DEFAULT_HOLD_AFTER_S, SchedulingPolicy, WithinTeam
from orchestrator.scheduler.queue_manager import Admission, QueueView
from orchestrator.scheduler.root_queue import RootQueue
from orchestrator.storage.queue_store import QueueEntry

TICK_S = 1.0
IDLE_EXIT_S = 3600.0  # no root at all this long: the actor ends; the next job starts it again

__all__ = ["QUEUE_SERVICE_NAME", "QueueService", "RayCluster", "start_queue_service"]


class QueueService:
    """The cluster's queue service: every call names its storage root's queue."""

    def __init__(
        self, hold_after_s: float = DEFAULT_HOLD_AFTER_S, autoscaling: bool = False,
        tick_s: float = TICK_S, within_team: str = WithinTeam.NEVER.value,
        cluster: ClusterReader | None = None,
    ) -> None:  # fmt: skip
        self.policy = SchedulingPolicy(hold_after_s, WithinTeam(within_team))
        self.autoscaling, self.tick_s = autoscaling, tick_s
        self.cluster = cluster or RayCluster()
        self.queues: dict[str, RootQueue] = {}
        self.stops: dict[str, threading.Event] = {}
        self.lock = threading.Lock()  # the dicts only
        self.closed = threading.Event()
        threading.Thread(target=self._watching, name="queue-idle", daemon=True).start()

    def enqueue(self, root: str, entry: QueueEntry) -> Admission:
        return self._queue(root).enqueue(entry)

    def admission(self, root: str, job_id: str) -> Admission:
        return self._queue(root).admission(job_id)

    def placed(self, root: str, job_id: str, nodes: list[str]) -> None:
        self._queue(root).placed(job_id, nodes)

    def release(self, root: str, job_id: str) -> None:
        self._queue(root).release(job_id)

    def requeue(self, root: str, job_id: str) -> Admission:
        return self._queue(root).requeue(job_id)

    def update_priority(self, root: str, job_id: str, priority: int) -> Admission:
        return self._queue(root).update_priority(job_id, priority)

    def view(self, root: str) -> QueueView:
        return self._queue(root).view()

    def close(self) -> None:
        """Every root stops ticking (tests; the actor itself ends when idle)."""
        self.closed.set()
        with self.lock:
            for stop in self.stops.values():
                stop.set()

    def _queue(self, root: str) -> RootQueue:
        with self.lock:
            queue = self.queues.get(root)
        if queue is not None:
            return queue
        # Read from the storage root outside the dicts' lock: another root's calls go on.
        fresh = RootQueue(root, self.policy, self.cluster, self.autoscaling)
        with self.lock:
            queue = self.queues.setdefault(root, fresh)
            if queue is fresh:
                self.stops[root] = fresh.start_ticking(
                    self.tick_s, lambda: self._forget(root, fresh)
                )
        return queue

    def _forget(self, root: str, queue: RootQueue) -> None:
        with self.lock:
            if self.queues.get(root) is queue:
                del self.queues[root]
                self.stops.pop(root, None)

    def _watching(self) -> None:
        """Ends the actor after IDLE_EXIT_S without any root (its name is free for the next)."""
        alone_since = time.monotonic()
        while not self.closed.wait(self.tick_s):
            with self.lock:
                if self.queues:
                    alone_since = time.monotonic()
                    continue
            if time.monotonic() - alone_since > IDLE_EXIT_S:
                import ray

                ray.kill(ray.get_runtime_context().current_actor)
                return


def start_queue_service(
    hold_after_s: float = DEFAULT_HOLD_AFTER_S, autoscaling: bool = False, tick_s: float = TICK_S,
    within_team: str = WithinTeam.NEVER.value,
) -> Any:  # fmt: skip
    """The cluster's queue service, started on this node (the head) if it is not running; the
    arguments count only for the call that starts it."""
    import ray

    from orchestrator.agents.services import NAMESPACE, shared_actor

    try:  # found by name: a GCS lookup, without exporting the class from this driver (~40 ms)
        return ray.get_actor(QUEUE_SERVICE_NAME, namespace=NAMESPACE)
    except ValueError:
        pass

    return shared_actor(QueueService, QUEUE_SERVICE_NAME, pinned_here=True, max_concurrency=16,
                        args=(hold_after_s, autoscaling, tick_s, within_team))  # fmt: skip
