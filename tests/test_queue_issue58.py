"""What the queue did wrong in issue 58 (item 2): the issue's three reproductions, found by an
independent random check of the rules; two shapes the property test found once rule 1 counted
jobs by start; two details of the fixes (each spared job's own reason, the quota check behind a
reclaim); a borrower preempted at the next decision for a job that had given way.
Every test here failed on 4efe849 (each says how); `test_queue_properties.py` reaches the
issue's shapes too (colocation, work that is not the queue's, two GPU kinds, memory, many small
CPU-only jobs beside GPU jobs)."""

from __future__ import annotations

from queue_sim import SimCluster

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

GIB = 2**30


def res(**amounts: float) -> Resources:
    """`res(CPU=8, H100=4, memory=32)`: memory in GiB."""
    return Resources.of(**{k: v * GIB if k == "memory" else v for k, v in amounts.items()})


def case1(now: float = 12685.0) -> ClusterSnapshot:
    """Six nodes of three kinds with work that is not the queue's on n44, n51 and n52; the
    running jobs started in the order listed."""
    h4, h8 = res(CPU=8, H100=4, memory=32), res(CPU=16, H100=8, memory=64)
    nodes = [
        Node("n44", h4, res(CPU=1, memory=18)),
        Node("n47", res(CPU=16, memory=64), res(CPU=16, memory=64)),
        Node("n51", h4, res(CPU=6, H100=2, memory=23)),
        Node("n52", res(CPU=8, A100=4, memory=32), res(CPU=7, A100=4, memory=31)),
        Node("n55", h8, res(CPU=2, H100=6, memory=51)),
        Node("n56", h8, res(CPU=1, H100=6, memory=47)),
    ]
    jobs = [
        ("j1157", "speech", 5, res(CPU=4, memory=8), ("n56", "n55")),
        ("j1176", "vision", 3, res(CPU=4, H100=2, memory=1), ("n44",)),
        ("j1151", "vision", 0, res(CPU=2, memory=4), ("n55", "n56")),
        ("j1181", "nlp", 10, res(CPU=1, memory=4), ("n44", "n56")),
        ("j1183", "nlp", 1, res(CPU=1, H100=2, memory=8), ("n44", "n51")),
        ("j1170", "nlp", 3, res(CPU=8, H100=2, memory=1), ("n55", "n56")),
    ]
    running = [RunningJob(j, team, prio, 11000.0 + i, Demand(bundle, len(on)), on)
               for i, (j, team, prio, bundle, on) in enumerate(jobs)]  # fmt: skip
    queued = [
        QueuedJob("j1114", "nlp", 2, 12015.0, Demand(res(CPU=8, A100=2, memory=4))),
        QueuedJob("j1186", "speech", 10, 12685.0, Demand(res(CPU=2, memory=8), 5)),
    ]
    quotas = {"nlp": {"GPU:H100": 8}, "vision": {"GPU:H100": 0, "GPU:A100": 4}}
    return ClusterSnapshot(queued, running, nodes, quotas, now)


def test_issue58_a_job_using_nothing_its_quota_limits_does_not_borrow_and_is_not_reclaimed():
    """4efe849 preempted j1151 and j1176 for j1186. Both were needed once n52 is kept for
    j1114 (past the hold, rule 5): the issue's check counted n52 as room. What was wrong is
    that j1151 was a victim at all: a CPU-only job, it uses nothing vision's quota limits (H100,
    A100), yet it borrowed because vision's higher-priority j1176 passed the H100 quota before
    it. Now a job borrows only for a resource it uses, so j1176 alone is reclaimable, and it
    alone frees too little: j1186 waits. Before: preempt == [j1151, j1176], borrowed == both."""
    decision = SchedulingPolicy(300).decide(case1())
    assert decision.borrowed == {"j1176"}
    assert decision.preempt == []
    assert decision.reserved == {"j1114": ("n52",)}  # past the hold: n52 is kept for it
    assert decision.waiting[1].reason.startswith(
        "needs 5 nodes with 2 CPU, 8.0 GiB memory free: 3 such nodes free (not counting nodes "
        "kept for jobs that waited longest); preempting j1157 of its own team would make room"
    )
    # Before j1114's hold nothing is kept: j1176 alone makes room (n52 and its n44 fit).
    early = SchedulingPolicy(1000).decide(case1())
    assert [(p.victim, p.for_job) for p in early.preempt] == [("j1176", "j1186")]
    assert early.held == {"j1186": ("n55", "n44", "n51", "n52", "n47")}


def case2() -> SimCluster:
    node = res(CPU=8, A100=4, memory=32)
    sim = SimCluster({"n49": node, "n65": node}, quotas={"nlp": {"GPU:A100": 0}},
                     policy=SchedulingPolicy(300))  # fmt: skip
    sim.running["j1360"] = RunningJob("j1360", "nlp", 0, 14000.0, Demand(res(CPU=2, memory=1)),
                                      ("n49",), resumable=True)  # fmt: skip
    sim.now = 14401.5
    sim.push("j1334", "vision", Demand(res(CPU=8, A100=4, memory=1), 2))
    sim.now = 14526.0
    sim.push("j1352", "nlp", Demand(res(CPU=4, A100=1, memory=4)), priority=5)
    sim.now = 14645.5
    return sim


def test_issue58_a_job_admitted_as_borrowing_makes_no_teammate_preemptable():
    """4efe849 admitted j1352 beyond nlp's quota (A100: 0) on n49, where j1334 cannot start
    (it needs all of n49's 8 CPUs). Rule 1 ranked nlp's jobs by priority, so j1352 (5) went
    before j1360 (0), which had been nlp's own (2 CPUs: nothing the quota limits), and both
    borrowed: the next decision, nothing else changed, preempted both for j1334. Now a team's
    jobs are its own in the order they started, and j1360 borrows nothing. Before: first
    borrowed == {j1352, j1360}; second preempt == [j1360, j1352] for j1334."""
    sim = case2()
    first = sim.step()
    assert [(a.job_id, a.placed_on, a.borrowed) for a in first.admit] == [
        ("j1352", ("n49",), True)
    ]  # fmt: skip
    assert first.borrowed == {"j1352"}
    second = sim.step()  # the same moment: nothing else changed
    assert second.preempt == [] and second.admit == []
    assert second.borrowed == {"j1352"}
    assert second.waiting[0].reason == (
        "needs 2 nodes with 4 A100, 8 CPU, 1.0 GiB memory free: 1 such node free"
    )


def case3() -> SimCluster:
    sim = SimCluster({"n143": res(CPU=8, H100=4, memory=32)},
                     quotas={"speech": {"GPU:H100": 12}},
                     policy=SchedulingPolicy(300, WithinTeam.RESUMABLE))  # fmt: skip
    sim.now = 33740.5
    sim.push("j3133", "speech", Demand(res(CPU=2, H100=2, memory=16), 2, colocated=True),
             priority=5)  # fmt: skip
    sim.now = 33805.5
    sim.push("j3143", "speech", Demand(res(CPU=2, H100=2, memory=4)), priority=10)
    sim.now = 34046.0
    return sim


def test_issue58_a_job_is_not_preempted_by_its_own_team_before_it_has_run_the_hold():
    """With preemption within a team on (`resumable`), 4efe849 admitted j3133, which had waited
    past the hold (rule 5), and at the next decision, nothing else changed, preempted it for
    its higher-priority teammate j3143: a busy team could start and stop it for ever, before
    its first checkpoint. Now a running job is not preempted by its own team before it has run
    `hold_after_s`. Before: the second decision preempted j3133 for j3143."""
    sim = case3()
    first = sim.step()
    assert [a.job_id for a in first.admit] == ["j3133"]
    second = sim.step()  # the same moment: nothing else changed
    assert second.preempt == []
    why = ("it has run 0 s, and a job runs ORCHESTRATOR_QUEUE_HOLD_AFTER_S (300 s) before its "
           "own team may preempt it")  # fmt: skip
    assert second.spared == {"j3133": f"not preempted for j3143: {why}"}
    assert second.waiting[0].reason.endswith(
        f"; preempting j3133 of its own team would make room, but {why}"
    )
    # Past the hold itself, j3143 goes first and keeps the node; once j3133 has run 300 s,
    # j3143 preempts it, and j3133 starts again after it (its own hold long past).
    sim.now = 34200.0
    assert sim.step().reserved == {"j3143": ("n143",)}
    sim.now = 34346.0
    assert [(p.victim, p.for_job) for p in sim.step().preempt] == [("j3133", "j3143")]
    assert [a.job_id for a in sim.step().admit] == ["j3143"]
    sim.end("j3143")
    assert [a.job_id for a in sim.step().admit] == ["j3133"]


def test_issue58_teammates_spared_for_different_reasons_each_say_theirs():
    """`low` cannot resume; `mid` could but has run 100 s of the 600 s hold: 4efe849 named only
    `low` (spared == {low: ...}) and gave `urgent` one reason for both."""
    node = Resources.of(H100=2, CPU=16)
    bundle = Demand(Resources.of(H100=2, CPU=8))
    running = [
        RunningJob("low", "vision", 1, 0.0, bundle, ("n0",), resumable=False),
        RunningJob("mid", "vision", 3, 500.0, bundle, ("n1",), resumable=True),
        RunningJob("other", "speech", 0, 0.0, bundle, ("n2",)),
        RunningJob("other2", "speech", 0, 0.0, bundle, ("n3",)),
    ]
    nodes = [Node(f"n{i}", node, node - bundle.bundle) for i in range(4)]
    urgent = QueuedJob("urgent", "vision", 5, 590.0, Demand(bundle.bundle, 2))
    snap = ClusterSnapshot([urgent], running, nodes, {}, 600.0)
    decision = SchedulingPolicy(600, WithinTeam.RESUMABLE).decide(snap)
    assert decision.preempt == []
    lose = ("they have no checkpointing and would lose their work "
            "(ORCHESTRATOR_QUEUE_PREEMPT_WITHIN_TEAM=resumable)")  # fmt: skip
    young = ("it has run 100 s, and a job runs ORCHESTRATOR_QUEUE_HOLD_AFTER_S (600 s) before "
             "its own team may preempt it")  # fmt: skip
    assert decision.spared == {"low": f"not preempted for urgent: {lose}",
                               "mid": f"not preempted for urgent: {young}"}  # fmt: skip
    assert decision.waiting[0].reason.endswith(
        f"; preempting low, mid of its own team would make room, but low: {lose}; mid: {young}"
    )


def test_issue58_no_job_of_a_team_borrows_while_another_holds_room_for_its_quota():
    """Found by the property test once rule 1 counted jobs in the order they started. `h`
    preempts `u1` (borrowing) for its team's quota; 4efe849 let `b`, beyond the quota with `h`
    counted, borrow n2 meanwhile, and once `u1` had left, `h` no longer fitted the quota beside
    `b` and was admitted as borrowing (its log says so; labels by priority called `b` the
    borrower). Counted by start, `b` would keep the quota `h` preempted for. Now `b` waits for
    `h` to start. Before: the first decision admitted `b` on n2, the second `h` borrowed=True."""
    big = Resources.of(H100=8, CPU=32)
    sim = SimCluster({"n0": big, "n1": big, "n2": Resources.of(H100=2, CPU=8)},
                     quotas={"t": {"GPU:H100": 8}, "u": {"GPU:H100": 0}})  # fmt: skip
    eight = Demand(Resources.of(H100=8, CPU=8))
    sim.running["u1"] = RunningJob("u1", "u", 0, 0.0, eight, ("n0",))
    sim.running["v1"] = RunningJob("v1", None, 0, 0.0, eight, ("n1",))
    sim.pushed_at["u1"] = 0.0  # kept when it is queued again
    sim.now = 10.0
    sim.push("h", "t", eight, priority=5)
    sim.push("b", "t", Demand(Resources.of(H100=1, CPU=1)))
    first = sim.step()
    assert [(p.victim, p.for_job) for p in first.preempt] == [("u1", "h")]
    assert first.admit == []
    assert first.waiting[1].reason == (
        "team t's quota is held for h, whose preempted jobs are leaving: none of its jobs "
        "borrows before it starts: needs 1 node with 1 H100, 1 CPU free: 1 such node free"
    )
    second = sim.step()  # u1 has left
    assert [(a.job_id, a.borrowed) for a in second.admit] == [("h", False), ("b", True)]
    assert second.borrowed == {"b"}


def test_issue58_a_borrower_goes_only_while_its_team_is_over_in_what_it_uses():
    """Team t (4 H100, 8 CPU) borrows H100 with `a` and `c` and CPU with `v`. Once `a` is chosen
    for `j`, t is within its CPU quota: `v` (CPU only) gives t's owners nothing back, and would be
    t's own at the next decision, though t is still over in H100 (`c`). 4efe849 preempted `a`
    and `v` (it asked only whether t was over in anything); now `j` waits."""
    quotas = {"t": {"GPU:H100": 4, "CPU": 8}}
    jobs = [  # in the order they started
        ("o", 9, Resources.of(H100=4, CPU=1), "no", Resources.of(H100=4, CPU=4)),
        ("a", 0, Resources.of(H100=2, CPU=2), "na", Resources.of(H100=2, CPU=8)),
        ("v", 1, Resources.of(CPU=6), "nv", Resources.of(CPU=8)),
        ("c", 2, Resources.of(H100=1, CPU=1), "nc", Resources.of(H100=1, CPU=2)),
    ]
    running = [RunningJob(j, "t", prio, float(i), Demand(b), (n,))
               for i, (j, prio, b, n, _) in enumerate(jobs)]  # fmt: skip
    nodes = [Node(n, cap, cap - b) for _, _, b, n, cap in jobs]
    j = QueuedJob("j", "s", 0, 10.0, Demand(Resources.of(CPU=8), 2))
    decision = SchedulingPolicy().decide(ClusterSnapshot([j], running, nodes, quotas, 10.0))
    assert decision.borrowed == {"a", "v", "c"}
    assert decision.preempt == []
    assert decision.waiting[0].reason == "needs 2 nodes with 8 CPU free: 0 such nodes free"


def test_issue58_a_job_that_preempting_teammates_brings_within_goes_before_borrowers():
    """Found by the quiet steps of the property test: `j` (beyond vision's quota while `l1`
    and `l2` run) would come within by preempting them, but jobs beyond their quota were served
    in fair-share order, and speech's `b` went first: it borrowed n1, and at the next decision
    `j` preempted `l1`, `l2` and `b`, admitted one decision before. Now `j` goes first among
    the jobs beyond their quota. Before: the first decision admitted `b`, the second preempted
    it for `j`."""
    node = Resources.of(H100=8, CPU=32)
    sim = SimCluster({"n0": node, "n1": node},
                     quotas={"vision": {"GPU:H100": 8}, "speech": {"GPU:H100": 0}},
                     policy=SchedulingPolicy(600, WithinTeam.ALWAYS))  # fmt: skip
    four = Demand(Resources.of(H100=4, CPU=4))
    for job_id in ("l1", "l2"):
        sim.running[job_id] = RunningJob(job_id, "vision", 0, 0.0, four, ("n0",))
        sim.pushed_at[job_id] = 0.0
    sim.now = 1000.0
    sim.push("j", "vision", Demand(four.bundle, 2), priority=3)
    sim.push("b", "speech", Demand(Resources.of(H100=8, CPU=4)))
    first = sim.step()
    assert sorted((p.victim, p.for_job) for p in first.preempt) == [("l1", "j"), ("l2", "j")]
    assert first.admit == [] and first.held == {"j": ("n0", "n1")}
    second = sim.step()  # l1 and l2 have left: j starts (they borrow what it leaves), b waits
    assert [(a.job_id, a.borrowed) for a in second.admit] == [
        ("j", False), ("l1", True), ("l2", True)
    ]  # fmt: skip
    assert second.preempt == [] and second.waiting[0].job_id == "b"


def test_issue58_a_job_that_gave_way_goes_in_its_place_once_the_job_it_gave_way_to_starts():
    """`v` waited past the hold, then gave way to `p`, whose room its leaving freed. 4efe849
    served `v` only after the jobs past the hold (it still waited for `p`, served later among
    the jobs whose preemptions freed room): `y` kept n1, `v` then fitted nowhere, and `b`
    borrowed n2. At the next decision, nothing else changed, `v` (past the hold, pushed before
    `y`) went first and preempted `b` for n1 and n2. Now `p` is served just before `v`, which
    then starts in its place. Before: the first decision admitted `p` and `b`, the second
    preempted `b` for `v`."""
    gpus = Resources.of(H100=4, CPU=16)
    sim = SimCluster({"n0": Resources.of(H100=8, CPU=32), "n1": gpus + res(memory=32), "n2": gpus},
                     quotas={"b": {"GPU:H100": 0}}, policy=SchedulingPolicy(100))  # fmt: skip
    two = Resources.of(H100=2, CPU=4)
    sim.running["r"] = RunningJob("r", "c", 0, 0.0, Demand(two), ("n1",))
    sim.pushed_at["v"] = 0.0
    sim.queued["v"] = QueuedJob("v", "a", 0, 0.0, Demand(two, 2), preempted_by="p")  # it left
    sim.now = 50.0
    sim.push("y", "c", Demand(gpus + res(memory=16)))  # only n1 could hold it: kept for it
    sim.now = 150.0
    sim.push("p", "a", Demand(Resources.of(H100=8, CPU=8)), priority=5)
    sim.now = 200.0
    sim.push("b", "b", Demand(gpus))
    first = sim.step()
    assert [(a.job_id, a.placed_on) for a in first.admit] == [("p", ("n0",)), ("v", ("n1", "n2"))]
    assert first.reserved == {"y": ("n1",)}  # after v: it waited less
    assert first.waiting[1].job_id == "b"
    sim.now += 1.0
    second = sim.step()
    assert second.preempt == [] and second.admit == []
