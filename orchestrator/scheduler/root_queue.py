"""The queue of one storage root (`RootQueue`): its parts wired together under one lock, and
the thread that ticks it.

A pushed job arrives as a file (`queue/incoming/`), with no process of its own: the queue
takes it, writes why it waits into its status (`JobNotes`), and when the policy admits it,
starts its controller (`ControllerLauncher`). Stops of such jobs arrive as files too. A
controller `enqueue`s its job (one started by `ray job submit ... orchestrator run` comes with
no file), polls `admission` until it says admitted (or impossible), says where Ray `placed` it,
and `release`s it when the job ends; an admitted job polls `admission` too, for a `preemption`.
Every change is written to the storage root before it is answered (`QueueLedger`), so a
service that is killed and started again rebuilds the same queues.

The parts, each tested alone: `QueueManager` (which jobs wait and run, their standings),
`SnapshotBuilder` (what the policy decides on, the cluster read through a `ClusterReader`),
`OrphanReaper` (jobs whose controller died), `QueueViewWriter` (what `orchestrator queue`
shows, with each waiting job's estimated start from `RunHistory`'s typical runs). Its storage
calls ride out an outage for `STORAGE_BUDGET_S` only (a job's own calls wait up to 30
minutes): a root that is down fails its own calls and ticks quickly, and is asked again at the
next tick.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from orchestrator.agents.runtimes import cluster_runtime_kind
from orchestrator.lifecycle import JobState
from orchestrator.scheduler.cluster_reader import ClusterReader
from orchestrator.scheduler.estimate import Estimate, estimate_starts
from orchestrator.scheduler.image_prefetch import ImagePrefetch, Pull
from orchestrator.scheduler.job_notes import JobNotes
from orchestrator.scheduler.launcher import ControllerLauncher, Launched
from orchestrator.scheduler.model import ClusterSnapshot, Decision
from orchestrator.scheduler.orphan_reaper import OrphanReaper
from orchestrator.scheduler.policy import SchedulingPolicy
from orchestrator.scheduler.queue_manager import Admission, QueueManager, QueueView, ViewedEntry
from orchestrator.scheduler.queue_view_writer import QueueViewWriter
from orchestrator.scheduler.reasons import never_fits_cause, queue_timeout_cause
from orchestrator.scheduler.run_history import RunHistory
from orchestrator.scheduler.snapshot_builder import SnapshotBuilder
from orchestrator.scheduler.team_meters import TeamMeters
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.queue_store import BEAT_S, QueueEntry, QueueStore
from orchestrator.storage.retry import StorageRetry
from orchestrator.storage.root import StorageRoot

STORAGE_BUDGET_S = 10.0  # how long the queue rides out its root's outage before a call fails
IDLE_DROP_S = 60.0  # a root with nothing queued or admitted this long is forgotten (memory)
ARRIVALS_POLL_S = {True: 0.05, False: 0.5}  # a local root / an object store: look for pushes
# Ray's count of free resources lags a placement group's removal (50-80 ms measured here: the
# raylet tells the GCS): after a job lets go, jobs still waiting are decided again this often,
# for this long, not at the next tick.
FREED_LOOK_S, FREED_FOR_S = 0.05, 0.5

__all__ = ["IDLE_DROP_S", "STORAGE_BUDGET_S", "Admission", "RootQueue"]


class RootQueue:
    """The queue of one storage root: the calls, each decided at once, and a tick for the rest."""

    def __init__(
        self, storage_root: str, policy: SchedulingPolicy, cluster: ClusterReader,
        autoscaling: bool = False, storage_budget_s: float = STORAGE_BUDGET_S,
        launcher: ControllerLauncher | None = None, prefetch: Pull | None = None,
        freed: Callable[[], None] = lambda: None, meters: TeamMeters | None = None,
    ) -> None:  # fmt: skip
        """`freed`: told when a job of this root lets go of its nodes (the service has the
        other roots' queues look again: what one root's job freed, another's may take).
        `meters`: told of the entries before each change (per-team Prometheus counters)."""
        self.root = StorageRoot(storage_root, StorageRetry(storage_root, storage_budget_s))
        self.store = store = QueueStore(self.root)
        self.queue = QueueManager(store)
        self.snapshots = SnapshotBuilder(cluster, autoscaling)
        jobs = JobStore(self.root)
        self.reaper = OrphanReaper(cluster, jobs, launcher)
        self.history = RunHistory(jobs)  # the projects' typical runs, for the start estimates
        self.view_writer = QueueViewWriter(store, self._estimate)
        self.notes = JobNotes(jobs)
        self.launcher = launcher
        self.session = launcher.session() if launcher is not None else None
        # Submitting a controller is an HTTP call to the Job API: never under the lock.
        self.launches = ThreadPoolExecutor(4, thread_name_prefix="queue-launch")
        self.prefetch = None  # waiting jobs' images onto their nodes, off this pool's threads
        if prefetch is not None:
            self.prefetch = ImagePrefetch(prefetch, ThreadPoolExecutor(2, "queue-prefetch"))
        self.policy = policy
        self.lock = threading.RLock()  # the calls and the ticking thread
        self.idle_since = time.monotonic()
        self.last_beat = 0.0
        self.look_again_until = 0.0  # resources freed: decided again until then (FREED_FOR_S)
        self.freed = freed
        self.meters = meters

    # -- the controllers' calls -----------------------------------------------------------------

    def enqueue(self, job: QueueEntry) -> Admission:
        """Queue a job (again: its standing, unchanged) and decide at once."""
        with self.lock:
            self._meter()
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
            self._meter()
            if self.queue.release(job_id):
                self._freed()

    def requeue(self, job_id: str) -> Admission:
        """A preempted job that flushed and let go: back in the queue, keeping its push time."""
        with self.lock:
            self._meter()
            if self.queue.requeue(job_id):
                self._freed()
            return self.admission(job_id)

    # -- what clients ask through the storage root (and tests directly) ---------------------------

    def update_priority(self, job_id: str, priority: int) -> Admission:
        with self.lock:
            self._meter()
            if not self.queue.reprioritise(job_id, priority):
                raise ValueError(f"job {job_id} is not waiting in the queue: only a queued "
                                 "job's priority can change")  # fmt: skip
            self._decide()
            return self.admission(job_id)

    def view(self) -> QueueView:
        """The queue as `orchestrator queue` shows it, decided now."""
        with self.lock:
            self._meter()
            self._decide()
            entries = self.queue.entries()
            return QueueView(
                self.queue.quotas,
                tuple(ViewedEntry(e, self.queue.standing(e.job_id)) for e in entries),
            )

    # -- inside ---------------------------------------------------------------------------------

    def _meter(self) -> None:
        """What the entries held up to now, counted before they change."""
        if self.meters is not None:
            self.meters.advance(self.queue.entries(), time.time())

    def tick(self) -> None:
        """What no call brings: pushed jobs and stops, requests, quotas, dead controllers,
        resources freed; and the service's sign of life."""
        self._meter()
        self._take_arrivals()
        self.queue.reload_quotas()
        for job_id in self.reaper.reap(self.queue):
            self.notes.settle(job_id)
        self._decide()
        self._beat()

    def _take_arrivals(self) -> None:
        """Pushed jobs into the queue (unless stopped before they were taken), then stops and
        priority requests. Those two are read before the pushes: a client writes one only once
        it has seen the job pushed, so its job is in the queue when it is applied."""
        requests = self.store.take_requests()
        stops = self.store.take_stops() if self.launcher is not None else []
        if self.launcher is not None:  # else no way to start a controller: pushes are a service's
            for entry in self.store.incoming_for(self.session):
                self.queue.add(entry)  # stored first: listed in one place or the other throughout
                self.store.drop_incoming(entry.job_id)
        for request in stops:
            self._stop(request.job_id)
        for request in requests:
            self.queue.reprioritise(request.job_id, request.priority)  # one that left: dropped

    def _stop(self, job_id: str) -> None:
        entry = self.queue.ledger.get(job_id)
        if entry is None:  # it left the queue meanwhile (started and ended)
            return
        if entry.awaits_controller:
            self.notes.end(job_id, JobState.STOPPED, "stopped by user", failed=False)
            self.queue.release(job_id)
        elif self.launcher is not None:  # its controller stops it, flushing what it holds
            self.launches.submit(self.launcher.stop, job_id)

    def _decide(self) -> Decision:
        """Decide; then act for the jobs that have no controller: start those admitted, write
        why the others wait, end those that never fit or waited too long (and decide again,
        as what they held is free)."""
        while True:
            now = time.time()
            snap = self.snapshots.build(self.queue.entries(), self.queue.quotas, now)
            decision = self.policy.decide(snap)
            self.queue.carry_out(decision, now)
            self.view_writer.show(decision, snap.nodes, now, snap)
            if self.prefetch is not None:
                self.prefetch.consider(decision, self.queue.ledger.get, snap.nodes)
            if not self._act_for_waiting(decision, now):
                return decision

    def _estimate(self, snap: ClusterSnapshot) -> Callable[[], dict[str, Estimate]]:
        """Each waiting job's estimated start: the policy simulated forward over the jobs'
        limits and their projects' latest runs. What it needs is taken now (the view writer
        asks under the lock); the simulation runs when called, off it."""
        entries = self.queue.entries()
        run_times = self.history.run_times(entries)
        pushed_at = {e.job_id: e.pushed_at for e in entries}
        return partial(estimate_starts, snap, self.policy, run_times, pushed_at=pushed_at)

    def _act_for_waiting(self, decision: Decision, now: float) -> bool:
        """What the service does for jobs without a controller; whether any left the queue."""
        left = False
        waiting = {w.job_id: w for w in decision.waiting}
        for entry in self.queue.entries():
            if not entry.awaits_controller:
                continue
            job_id = entry.job_id
            if entry.state == "admitted":  # marked (and how) before it is started
                hosted = self.launcher is not None and self.launcher.hosts(entry)
                self.queue.ledger.update(entry, launched_at=now, hosted=hosted)
                self.launches.submit(self._launch, self.queue.ledger[job_id])
            elif job_id in decision.impossible:
                self.notes.end(job_id, JobState.DEPLOY_FAILED,
                               never_fits_cause(decision.impossible[job_id]))  # fmt: skip
                left |= self.queue.release(job_id)
            elif (w := waiting.get(job_id)) is not None:
                timeout = entry.queue_timeout_s
                if timeout is not None and now - entry.pushed_at > timeout:
                    self.notes.end(job_id, JobState.DEPLOY_FAILED,
                                   queue_timeout_cause(timeout, w.reason))  # fmt: skip
                    left |= self.queue.release(job_id)
                else:
                    self.notes.pending(
                        job_id, f"waiting in the queue (position {w.position}): {w.reason}"
                    )
        return left

    def _launch(self, entry: QueueEntry) -> None:
        """Start an admitted job's controller (a pool thread); a refusal ends the job."""
        assert self.launcher is not None
        self.notes.settle(entry.job_id)  # from here on its controller writes its status
        try:
            if self.notes.ended(entry.job_id):  # stopped by a client while no service ran
                self._leave(entry.job_id)
                return
            outcome = self.launcher.launch(entry)
            if outcome.launched is Launched.HOST_GONE:
                # A Ray job then, whose controller starts a host again; marked so first, as
                # every start is (a service that dies in between starts it once, as that).
                with self.lock:
                    if (current := self.queue.ledger.get(entry.job_id)) is None:
                        return  # stopped meanwhile
                    self.queue.ledger.update(current, hosted=False)
                    entry = self.queue.ledger[entry.job_id]
                outcome = self.launcher.launch(entry)
            if outcome.launched is Launched.REFUSED:
                cause = f"the job's controller could not be started: {outcome.cause}"
                self.notes.end(entry.job_id, JobState.DEPLOY_FAILED, cause)
                self._leave(entry.job_id)
            elif outcome.host is not None:
                with self.lock:
                    if (current := self.queue.ledger.get(entry.job_id)) is not None:
                        self.queue.ledger.update(current, hosted_by=outcome.host)
        except Exception:
            traceback.print_exc()

    def _leave(self, job_id: str) -> None:
        with self.lock:
            if self.queue.release(job_id):
                self._freed()

    def _freed(self) -> None:
        """A job let go of what it held: decided now, and again soon while others wait (Ray
        may not count what it freed yet; FREED_LOOK_S)."""
        if self._decide().waiting:
            self.look_soon()
        self.freed()

    def look_soon(self) -> None:
        """Decide again every FREED_LOOK_S for FREED_FOR_S (then the tick goes on)."""
        self.look_again_until = time.monotonic() + FREED_FOR_S

    def _look_again(self) -> None:
        if not self._decide().waiting:
            self.look_again_until = 0.0

    def _beat(self) -> None:
        if self.session is None or time.monotonic() - self.last_beat < BEAT_S:
            return
        self.store.beat(self.session, time.time(), cluster_runtime_kind().said)
        self.last_beat = time.monotonic()

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
        """A tick every `tick_s`, sooner when a push, stop or request arrives."""
        poll_s = min(tick_s, ARRIVALS_POLL_S[self.root.is_local])
        next_tick = next_poll = time.monotonic()
        while not stop.wait(min(poll_s, FREED_LOOK_S) if self._looking_again() else poll_s):
            try:
                now = time.monotonic()
                if self._looking_again():
                    with self.lock:
                        self._look_again()
                    if now < next_poll - FREED_LOOK_S / 2:  # arrivals: looked for every poll_s
                        continue
                next_poll = now + poll_s
                due = now >= next_tick
                if not due and not self._watched_arrivals():
                    continue
                next_tick = time.monotonic() + tick_s
                with self.lock:
                    if self.queue.ledger or not due or self._watched_arrivals():
                        self.idle_since = time.monotonic()
                        self.tick()
                    elif time.monotonic() - self.idle_since > IDLE_DROP_S and self._let_go():
                        forget()  # its state is all in the storage root
                        return
                    else:
                        self._beat()
            except Exception:  # a storage outage, a GCS hiccup: said, and tried again
                traceback.print_exc()

    def _looking_again(self) -> bool:
        return time.monotonic() < self.look_again_until

    def _watched_arrivals(self) -> bool:
        return self.launcher is not None and self.store.arrivals()

    def _let_go(self) -> bool:
        """Stop watching an idle root: its beat goes first, so a push made from now on starts
        a service itself; one that came before is still seen (then the root is kept)."""
        if self.session is not None:
            self.store.forget_beat(self.session)
        if self._watched_arrivals():
            self.last_beat = 0.0
            return False
        self.notes.close()
        self.launches.shutdown(wait=False)
        if self.prefetch is not None:
            self.prefetch.pool.shutdown(wait=False)
        return True
