"""The queue service: one detached actor per cluster (`orchestrator-queue`, on the head) that
keeps one queue per storage root (`RootQueue`, scheduler/root_queue.py), reads the cluster from
Ray (`RayCluster`, scheduler/cluster_reader.py) and starts admitted jobs' controllers with
the launcher the head's ORCHESTRATOR_CONTROLLERS names (`launcher_for`, scheduler/launcher.py),
unless handed other ones.

The roots it watches are kept in the GCS too (`KNOWN_ROOTS_KEY`): Ray restarts the actor when
its process dies, and the new one watches the same roots at once, so jobs that wait with no
process of their own are taken on again without anyone calling.

Each root ticks on its own thread (requests, quotas, dead controllers, resources freed without a
call) and has its own lock, and its storage calls give up after a short budget: one storage root
that hangs (an outage) holds up only its own queue; every other root admits as before.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from orchestrator import ray_private, settings
from orchestrator.agents.runtimes import cluster_runtime_kind
from orchestrator.scheduler import QUEUE_SERVICE_NAME
from orchestrator.scheduler.cluster_reader import ClusterReader, RayCluster
from orchestrator.scheduler.image_prefetch import ray_pull
from orchestrator.scheduler.launcher import ControllerLauncher, launcher_for
from orchestrator.scheduler.policy import DEFAULT_HOLD_AFTER_S, SchedulingPolicy, WithinTeam
from orchestrator.scheduler.queue_manager import Admission, QueueView
from orchestrator.scheduler.root_queue import RootQueue
from orchestrator.scheduler.roots_inbox import POLL_S, Inbox
from orchestrator.scheduler.team_meters import TeamMeters, ray_sink
from orchestrator.scheduler.webhooks import Webhooks
from orchestrator.storage.queue_store import QueueEntry

TICK_S = 1.0
IDLE_EXIT_S = 3600.0  # no root at all this long: the actor ends; the next job starts it again
KNOWN_ROOTS_KEY = b"orchestrator/queue-roots"

__all__ = ["QUEUE_SERVICE_NAME", "QueueService", "RayCluster", "start_queue_service"]


class QueueService:
    """The cluster's queue service: every call names its storage root's queue."""

    def __init__(
        self, hold_after_s: float = DEFAULT_HOLD_AFTER_S, autoscaling: bool = False,
        tick_s: float = TICK_S, within_team: str = WithinTeam.NEVER.value,
        cluster: ClusterReader | None = None, launcher: ControllerLauncher | None = None,
    ) -> None:  # fmt: skip
        """Without `cluster` it runs in Ray: Ray's cluster, the Job API, the GCS's list of
        roots; with one (tests), only what it is handed."""
        self.policy = SchedulingPolicy(hold_after_s, WithinTeam(within_team))
        self.autoscaling, self.tick_s = autoscaling, tick_s
        in_ray = cluster is None
        self.cluster = cluster or RayCluster()
        self.launcher = launcher or (launcher_for(settings.CONTROLLERS.get()) if in_ray else None)
        # Waiting jobs' images onto their nodes, where jobs run in containers (the cluster's
        # setting, which the head has as every node does).
        pulls = cluster_runtime_kind().nodes_pull_images
        self.prefetch = ray_pull if in_ray and pulls else None
        self.known = GcsRoots() if in_ray else None
        # Each watched root's webhooks, delivered until nothing is owed (scheduler/webhooks.py)
        self.webhooks = Webhooks(self.launcher.session() if in_ray and self.launcher else None)
        self.team_sink = ray_sink() if in_ray else None  # per-team counters, every root's
        self.queues: dict[str, RootQueue] = {}
        self.stops: dict[str, threading.Event] = {}
        self.lock = threading.Lock()  # the dicts only
        self.closed = threading.Event()
        threading.Thread(target=self._watching, name="queue-idle", daemon=True).start()
        if self.known is not None:
            threading.Thread(target=self._resume, name="queue-resume", daemon=True).start()
        inbox = settings.ROOTS_INBOX.get() if in_ray and self.launcher is not None else None
        if inbox:
            try:
                box = Inbox(Path(inbox), self.launcher.session())
            except OSError:  # no inbox: new roots' first pushes are Ray jobs, as elsewhere
                traceback.print_exc()
            else:
                threading.Thread(target=self._polling, args=(box,), name="queue-inbox",
                                 daemon=True).start()  # fmt: skip

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
        fresh = RootQueue(root, self.policy, self.cluster, self.autoscaling,
                          launcher=self.launcher, prefetch=self.prefetch,
                          freed=lambda: self._freed_in(root),
                          meters=TeamMeters(self.team_sink) if self.team_sink else None,
                          )  # fmt: skip
        with self.lock:
            queue = self.queues.setdefault(root, fresh)
            if queue is fresh:
                self.stops[root] = fresh.start_ticking(
                    self.tick_s, lambda: self._forget(root, fresh)
                )
                self._remember()
                self.webhooks.watch(root)
        return queue

    def _freed_in(self, root: str) -> None:
        """A job of `root` let go of its nodes: the other roots' waiting jobs may fit now."""
        with self.lock:
            others = [q for r, q in self.queues.items() if r != root]
        for queue in others:
            queue.look_soon()

    def _forget(self, root: str, queue: RootQueue) -> None:
        with self.lock:
            if self.queues.get(root) is queue:
                del self.queues[root]
                self.stops.pop(root, None)
                self.webhooks.let_go(root)
                self._remember()

    def _remember(self) -> None:
        """The roots watched, in the GCS (under the dicts' lock)."""
        if self.known is not None:
            self.known.put(sorted({*self.queues, *self.webhooks.busy_roots()}))

    def _resume(self) -> None:
        """A restarted service watches the roots its predecessor did."""
        assert self.known is not None
        for root in self.known.get():
            try:
                self._queue(root)
            except Exception:  # that root is out: the next push or controller brings it back
                traceback.print_exc()

    def _polling(self, inbox: Inbox) -> None:
        """Watches the roots a client on this machine asks for (roots_inbox.py)."""
        while not self.closed.wait(POLL_S):
            try:
                inbox.say()
                for root in inbox.take():
                    self._queue(root)
            except Exception:  # a root that cannot be read: its push falls back to a Ray job
                traceback.print_exc()
        inbox.close()

    def _watching(self) -> None:
        """Ends the actor after IDLE_EXIT_S without any root (its name is free for the next)."""
        alone_since = time.monotonic()
        while not self.closed.wait(self.tick_s):
            with self.lock:
                if self.queues or self.webhooks.busy_roots():
                    alone_since = time.monotonic()
                    continue
            if time.monotonic() - alone_since > IDLE_EXIT_S:
                import ray

                ray.kill(ray.get_runtime_context().current_actor)
                return


class GcsRoots:
    """The watched roots in the GCS's key-value store: they outlive the actor's process."""

    def get(self) -> list[str]:
        raw = ray_private.kv_get(KNOWN_ROOTS_KEY)
        return list(json.loads(raw)) if raw else []

    def put(self, roots: list[str]) -> None:
        ray_private.kv_put(KNOWN_ROOTS_KEY, json.dumps(roots).encode())


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
                        args=(hold_after_s, autoscaling, tick_s, within_team),
                        max_restarts=-1)  # fmt: skip
