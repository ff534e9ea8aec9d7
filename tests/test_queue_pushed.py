"""Pushed jobs in the queue with no process of their own, without Ray: the queue takes them from
the storage root, says why they wait in their status, starts each controller once when it is
admitted, and ends the ones stopped, never fitting or waiting too long itself."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import eventually

from orchestrator.lifecycle import JobState
from orchestrator.scheduler.launcher import (
    AS_RAY_JOB,
    NOT_STARTED,
    RUNNING_OR_UNKNOWN,
    ControllerStanding,
    LaunchOutcome,
)
from orchestrator.scheduler.model import Node
from orchestrator.scheduler.policy import SchedulingPolicy
from orchestrator.scheduler.resources import Resources
from orchestrator.scheduler.root_queue import RootQueue
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.logs import read_logs
from orchestrator.storage.queue_store import Launch, QueueEntry, QueueStore
from orchestrator.storage.records import JobStatus
from orchestrator.storage.root import StorageRoot


class FakeCluster:
    """One node of 2 CPUs; drivers as the GCS would list them."""

    def __init__(self) -> None:
        self.drivers: set[str] = set()

    def nodes(self) -> list[Node]:
        return [Node("n0", Resources.of(CPU=2), Resources.of(CPU=2))]

    def live_drivers(self) -> set[str]:
        return self.drivers


class FakeLauncher:
    """The Job API as the service uses it: what it launched and stopped, and how Ray says each
    controller's Ray job stands (`ray_jobs`: running unless said)."""

    def __init__(self) -> None:
        self.launched: list[str] = []
        self.stopped: list[str] = []
        self.refuse: str | None = None
        self.ray_jobs: dict[str, ControllerStanding] = {}

    def session(self) -> str:
        return "session-1"

    def hosts(self, entry: QueueEntry) -> bool:
        return False

    def launch(self, entry: QueueEntry) -> LaunchOutcome:
        if self.refuse:
            return LaunchOutcome.refused(self.refuse)
        self.launched.append(entry.job_id)
        return AS_RAY_JOB

    def stop(self, job_id: str) -> None:
        self.stopped.append(job_id)

    def standing(self, entry: QueueEntry) -> ControllerStanding:
        return self.ray_jobs.get(entry.job_id, RUNNING_OR_UNKNOWN)

    def gone(self, job_id: str, cause: str) -> None:
        pass


@pytest.fixture
def launcher() -> FakeLauncher:
    return FakeLauncher()


def queue_on(root: Path, launcher: FakeLauncher) -> RootQueue:
    return RootQueue(str(root), SchedulingPolicy(), FakeCluster(), launcher=launcher)


def push(root: Path, job_id: str, cpus: float, *, pushed_at: float | None = None,
         timeout_s: float | None = None, cluster: str | None = "session-1") -> None:  # fmt: skip
    """What `push` writes: the job's status (CREATED) and its entry in queue/incoming."""
    JobStore(StorageRoot(root)).put_status(JobStatus.new(job_id, "submitted"))
    QueueStore(StorageRoot(root)).put_incoming(QueueEntry(
        job_id=job_id, team="t", pushed_at=pushed_at or time.time(), bundle={"CPU": cpus},
        launch=Launch(entrypoint=f"python -m orchestrator.controller --job-id {job_id}"),
        cluster=cluster, queue_timeout_s=timeout_s,
    ))  # fmt: skip


def status(root: Path, job_id: str) -> JobStatus:
    return JobStore(StorageRoot(root)).status(job_id)


def launches_done(queue: RootQueue) -> None:
    """Every controller start and stop the queue has handed its pool has run (the pool shut
    down, waiting): the launcher then holds all this queue will ever launch of them."""
    queue.launches.shutdown(wait=True)


def test_a_pushed_job_is_started_once_when_admitted_even_after_a_restart(tmp_path, launcher):
    push(tmp_path, "a", 2)
    queue = queue_on(tmp_path, launcher)
    queue.tick()
    eventually(lambda: launcher.launched == ["a"], "a's controller to be started", 5)
    assert QueueStore(StorageRoot(tmp_path)).incoming() == []  # taken
    entry = QueueStore(StorageRoot(tmp_path)).entry("a")
    assert entry is not None and entry.state == "admitted" and entry.launched_at is not None

    again = queue_on(tmp_path, launcher)  # the service restarted: its entries read back
    again.tick()
    launches_done(again)  # a second start would have been handed to its pool by the tick
    assert launcher.launched == ["a"]
    # The controller comes and enqueues the same job: recorded as its driver, still admitted.
    came = again.enqueue(QueueEntry(job_id="a", team="t", pushed_at=1.0, bundle={"CPU": 2},
                                    ray_job_id="driver-a", submission_id="a"))  # fmt: skip
    assert came.state == "admitted"
    assert QueueStore(StorageRoot(tmp_path)).entry("a").ray_job_id == "driver-a"


def test_a_waiting_pushed_job_says_why_in_its_status_and_logs(tmp_path, launcher):
    push(tmp_path, "big", 2, pushed_at=time.time() - 2)
    push(tmp_path, "next", 1, pushed_at=time.time() - 1)
    queue = queue_on(tmp_path, launcher)
    queue.tick()
    why = "waiting in the queue (position 1): needs 1 node with 1 CPU free: 0 such nodes free"
    eventually(lambda: status(tmp_path, "next").history[-1].reason == why, "next's reason", 5)
    assert status(tmp_path, "next").state == JobState.PENDING
    assert any(line.endswith(f"PENDING: {why}") for line in
               read_logs(StorageRoot(tmp_path), "next")[0])  # fmt: skip
    assert launcher.launched == ["big"]

    queue.release("big")  # big ended: next is admitted and started; no more reasons written
    eventually(lambda: launcher.launched == ["big", "next"], "next's controller", 5)
    assert status(tmp_path, "next").state == JobState.PENDING  # its controller moves it on


def test_a_stop_of_a_waiting_pushed_job_ends_it_and_of_a_started_one_asks_its_controller(
    tmp_path, launcher
):
    push(tmp_path, "running", 2, pushed_at=1.0)
    push(tmp_path, "waiting", 2, pushed_at=2.0)
    queue = queue_on(tmp_path, launcher)
    queue.tick()
    store = QueueStore(StorageRoot(tmp_path))
    store.request_stop("waiting", time.time())
    store.request_stop("running", time.time())
    queue.tick()
    ended = status(tmp_path, "waiting")
    assert ended.state == JobState.STOPPED and ended.history[-1].reason == "stopped by user"
    assert queue.admission("waiting").state == "unknown"  # it left the queue
    eventually(lambda: launcher.stopped == ["running"], "the running job's stop to go out", 5)
    assert status(tmp_path, "running").state != JobState.STOPPED  # its controller records it


def test_a_pushed_job_stopped_before_the_service_took_it_is_never_started(tmp_path, launcher):
    push(tmp_path, "early", 1)
    store = QueueStore(StorageRoot(tmp_path))
    store.request_stop("early", time.time())
    queue = queue_on(tmp_path, launcher)
    queue.tick()
    launches_done(queue)  # a start would have been handed to its pool by the tick
    assert launcher.launched == []
    assert status(tmp_path, "early").state == JobState.STOPPED


def test_a_pushed_job_that_never_fits_or_waits_past_its_timeout_is_deploy_failed(
    tmp_path, launcher
):
    push(tmp_path, "huge", 64)
    push(tmp_path, "blocker", 2, pushed_at=1.0)
    push(tmp_path, "impatient", 2, pushed_at=time.time() - 30, timeout_s=5)
    queue = queue_on(tmp_path, launcher)
    queue.tick()
    huge = status(tmp_path, "huge")
    assert huge.state == JobState.DEPLOY_FAILED
    assert huge.failure is not None and "cannot be placed on this cluster even when it is idle" \
        in huge.failure.cause  # fmt: skip
    impatient = status(tmp_path, "impatient")
    assert impatient.state == JobState.DEPLOY_FAILED
    assert "waited in the queue longer than its 5 s queue timeout" in impatient.failure.cause
    assert [e.job_id for e in QueueStore(StorageRoot(tmp_path)).entries()] == ["blocker"]


def test_a_controller_that_cannot_be_started_fails_the_deploy_and_frees_its_room(
    tmp_path, launcher
):
    launcher.refuse = "HTTP 500: no agent"
    push(tmp_path, "a", 2, pushed_at=1.0)
    queue = queue_on(tmp_path, launcher)
    queue.tick()
    eventually(lambda: status(tmp_path, "a").state == JobState.DEPLOY_FAILED, "a to fail", 5)
    cause = status(tmp_path, "a").failure.cause
    assert cause == "the job's controller could not be started: HTTP 500: no agent"
    eventually(lambda: queue.admission("a").state == "unknown", "a to leave the queue", 5)


def test_a_started_controller_whose_ray_job_ended_before_it_came_fails_the_job(tmp_path, launcher):
    push(tmp_path, "a", 2)
    queue = queue_on(tmp_path, launcher)
    queue.tick()
    eventually(lambda: launcher.launched == ["a"], "a's controller to be started", 5)
    launcher.ray_jobs["a"] = ControllerStanding.ended("FAILED: entrypoint exited with 1")
    queue.tick()
    failed = status(tmp_path, "a")
    assert failed.state == JobState.FAILED
    assert "ended before it started the job: FAILED: entrypoint exited with 1" in (
        failed.failure.cause
    )
    assert queue.admission("a").state == "unknown"


def test_a_job_pushed_to_another_cluster_is_left_for_that_clusters_service(tmp_path, launcher):
    push(tmp_path, "theirs", 1, cluster="session-2")
    queue = queue_on(tmp_path, launcher)
    queue.tick()
    assert launcher.launched == []
    assert [e.job_id for e in QueueStore(StorageRoot(tmp_path)).incoming()] == ["theirs"]


def test_the_service_beats_in_the_root_it_watches(tmp_path, launcher):
    store = QueueStore(StorageRoot(tmp_path))
    assert not store.watched_by("session-1")
    push(tmp_path, "a", 1)
    queue_on(tmp_path, launcher).tick()
    assert store.watched_by("session-1") and not store.watched_by("session-2")


def test_a_job_pushed_to_a_cluster_session_that_is_gone_is_taken_by_the_next(tmp_path, launcher):
    """The head restarted (a new session) before its service took the job: it is not stranded."""
    push(tmp_path, "stranded", 1, cluster="session-0", pushed_at=time.time() - 60)
    queue = queue_on(tmp_path, launcher)
    queue.tick()
    eventually(lambda: launcher.launched == ["stranded"], "the stranded job to start", 5)


def started_then_missing(root: Path, launcher: FakeLauncher) -> RootQueue:
    """Job "a" admitted and its controller started, then Ray says it knows no such Ray job."""
    push(root, "a", 2)
    queue = queue_on(root, launcher)
    queue.tick()
    eventually(lambda: launcher.launched == ["a"], "a's controller to be started", 5)
    launcher.ray_jobs["a"] = NOT_STARTED
    queue.tick()
    return queue


def test_a_started_controller_ray_does_not_know_yet_is_given_time(tmp_path, launcher):
    """The start is recorded before the submit goes out: a tick between the two fails nothing."""
    queue = started_then_missing(tmp_path, launcher)
    assert queue.admission("a").state == "admitted"
    assert status(tmp_path, "a").state != JobState.FAILED


def test_a_started_controller_whose_ray_job_never_came_to_exist_is_started_again(
    tmp_path, launcher, monkeypatch
):
    """The service died between marking the start and submitting it: the job is not lost."""
    monkeypatch.setattr("orchestrator.scheduler.orphan_reaper.MISSING_GRACE_S", 0.0)
    started_then_missing(tmp_path, launcher)
    eventually(lambda: launcher.launched == ["a", "a"], "a's controller started again", 5)
    assert status(tmp_path, "a").state != JobState.FAILED


def test_an_idle_root_is_let_go_of_only_when_no_push_came_meanwhile(tmp_path, launcher):
    """Its beat goes first: a push that read the beat before that is still taken."""
    queue = queue_on(tmp_path, launcher)
    queue.tick()
    store = QueueStore(StorageRoot(tmp_path))
    assert store.watched_by("session-1")
    push(tmp_path, "late", 1)  # read the beat just before it went
    assert not queue._let_go()
    queue.tick()
    eventually(lambda: launcher.launched == ["late"], "the late push to start", 5)
    assert store.watched_by("session-1")
    queue.release("late")
    assert queue._let_go() and not store.watched_by("session-1")


def test_a_stop_or_priority_change_right_after_the_push_is_never_lost(tmp_path, launcher):
    """A client writes a stop or a priority request once it sees the job pushed; the service may
    have listed the pushed jobs a moment before the push came. Both still apply, a tick later."""
    push(tmp_path, "blocker", 2, pushed_at=1.0)
    queue = queue_on(tmp_path, launcher)
    queue.tick()
    store = QueueStore(StorageRoot(tmp_path))
    listing = queue.store.incoming_for

    def push_and_ask_while_listing(session):
        taken = listing(session)  # the service's view, just before the pushes and asks land
        push(tmp_path, "raised", 2)
        push(tmp_path, "stopped", 2)
        store.request_priority("raised", 7, time.time())
        store.request_stop("stopped", time.time())
        return taken

    queue.store.incoming_for = push_and_ask_while_listing
    queue.tick()
    queue.store.incoming_for = listing
    queue.tick()
    assert store.entry("raised").priority == 7
    assert status(tmp_path, "stopped").state == JobState.STOPPED
    assert launcher.launched == ["blocker"]
