"""The queue service with two storage roots, without Ray (the cluster is a fake read through
`ClusterReader`): one root's storage outage never stops the other root's admissions."""

from __future__ import annotations

import errno
from collections.abc import Iterator

import pytest
from conftest import eventually

from orchestrator.scheduler.policy import Node
from orchestrator.scheduler.resources import Resources
from orchestrator.scheduler.root_queue import STORAGE_BUDGET_S
from orchestrator.scheduler.service import QueueService
from orchestrator.storage.queue_store import QueueEntry


class FakeCluster:
    """One node of 2 CPUs, busy with work that is not the queue's until `free_up`."""

    def __init__(self) -> None:
        self.free = Resources.of(CPU=0)

    def nodes(self) -> list[Node]:
        return [Node("n0", Resources.of(CPU=2), self.free)]

    def live_drivers(self) -> set[str]:
        return set()

    def free_up(self) -> None:
        self.free = Resources.of(CPU=2)


class UnreachableFs:
    """A storage root that refuses every connection (a transient error: ridden out)."""

    def __getattr__(self, name: str):
        def refuse(*args, **kwargs):
            raise ConnectionRefusedError(errno.ECONNREFUSED, "connection refused")

        return refuse


@pytest.fixture
def service() -> Iterator[tuple[QueueService, FakeCluster]]:
    cluster = FakeCluster()
    queues = QueueService(tick_s=0.05, cluster=cluster)
    yield queues, cluster
    queues.close()


def entry(job_id: str) -> QueueEntry:
    return QueueEntry(job_id=job_id, team="t", pushed_at=1.0, bundle={"CPU": 1})


def test_a_storage_root_that_is_down_holds_up_only_its_own_queue(service, tmp_path):
    queues, cluster = service
    down, up = str(tmp_path / "down"), str(tmp_path / "up")
    assert queues.enqueue(down, entry("a1")).state == "queued"  # the node is busy
    broken = queues.queues[down]
    broken.root.fs, broken.root.is_local = UnreachableFs(), False  # every call now refused
    assert queues.enqueue(up, entry("b1")).state == "queued"

    cluster.free_up()  # no call says so: only a tick finds it
    eventually(lambda: queues.admission(up, "b1").state == "admitted",
               "the other root's job to be admitted while this one is down", 5)  # fmt: skip
    # The queue gives up on its root soon (a job's own calls wait out 30 minutes).
    assert broken.root.retry.budget_s == STORAGE_BUDGET_S <= 30
