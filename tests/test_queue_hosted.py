"""Controllers hosted in the head's controller host, as the queue service sees them, without
Ray: the service marks each admitted job hosted before starting it, remembers which host
incarnation runs it, and fails the job (with why) once its controller is gone: with its host,
or ended without recording an end. One the host never started is started again."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import eventually
from test_queue_pushed import FakeCluster, FakeLauncher, status

from orchestrator.lifecycle import JobState
from orchestrator.scheduler import orphan_reaper
from orchestrator.scheduler.launcher import (
    NOT_STARTED,
    RUNNING_OR_UNKNOWN,
    ControllerStanding,
    ControllerState,
    HostTable,
    Launched,
    LaunchOutcome,
    hostable,
    hosted_standing,
)
from orchestrator.scheduler.policy import SchedulingPolicy
from orchestrator.scheduler.root_queue import RootQueue
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.queue_store import Launch, QueueEntry, QueueStore
from orchestrator.storage.records import JobStatus
from orchestrator.storage.root import StorageRoot


class FakeHost(FakeLauncher):
    """A launcher that hosts: the incarnation of the host, and what it says of each job."""

    def __init__(self) -> None:
        super().__init__()
        self.incarnation = "host-1"
        self.said: dict[str, ControllerStanding] = {}  # job id: its standing, as the host says
        self.gone_jobs: dict[str, str] = {}
        self.dies_at_start = False

    def hosts(self, entry: QueueEntry) -> bool:
        return hostable(entry)  # a host runs: the entry decides, as HostedLauncher's

    def launch(self, entry: QueueEntry) -> LaunchOutcome:
        if entry.hosted and self.dies_at_start:
            self.dies_at_start = False
            return LaunchOutcome(Launched.HOST_GONE, cause="the controller host is gone")
        started = super().launch(entry)
        return LaunchOutcome(Launched.HOSTED, host=self.incarnation) if entry.hosted else started

    def standing(self, entry: QueueEntry) -> ControllerStanding:
        if not entry.hosted:
            return super().standing(entry)
        if entry.job_id in self.said:
            return self.said[entry.job_id]
        if entry.hosted_by is None:
            return NOT_STARTED
        if entry.hosted_by == self.incarnation:
            return RUNNING_OR_UNKNOWN
        return ControllerStanding.failed("its host died")

    def gone(self, job_id: str, cause: str) -> None:
        self.gone_jobs[job_id] = cause


@pytest.fixture
def host() -> FakeHost:
    return FakeHost()


def push(root: Path, job_id: str, *, hostable: bool = True, pushed_at: float = 1.0) -> None:
    JobStore(StorageRoot(root)).put_status(JobStatus.new(job_id, "submitted"))
    launch = Launch(entrypoint=f"python -m orchestrator.controller --job-id {job_id}",
                    storage_root=str(root) if hostable else None,
                    scheduling_timeout_s=600.0 if hostable else None)  # fmt: skip
    QueueStore(StorageRoot(root)).put_incoming(QueueEntry(
        job_id=job_id, team="t", pushed_at=pushed_at, bundle={"CPU": 2}, launch=launch,
        cluster="session-1",
    ))  # fmt: skip


def entry(root: Path, job_id: str) -> QueueEntry | None:
    return QueueStore(StorageRoot(root)).entry(job_id)


def tick(queue: RootQueue) -> None:
    """One tick, as the service's ticking thread makes it: under the queue's lock."""
    with queue.lock:
        queue.tick()


def started(root: Path, host: FakeHost, job_id: str) -> RootQueue:
    queue = RootQueue(str(root), SchedulingPolicy(), FakeCluster(), launcher=host)
    tick(queue)
    eventually(lambda: (e := entry(root, job_id)) is not None and e.hosted_by is not None,
               f"{job_id}'s host to be recorded", 5)  # fmt: skip
    return queue


def test_an_admitted_job_is_started_in_the_host_and_runs_untouched_while_it_is_there(
    tmp_path, host
):
    push(tmp_path, "a")
    queue = started(tmp_path, host, "a")
    stored = entry(tmp_path, "a")
    assert stored.hosted and stored.hosted_by == "host-1" and host.launched == ["a"]
    tick(queue)
    tick(queue)
    assert entry(tmp_path, "a") is not None and host.launched == ["a"]  # started once
    assert status(tmp_path, "a").state == JobState.CREATED  # its controller writes from here


def test_a_job_pushed_without_what_the_host_needs_is_started_as_a_ray_job(tmp_path, host):
    push(tmp_path, "old", hostable=False)  # by an older client
    queue = RootQueue(str(tmp_path), SchedulingPolicy(), FakeCluster(), launcher=host)
    tick(queue)
    eventually(lambda: host.launched == ["old"], "old's controller to be started", 5)
    stored = entry(tmp_path, "old")
    assert not stored.hosted and stored.hosted_by is None and stored.launched_at is not None


def test_a_job_whose_host_died_fails_with_why_and_frees_its_room(tmp_path, host):
    push(tmp_path, "a", pushed_at=1.0)
    push(tmp_path, "b", pushed_at=2.0)
    queue = started(tmp_path, host, "a")
    assert host.launched == ["a"]  # b waits for a's CPUs
    host.incarnation = "host-2"  # the host's process died; the next start makes a new one
    tick(queue)
    failed = status(tmp_path, "a")
    assert failed.state == JobState.FAILED
    assert failed.failure.cause == "its host died"
    assert host.gone_jobs == {"a": "its host died"}  # the dashboard's row ends too
    assert entry(tmp_path, "a") is None
    eventually(lambda: host.launched == ["a", "b"], "b to start on the freed room", 5)
    eventually(lambda: (e := entry(tmp_path, "b")) is not None and e.hosted_by == "host-2",
               "b in the new host", 5)  # fmt: skip


def test_a_hosted_controller_that_ended_without_a_record_fails_its_job(tmp_path, host):
    push(tmp_path, "a")
    queue = started(tmp_path, host, "a")
    host.said["a"] = ControllerStanding.failed("the job's controller raised RuntimeError: boom")
    tick(queue)
    failed = status(tmp_path, "a")
    assert failed.state == JobState.FAILED
    assert failed.failure.cause == "the job's controller raised RuntimeError: boom"
    assert entry(tmp_path, "a") is None


def test_a_hosted_controller_that_ended_with_its_record_only_leaves_the_queue(tmp_path, host):
    push(tmp_path, "a")
    queue = started(tmp_path, host, "a")
    store = JobStore(StorageRoot(tmp_path))
    for state in (JobState.DEPLOYING, JobState.RUNNING, JobState.COMPLETED):
        store.put_status(store.status("a").moved_to(state, "its controller's steps"))
    host.said["a"] = ControllerStanding.ended()  # it let go of its entry too late, or not at all
    tick(queue)
    assert status(tmp_path, "a").state == JobState.COMPLETED
    assert entry(tmp_path, "a") is None and host.gone_jobs == {}


def test_a_job_its_host_never_took_is_started_again_after_a_grace(tmp_path, host, monkeypatch):
    push(tmp_path, "a")
    host.launch = lambda e: FakeLauncher.launch(host, e)  # the answer never came back
    queue = RootQueue(str(tmp_path), SchedulingPolicy(), FakeCluster(), launcher=host)
    tick(queue)
    eventually(lambda: host.launched == ["a"], "a's first start", 5)
    tick(queue)
    assert host.launched == ["a"]  # within the grace: not started twice
    monkeypatch.setattr(orphan_reaper, "MISSING_GRACE_S", 0.0)
    time.sleep(0.01)
    tick(queue)  # past it: marked not started, and started again
    eventually(lambda: host.launched == ["a", "a"], "a's second start", 5)
    assert status(tmp_path, "a").state != JobState.FAILED


def test_a_job_admitted_as_its_host_dies_is_started_as_a_ray_job(tmp_path, host):
    push(tmp_path, "a")
    host.dies_at_start = True
    queue = RootQueue(str(tmp_path), SchedulingPolicy(), FakeCluster(), launcher=host)
    tick(queue)
    eventually(lambda: host.launched == ["a"], "a's controller to be started", 5)
    stored = entry(tmp_path, "a")
    assert not stored.hosted and stored.hosted_by is None  # a Ray job: the reaper asks Ray
    assert status(tmp_path, "a").state == JobState.CREATED


def test_the_hosts_table_says_which_hosted_controllers_are_gone_and_why():
    def standing(table: HostTable, hosted_by: str | None) -> ControllerStanding:
        entry = QueueEntry(job_id="a", pushed_at=1.0, bundle={}, hosted=True, hosted_by=hosted_by)
        return hosted_standing(table, entry)

    live = HostTable("inc-1", frozenset({"a"}))
    assert standing(live, "inc-1") == RUNNING_OR_UNKNOWN
    raised = HostTable("inc-1", ended=(("a", "the job's controller raised KeyError: 'x'"),))
    assert standing(raised, "inc-1") == ControllerStanding(
        ControllerState.FAILED, "the job's controller raised KeyError: 'x'"
    )
    ended = ControllerStanding(ControllerState.ENDED)
    assert standing(HostTable("inc-1", ended=(("a", None),)), "inc-1") == ended
    assert standing(HostTable("inc-1"), None) == NOT_STARTED  # its start has not answered yet
    assert standing(HostTable("inc-1"), "inc-1") == ended  # ran here, forgotten since
    for table in (HostTable("inc-2"), HostTable(None)):  # another host, or none: it died
        died = standing(table, "inc-1")
        assert died.state is ControllerState.FAILED
        assert died.cause.startswith("the controller host's process on the head ended")


def test_a_hosted_controller_that_raises_fails_its_job_and_the_host_says_why(tmp_path):
    """Without Ray: the host runs a controller whose job has a status but no record."""
    from orchestrator.controller.host import ControllerHost
    from orchestrator.scheduler.launcher import HostedJob

    JobStore(StorageRoot(tmp_path)).put_status(JobStatus.new("broken", "submitted"))
    host = ControllerHost()
    assert host.stop("later") is False  # not started: kept, it starts stopped
    incarnation = host.start(HostedJob("broken", str(tmp_path), 600.0, ": 'p/broken'"))
    assert host.start(HostedJob("broken", str(tmp_path), 600.0, "")) == incarnation  # once
    eventually(lambda: "broken" not in host.table().running, "the controller to end", 10)
    ended, why = host.table().why_ended("broken")
    assert ended and why.startswith("the job's controller raised JobNotFound")
    failed = status(tmp_path, "broken")
    assert failed.state == JobState.FAILED and failed.failure.cause == why
    assert host.table().incarnation == incarnation and "later" in host.stopped_early
