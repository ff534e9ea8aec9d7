"""A job's run as its controller drives it: the record, the status and the lines.

The status changes in one of two ways only. A transition moves the job to a state: it is said in
a line first, so a reader that sees the new state has every line written before it, then stored
and waited for. An amendment changes what the status says without a state of its own (the nodes
a prepare found, an attempt's end) and is stored behind the lines already queued.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

from orchestrator.home import orchestrator_home
from orchestrator.lifecycle import JobState
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.journal import JobJournal, spill_dir
from orchestrator.storage.records import JobRecord, JobStatus

STORED_WAIT_S = 10.0  # a transition waits this long to be stored (not at all in an outage)
STOPPED_CLOSE_S = 5.0  # what a stopped job's journal has left of Ray's stop grace


class JobStopped(Exception):
    """A stop was requested (SIGTERM from `ray job stop` / `orchestrator stop`)."""


class StorageLost(Exception):
    """The job's logs and status cannot be stored and ORCHESTRATOR_ON_STORAGE_ERROR=stop."""


class JobRun:
    """The one owner of a job's status while it runs; its lines go out through it too."""

    def __init__(self, store: JobStore, job_id: str, echo: TextIO | None = None) -> None:
        """`echo`: where its lines are also written as they come (the process's stdout: the
        Ray job's log; a hosted controller's own file)."""
        self.echo = echo
        self.root = store.root
        self.record: JobRecord = store.record(job_id)
        self._status: JobStatus = store.status(job_id)
        self.journal = JobJournal(
            store.root, job_id, spill_dir(orchestrator_home(), job_id), self.say
        )
        self.stop_requested = threading.Event()
        self.running_since = 0.0  # when the first attempt's commands started

    @property
    def status(self) -> JobStatus:
        return self._status

    # --- the two writers ---------------------------------------------------------------------

    def transition(self, state: JobState, reason: str | None = None, **updates: Any) -> None:
        """Move to `state`, said in a line, stored before the job goes on (unless in an outage)."""
        status = self._status.moved_to(state, reason).model_copy(update=updates)
        self.say(f"{state.value}" + (f": {reason}" if reason else ""))
        self._status = status
        self.journal.status(status)
        self.journal.wait_stored(STORED_WAIT_S)

    def amend(self, **updates: Any) -> None:
        """Change what the status says in the state it is in; stored, not waited for."""
        self._status = self._status.model_copy(update=updates)
        self.journal.status(self._status)

    # --- lines -------------------------------------------------------------------------------

    def say(self, message: str) -> None:
        """A controller line, in the Ray job log and the stored logs."""
        line = f"[orchestrator {time.strftime('%H:%M:%S')}] {message}"
        self._echo(line + "\n")
        self.journal.lines([line])

    def lines(self, lines: list[str]) -> None:
        """Lines that carry their own prefix (a rank's, the uploaders'), as they are."""
        if lines:
            self._echo("".join(line + "\n" for line in lines))
            self.journal.lines(lines)

    def _echo(self, text: str) -> None:
        out = self.echo or sys.stdout
        out.write(text)
        out.flush()

    # --- stopping ----------------------------------------------------------------------------

    def check_stop(self) -> None:
        """Raise JobStopped once a stop is asked, StorageLost once the journal cannot store
        and the job says to stop then."""
        if self.stop_requested.is_set():
            raise JobStopped()
        if self.journal.problem and self.record.storage.on_error == "stop":
            raise StorageLost(self.journal.problem)

    def close(self) -> list[str]:
        """Store what waits; a stopped job has only what is left of Ray's stop grace. What
        could not be stored, each in a line (also printed)."""
        stopped = self._status.state == JobState.STOPPED
        unstored = self.journal.close(STOPPED_CLOSE_S if stopped else self.record.storage.outage_s)
        if unstored:
            line = f"could not be stored in {self.root.url}: " + "; ".join(unstored)
            self._echo(f"[orchestrator {time.strftime('%H:%M:%S')}] {line}\n")
        return unstored
