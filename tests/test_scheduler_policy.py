"""The queue's scheduling rules, without Ray: order, quotas, borrowing, preemption, starvation.

The tests named `test_issue29_*` are the examples of what the queue did wrong before: each fails
on 994a579 (livelock, borrowing busy capacity, a stale borrowed flag, needless victims,
starvation across teams, positions, preemption within a team by default).
"""

from __future__ import annotations

from queue_sim import SimCluster, cpus, gpus

from orchestrator.scheduler.policy import (
    ClusterSnapshot,
    Demand,
    Node,
    QueuedJob,
    RunningJob,
    SchedulingPolicy,
    WithinTeam,
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
            at: float = 0.0, gpus: int = 2, leaving_for: str | None = None,
            resumable: bool = True) -> RunningJob:  # fmt: skip
    bundle = Resources.of(H100=gpus, CPU=4 * gpus)
    return RunningJob(job_id, team, priority, at, Demand(bundle, len(on)), on,
                      resumable=resumable, leaving=leaving_for is not None,
                      leaving_for=leaving_for)  # fmt: skip


def occupied(jobs: list[RunningJob]) -> dict[str, Resources]:
    used: dict[str, Resources] = {}
    for job in jobs:
        for node in job.placed_on:
            used[node] = used.get(node, Resources()) + job.demand.bundle
    return used


def decide(queue, run=(), quotas=None, now=0.0, count=4, hold_after_s=600.0, autoscaling=False,
           within_team=WithinTeam.NEVER):  # fmt: skip
    run = list(run)
    snap = ClusterSnapshot(queue, run, nodes(count, occupied(run)), quotas or {}, now,
                           autoscaling)  # fmt: skip
    return SchedulingPolicy(hold_after_s, within_team).decide(snap)


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
    run = [
        running("s0", ("n0",), team="speech"),
        running("s1", ("n1",), team="speech"),
        running("s-old", ("n2",), team="speech", at=1),
        running("s-new", ("n3",), team="speech", at=2),
    ]  # speech's last two borrow
    decision = decide([queued("v1", at=5)], run, quotas)
    assert [(p.victim, p.for_job) for p in decision.preempt] == [("s-new", "v1")]  # one is enough
    assert decision.preempt[0].reason.startswith("preempted by v1: borrowed capacity")
    assert decision.waiting[0].reason == "preempting s-new to make room"
    # A job over its own quota takes nothing from another team's borrowed jobs.
    over = decide([queued("v1", at=5)], [*run[:3], running("v0", ("n3",))],
                  {"vision": {"GPU:H100": 2}, "speech": {"GPU:H100": 4}})  # fmt: skip
    assert over.preempt == []


def test_a_higher_priority_job_preempts_lower_ones_of_its_own_team_only_where_allowed():
    run = [running("low", ("n0",), priority=1), running("mid", ("n1",), priority=3),
           running("other", ("n2",), team="speech"),
           running("other2", ("n3",), team="speech")]  # fmt: skip
    urgent = queued("urgent", priority=5, nodes=2, at=9)
    # They have run 600 s: before the hold no job is preempted by its own team (issue 58).
    decision = decide([urgent], run, now=600, within_team=WithinTeam.ALWAYS)
    assert sorted(p.victim for p in decision.preempt) == ["low", "mid"]
    assert decide([queued("same", priority=1, at=9)], run, now=600,
                  within_team=WithinTeam.ALWAYS).preempt == []  # fmt: skip
    # resumable: a job without checkpointing would lose its work, so it is not preempted.
    run[0] = running("low", ("n0",), priority=1, resumable=False)
    decision = decide([urgent], run, now=600, within_team=WithinTeam.RESUMABLE)
    assert decision.preempt == []
    assert decision.spared == {
        "low": "not preempted for urgent: they have no checkpointing and would lose their "
        "work (ORCHESTRATOR_QUEUE_PREEMPT_WITHIN_TEAM=resumable)"
    }
    assert decision.waiting[0].reason.endswith(
        "; preempting low of its own team would make room, but they have no checkpointing "
        "and would lose their work (ORCHESTRATOR_QUEUE_PREEMPT_WITHIN_TEAM=resumable)"
    )


def test_what_leaving_jobs_free_is_held_for_the_job_they_left_for():
    run = [running("going", ("n0",), gpus=1, leaving_for="waiter")]  # n0: 1 GPU free besides
    run += [running(f"r{i}", (f"n{i}",), team="other") for i in (1, 2, 3)]
    queue = [queued("waiter", priority=5, at=1), queued("small", gpus=1, at=2)]
    decision = decide(queue, run)
    assert decision.admit == [] and decision.preempt == []
    assert decision.waiting[0].reason == "waiting for preempted jobs to leave"


def test_a_large_job_is_not_overtaken_forever():
    """Before the bound, small jobs fill the gaps (backfill); after it, the nodes closest to
    holding the large job are kept for it."""
    run = [running("r0", ("n0",), gpus=1, team="other"),
           running("r1", ("n1",), gpus=1, team="other")]  # fmt: skip
    big = queued("big", priority=1, nodes=4, at=0)
    small = queued("small", gpus=1, at=10)
    early = decide([big, small], run, now=60, hold_after_s=600)
    assert [a.job_id for a in early.admit] == ["small"]
    late = decide([big, small], run, now=601, hold_after_s=600)
    assert late.admit == [] and late.reserved == {"big": ("n2", "n3", "n0", "n1")}
    assert late.waiting[0].reason.startswith("waited 601 s, past the hold: needs 4 nodes")
    assert late.waiting[0].reason.endswith("the 4 nodes closest to holding it are kept for it "
                                           "until it starts")  # fmt: skip
    assert late.waiting[1].reason == (
        "needs 1 node with 1 H100, 4 CPU free: 0 such nodes free (not counting nodes kept for "
        "jobs that waited longest)"
    )


def test_a_job_larger_than_any_node_can_never_start_unless_the_cluster_autoscales():
    three = queued("three", gpus=3)
    decision = decide([three], [])
    assert decision.impossible == {
        "three": "needs 1 node with 3 H100, 12 CPU each; 0 of the cluster's 4 nodes have "
        "that much even when empty"
    }
    assert decision.waiting == [] and decision.admit == []
    assert "three" not in decide([three], [], autoscaling=True).impossible


# -- what the queue did wrong before (issue 29): each fails on 994a579 ------------------------


def test_issue29_a_preempted_borrower_does_not_come_back_on_the_room_it_freed():
    """Livelock: the borrower went back with its old push time, was ordered first and admitted
    on the room it had just freed, to be preempted again (15 times in 30 decisions)."""
    sim = SimCluster({"n0": Resources.of(H100=8, CPU=16)},
                     quotas={"T": {"GPU:H100": 8}, "U": {"GPU:H100": 4}})  # fmt: skip
    sim.push("V", "U", gpus(8, cpus=8))
    assert [(a.job_id, a.borrowed) for a in sim.step().admit] == [("V", True)]
    sim.now = 10.0
    sim.push("P", "T", gpus(8, cpus=8))
    for _ in range(30):
        sim.now += 1
        sim.step()
    assert sim.preemptions == [("V", "P")]
    # P started: V waits for P no more (its mark is cleared), only for room beyond its quota.
    assert list(sim.running) == ["P"] and sim.queued["V"].preempted_by is None
    assert sim.last.waiting[0].reason.startswith("team U is at its quota of 4 H100 (0 in use)")


def test_two_jobs_that_gave_way_to_each_other_do_not_wait_for_each_other_for_ever():
    """A gave way to B; B started, and later gave way to A. A's mark named B still: each waited
    for the other to start, on an idle cluster, for ever (a replayed trace found it). The mark
    is cleared once the job it names starts."""
    sim = SimCluster({"n0": Resources.of(H100=8, CPU=16)},
                     quotas={"T": {"GPU:H100": 8}, "U": {"GPU:H100": 8}})  # fmt: skip
    sim.queued["A"] = QueuedJob("A", "T", 0, 0.0, gpus(8, cpus=8), preempted_by="B")
    sim.push("B", "U", gpus(8, cpus=8))
    assert [a.job_id for a in sim.step().admit] == ["B"]  # A waits for B to start: it has
    assert sim.queued["A"].preempted_by is None
    del sim.running["B"]  # B gave way to A, and is back in the queue
    sim.queued["B"] = QueuedJob("B", "U", 0, 1.0, gpus(8, cpus=8), preempted_by="A")
    sim.now += 1
    assert [a.job_id for a in sim.step().admit] == ["A"]


def test_issue29_a_job_beyond_its_quota_does_not_start_ahead_of_a_job_within_its_own():
    """Teams were ordered by dominant share alone: team a (half its share) went first, its job
    beyond the quota took the last free node, and team b's job within its quota preempted it
    at the next decision."""
    capacity = Resources.of(H100=4, CPU=16)
    run = [RunningJob("a1", "a", 0, 0.0, gpus(2), ("n0",))]
    run += [RunningJob(f"b{i}", "b", 0, 0.0, gpus(4), (f"n{i}",)) for i in (1, 2, 3)]
    used = occupied(run)
    nodes_ = [Node(f"n{i}", capacity, capacity - used.get(f"n{i}", Resources())) for i in range(5)]
    queue = [QueuedJob("a2", "a", 0, 0.0, gpus(4)), QueuedJob("b4", "b", 0, 1.0, gpus(4))]
    quotas = {"a": {"GPU:H100": 4}, "b": {"GPU:H100": 16}}
    decision = SchedulingPolicy().decide(ClusterSnapshot(queue, run, nodes_, quotas, 2.0))
    assert [(a.job_id, a.borrowed) for a in decision.admit] == [("b4", False)]
    assert decision.waiting[0].job_id == "a2" and decision.waiting[0].reason.startswith(
        "team a is at its quota of 4 H100 (2 in use) and the cluster has no idle capacity"
    )


def test_issue29_a_job_whose_team_is_back_within_its_quota_is_no_longer_borrowed():
    """The borrowed flag was set at admission and kept: once the team's other job had ended
    (or its quota grew), the job, now within the quota, was still preempted as "borrowed
    capacity"."""
    sim = SimCluster({"n0": Resources.of(H100=8, CPU=32), "n1": Resources.of(H100=8, CPU=32)},
                     quotas={"T": {"GPU:H100": 8}, "U": {"GPU:H100": 16}})  # fmt: skip
    sim.push("t-first", "T", gpus(8))
    sim.push("t-second", "T", gpus(8))  # beyond T's 8: borrows idle n1
    first = sim.step()
    sim.end("t-first")  # another of its team's jobs ends
    sim.push("u-own", "U", gpus(8))
    sim.now = 1.0
    second = sim.step()  # u-own takes the free n0; t-second is T's own now
    sim.push("u-next", "U", gpus(8))
    third = sim.step()
    assert third.preempt == []  # nothing borrowed to reclaim
    assert third.waiting[0].reason == "needs 1 node with 8 H100, 32 CPU free: 0 such nodes free"
    assert [a.job_id for a in second.admit] == ["u-own"]
    assert first.borrowed == {"t-second"} and second.borrowed == third.borrowed == set()
    # The same when a quota grows: a borrowed job becomes its team's own.
    sim.quotas["T"] = {"GPU:H100": 4}
    assert SchedulingPolicy().decide(sim.snapshot()).borrowed == {"t-second"}
    sim.quotas["T"] = {"GPU:H100": 16}
    assert SchedulingPolicy().decide(sim.snapshot()).borrowed == set()


def test_issue29_only_victims_whose_release_makes_the_job_fit_are_preempted():
    """Victims were added greedily until the job fit: a CPU-only borrower that freed nothing the
    job could use went too."""
    capacity = Resources.of(H100=8, CPU=16)
    run = [
        RunningJob("t-run", "T", 0, 0.0, gpus(8, cpus=8), ("n0",)),
        RunningJob("s-gpu", "S", 0, 1.0, gpus(8, cpus=8), ("n1",)),
        RunningJob("s-cpu", "S", 0, 2.0, cpus(4), ("n0",)),  # the newest: it would go first
    ]
    used = occupied(run)
    nodes_ = [Node(n, capacity, capacity - used.get(n, Resources())) for n in ("n0", "n1")]
    quotas = {"T": {"GPU:H100": 16}, "S": {"GPU:H100": 1, "CPU": 1}}  # S borrows both
    snap = ClusterSnapshot([QueuedJob("t-new", "T", 0, 3.0, gpus(8, cpus=8))], run, nodes_,
                           quotas, 4.0)  # fmt: skip
    decision = SchedulingPolicy().decide(snap)
    assert [(p.victim, p.for_job) for p in decision.preempt] == [("s-gpu", "t-new")]
    assert decision.waiting[0].reason == "preempting s-gpu to make room"


def test_issue29_a_job_that_waited_past_the_hold_is_not_overtaken_by_another_team():
    """Team b's job (quota 4 CPU, using 2, needs 2) was overtaken by 180 later 1-CPU jobs of
    team a, far below its share and so always ordered first: it never started."""
    sim = SimCluster({"n0": Resources.of(CPU=4)},
                     quotas={"a": {"CPU": 100}, "b": {"CPU": 4}},
                     policy=SchedulingPolicy(hold_after_s=600))  # fmt: skip
    sim.push("b-run", "b", cpus(2))
    sim.push("a-0", "a", cpus(1))
    sim.push("a-1", "a", cpus(1))
    sim.step()
    sim.push("b-job", "b", cpus(2))
    overtaken_after_hold = []
    for i in range(2, 182):  # an a-job ends and a new one is pushed every 10 s
        sim.now += 10
        oldest = min((r for r in sim.running.values() if r.team == "a"),
                     key=lambda r: r.started_at)  # fmt: skip
        sim.end(oldest.job_id)
        sim.push(f"a-{i}", "a", cpus(1))
        decision = sim.step()
        if "b-job" in sim.running:
            break
        if sim.now >= 600:
            overtaken_after_hold += [a.job_id for a in decision.admit]
    assert "b-job" in sim.running
    assert sim.running["b-job"].started_at == 610  # the hold began at 600 s, 1 CPU was free
    assert overtaken_after_hold == []


def test_issue29_positions_count_only_the_jobs_still_waiting():
    """A job admitted in the same decision used to take position 1: the waiting ones said 2, 3."""
    full = [running(f"r{i}", (f"n{i}",), team="other") for i in (1, 2, 3)]
    queue = [queued("fits", at=1), queued("next", at=2), queued("last", at=3)]
    decision = decide(queue, full)
    assert [a.job_id for a in decision.admit] == ["fits"]
    assert [(w.job_id, w.position) for w in decision.waiting] == [("next", 1), ("last", 2)]


def test_issue29_a_job_does_not_preempt_its_own_team_by_default_and_says_why():
    """A higher-priority job of the same team preempted a running one by default, also one
    without checkpointing (all its work lost). Kueue's default within a queue is Never."""
    run = [running("low", ("n0",), priority=1, resumable=False),
           running("mid", ("n1",), priority=3),
           running("other", ("n2",), team="speech"),
           running("other2", ("n3",), team="speech")]  # fmt: skip
    decision = SchedulingPolicy().decide(ClusterSnapshot(
        [queued("urgent", priority=5, nodes=2, at=9)], run, nodes(4, occupied(run)), {}, 10.0
    ))  # fmt: skip
    assert decision.preempt == []
    off = "preemption within a team is off (ORCHESTRATOR_QUEUE_PREEMPT_WITHIN_TEAM=never)"
    assert decision.spared == {"low": f"not preempted for urgent: {off}",
                               "mid": f"not preempted for urgent: {off}"}  # fmt: skip
    assert decision.waiting[0].reason == (
        "needs 2 nodes with 2 H100, 8 CPU free: 0 such nodes free; preempting low, mid of its "
        f"own team would make room, but {off}"
    )
