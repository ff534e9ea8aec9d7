"""The queue's promises under any sequence of events, checked after every decision.

A seeded generator drives `queue_sim.SimCluster` through random clusters (H100, A100 and CPU
nodes joining and leaving, work that is not the queue's), teams with random quotas (or none),
jobs of every shape (several nodes, colocated), priorities, priority changes, quota changes,
jobs ending, and whatever the policy preempts and requeues, under each preemption-within-team
mode. Half the clusters are *roomy* (GPU nodes with CPUs to spare), half *tight*, as issue 58's:
4-GPU nodes with 8 CPUs, memory as scarce as CPUs, several GPU kinds, CPU and memory used by work
that is not the queue's, many small CPU-only jobs beside the GPU ones. A fifth of the steps are
*quiet*: nothing happens but the next decision a tick later (what was admitted runs, what was
preempted is still leaving), which must preempt no job the decision before admitted. Every
check is computed here from the snapshot and the decision, not by asking the policy's own
helpers. A failure names its seed and step: `run(seed)` replays it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace

from queue_sim import SimCluster

from orchestrator.scheduler.policy import (
    ClusterSnapshot,
    Decision,
    Demand,
    QueuedJob,
    RunningJob,
    SchedulingPolicy,
    WithinTeam,
)
from orchestrator.scheduler.resources import Resources, total

GIB = 2**30
ROOMY = {
    "h100": Resources.of(H100=8, CPU=32),
    "a100": Resources.of(A100=4, CPU=16),
    "cpu": Resources.of(CPU=16),
}
TIGHT = {  # issue 58's nodes: CPUs and memory run out before the GPUs do
    "h100x4": Resources.of(H100=4, CPU=8, memory=32 * GIB),
    "h100x8": Resources.of(H100=8, CPU=16, memory=64 * GIB),
    "a100x4": Resources.of(A100=4, CPU=8, memory=32 * GIB),
    "cpu": Resources.of(CPU=16, memory=64 * GIB),
}
TEAMS = ("a", "b", "c", None)
SEEDS = 330
STEPS = 120
QUIET = 0.2  # the share of steps in which nothing happens before the decision
TICK = 2**-10  # a quiet step's: the next tick (exact in binary, so no job's hold is crossed)
EPS = 1e-6


def test_the_queue_keeps_its_promises_over_100_000_random_operations():
    started = time.process_time()  # this test's own CPU time: other work on the machine aside
    ops = decisions = quiet = 0
    for seed in range(SEEDS):
        o, d, q = run(seed)
        ops, decisions, quiet = ops + o, decisions + d, quiet + q
    took = time.process_time() - started
    print(f"{ops} operations ({decisions} decisions, {quiet} quiet) in {took:.1f} s of CPU")
    assert ops >= 100_000 and took < 60


def run(seed: int, steps: int = STEPS) -> tuple[int, int, int]:
    """One random history; (operations, decisions, quiet decisions). AssertionError names the
    seed and step."""
    rng = random.Random(seed)
    mode = rng.choice(list(WithinTeam))
    hold = rng.choice((30.0, 120.0, 600.0))
    kinds = TIGHT if rng.random() < 0.5 else ROOMY
    size = rng.randint(1, 4) if kinds is ROOMY else rng.randint(2, 6)
    capacity = {f"n{i}": kinds[rng.choice(list(kinds))] for i in range(size)}
    quotas = {t: q for t in "abc" if (q := random_quota(rng)) is not None}
    sim = SimCluster(capacity, quotas, SchedulingPolicy(hold, mode))
    if kinds is TIGHT:
        for node in capacity:
            add_foreign(rng, sim, node)
    ops = serial = quiet_steps = 0
    admitted: set[str] = set()  # by the decision before
    for step in range(steps):
        quiet = step > 0 and rng.random() < QUIET
        if quiet:
            quiet_steps += 1
            sim.now += TICK  # what it preempted is still leaving; what it admitted runs
        else:
            sim.now += rng.choice((1.0, 5.0, 20.0, 60.0))
            for _ in range(rng.randint(0, 3)):
                if len(sim.queued) < 30:
                    serial += 1
                    sim.push(f"j{serial}", rng.choice(TEAMS), random_demand(rng, kinds),
                             rng.randint(0, 3), resumable=rng.random() < 0.6)  # fmt: skip
                    ops += 1
            ops += random_events(rng, sim, kinds)
            sim.requeue_leaving()  # what the decision before preempted has left
        snap = sim.snapshot()
        decision = sim.policy.decide(snap)
        try:
            check(snap, decision, mode, hold)
            for p in decision.preempt if quiet else ():
                assert p.victim not in admitted, (
                    f"{p.victim} admitted, then preempted for {p.for_job} at the next decision, "
                    "nothing else changed"
                )
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, step {step}: {e}") from None
        sim.carry_out(decision)
        admitted = {a.job_id for a in decision.admit}
        for job_id in decision.impossible:  # DEPLOY_FAILED: it leaves the queue
            sim.end(job_id)
        ops += 1
    return ops, steps, quiet_steps


def random_events(rng: random.Random, sim: SimCluster, kinds: Mapping[str, Resources]) -> int:
    """Jobs end, nodes join and go, quotas, priorities and other work change; how many."""
    events = 0
    for job in list(sim.running.values()):
        if not job.leaving and rng.random() < 0.08:
            sim.end(job.job_id)
            events += 1
    if rng.random() < 0.04 and len(sim.capacity) < 6:
        sim.capacity[f"m{sim.now:g}"] = kinds[rng.choice(list(kinds))]
        events += 1
    if rng.random() < 0.03 and len(sim.capacity) > 1:
        lost = rng.choice(sorted(sim.capacity))
        del sim.capacity[lost]
        sim.foreign.pop(lost, None)
        for job in [r for r in sim.running.values() if lost in r.placed_on]:
            sim.end(job.job_id)  # its controller sees the node go
        events += 1
    if rng.random() < 0.04:
        team = rng.choice("abc")
        quota = random_quota(rng)
        if quota is None:
            sim.quotas.pop(team, None)
        else:
            sim.quotas[team] = quota
        events += 1
    if rng.random() < (0.04 if kinds is ROOMY else 0.1):
        add_foreign(rng, sim, rng.choice(sorted(sim.capacity)))
        events += 1
    if rng.random() < 0.05 and sim.queued:
        job_id = rng.choice(sorted(sim.queued))
        sim.queued[job_id] = replace(sim.queued[job_id], priority=rng.randint(0, 3))
        events += 1
    return events


def add_foreign(rng: random.Random, sim: SimCluster, node: str) -> None:
    """A Serve replica comes or goes on `node`: only on room (the queue's jobs leave it)."""
    room = sim.capacity[node] - _ours(sim.running.values(), node)
    work = {"CPU": min(rng.choice((0, 0, 1, 2, 4)), room.get("CPU"))}
    if room.get("memory") > 0:
        work["memory"] = min(rng.choice((0, 1, 1, 4)) * GIB, room.get("memory"))
    sim.foreign[node] = Resources(work)


def random_quota(rng: random.Random) -> dict[str, float] | None:
    if rng.random() < 0.25:
        return None
    quota: dict[str, float] = {}
    if rng.random() < 0.8:
        quota["GPU:H100"] = rng.choice((0, 4, 8, 16, 24))
    if rng.random() < 0.3:
        quota["GPU:A100"] = rng.choice((0, 4, 8))
    if rng.random() < 0.4 or not quota:
        quota["CPU"] = rng.choice((8, 16, 32, 64))
    return quota


def random_demand(rng: random.Random, kinds: Mapping[str, Resources]) -> Demand:
    if kinds is TIGHT:
        return tight_demand(rng)
    kind = rng.random()
    if kind < 0.35:
        bundle = Resources.of(CPU=rng.choice((1, 2, 4, 8)))
    elif kind < 0.8:
        g = rng.choice((1, 2, 4, 8))
        bundle = Resources.of(H100=g, CPU=rng.choice((1, 2 * g, 4 * g)))
    else:
        g = rng.choice((1, 2, 4))
        bundle = Resources.of(A100=g, CPU=rng.choice((1, 4)))
    nodes = rng.choice((1, 1, 1, 2, 3))
    return Demand(bundle, nodes, colocated=nodes > 1 and rng.random() < 0.25)


def tight_demand(rng: random.Random) -> Demand:
    """Half of them small CPU-only jobs, often on several nodes; GPU jobs of both kinds."""
    memory = rng.choice((1, 4, 8, 16)) * GIB
    kind = rng.random()
    if kind < 0.5:
        bundle = Resources.of(CPU=rng.choice((1, 2, 2, 4)), memory=memory)
    elif kind < 0.85:
        bundle = Resources.of(H100=rng.choice((1, 2, 2, 4)), CPU=rng.choice((1, 2, 4, 8)),
                              memory=memory)  # fmt: skip
    else:
        bundle = Resources.of(A100=rng.choice((1, 2, 4)), CPU=rng.choice((1, 4, 8)),
                              memory=memory)  # fmt: skip
    nodes = rng.choice((1, 1, 2, 2, 3, 5))
    return Demand(bundle, nodes, colocated=nodes > 1 and rng.random() < 0.3)


# -- the promises ---------------------------------------------------------------------------------


def check(snap: ClusterSnapshot, d: Decision, mode: WithinTeam, hold: float) -> None:
    queued = {j.job_id: j for j in snap.queued}
    running = {r.job_id: r for r in snap.running}
    capacity = {n.node_id: n.capacity for n in snap.nodes}
    foreign = {n.node_id: n.capacity - _ours(snap.running, n.node_id) - n.free for n in snap.nodes}
    admitted = {a.job_id: a for a in d.admit}
    waiting = [w.job_id for w in d.waiting]

    # Every queued job is admitted, waits (at positions 1..n) or is impossible, once.
    assert sorted([*admitted, *waiting, *d.impossible]) == sorted(queued), "a job lost or doubled"
    assert [w.position for w in d.waiting] == list(range(1, len(d.waiting) + 1)), "positions"
    for job in snap.queued:
        never = not _fits(job.demand, capacity)
        assert never == (job.job_id in d.impossible), f"{job.job_id}: impossible is wrong"

    # No node over capacity, now, nor once the leaving jobs have gone and held room is taken.
    now = _used(running.values(), admitted, queued, {}, foreign)
    for node, used in now.items():
        assert _holds(capacity[node], used), f"{node} over capacity: {used} > {capacity[node]}"
    leaving = {v.victim for v in d.preempt} | {r.job_id for r in snap.running if r.leaving}
    staying = [r for r in running.values() if r.job_id not in leaving]
    later = _used(staying, admitted, queued, d.held, foreign)
    for node, used in later.items():
        assert _holds(capacity[node], used), f"{node} over capacity once held room is taken"

    # Borrowed, recomputed: a team's jobs in the order they started, each its own while what
    # it uses of its quota fits beside the jobs before it.
    after = [*running.values()]  # admitted jobs started in the order they were admitted
    after += [_as_running(queued[a.job_id], a.placed_on, snap.now + i * 1e-6)
              for i, a in enumerate(d.admit)]  # fmt: skip
    assert d.borrowed == _borrowed(after, snap.quotas), "borrowed labels"
    for team, quota in snap.quotas.items():
        own = total(r.demand.total for r in after if r.team == team and r.job_id not in d.borrowed)
        assert _within_limits(own, quota), f"team {team}'s own jobs exceed its quota"
    # Admitting a job makes no running job borrow: one admitted beyond its quota is the one that
    # borrows, and a job borrows only a resource it uses that its team's quota limits.
    lenders = _borrowed(list(running.values()), snap.quotas)
    for r in snap.running:
        assert r.job_id in lenders or r.job_id not in d.borrowed, (
            f"{r.job_id}, its team's own, borrows once {[a.job_id for a in d.admit]} are admitted"
        )
    for a in d.admit:
        assert a.borrowed == (a.job_id in d.borrowed), f"{a.job_id} admitted, labelled otherwise"
    for r in after:
        limits = snap.quotas.get(r.team or "", {})
        assert r.job_id not in d.borrowed or any(r.demand.total.get(k) > 0 for k in limits), (
            f"{r.job_id} borrows, but uses nothing its team's quota limits"
        )

    usage = {}  # what each team runs, is admitted and holds room for, after this decision
    for r in after:
        usage[r.team] = usage.get(r.team, Resources()) + r.demand.total
    for job_id in d.held:
        job = queued[job_id]
        usage[job.team] = usage.get(job.team, Resources()) + job.demand.total

    def within(job: QueuedJob) -> bool:
        """Within its quota after this decision (its own held room not counted twice)."""
        mine = [_as_running(job, (), 0.0)] if job.job_id in d.held else []
        return _quota_ok(job, usage, mine, snap.quotas)

    def gave_way(job: QueuedJob, at_start: bool = False) -> bool:
        """Preempted for a job still waiting (at the start of the decision, or at its end)."""
        by = job.preempted_by
        waits = by in queued and by not in d.impossible
        return by is not None and waits and (at_start or by not in admitted)

    # A preempted job does not start again before the job it gave way to has started.
    for job_id in admitted:
        by = queued[job_id].preempted_by
        assert not gave_way(queued[job_id]), f"{job_id} started before {by}, which preempted it"

    # Room held and nodes kept are taken out of what anyone else could use.
    kept = {n for nodes in d.reserved.values() for n in nodes}
    free = {n: capacity[n] - used for n, used in now.items() if n not in kept}
    for job_id, spot in d.held.items():
        for node in spot:
            if node in free:
                free[node] = free[node] - queued[job_id].demand.bundle

    # Borrowing only takes what no job within its quota could use now.
    borrowers = [a for a in d.admit if a.borrowed]
    if borrowers:
        before = dict(free)
        for a in borrowers:
            for node in a.placed_on:
                before[node] = before[node] + queued[a.job_id].demand.bundle
        for job_id in waiting:
            job = queued[job_id]
            if job_id in d.held or gave_way(job, at_start=True) or not within(job):
                continue
            assert not _fits(job.demand, before), (
                f"{[a.job_id for a in borrowers]} borrowed room {job_id} (within its quota) fits"
            )

    # Preemption: allowed victims only, and each one needed (its nodes or its team's quota).
    victims: dict[str, list[RunningJob]] = {}
    for p in d.preempt:
        v, job = running[p.victim], queued[p.for_job]
        assert not v.leaving, f"{v.job_id} preempted twice"
        if v.team == job.team:
            assert mode is not WithinTeam.NEVER, f"{v.job_id} preempted by its own team"
            assert v.priority < job.priority, f"{v.job_id} preempted by a job of no higher priority"
            assert mode is WithinTeam.ALWAYS or v.resumable, f"{v.job_id} cannot resume"
            ran = snap.now - v.started_at
            assert ran >= hold - EPS, f"{v.job_id} preempted by its own team after {ran:g} s"
        else:
            assert v.job_id in lenders, f"{v.job_id} preempted but not borrowing"
        victims.setdefault(p.for_job, []).append(v)
    used: dict[str | None, Resources] = {}
    for r in snap.running:
        used[r.team] = used.get(r.team, Resources()) + r.demand.total
    # Another team's job goes only while its team, less the victims before it, is over its quota
    # in a resource it uses: its release gives the owners back some of their quota.
    for job_id, gone in victims.items():
        for i, v in enumerate(gone):
            if v.team == queued[job_id].team:
                continue
            left = used[v.team] - total(g.demand.total for g in gone[:i] if g.team == v.team)
            assert any(v.demand.total.get(k) > 0 and left.get(k) > limit + EPS
                       for k, limit in snap.quotas[v.team or ""].items()), (
                f"{v.job_id} preempted for {job_id}: its team is within its quota without it"
            )  # fmt: skip
    # Replayed in the order the jobs were served: what was free when each job made room.
    room = {n.node_id: n.free for n in snap.nodes}
    for job_id in d.served:
        job = queued[job_id]
        for node in d.reserved.get(job_id, ()):
            room.pop(node)
        if job_id in victims:
            mine = [r for r in snap.running if r.leaving and r.leaving_for == job_id]
            check_needed(job, victims[job_id], mine, room, used, snap.quotas)
        spot = admitted[job_id].placed_on if job_id in admitted else d.held.get(job_id, ())
        for node in spot:
            room[node] = room[node] - job.demand.bundle
        if spot:
            used[job.team] = used.get(job.team, Resources()) + job.demand.total

    # After the hold: nothing is placed on the nodes kept for a job (but by a job that waited
    # longer, or one whose preemptions freed room for it, served before); each such job either
    # holds room, keeps nodes, or every node that could hold it is kept or held for another.
    claims = {r.leaving_for for r in snap.running if r.leaving} | {
        j.preempted_by for j in snap.queued
    }
    for a in d.admit:
        job = queued[a.job_id]
        for holder, nodes in d.reserved.items():
            older = (job.pushed_at, job.job_id) < (queued[holder].pushed_at, holder)
            first = snap.now - job.pushed_at >= hold and older
            first |= a.job_id in claims and d.served.index(a.job_id) < d.served.index(holder)
            assert first or not set(nodes).intersection(a.placed_on), (
                f"{a.job_id} took nodes kept for {holder}, which waited longer"
            )
    held_nodes = {n for spot in d.held.values() for n in spot}
    for job_id in waiting:
        job = queued[job_id]
        if snap.now - job.pushed_at < hold or gave_way(job, at_start=True) or not within(job):
            continue
        if job_id in d.held or job_id in d.reserved:
            need = _need(job.demand)[0]
            assert all(_holds(capacity[n], need) for n in d.reserved.get(job_id, ())), "kept"
            continue
        usable = {n for n in capacity if _holds(capacity[n], _need(job.demand)[0])}
        assert usable <= kept | held_nodes, f"{job_id} waited past the hold with nothing kept"


def check_needed(
    job: QueuedJob, gone: list[RunningJob], mine: list[RunningJob],
    free: Mapping[str, Resources], used: Mapping[str | None, Resources],
    quotas: Mapping[str, Mapping[str, float]],
) -> None:  # fmt: skip
    """`job` fits once `gone` (and `mine`, leaving for it already) have left, and without any
    one of them it would not: not on the nodes, or not within its team's quota."""
    room = _released(free, [*gone, *mine])
    fits = _fits(job.demand, room) and _quota_ok(job, used, [*gone, *mine], quotas)
    assert fits, f"{job.job_id}: no room"
    for v in gone:
        rest = [g for g in gone if g is not v]
        needed = not _fits(job.demand, _released(room, [v], back=True)) or not _quota_ok(
            job, used, [*rest, *mine], quotas
        )  # fmt: skip
        assert needed, f"{v.job_id} preempted for {job.job_id} but not needed"


def _quota_ok(
    job: QueuedJob, used: Mapping[str | None, Resources], gone: Iterable[RunningJob],
    quotas: Mapping[str, Mapping[str, float]],
) -> bool:  # fmt: skip
    """`job` within its team's quota beside `used`, less what `gone` of its team hold, in each
    resource it uses (the team may be over another: not this job's doing)."""
    quota = quotas.get(job.team or "")
    wanted = used.get(job.team, Resources()) + job.demand.total
    for v in gone:
        if v.team == job.team:
            wanted = wanted - v.demand.total
    uses = {k: v for k, v in (quota or {}).items() if job.demand.total.get(k) > 0}
    return _within_limits(wanted, uses)


# -- arithmetic, written again here so the checks do not lean on the policy's -------------------


def _need(demand: Demand) -> tuple[Resources, int]:
    return (demand.total, 1) if demand.colocated else (demand.bundle, demand.nodes)


def _fits(demand: Demand, room: Mapping[str, Resources]) -> bool:
    need, count = _need(demand)
    return sum(1 for free in room.values() if _holds(free, need)) >= count


def _holds(room: Resources, need: Resources) -> bool:
    have = room.amounts
    for key, amount in need.amounts.items():
        if amount > 0 and amount > have.get(key, 0.0) + EPS:
            return False
    return True


def _within_limits(used: Resources, quota: Mapping[str, float]) -> bool:
    """A quota limits the resources it names; any other is unlimited."""
    return all(used.get(k) <= limit + EPS for k, limit in quota.items())


def _released(
    room: Mapping[str, Resources], jobs: Iterable[RunningJob], back: bool = False
) -> dict[str, Resources]:
    out = dict(room)
    for job in jobs:
        for node in job.placed_on:
            if node in out:
                b = job.demand.bundle
                out[node] = out[node] - b if back else out[node] + b
    return out


def _ours(jobs: Iterable[RunningJob], node: str) -> Resources:
    return total(j.demand.bundle for j in jobs for n in j.placed_on if n == node)


def _used(
    jobs: Iterable[RunningJob], admitted: Mapping, queued: Mapping[str, QueuedJob],
    held: Mapping[str, tuple[str, ...]], foreign: Mapping[str, Resources],
) -> dict[str, Resources]:  # fmt: skip
    used = dict(foreign)
    spots = [(j.demand.bundle, j.placed_on) for j in jobs]
    spots += [(queued[a.job_id].demand.bundle, a.placed_on) for a in admitted.values()]
    spots += [(queued[job_id].demand.bundle, spot) for job_id, spot in held.items()]
    for bundle, nodes in spots:
        for node in nodes:
            used[node] = used.get(node, Resources()) + bundle
    return used


def _as_running(job: QueuedJob, nodes: tuple[str, ...], now: float) -> RunningJob:
    return RunningJob(job.job_id, job.team, job.priority, now, job.demand, nodes)


def _borrowed(jobs: list[RunningJob], quotas: Mapping[str, Mapping[str, float]]) -> set[str]:
    """Rule 1: a team's jobs in the order they started; a job borrows where its team's use of a
    resource it takes, counting it and the jobs before it, passes the quota."""
    out: set[str] = set()
    for team, quota in quotas.items():
        used = Resources()
        for job in sorted((j for j in jobs if j.team == team),
                          key=lambda j: (j.started_at, j.job_id)):  # fmt: skip
            used = used + job.demand.total
            if any(job.demand.total.get(k) > 0 and used.get(k) > v + EPS
                   for k, v in quota.items()):  # fmt: skip
                out.add(job.job_id)
    return out
