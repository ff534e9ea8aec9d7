"""The per-team counters (scheduler/team_meters.py) through one storage root's queue on a fake
cluster (no Ray): each team is counted what its admitted jobs held from admission to release,
nothing while they wait and nothing after they leave."""

from __future__ import annotations

from collections import defaultdict

import pytest
from test_queue_manager import FakeCluster

from orchestrator.node import metric_series as series
from orchestrator.scheduler import root_queue
from orchestrator.scheduler.model import Node
from orchestrator.scheduler.policy import SchedulingPolicy
from orchestrator.scheduler.resources import Resources
from orchestrator.scheduler.root_queue import RootQueue
from orchestrator.scheduler.team_meters import TeamMeters
from orchestrator.storage.queue_store import QueueEntry

GIB = 2**30


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def counted(monkeypatch):
    """(the counters by series and tags, the queue's clock)."""
    clock = Clock()
    monkeypatch.setattr(root_queue.time, "time", clock)
    totals: dict[tuple[str, tuple], float] = defaultdict(float)

    def sink(s: series.Series, value: float, tags: dict[str, str]) -> None:
        assert set(tags) == set(s.tag_keys), (s.name, tags)
        totals[s.name, tuple(sorted(tags.items()))] += value

    return totals, clock, TeamMeters(sink)


def entry(job_id: str, team: str | None, bundle: dict[str, float], nodes: int = 1) -> QueueEntry:
    return QueueEntry(job_id=job_id, team=team, pushed_at=1.0, bundle=bundle, nodes=nodes)


def test_each_team_is_counted_what_it_held_from_admission_to_release(tmp_path, counted):
    totals, clock, meters = counted
    cluster = FakeCluster()
    cluster.free = Resources.of(CPU=2, H100=8, memory=64 * GIB)
    cluster.nodes = lambda: [Node("n0", Resources.of(CPU=2, H100=8, memory=64 * GIB), cluster.free)]
    queue = RootQueue(str(tmp_path), SchedulingPolicy(), cluster, meters=meters)
    vision = {"CPU": 1.0, "memory": 4 * GIB, "GPU:H100": 4.0}
    assert queue.enqueue(entry("a", "vision", vision)).state == "admitted"  # at 1000
    clock.now += 10
    assert queue.enqueue(entry("b", None, {"CPU": 1.0})).state == "admitted"  # at 1010
    clock.now += 5
    assert queue.enqueue(entry("c", "nlp", {"CPU": 1.0})).state == "queued"  # no CPU left
    clock.now += 20
    queue.release("a")  # at 1035: a held 35 s; c is admitted now
    assert queue.admission("c").state == "admitted"
    clock.now += 100
    queue.tick()  # at 1135
    queue.release("b")
    queue.release("c")
    clock.now += 1000
    queue.tick()  # nothing is held any more

    def of(s: series.Series, **tags: str) -> float:
        return totals[s.name, tuple(sorted(tags.items()))]

    assert of(series.TEAM_GPU_SECONDS, team="vision", accelerator="H100") == pytest.approx(4 * 35)
    assert of(series.TEAM_CPU_SECONDS, team="vision") == pytest.approx(35)
    assert of(series.TEAM_MEMORY_GIB_SECONDS, team="vision") == pytest.approx(4 * 35)
    assert of(series.TEAM_CPU_SECONDS, team="(no team)") == pytest.approx(125)  # 1010 to 1135
    assert of(series.TEAM_CPU_SECONDS, team="nlp") == pytest.approx(100)  # never while queued
    assert {name for name, _ in totals} == {s.name for s in series.TEAM_COUNTERS}
