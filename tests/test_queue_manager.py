"""One storage root's queue on a fake cluster (no Ray): what a controller and a user see of it.
A job that fits is admitted at once; one that does not waits with its position and why; a job
whose controller died is failed and its room freed; a storage outage loses no admission. The
storage root is a real local one, and a fresh `RootQueue` on it is a restarted service."""

from __future__ import annotations

import errno
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.errors import StorageUnavailable
from orchestrator.lifecycle import JobState
from orchestrator.scheduler.model import Node
from orchestrator.scheduler.policy import SchedulingPolicy
from orchestrator.scheduler.resources import Resources
from orchestrator.scheduler.root_queue import RootQueue
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.queue_store import QueueEntry, QueueStore
from orchestrator.storage.records import JobStatus
from orchestrator.storage.root import StorageRoot


class FakeCluster:
    """One node of 2 CPUs, all free unless `busy`; the drivers the GCS says are alive."""

    def __init__(self) -> None:
        self.free = Resources.of(CPU=2)
        self.drivers: set[str] = set()

    def nodes(self) -> list[Node]:
        return [Node("n0", Resources.of(CPU=2), self.free)]

    def live_drivers(self) -> set[str]:
        return set(self.drivers)


class WriteOutage:
    """Every write to the root refused (a transient error, ridden out) while `down` is set."""

    def __init__(self, root: StorageRoot) -> None:
        self.down = threading.Event()
        write = root._write_bytes

        def refusing(rel: str, data: bytes) -> None:
            if self.down.is_set():
                raise ConnectionRefusedError(errno.ECONNREFUSED, "connection refused")
            write(rel, data)

        root._write_bytes = refusing  # type: ignore[method-assign]

    def for_(self, seconds: float) -> None:
        self.down.set()
        threading.Timer(seconds, self.down.clear).start()


def entry(job_id: str, cpus: float, *, driver: str | None = None) -> QueueEntry:
    return QueueEntry(job_id=job_id, team="t", pushed_at=time.time(), bundle={"CPU": cpus},
                      ray_job_id=driver)  # fmt: skip


def queue_on(root: Path, cluster: FakeCluster, budget_s: float = 10.0) -> RootQueue:
    return RootQueue(str(root), SchedulingPolicy(), cluster, storage_budget_s=budget_s)


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster()


def test_a_job_that_fits_is_admitted_at_once_and_stays_admitted_after_a_restart(tmp_path, cluster):
    queue = queue_on(tmp_path, cluster)
    admitted = queue.enqueue(entry("a", 1))
    assert admitted.state == "admitted" and admitted.placed_on == ("n0",)
    assert queue.enqueue(entry("a", 1)) == admitted  # asked again: the same answer
    assert queue_on(tmp_path, cluster).admission("a") == admitted  # stored before answered


def test_a_job_that_does_not_fit_waits_with_its_position_and_why(tmp_path, cluster):
    queue = queue_on(tmp_path, cluster)
    assert queue.enqueue(entry("a", 2)).state == "admitted"
    # Ray still says 2 CPUs free (a's placement group is on its way): a holds them already.
    waiting = queue.enqueue(entry("b", 2))
    assert waiting.state == "queued" and waiting.position == 1
    assert waiting.reason == "needs 1 node with 2 CPU free: 0 such nodes free"
    never = queue.enqueue(entry("c", 100))
    assert never.state == "impossible" and "even when empty" in never.reason

    shown = QueueStore(StorageRoot(tmp_path)).view()  # what `orchestrator queue` reads
    assert shown is not None
    assert [(w.job_id, w.position) for w in shown.waiting] == [("b", 1)]
    assert "c" in shown.impossible and shown.nodes[0].node_id == "n0"

    queue.release("a")
    assert queue.admission("b").state == "admitted"
    assert queue.admission("a").state == "unknown"


def test_a_job_whose_controller_died_is_failed_and_its_room_freed(tmp_path, cluster):
    jobs = JobStore(StorageRoot(tmp_path))
    jobs.put_status(JobStatus.new("a"))
    cluster.drivers = {"driver-a", "driver-b"}
    queue = queue_on(tmp_path, cluster)
    assert queue.enqueue(entry("a", 2, driver="driver-a")).state == "admitted"
    assert queue.enqueue(entry("b", 2, driver="driver-b")).state == "queued"

    queue.tick()  # both drivers alive: nothing happens
    assert queue.admission("a").state == "admitted"
    cluster.drivers = {"driver-b"}  # a's Ray job was stopped, or its process killed
    queue.tick()
    status = jobs.status("a")
    assert status.state == JobState.FAILED
    assert status.failure is not None and "controller" in status.failure.cause
    assert "died while CREATED" in status.failure.cause
    assert queue.admission("a").state == "unknown"
    assert queue.admission("b").state == "admitted"
    assert [e.job_id for e in QueueStore(StorageRoot(tmp_path)).entries()] == ["b"]


def test_an_orphan_without_a_job_record_still_leaves_the_queue(tmp_path, cluster):
    """Its record deleted (or never written): nothing to fail, and the next tick goes on."""
    queue = queue_on(tmp_path, cluster)
    assert queue.enqueue(entry("gone", 2, driver="dead")).state == "admitted"
    assert queue.enqueue(entry("next", 2)).state == "queued"
    queue.tick()
    assert queue.admission("gone").state == "unknown"
    assert queue.admission("next").state == "admitted"


def test_a_storage_outage_shorter_than_the_budget_loses_no_admission(tmp_path, cluster):
    queue = queue_on(tmp_path, cluster, budget_s=10)
    outage = WriteOutage(queue.root)
    assert queue.enqueue(entry("a", 2)).state == "admitted"
    assert queue.enqueue(entry("b", 2)).state == "queued"

    outage.for_(1.0)
    queue.release("a")  # b's admission is written while the root refuses: ridden out
    assert not outage.down.is_set()
    assert queue.admission("b").state == "admitted"
    assert queue_on(tmp_path, cluster).admission("b").state == "admitted"


def test_an_admission_that_could_not_be_stored_is_never_answered(tmp_path, cluster):
    """An outage past the budget fails the call; the job is still queued, and admitted by the
    next decision once the root answers."""
    queue = queue_on(tmp_path, cluster, budget_s=0.5)
    outage = WriteOutage(queue.root)
    cluster.free = Resources.of(CPU=0)  # work that is not the queue's
    assert queue.enqueue(entry("a", 2)).state == "queued"

    outage.down.set()
    cluster.free = Resources.of(CPU=2)
    with pytest.raises(StorageUnavailable):
        queue.tick()
    assert queue.admission("a").state == "queued"
    assert queue_on(tmp_path, cluster).admission("a").state == "queued"
    outage.down.clear()
    queue.tick()
    assert queue.admission("a").state == "admitted"


def test_a_priority_asked_through_the_storage_root_counts_at_the_next_tick(tmp_path, cluster):
    queue = queue_on(tmp_path, cluster)
    queue.enqueue(entry("a", 2))
    queue.enqueue(entry("b", 2))
    queue.enqueue(entry("c", 2))
    assert queue.admission("c").position == 2
    store = QueueStore(StorageRoot(tmp_path))
    store.request_priority("c", 5, at=time.time())  # `orchestrator update --priority`
    queue.tick()
    assert queue.admission("c").position == 1
    assert not store.request_pending("c")
    assert [v.entry.priority for v in queue.view().entries if v.entry.job_id == "c"] == [5]


def test_the_view_is_rewritten_only_when_what_it_says_changes(tmp_path, cluster):
    queue = queue_on(tmp_path, cluster)
    queue.enqueue(entry("a", 2))
    queue.enqueue(entry("b", 2))
    store = QueueStore(StorageRoot(tmp_path))
    first = store.view()
    queue.tick()
    queue.tick()
    assert store.view() == first  # the same decision: not written again
    queue.release("a")
    changed = store.view()
    assert changed is not None and changed.waiting == [] and changed != first


def test_the_queue_imports_no_ray():
    """Only `RayCluster` reads Ray, when the service calls it: the queue's parts run without."""
    run = subprocess.run(
        [sys.executable, "-c", "import sys, orchestrator.scheduler.root_queue; "
         "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert run.stdout.strip() == "[]"


def test_a_job_that_gave_way_waits_for_that_job_only_until_it_starts(tmp_path, cluster):
    """Stored: once the job it gave way to is admitted, a queued job's mark is cleared (else,
    should that job give way to it in turn, each would wait for the other for ever)."""
    store = QueueStore(StorageRoot(tmp_path))
    store.put(entry("a", 1).model_copy(update={"preempted_by": "b"}))
    queue = queue_on(tmp_path, cluster)
    assert queue.enqueue(entry("b", 2)).state == "admitted"
    assert queue.admission("a").state == "queued"  # no room left beside b
    assert store.entry("a").preempted_by is None
    queue.release("b")
    assert queue.admission("a").state == "admitted"
