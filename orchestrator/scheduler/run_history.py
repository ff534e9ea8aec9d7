"""How long each project's jobs hold their nodes (`RunHistory`): what the queue's start
estimates (`scheduler/estimate.py`) count on for a job with no `max_duration` of its own.

Read from the storage root's job statuses, never on a tick: at most every `refresh_s`, on a
thread of its own, so a root of thousands of jobs on an object store holds up no decision. A
finished job's figure never changes, so it is read once; only jobs not finished yet are read
again. A project's typical run is the median over its latest `RECENT` finished jobs of how long
each held its nodes: the sum of its holds (`JobStatus.holds`), or, for a status written before
holds were, its RUNNING to end span. Jobs that never held nodes (stopped while queued, failed
to deploy) are not counted.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Iterable

from orchestrator.errors import JobNotFound
from orchestrator.lifecycle import JobState
from orchestrator.scheduler.estimate import RunTime, expected_run
from orchestrator.storage import layout
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.queue_store import QueueEntry
from orchestrator.storage.records import JobStatus

HISTORY_REFRESH_S = 180.0  # the statuses are read again at most this often
RECENT = 50  # a project's latest finished jobs counted in its typical run


def held_for(status: JobStatus) -> tuple[float, float] | None:
    """A finished job's (end, seconds it held its nodes); None while it runs or if it held none."""
    if not status.state.is_terminal or status.state is JobState.DEPLOY_FAILED:
        return None
    ended = status.history[-1].at
    if status.holds:
        held = sum((h.until if h.until is not None else ended) - h.since for h in status.holds)
    else:
        runs = [e.at for e in status.history if e.state is JobState.RUNNING]
        held = ended - runs[0] if runs else 0.0
    return (ended, held) if held > 0 else None


def recent_runs(finished: Iterable[tuple[str, float, float]]) -> dict[str, tuple[float, ...]]:
    """Per project, how long its latest `RECENT` finished jobs held their nodes, from
    (project, end, held seconds)."""
    by_project: dict[str, list[tuple[float, float]]] = {}
    for project, ended, held in finished:
        by_project.setdefault(project, []).append((ended, held))
    return {p: tuple(held for _, held in sorted(runs)[-RECENT:]) for p, runs in by_project.items()}


class RunHistory:
    """One root's projects' latest runs, as last read."""

    def __init__(
        self, jobs: JobStore, refresh_s: float = HISTORY_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.jobs, self.refresh_s, self.clock = jobs, refresh_s, clock
        self.lock = threading.Lock()
        self.project: dict[str, str] = {}  # job id -> its project (id), from its record
        self.finished: dict[str, tuple[str, float, float] | None] = {}  # job -> (project, ...)
        self.runs: dict[str, tuple[float, ...]] = {}  # project -> its latest finished runs
        self.read_at: float | None = None
        self.reading: threading.Thread | None = None

    def run_times(self, entries: Iterable[QueueEntry]) -> dict[str, RunTime | None]:
        """Each entry's expected run time (its limit, its project's typical run); asks for a
        new reading when the last is `refresh_s` old (never waited on)."""
        self.refresh_soon()
        with self.lock:
            runs, projects = self.runs, self.project
        out = {}
        for e in entries:
            project = e.project or projects.get(e.job_id)
            out[e.job_id] = expected_run(e.max_duration_s, runs.get(project or "", ()))
        return out

    def refresh_soon(self) -> None:
        """A reading on its own thread, if the last one is due and none is under way."""
        with self.lock:
            due = self.read_at is None or self.clock() - self.read_at >= self.refresh_s
            if not due or (self.reading is not None and self.reading.is_alive()):
                return
            self.read_at = self.clock()  # a failed reading is tried again after refresh_s too
            self.reading = threading.Thread(target=self._refresh_logged, daemon=True,
                                            name=f"run-history {self.jobs.root.url}")  # fmt: skip
            self.reading.start()

    def _refresh_logged(self) -> None:
        try:
            self.refresh()
        except Exception:  # a storage outage: the estimates keep the last reading
            traceback.print_exc()

    def refresh(self) -> None:
        """Read the jobs not finished when last read, and new ones (a test calls it directly)."""
        root = self.jobs.root
        for job_id in root.list_names(layout.jobs()):
            if job_id in self.finished or not layout.is_segment(job_id):
                continue
            try:
                if job_id not in self.project:
                    self.project[job_id] = self.jobs.record(job_id).project_key
                status = self.jobs.status(job_id)
            except (JobNotFound, FileNotFoundError, ValueError):  # not a job (yet): next time
                continue
            if status.state.is_terminal:
                held = held_for(status)
                self.finished[job_id] = None if held is None else (self.project[job_id], *held)
        runs = recent_runs(v for v in self.finished.values() if v is not None)
        with self.lock:
            self.runs = runs
            self.read_at = self.clock()
