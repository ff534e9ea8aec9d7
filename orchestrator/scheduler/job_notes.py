"""What the queue service writes into the status and logs of a job that has no controller yet
(`JobNotes`): why it waits (PENDING, each reason as it changes), or how it ended while it
waited (stopped, never fits, queue timeout, its controller could not start).

The reasons are written by one thread, the latest per job, so a decision that moves a thousand
jobs' positions returns at once and a burst of changes costs one write per job. Before the
service starts a job's controller it `settle`s the job: what was queued for it is written, and
nothing more is, so the controller is then the status' only writer.
"""

from __future__ import annotations

import threading
import time
import traceback

from orchestrator.errors import JobNotFound
from orchestrator.lifecycle import JobState
from orchestrator.storage import layout
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.logs import next_segment
from orchestrator.storage.records import Failure


class JobNotes:
    """The service's writes into jobs' status and logs, for one storage root."""

    def __init__(self, jobs: JobStore) -> None:
        self.jobs = jobs
        self._reasons: dict[str, str] = {}  # job -> the latest reason not yet written
        self._written: dict[str, str] = {}  # job -> the reason its status says
        self._busy: str | None = None  # the job being written now
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._run, name="queue-notes", daemon=True).start()

    def pending(self, job_id: str, reason: str) -> None:
        """The job waits, for `reason` (written unless it is what the status says already)."""
        with self._cond:
            if self._written.get(job_id) == reason and job_id not in self._reasons:
                return
            self._reasons[job_id] = reason
            self._cond.notify_all()

    def settle(self, job_id: str) -> None:
        """Wait until nothing is being written for the job, and write nothing more for it."""
        with self._cond:
            self._reasons.pop(job_id, None)
            while self._busy == job_id:
                self._cond.wait()
            self._written.pop(job_id, None)

    def end(self, job_id: str, state: JobState, cause: str, *, failed: bool = True) -> bool:
        """End a job that has no controller, said in its logs; False if it had ended already
        (or has no record)."""
        self.settle(job_id)
        try:
            status = self.jobs.status(job_id)
        except (JobNotFound, FileNotFoundError):
            return False
        if status.state.is_terminal:
            return False
        self._line(job_id, f"{state.value}: {cause}")
        ended = status.moved_to(state, cause)
        if failed:
            ended = ended.model_copy(update={"failure": Failure(cause=cause)})
        self.jobs.put_status(ended)
        return True

    def ended(self, job_id: str) -> bool:
        """Whether the job's status is terminal (or it has no record: nothing to start)."""
        try:
            return self.jobs.status(job_id).state.is_terminal
        except (JobNotFound, FileNotFoundError):
            return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- the writer -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._reasons and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job_id, reason = next(iter(self._reasons.items()))
                del self._reasons[job_id]
                self._busy = job_id
            try:
                if self._write_pending(job_id, reason):
                    with self._cond:
                        self._written[job_id] = reason
            except Exception:  # an outage: the next change of reason tries again
                traceback.print_exc()
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()

    def _write_pending(self, job_id: str, reason: str) -> bool:
        try:
            status = self.jobs.status(job_id)
        except (JobNotFound, FileNotFoundError):
            return False
        if status.state not in (JobState.CREATED, JobState.PENDING):
            return False
        self._line(job_id, f"{JobState.PENDING.value}: {reason}")
        self.jobs.put_status(status.moved_to(JobState.PENDING, reason))
        return True

    def _line(self, job_id: str, text: str) -> None:
        """One line in the job's logs, as its controller would say it, in the next segment."""
        root = self.jobs.root
        line = f"[orchestrator {time.strftime('%H:%M:%S')}] {text}\n"
        root.write_bytes(layout.log_segment(job_id, next_segment(root, job_id)), line.encode())
