"""Placing a plan's bundles and placing a lost rank's again, on fake placement groups (no Ray):
what the job is told while it waits, and when it gives up."""

from __future__ import annotations

from pathlib import Path

import pytest
from controller_fakes import FakeCluster, FakePlacementGroups

from orchestrator import definitions as d
from orchestrator.client.prepare import prepare_job
from orchestrator.client.submit import store_job
from orchestrator.controller.fault_judge import FaultJudge
from orchestrator.controller.placement import Placement
from orchestrator.controller.plan import SpecPlan
from orchestrator.controller.rank_group import GroupError
from orchestrator.storage.root import StorageRoot


def no_stop() -> None:
    pass


@pytest.fixture
def placement(tmp_path: Path, monkeypatch):
    """A placement for a stored job of `cpus` CPUs a node, on a fake cluster of 2 nodes."""
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")

    def make(cpus: float = 2, nodes: int = 2):
        project = d.TrainingProject(
            name="placed",
            job=d.TrainingJob(
                image=d.Image(base_image="python:3.11"),
                compute=d.Compute(node_count=nodes, cpu_count=cpus),
                runtime=d.Runtime(start_commands=["python train.py"]),
            ),
        )
        prepared = prepare_job(project, source_dir=tmp_path / "code")
        record = store_job(prepared, StorageRoot(str(tmp_path / "storage")), "jplace0001", None)
        cluster = FakeCluster(2)
        calls: list[str] = []
        groups = FakePlacementGroups(cluster, calls)
        return Placement(record, calls.append, cluster, groups), SpecPlan(record).plan(0), cluster

    return make


def test_a_plan_placed_at_once_names_each_ranks_node(placement):
    place, plan, _ = placement()
    pending: list[str] = []
    place.reserve(plan, 5, pending.append, no_stop)
    assert pending == [] and place.placed_nodes() == ["node-0", "node-1"]


def test_a_plan_bigger_than_the_idle_cluster_fails_at_once_saying_what_is_missing(placement):
    place, plan, _ = placement(cpus=64)  # the fake nodes have 8 CPUs each
    with pytest.raises(GroupError, match="cannot be placed on this cluster even when it is idle"):
        place.reserve(plan, 5, lambda reason: None, no_stop)


def test_a_plan_that_does_not_fit_now_says_why_and_gives_up_at_its_timeout(placement):
    place, plan, _ = placement()
    place.groups.placeable = False  # other work holds the nodes
    pending: list[str] = []
    with pytest.raises(GroupError, match="could not be scheduled within 1 s: needs 2 nodes"):
        place.reserve(plan, 1, pending.append, no_stop)
    assert len(pending) == 1 and "in use by other work" in pending[0]  # said once, not per look


def test_a_lost_rank_is_placed_again_once_its_preempted_node_has_gone(placement):
    place, plan, cluster = placement()
    place.reserve(plan, 5, lambda reason: None, no_stop)
    judge = FaultJudge(cluster)
    cluster.drains["node-1"] = 0.0
    judge.draining({0: "node-0", 1: "node-1"})
    pending: list[str] = []

    def stop_waiting() -> None:  # the node goes while the rank waits for it
        if pending:
            cluster.kill("node-1")

    place.place_again([1], ["node-1"], judge, 10, pending.append, stop_waiting)
    assert pending == [
        "waiting for preempted node node-1 to go, so that its rank is placed elsewhere"
    ]
    assert place.placed_nodes() == ["node-0", "spare-1"]


def test_a_lost_rank_that_cannot_be_placed_again_gives_up_at_its_timeout(placement):
    place, plan, cluster = placement()
    place.reserve(plan, 5, lambda reason: None, no_stop)
    judge = FaultJudge(cluster)
    judge.silent.add("node-1")  # crashed, but the GCS has not said so yet
    with pytest.raises(GroupError, match=r"rank\(s\) 1 could not be placed again within 0.5 s"):
        place.place_again([1], ["node-1"], judge, 0.5, lambda reason: None, no_stop)
