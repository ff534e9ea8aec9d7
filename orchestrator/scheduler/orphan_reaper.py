"""Jobs whose controller died (`OrphanReaper`): a queue entry whose Ray driver is gone, or whose
controller the service started and whose Ray job ended before it came, ends FAILED in the job's
status, saying why, and leaves the queue, so what it held is freed for the jobs that wait. A
controller marked started that never came to exist is started again. How a controller the
service started stands is its launcher's answer (`ControllerStanding`, scheduler/launcher.py):
a hosted one (a thread of the controller host) gone with its host, or ended without recording
its job's end, is failed the same way."""

from __future__ import annotations

import time

from orchestrator.errors import JobNotFound
from orchestrator.lifecycle import JobState
from orchestrator.scheduler.cluster_reader import ClusterReader
from orchestrator.scheduler.launcher import ControllerLauncher, ControllerState
from orchestrator.scheduler.queue_manager import QueueManager
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.queue_store import QueueEntry
from orchestrator.storage.records import Failure, JobStatus

MISSING_GRACE_S = 60.0  # a started controller's Ray job that Ray does not know: started again after


class OrphanReaper:
    """Finds the dead drivers through the cluster, records the ends in the root's job store."""

    def __init__(
        self, cluster: ClusterReader, jobs: JobStore, launcher: ControllerLauncher | None = None
    ) -> None:
        self.cluster = cluster
        self.jobs = jobs
        self.launcher = launcher

    def reap(self, queue: QueueManager) -> list[str]:
        """Every orphan failed and released; their job ids."""
        alive = self.cluster.live_drivers()
        reaped = []
        for entry in queue.entries():
            if entry.hosted:
                if not self._hosted_gone(queue, entry):
                    continue
            elif entry.ray_job_id is None:
                if not self._never_came(queue, entry):
                    continue
            elif entry.ray_job_id in alive:
                continue
            else:
                self._fail(entry)
            queue.release(entry.job_id)
            reaped.append(entry.job_id)
        return reaped

    def _never_came(self, queue: QueueManager, entry: QueueEntry) -> bool:
        """A controller the service started whose Ray job ended before it enqueued: failed.
        One Ray does not know a minute after it was marked started (the service died between
        marking and submitting, or a head restarted): started again, as the same Ray job id."""
        if entry.launched_at is None or self.launcher is None:
            return False
        standing = self.launcher.standing(entry)
        if standing.state is ControllerState.RUNNING_OR_UNKNOWN:
            return False
        if standing.state is ControllerState.NOT_STARTED:  # marked before the submit goes out
            if time.time() - entry.launched_at > MISSING_GRACE_S and entry.launch is not None:
                queue.ledger.update(entry, launched_at=None)  # the next decision starts it
            return False
        cause = (
            f"the job's controller (Ray job {entry.job_id}) ended before it started the job: "
            f"{standing.cause}"
        )
        self._record_failed(entry.job_id, cause)
        return True

    def _hosted_gone(self, queue: QueueManager, entry: QueueEntry) -> bool:
        """Whether a hosted controller is gone (its job's end recorded, with why if it had
        none); one its host never started is started again after a grace, as a Ray job's."""
        if self.launcher is None:
            return False
        standing = self.launcher.standing(entry)
        if standing.state is ControllerState.RUNNING_OR_UNKNOWN:
            return False
        if standing.state is ControllerState.NOT_STARTED:
            late = entry.launched_at is None or time.time() - entry.launched_at > MISSING_GRACE_S
            if late and entry.hosted_by is None:  # the service died between marking and asking
                queue.ledger.update(entry, launched_at=None)
            return False
        if standing.state is ControllerState.FAILED:
            self._record_failed(entry.job_id, standing.cause)
            self.launcher.gone(entry.job_id, standing.cause)
        return True

    def _record_failed(self, job_id: str, cause: str) -> None:
        try:
            status = self.jobs.status(job_id)
        except (JobNotFound, FileNotFoundError):
            return
        if not status.state.is_terminal:
            self._put_failed(status, cause)

    def _put_failed(self, status: JobStatus, cause: str) -> None:
        self.jobs.put_status(status.moved_to(JobState.FAILED, cause).model_copy(
            update={"failure": Failure(cause=cause)}
        ))  # fmt: skip

    def _fail(self, entry: QueueEntry) -> None:
        try:
            status = self.jobs.status(entry.job_id)
        except (JobNotFound, FileNotFoundError):  # no record to end: the entry still goes
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
        self._put_failed(status, cause)
