"""The queue of one storage root (`RootQueue`): its parts wired together under one lock, and
the thread that ticks it.

Controllers `enqueue` their job, poll `admission` until it says admitted (or impossible), say
where Ray `placed` it, and `release` it when the job ends; an admitted job polls `admission`
too, for a `preemption`. Every change is written to the storage root before it is answered
(`QueueLedger`), so a service that is killed and started again rebuilds the same queues.

The parts, each tested alone: `QueueManager` (which jobs wait and run, their standings),
`SnapshotBuilder` (what the policy decides on, the cluster read through a `ClusterReader`),
`OrphanReaper` (jobs whose controller died), `QueueViewWriter` (what `orchestrator queue`
shows). Its storage calls ride out an outage for `STORAGE_BUDGET_S` only (a job's own calls
wait up to 30 minutes): a root that is down fails its own calls and ticks quickly, and is asked
again at the next tick.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable

from orchestrator.scheduler.cluster_reader import ClusterReader
from orchestrator.scheduler.model import Decision
from orchestrator.scheduler.orphan_reaper import OrphanReaper
from orchestrator.scheduler.policy import SchedulingPolicy
from orchestrator.scheduler.queue_manager import Admission, QueueManager, QueueView, ViewedEntry
from orchestrator.scheduler.queue_view_writer import QueueViewWriter
from orchestrator.scheduler.snapshot_builder import SnapshotBuilder
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.queue_store import QueueEntry, QueueStore
from orchestrator.storage.retry import StorageRetry
from orchestrator.storage.root import StorageRoot

STORAGE_BUDGET_S = 10.0  # how long the queue rides out its root's outage before a call fails
IDLE_DROP_S = 60.0  # a root with nothing queued or admitted this long is forgotten (memory)

__all__ = ["IDLE_DROP_S", "STORAGE_BUDGET_S", "Admission", "RootQueue"]


class RootQueue:
    """The queue of one storage root: the calls, each decided at once, and a tick for the rest."""

    def __init__(
        self, storage_root: str, policy: SchedulingPolicy, cluster: ClusterReader,
        autoscaling: bool = False, storage_budget_s: float = STORAGE_BUDGET_S,
    ) -> None:  # fmt: skip
        self.root = StorageRoot(storage_root, StorageRetry(storage_root, storage_budget_s))
        store = QueueStore(self.root)
        self.queue = QueueManager(store)
        self.snapshots = SnapshotBuilder(cluster, autoscaling)
        self.reaper = OrphanReaper(cluster, JobStore(self.root))
        self.view_writer = QueueViewWriter(store)
        self.policy = policy
        self.lock = threading.RLock()  # the calls and the ticking thread
        self.idle_since = time.monotonic()

    # -- the controllers' calls -----------------------------------------------------------------

    def enqueue(self, job: QueueEntry) -> Admission:
        """Queue a job (again: its standing, unchanged) and decide at once."""
        with self.lock:
            if self.queue.add(job):
                self._decide()
            return self.admission(job.job_id)

    def admission(self, job_id: str) -> Admission:
        with self.lock:
            return self.queue.standing(job_id)

    def placed(self, job_id: str, nodes: list[str]) -> None:
        """Where Ray put the job's bundles (not always the nodes it was admitted to)."""
        with self.lock:
            self.queue.placed(job_id, nodes)

    def release(self, job_id: str) -> None:
        """The job ended, was stopped while queued, or left after a preemption."""
        with self.lock:
            if self.queue.release(job_id):
                self._decide()

    def requeue(self, job_id: str) -> Admission:
        """A preempted job that flushed and let go: back in the queue, keeping its push time."""
        with self.lock:
            if self.queue.requeue(job_id):
                self._decide()
            return self.admission(job_id)

    # -- what clients ask through the storage root (and tests directly) ---------------------------

    def update_priority(self, job_id: str, priority: int) -> Admission:
        with self.lock:
            if not self.queue.reprioritise(job_id, priority):
                raise ValueError(f"job {job_id} is not waiting in the queue: only a queued "
                                 "job's priority can change")  # fmt: skip
            self._decide()
            return self.admission(job_id)

    def view(self) -> QueueView:
        """The queue as `orchestrator queue` shows it, decided now."""
        with self.lock:
            self._decide()
            entries = self.queue.entries()
            return QueueView(
                self.queue.quotas,
                tuple(ViewedEntry(e, self.queue.standing(e.job_id)) for e in entries),
            )

    # -- inside ---------------------------------------------------------------------------------

    def tick(self) -> None:
        """What no call brings: requests, quotas, dead controllers, resources freed."""
        self.queue.take_requests()
        self.queue.reload_quotas()
        self.reaper.reap(self.queue)
        self._decide()

    def _decide(self) -> Decision:
        now = time.time()
        snap = self.snapshots.build(self.queue.entries(), self.queue.quotas, now)
        decision = self.policy.decide(snap)
        self.queue.carry_out(decision, now)
        self.view_writer.show(decision, snap.nodes, now)
        return decision

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
                    if self.queue.ledger:
                        self.idle_since = time.monotonic()
                        self.tick()
                    elif time.monotonic() - self.idle_since > IDLE_DROP_S:
                        forget()  # its state is all in the storage root
                        return
            except Exception:  # a storage outage, a GCS hiccup: said, and tried again
                traceback.print_exc()
