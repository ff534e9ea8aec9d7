"""The queue's scheduling rules, without Ray: order, quotas, borrowing, preemption, starvation."""

from __future__ import annotations

from orchestrator.scheduler.policy import (
    ClusterSnapshot,
    Demand,
    Node,
    QueuedJob,
    RunningJob,
    SchedulingPolicy,
)
from orchestrator.scheduler.resources import Resources

H100 = Resources.of(H100=2, CPU=16)  # one node's worth: 2 GPUs
ONE_GPU = Resources.of(H100=1, CPU=4)


def nodes(count: int = 4, used: dict[str, Resources] | None = None) -> list[Node]:
    used = used or {}
    return [Node(f"n{i}", H100, H100 - used.get(f"n{i}", Resources())) for i in range(count)]


def queued(job_id: str, team: str = "vision", priority: int = 0, at: float = 0.0,
           gpus: int = 2, nodes: int = 1) -> QueuedJob:  # fmt: skip
    bundle = Resources.of(H100=gpus, CPU=4 * gpus)
    return QueuedJob(job_id, team, priority, at, Demand(bundle, nodes))


def running(job_id: str, on: tuple[str, ...], team: str = "vision", priority: int = 0,
            at: float = 0.0, borrowed: bool = False, gpus: int = 2,
            leaving: bool = False) -> RunningJob:  # fmt: skip
    bundle = Resources.of(H100=gpus, CPU=4 * gpus)
    return RunningJob(job_id, team, priority, at, Demand(bundle, len(on)), on, borrowed, leaving)


def occupied(jobs: list[RunningJob]) -> dict[str, Resources]:
    used: dict[str, Resources] = {}
    for job in jobs:
        for node in job.placed_on:
            used[node] = used.get(node, Resources()) + job.demand.bundle
    return used


def decide(queue, run=(), quotas=None, now=0.0, count=4, hold_after_s=600.0, autoscaling=False):
    run = list(run)
    snap = ClusterSnapshot(queue, run, nodes(count, occupied(run)), quotas or {}, now,
                           autoscaling)  # fmt: skip
    return SchedulingPolicy(hold_after_s).decide(snap)


def test_a_team_is_served_by_priority_then_push_time_and_waiting_jobs_say_their_place():
    full = [running(f"r{i}", (f"n{i}",), team="other") for i in range(4)]
    queue = [queued("late-low", at=3), queued("early-low", at=1), queued("high", priority=5, at=9)]
    waiting = decide(queue, full).waiting
    assert [(w.job_id, w.position) for w in waiting] == [
        ("high", 1), ("early-low", 2), ("late-low", 3)
    ]  # fmt: skip
    assert waiting[0].reason == "needs 1 node with 2 H100, 8 CPU free: 0 such nodes free"


def test_a_job_that_fits_starts_at_once_on_the_fullest_node_that_fits():
    half = [running("r0", ("n0",), gpus=1)]
    decision = decide([queued("a", gpus=1), queued("b", gpus=2, nodes=2)], half)
    admitted = {a.job_id: a.placed_on for a in decision.admit}
    assert admitted["a"] == ("n0",)  # best fit: the half-used node, keeping whole nodes whole
    assert len(set(admitted["b"])) == 2 and "n0" not in admitted["b"]
    assert not any(a.borrowed for a in decision.admit)


def test_idle_capacity_goes_to_the_team_furthest_below_its_share():
    quotas = {"vision": {"GPU:H100": 4}, "speech": {"GPU:H100": 4}}
    run = [running("v0", ("n0",), team="vision")]  # vision uses half its quota, speech none
    queue = [queued("v1", team="vision", at=1), queued("s1", team="speech", at=2),
             queued("s2", team="speech", at=3)]  # fmt: skip
    decision = decide(queue, run, quotas, count=3)  # room for two more jobs
    assert [a.job_id for a in decision.admit] == ["s1", "v1"]  # speech first, then even shares
    assert [w.job_id for w in decision.waiting] == ["s2"]


def test_beyond_its_quota_a_team_borrows_idle_capacity():
    quotas = {"vision": {"GPU:H100": 2}}
    run = [running("v0", ("n0",))]
    decision = decide([queued("v1", at=1)], run, quotas)
    (admit,) = decision.admit
    assert admit.job_id == "v1" and admit.borrowed


def test_a_team_at_its_quota_waits_when_nothing_is_idle_and_says_so():
    quotas = {"vision": {"GPU:H100": 4}, "speech": {"GPU:H100": 4}}
    run = [running("v0", ("n0",)), running("v1", ("n1",)),
           running("s0", ("n2",), team="speech"),
           running("s1", ("n3",), team="speech")]  # fmt: skip
    (waiting,) = decide([queued("v2", at=1)], run, quotas).waiting
    assert waiting.reason.startswith("team vision is at its quota of 4 H100 (4 in use)")


def test_the_owning_team_reclaims_borrowed_capacity_lowest_priority_newest_first():
    quotas = {"vision": {"GPU:H100": 4}, "speech": {"GPU:H100": 4}}
    run = [running("s0", ("n0",), team="speech"), running("s1", ("n1",), team="speech"),
           running("s-old", ("n2",), team="speech", borrowed=True, at=1),
           running("s-new", ("n3",), team="speech", borrowed=True, at=2)]  # fmt: skip
    decision = decide([queued("v1", at=5)], run, quotas)
    assert [(p.victim, p.for_job) for p in decision.preempt] == [("s-new", "v1")]  # one is enough
    assert decision.preempt[0].reason.startswith("preempted by v1: borrowed capacity")
    assert decision.waiting[0].reason == "preempting s-new to make room"
    # A job over its own quota takes nothing from another team's borrowed jobs.
    over = decide([queued("v1", at=5)], [*run[:3], running("v0", ("n3",))],
                  {"vision": {"GPU:H100": 2}, "speech": {"GPU:H100": 4}})  # fmt: skip
    assert over.preempt == []


def test_a_higher_priority_job_preempts_lower_ones_of_its_own_team_only():
    run = [running("low", ("n0",), priority=1), running("mid", ("n1",), priority=3),
           running("other", ("n2",), team="speech"),
           running("other2", ("n3",), team="speech")]  # fmt: skip
    decision = decide([queued("urgent", priority=5, nodes=2, at=9)], run)
    assert sorted(p.victim for p in decision.preempt) == ["low", "mid"]
    assert decide([queued("same", priority=1, at=9)], run).preempt == []


def test_what_leaving_jobs_free_is_held_for_the_job_they_left_for():
    run = [running("going", ("n0",), gpus=1, leaving=True)]  # n0 has 1 GPU free besides
    run += [running(f"r{i}", (f"n{i}",), team="other") for i in (1, 2, 3)]
    queue = [queued("waiter", priority=5, at=1), queued("small", gpus=1, at=2)]
    decision = decide(queue, run)
    assert decision.admit == [] and decision.preempt == []
    assert decision.waiting[0].reason == "waiting for preempted jobs to leave"


def test_a_large_job_is_not_overtaken_forever():
    """Before the bound, small jobs fill the gaps (backfill); after it, they wait behind it."""
    run = [running("r0", ("n0",), gpus=1, team="other"),
           running("r1", ("n1",), gpus=1, team="other")]  # fmt: skip
    big = queued("big", priority=1, nodes=4, at=0)
    small = queued("small", gpus=1, at=10)
    early = decide([big, small], run, now=60, hold_after_s=600)
    assert [a.job_id for a in early.admit] == ["small"]
    late = decide([big, small], run, now=601, hold_after_s=600)
    assert late.admit == []
    assert late.waiting[1].reason.startswith("held behind big, which has waited 601 s")


def test_a_job_larger_than_any_node_can_never_start_unless_the_cluster_autoscales():
    three = queued("three", gpus=3)
    decision = decide([three], [])
    assert decision.impossible == {
        "three": "needs 1 node with 3 H100, 12 CPU each; 0 of the cluster's 4 nodes have "
        "that much even when empty"
    }
    assert decision.waiting == [] and decision.admit == []
    assert "three" not in decide([three], [], autoscaling=True).impossible
