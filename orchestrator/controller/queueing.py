"""The job's place in the cluster's queue, from its controller: wait to be admitted, say where
Ray placed it, notice a preemption, go back in line, let go at the end.

The queue itself is the cluster's queue service (scheduler/service.py), which keeps one queue
per storage root. A service that dies is started again and rebuilds the queues from the storage
roots; the call is simply made again. A fake queue stands in for it in the controller's tests
(tests/test_controller.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from orchestrator import settings
from orchestrator.errors import StorageUnavailable, last_line
from orchestrator.scheduler.entries import entry_for
from orchestrator.scheduler.queue_manager import Admission, Standing
from orchestrator.scheduler.reasons import queue_timeout_cause
from orchestrator.storage.queue_store import QueueEntry
from orchestrator.storage.records import JobRecord

POLL_S = 0.25  # a queued job asks whether it is admitted this often
PREEMPTION_POLL_S = 1.0  # a running job asks whether it must give way this often
CALL_TIMEOUT_S = 30.0
CALL_TRIES = 3
STORAGE_RETRY_S = 2.0  # the queue service could not write our storage root: asked again after


class NeverFits(Exception):
    """The job does not fit this cluster even when it is empty (internal: the job's cause)."""


class QueueTimeout(Exception):
    """The job waited in the queue longer than its queue timeout (internal: the job's cause)."""


class QueueUnavailable(Exception):
    """The queue service could not be reached or started (internal: the job's cause)."""


class JobQueue(Protocol):
    def wait_admitted(
        self, timeout_s: float | None, on_pending: Callable[[str], None],
        check_stop: Callable[[], None],
    ) -> bool:  # fmt: skip
        """Until the job may reserve its nodes; whether it is borrowing capacity. NeverFits,
        QueueTimeout; a stop (check_stop) ends the wait."""

    def placed(self, node_ids: list[str]) -> None: ...

    def preemption(self) -> str | None:
        """ "preempted by <job>: why" once the job must give way (asked at most every
        PREEMPTION_POLL_S)."""

    def requeue(self) -> None: ...

    def release(self) -> None: ...


def queue_entry(record: JobRecord, ray_job_id: str | None) -> QueueEntry:
    return entry_for(
        record, ray_job_id=ray_job_id,
        submission_id=os.environ.get("RAY_JOB_SUBMISSION_ID") or record.job_id,
    )  # fmt: skip


class RayJobQueue:
    """The job's storage root's queue in the cluster's queue service, called from the
    controller (on the head node)."""

    def __init__(self, record: JobRecord, say: Callable[[str], None]) -> None:
        import ray

        self.record = record
        self.say = say
        self.entry = queue_entry(record, ray.get_runtime_context().get_job_id())
        self.service: Any = None
        self.next_look = 0.0
        self.enqueued = False

    def wait_admitted(
        self, timeout_s: float | None, on_pending: Callable[[str], None],
        check_stop: Callable[[], None],
    ) -> bool:  # fmt: skip
        standing = self._enqueue()
        self.enqueued = True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        shown = None
        while standing.state != Standing.ADMITTED:
            if standing.state == Standing.IMPOSSIBLE:
                raise NeverFits(standing.reason)
            if standing.state == Standing.UNKNOWN:  # let go of meanwhile (never by this job)
                standing = self._enqueue()
                continue
            where = f" (position {standing.position})" if standing.position else ""
            reason = f"waiting in the queue{where}: {standing.reason}"
            if reason != shown:
                on_pending(reason)
                shown = reason
            check_stop()
            if deadline is not None and time.monotonic() > deadline:
                raise QueueTimeout(queue_timeout_cause(timeout_s, standing.reason))
            time.sleep(POLL_S)
            standing = self._admission()
        return standing.borrowed

    def placed(self, node_ids: list[str]) -> None:
        self._call(lambda service, root: service.placed.remote(root, self.record.job_id, node_ids))

    def preemption(self) -> str | None:
        if time.monotonic() < self.next_look:
            return None
        self.next_look = time.monotonic() + PREEMPTION_POLL_S
        try:
            return self._admission().preemption
        except QueueUnavailable as e:  # the job runs on; asked again later
            self.say(str(e))
            return None

    def requeue(self) -> None:
        self._call(lambda service, root: service.requeue.remote(root, self.record.job_id))

    def release(self) -> None:
        if self.enqueued:
            self._call(lambda service, root: service.release.remote(root, self.record.job_id))
            self.enqueued = False

    def _enqueue(self) -> Admission:
        return self._call(lambda service, root: service.enqueue.remote(root, self.entry))

    def _admission(self) -> Admission:
        return self._call(lambda service, root: service.admission.remote(root, self.record.job_id))

    def _call(self, call: Callable[[Any, str], Any]) -> Any:
        """`call(service, storage root)` made and waited for: the service started again if it
        is gone, the call made again while our root's storage is out (up to the job's budget)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        from orchestrator.scheduler.service import start_queue_service

        error: Exception | None = None
        tries = 0
        outage_until = time.monotonic() + self.record.storage.outage_s
        while tries < CALL_TRIES:
            if self.service is None:
                self.service = start_queue_service(
                    settings.QUEUE_HOLD_AFTER_S.get(), settings.CLUSTER_AUTOSCALES.get(),
                    within_team=settings.QUEUE_PREEMPT_WITHIN_TEAM.get(),
                )  # fmt: skip
            try:
                return ray.get(call(self.service, self.record.storage_root), timeout=CALL_TIMEOUT_S)
            except StorageUnavailable as e:  # the service gave up on our root quickly: we wait
                if time.monotonic() > outage_until:  # as long as the job's own budget says
                    why = last_line(e)  # through Ray: the remote traceback first
                    raise QueueUnavailable(f"the queue could not store its state: {why}") from None
                time.sleep(STORAGE_RETRY_S)
            except (RayActorError, GetTimeoutError) as e:  # gone or stuck: started again
                error, self.service = e, None
                tries += 1
                self.say(f"the queue service did not answer ({type(e).__name__}): asking again")
                time.sleep(1.0)
        raise QueueUnavailable(f"the queue service did not answer {CALL_TRIES} times: {error}")


class HostedJobQueue(RayJobQueue):
    """The queue, for a controller the controller host runs (controller/host.py): its entry
    names the host's incarnation instead of a Ray driver, so the service asks the host whether
    it lives, also for an entry this controller enqueues again itself."""

    def __init__(self, record: JobRecord, say: Callable[[str], None], incarnation: str) -> None:
        super().__init__(record, say)
        self.entry = entry_for(record, hosted=True, hosted_by=incarnation)
