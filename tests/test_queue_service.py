"""The queue service actor on the session's local cluster: admits what fits at once, says why
the rest waits, and, killed and started again, rebuilds the same queue from the storage root."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import ray
from conftest import ray_driver

from orchestrator.actor_names import NAMESPACE
from orchestrator.cluster.local import LocalClusterInfo
from orchestrator.scheduler.service import QUEUE_SERVICE_NAME, start_queue_service
from orchestrator.storage.queue_store import QueueEntry, QueueStore
from orchestrator.storage.root import StorageRoot


@pytest.fixture
def driver(ray_cluster: LocalClusterInfo, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with ray_driver(ray_cluster, monkeypatch, "queue-service-test"):
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):  # started by this test, or rebuilt by the next
                ray.kill(ray.get_actor(QUEUE_SERVICE_NAME, namespace=NAMESPACE))


def entry(job_id: str, cpus: float, at: float) -> QueueEntry:
    return QueueEntry(job_id=job_id, team="t", pushed_at=at, bundle={"CPU": cpus})


def test_a_killed_service_comes_back_with_the_same_queue(driver, tmp_path):
    cpus = max(n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"])
    root = str(tmp_path / "root")
    # Pushed just now: a job waiting past ORCHESTRATOR_QUEUE_HOLD_AFTER_S would say so.
    now = time.time()
    service = start_queue_service()
    first = ray.get(service.enqueue.remote(root, entry("a", 1, now + 1)))
    assert first.state == "admitted" and len(first.placed_on) == 1  # at once
    waiting = ray.get(service.enqueue.remote(root, entry("c", cpus, now + 2)))
    assert waiting.state == "queued" and waiting.position == 1
    assert waiting.reason == f"needs 1 node with {cpus:g} CPU free: 0 such nodes free"
    never = ray.get(service.enqueue.remote(root, entry("b", cpus + 100, now + 3)))
    assert never.state == "impossible" and "even when empty" in never.reason

    ray.kill(service)
    deadline = time.monotonic() + 30
    while True:  # the name is free once the old actor is gone
        try:
            ray.get_actor(QUEUE_SERVICE_NAME, namespace=NAMESPACE)
        except ValueError:
            break
        assert time.monotonic() < deadline
        time.sleep(0.1)
    again = start_queue_service()
    assert ray.get(again.admission.remote(root, "a")) == first  # still admitted, not admitted again
    same = ray.get(again.enqueue.remote(root, entry("a", 1, now + 1)))
    assert same.placed_on == first.placed_on
    assert ray.get(again.admission.remote(root, "c")).state == "queued"
    ray.get(again.release.remote(root, "a"))
    assert ray.get(again.admission.remote(root, "c")).state == "admitted"
    assert ray.get(again.admission.remote(root, "a")).state == "unknown"

    # Only a waiting job's priority changes; a preempted job goes back keeping its push time.
    with pytest.raises(ray.exceptions.RayTaskError, match="not waiting in the queue"):
        ray.get(again.update_priority.remote(root, "c", 9))
    ray.get(again.enqueue.remote(root, entry("d", 1, now + 4)))
    moved = ray.get(again.update_priority.remote(root, "d", 7))
    assert moved.state == "queued" and moved.position == 1
    back = ray.get(again.requeue.remote(root, "c"))  # preempted: d (priority 7) now goes first
    assert back.state == "queued"
    assert ray.get(again.admission.remote(root, "d")).state == "admitted"
    view = {v.entry.job_id: v.entry for v in ray.get(again.view.remote(root)).entries}
    assert view["d"].priority == 7 and view["c"].pushed_at == now + 2
    assert [e.job_id for e in QueueStore(StorageRoot(root)).entries()] == ["c", "b", "d"]
