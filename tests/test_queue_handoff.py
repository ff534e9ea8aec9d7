"""A job's end hands its nodes to the next waiting job at once, without Ray (the cluster is a
fake read through `ClusterReader`): Ray counts a removed placement group's resources free only
some 50-80 ms after the controller lets go, and the queue must not leave them idle until its
next tick because of that."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from conftest import eventually

from orchestrator.scheduler.policy import Node
from orchestrator.scheduler.resources import Resources
from orchestrator.scheduler.root_queue import FREED_FOR_S
from orchestrator.scheduler.service import QueueService
from orchestrator.storage.queue_store import QueueEntry

TICK_S = 30.0  # longer than any wait here: only a release's own looks can admit


class LaggingCluster:
    """One node of 2 CPUs whose free count, as Ray reports it, follows a release late."""

    def __init__(self) -> None:
        self.free = Resources.of(CPU=2)
        self.frees_at: float | None = None
        self.reads = 0
        self.lock = threading.Lock()

    def nodes(self) -> list[Node]:
        with self.lock:
            self.reads += 1
            if self.frees_at is not None and time.monotonic() >= self.frees_at:
                self.free, self.frees_at = Resources.of(CPU=2), None
            return [Node("n0", Resources.of(CPU=2), self.free)]

    def live_drivers(self) -> set[str]:
        return set()

    def busy(self) -> None:
        with self.lock:
            self.free = Resources.of(CPU=0)

    def freed_in(self, delay_s: float | None) -> None:
        """Ray counts the CPUs free `delay_s` from now (None: never: work not the queue's)."""
        with self.lock:
            self.frees_at = None if delay_s is None else time.monotonic() + delay_s


@pytest.fixture
def service() -> Iterator[tuple[QueueService, LaggingCluster]]:
    cluster = LaggingCluster()
    queues = QueueService(tick_s=TICK_S, cluster=cluster)
    yield queues, cluster
    queues.close()


def entry(job_id: str, pushed_at: float) -> QueueEntry:
    return QueueEntry(job_id=job_id, team="t", pushed_at=pushed_at, bundle={"CPU": 2})


def test_the_next_job_is_admitted_when_ray_counts_the_freed_nodes_not_at_the_next_tick(
    service, tmp_path
):
    queues, cluster = service
    root = str(tmp_path)
    assert queues.enqueue(root, entry("first", 1.0)).state == "admitted"
    cluster.busy()  # its placement group made
    assert queues.enqueue(root, entry("second", 2.0)).state == "queued"

    cluster.freed_in(0.3)  # the placement group removed; Ray says so 0.3 s later
    queues.release(root, "first")
    assert queues.admission(root, "second").state == "queued"  # Ray's count is behind
    eventually(lambda: queues.admission(root, "second").state == "admitted",
               "the waiting job admitted once Ray counts the nodes free", 5)  # fmt: skip


def test_a_release_that_frees_nothing_ray_sees_stops_looking_after_a_while(service, tmp_path):
    """Work that is not the queue's took the CPUs meanwhile: the job waits for a tick, and the
    queue does not keep asking Ray many times a second."""
    queues, cluster = service
    root = str(tmp_path)
    queues.enqueue(root, entry("first", 1.0))
    cluster.busy()
    queues.enqueue(root, entry("second", 2.0))

    cluster.freed_in(None)
    before = cluster.reads
    queues.release(root, "first")
    queue = queues.queues[root]
    eventually(lambda: cluster.reads >= before + 5, "the queue looking again", 5)
    eventually(lambda: not queue._looking_again(), "the looks to end", 5 * FREED_FOR_S)
    time.sleep(0.1)  # a look begun as the window closed ends
    settled = cluster.reads
    time.sleep(0.5)  # ten looks' worth of time, with none
    assert cluster.reads == settled  # no more looks until the next tick, 30 s on
    assert queues.admission(root, "second").state == "queued"


def test_what_one_roots_job_frees_goes_to_another_roots_waiting_job(service, tmp_path):
    """Two teams' storage roots on one cluster: a job of one ends, the other's waiting job is
    admitted once Ray counts the nodes free, not at its own root's next tick."""
    queues, cluster = service
    mine, theirs = str(tmp_path / "mine"), str(tmp_path / "theirs")
    assert queues.enqueue(mine, entry("first", 1.0)).state == "admitted"
    cluster.busy()
    assert queues.enqueue(theirs, entry("second", 2.0)).state == "queued"

    cluster.freed_in(0.3)
    queues.release(mine, "first")
    eventually(lambda: queues.admission(theirs, "second").state == "admitted",
               "the other root's job admitted once Ray counts the nodes free", 5)  # fmt: skip
