"""Jobs whose controller died (`OrphanReaper`): a queue entry whose Ray driver is gone ends
FAILED in the job's status, saying why, and leaves the queue, so what it held is freed for the
jobs that wait."""

from __future__ import annotations

from orchestrator.errors import JobNotFound
from orchestrator.lifecycle import JobState
from orchestrator.scheduler.cluster_reader import ClusterReader
from orchestrator.scheduler.queue_manager import QueueManager
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.queue_store import QueueEntry
from orchestrator.storage.records import Failure


class OrphanReaper:
    """Finds the dead drivers through the cluster, records the ends in the root's job store."""

    def __init__(self, cluster: ClusterReader, jobs: JobStore) -> None:
        self.cluster = cluster
        self.jobs = jobs

    def reap(self, queue: QueueManager) -> list[str]:
        """Every orphan failed and released; their job ids."""
        alive = self.cluster.live_drivers()
        reaped = []
        for entry in queue.entries():
            if entry.ray_job_id is None or entry.ray_job_id in alive:
                continue
            self._fail(entry)
            queue.release(entry.job_id)
            reaped.append(entry.job_id)
        return reaped

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
        self.jobs.put_status(status.moved_to(JobState.FAILED, cause).model_copy(
            update={"failure": Failure(cause=cause)}
        ))  # fmt: skip
