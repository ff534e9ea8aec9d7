"""Which queued jobs start, which running jobs give way, and why every other job waits.

Pure: the queue service hands `SchedulingPolicy.decide` a snapshot (queued jobs, running jobs and
where their bundles are, each node's capacity and free resources, the teams' quotas) and carries
out the `Decision`. The rules, in the order they apply:

1. Order. Within a team: higher `priority` first, then earlier push. Across teams the next job is
   the head of the team furthest below its share (dominant-resource share: the largest fraction
   of its quota, or of the cluster for a resource without a quota, that the team uses, counting
   jobs already ordered before); ties go to the higher priority, then the earlier push.
2. Admission, in that order: a job starts when its bundles fit the nodes' free resources (one
   node per bundle, several nodes each their own). Within its team's quota it runs as its own;
   beyond it, it *borrows* idle capacity.
3. Preemption. A job within its quota that does not fit may preempt borrowed jobs of other teams;
   a job may preempt lower-priority jobs of its own team. Victims go lowest priority first, then
   most recently started, only as many as make it fit; what they free is held for that job.
4. No starvation. Once a job within its quota has waited `hold_after_s` (from its push) without
   starting, nothing after it in the order starts until it has: what frees up meanwhile is held
   for it. Its wait is bounded by the jobs ahead of it and the running jobs' run times.
5. A job that does not fit the cluster even empty can never start (unless the cluster autoscales).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from orchestrator.scheduler.resources import GPU_PREFIX, Resources, describe, total

DEFAULT_HOLD_AFTER_S = 600.0


@dataclass(frozen=True)
class Demand:
    """`nodes` bundles of `bundle`: each on its own node, or all on one when `colocated`."""

    bundle: Resources
    nodes: int = 1
    colocated: bool = False

    @cached_property
    def total(self) -> Resources:
        return self.bundle * self.nodes

    @cached_property
    def key(self) -> tuple:
        return tuple(sorted(self.bundle.amounts.items())), self.nodes, self.colocated


@dataclass(frozen=True)
class QueuedJob:
    job_id: str
    team: str | None
    priority: int
    pushed_at: float
    demand: Demand


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    team: str | None
    priority: int
    started_at: float
    demand: Demand
    placed_on: tuple[str, ...]  # the node of each bundle
    borrowed: bool = False
    leaving: bool = False  # preempted or stopping: what it holds is about to be free


@dataclass(frozen=True)
class Node:
    node_id: str
    capacity: Resources
    free: Resources


@dataclass(frozen=True)
class ClusterSnapshot:
    queued: Sequence[QueuedJob]
    running: Sequence[RunningJob]
    nodes: Sequence[Node]
    quotas: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # team -> limits
    now: float = 0.0
    autoscaling: bool = False  # more nodes may come: nothing is impossible


@dataclass(frozen=True)
class Admit:
    job_id: str
    placed_on: tuple[str, ...]
    borrowed: bool


@dataclass(frozen=True)
class Preempt:
    victim: str
    for_job: str
    reason: str  # "preempted by <job>: ..."


@dataclass(frozen=True)
class Waiting:
    job_id: str
    position: int  # 1 = next to start
    reason: str


@dataclass(frozen=True)
class Decision:
    admit: list[Admit] = field(default_factory=list)
    preempt: list[Preempt] = field(default_factory=list)
    waiting: list[Waiting] = field(default_factory=list)
    impossible: dict[str, str] = field(default_factory=dict)  # job id -> why


class SchedulingPolicy:
    def __init__(self, hold_after_s: float = DEFAULT_HOLD_AFTER_S) -> None:
        self.hold_after_s = hold_after_s

    def decide(self, snap: ClusterSnapshot) -> Decision:
        decision = Decision()
        free = {n.node_id: n.free for n in snap.nodes}
        capacity = {n.node_id: n.capacity for n in snap.nodes}
        usage = _usage(snap.running)
        running = [r for r in snap.running if not r.leaving]
        leaving = [r for r in snap.running if r.leaving]
        holder: QueuedJob | None = None
        position = 0
        # Jobs alike (same demand, team, priority, quota standing) fare alike until something
        # is admitted or preempted: remember why they wait (1,000 queued jobs, few shapes).
        unplaceable: dict[tuple, str] = {}
        never: dict[tuple, str | None] = {}  # by demand: why it fits no node even when empty
        for job in order(snap.queued, usage, snap.quotas, _cluster_total(snap.nodes)):
            if job.demand.key not in never:
                empty = snap.autoscaling or place(job.demand, capacity) is not None
                never[job.demand.key] = None if empty else never_fits(job.demand, snap.nodes)
            if never[job.demand.key] is not None:
                decision.impossible[job.job_id] = str(never[job.demand.key])
                continue
            position += 1
            within = _within_quota(job, usage, snap.quotas)
            if holder is not None:
                decision.waiting.append(Waiting(job.job_id, position, _held(holder, snap.now)))
                continue
            alike = (job.demand.key, job.team, job.priority, within)
            reason = unplaceable.get(alike)
            if reason is None:
                spot = place(job.demand, free)
                if spot is not None:
                    decision.admit.append(Admit(job.job_id, spot, borrowed=not within))
                    _take(free, job.demand, spot)
                    usage[job.team] = usage.get(job.team, Resources()) + job.demand.total
                    unplaceable.clear()
                    continue
                reason = self._make_room(job, within, free, running, leaving, decision)
                if reason is None:
                    reason = _why_waiting(job, within, usage, snap, free)
                    unplaceable[alike] = reason
                else:
                    unplaceable.clear()
            decision.waiting.append(Waiting(job.job_id, position, reason))
            if within and snap.now - job.pushed_at >= self.hold_after_s:
                holder = job
        return decision

    def _make_room(
        self,
        job: QueuedJob,
        within: bool,
        free: dict[str, Resources],
        running: list[RunningJob],
        leaving: list[RunningJob],
        decision: Decision,
    ) -> str | None:
        """Room for `job` from jobs already leaving, else from jobs it may preempt; what it
        finds is held for it. None: no room can be made."""
        freed = _with_released(free, leaving)
        spot = place(job.demand, freed)
        if spot is not None:
            _take(free, job.demand, spot)  # held: nothing after it takes those nodes
            return "waiting for preempted jobs to leave"
        victims: list[RunningJob] = []
        for candidate in _candidates(job, within, running):
            victims.append(candidate)
            spot = place(job.demand, _with_released(freed, victims))
            if spot is None:
                continue
            for v in victims:
                running.remove(v)
                why = "borrowed capacity its team's quota needs" if v.team != job.team else (
                    f"priority {v.priority} is below its priority {job.priority}"
                )  # fmt: skip
                decision.preempt.append(Preempt(v.job_id, job.job_id,
                                                f"preempted by {job.job_id}: {why}"))  # fmt: skip
                leaving.append(v)
            _take(free, job.demand, spot)
            return f"preempting {', '.join(v.job_id for v in victims)} to make room"
        return None


def order(
    queued: Sequence[QueuedJob],
    usage: Mapping[str | None, Resources],
    quotas: Mapping[str, Mapping[str, float]],
    cluster: Resources,
) -> list[QueuedJob]:
    """Rule 1: the queue as it will be served."""
    by_team: dict[str | None, list[QueuedJob]] = {}
    for job in sorted(queued, key=lambda j: (-j.priority, j.pushed_at, j.job_id)):
        by_team.setdefault(job.team, []).append(job)
    used = {team: usage.get(team, Resources()) for team in by_team}

    def share(team: str | None) -> float:
        return dominant_share(used[team], quotas.get(team or ""), cluster)

    shares = {team: share(team) for team in by_team}
    ordered: list[QueuedJob] = []
    while by_team:
        team = min(by_team, key=lambda t: (shares[t], -by_team[t][0].priority,
                                           by_team[t][0].pushed_at))  # fmt: skip
        job = by_team[team].pop(0)
        ordered.append(job)
        if not by_team[team]:
            del by_team[team]
            continue
        used[team] = used[team] + job.demand.total
        shares[team] = share(team)
    return ordered


def dominant_share(used: Resources, quota: Mapping[str, float] | None, cluster: Resources) -> float:
    """The largest fraction of its quota (or of the cluster, where it has none) a team uses."""
    shares = [0.0]
    for key, amount in used.amounts.items():
        limit = (quota or {}).get(key) or cluster.get(key)
        if amount > 0 and limit > 0:
            shares.append(amount / limit)
    return max(shares)


def place(demand: Demand, free: Mapping[str, Resources]) -> tuple[str, ...] | None:
    """Nodes for the bundles (best fit: the fullest node that fits first), or None."""
    need = demand.total if demand.colocated else demand.bundle
    count = 1 if demand.colocated else demand.nodes
    fitting = [n for n, room in free.items() if need.fits_in(room)]
    if len(fitting) < count:
        return None
    key = _main_key(need)
    fitting.sort(key=lambda n: (free[n].get(key), n))
    chosen = tuple(fitting[:count])
    return chosen * demand.nodes if demand.colocated else chosen


def never_fits(demand: Demand, nodes: Sequence[Node]) -> str:
    need = demand.total if demand.colocated else demand.bundle
    count = 1 if demand.colocated else demand.nodes
    fitting = sum(1 for n in nodes if need.fits_in(n.capacity))
    why = (
        f"needs {count} node{'s' if count > 1 else ''} with {need.describe()} each; "
        f"{fitting} of the cluster's {len(nodes)} node{'' if len(nodes) == 1 else 's'} "
        f"{'has' if fitting == 1 else 'have'} "
        "that much even when empty"
    )
    have = sorted({k for n in nodes for k, v in n.capacity.amounts.items()
                   if k.startswith(GPU_PREFIX) and v > 0})  # fmt: skip
    for key in need.amounts:
        if key.startswith(GPU_PREFIX) and key not in have:
            names = ", ".join(k.removeprefix(GPU_PREFIX) for k in have) or "no GPUs"
            why += f" (no node has {key.removeprefix(GPU_PREFIX)} GPUs; the cluster has {names})"
    return why


def _main_key(need: Resources) -> str:
    gpus = [k for k, v in need.amounts.items() if k.startswith(GPU_PREFIX) and v > 0]
    return gpus[0] if gpus else "CPU"


def _take(free: dict[str, Resources], demand: Demand, spot: tuple[str, ...]) -> None:
    for node in spot:
        free[node] = free[node] - demand.bundle


def _with_released(
    free: Mapping[str, Resources], jobs: Sequence[RunningJob]
) -> dict[str, Resources]:
    out = dict(free)
    for job in jobs:
        for node in job.placed_on:
            if node in out:
                out[node] = out[node] + job.demand.bundle
    return out


def _candidates(job: QueuedJob, within: bool, running: list[RunningJob]) -> list[RunningJob]:
    """Rule 3: whom `job` may preempt, in the order they go."""
    found = [
        r for r in running
        if (within and r.borrowed and r.team != job.team)
        or (r.team == job.team and r.priority < job.priority)
    ]  # fmt: skip
    return sorted(found, key=lambda r: (r.priority, -r.started_at, r.job_id))


def _usage(running: Sequence[RunningJob]) -> dict[str | None, Resources]:
    usage: dict[str | None, Resources] = {}
    for r in running:
        usage[r.team] = usage.get(r.team, Resources()) + r.demand.total
    return usage


def _cluster_total(nodes: Sequence[Node]) -> Resources:
    return total(n.capacity for n in nodes)


def _within_quota(
    job: QueuedJob, usage: Mapping[str | None, Resources], quotas: Mapping[str, Mapping[str, float]]
) -> bool:
    quota = quotas.get(job.team or "")
    if not quota:
        return True
    used, wanted = usage.get(job.team, Resources()), job.demand.total
    return all(used.get(k) + wanted.get(k) <= limit + 1e-9 for k, limit in quota.items())


def _why_waiting(
    job: QueuedJob,
    within: bool,
    usage: Mapping[str | None, Resources],
    snap: ClusterSnapshot,
    free: Mapping[str, Resources],
) -> str:
    need = job.demand.total if job.demand.colocated else job.demand.bundle
    count = 1 if job.demand.colocated else job.demand.nodes
    fitting = sum(1 for room in free.values() if need.fits_in(room))
    room = (
        f"needs {count} node{'s' if count > 1 else ''} with {need.describe()} free: "
        f"{fitting} such node{'' if fitting == 1 else 's'} free"
    )
    if within:
        return room
    quota = snap.quotas.get(job.team or "", {})
    used = usage.get(job.team, Resources())
    over = [k for k in quota if used.get(k) + job.demand.total.get(k) > quota[k] + 1e-9]
    key = over[0] if over else next(iter(quota))
    limit = describe({key: quota[key]})
    return (
        f"team {job.team} is at its quota of {limit} ({used.get(key):g} in use) and the cluster "
        f"has no idle capacity to lend: {room}"
    )


def _held(holder: QueuedJob, now: float) -> str:
    waited = now - holder.pushed_at
    return (
        f"held behind {holder.job_id}, which has waited {waited:.0f} s: resources are kept for "
        "it until it starts"
    )
