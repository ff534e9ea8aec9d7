"""Who owns what: each team's use against its quota (dominant share), the fair-share order of
the queue across teams, and which running jobs borrow (rules 1 and 2 of policy.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from heapq import heapify, heappop, heappush

from orchestrator.scheduler.model import QueuedJob, RunningJob
from orchestrator.scheduler.resources import Resources

_NOTHING = Resources()


def order(
    queued: Sequence[QueuedJob],
    usage: Mapping[str | None, Resources],
    quotas: Mapping[str, Mapping[str, float]],
    cluster: Resources,
) -> list[QueuedJob]:
    """Rule 2's interleaving: each team's jobs by priority then push, the next one from the
    team furthest below its share."""
    by_team: dict[str | None, list[QueuedJob]] = {}
    for job in sorted(queued, key=lambda j: (-j.priority, j.pushed_at, j.job_id)):
        by_team.setdefault(job.team, []).append(job)
    # A team's use only grows as its jobs are ordered, so its dominant share is the larger of
    # the share before and the new job's resources' shares: no full recount per job.
    used = {team: dict(usage.get(team, _NOTHING).amounts) for team in by_team}
    limits = {team: _limits(quotas.get(team or ""), cluster) for team in by_team}
    heap = []
    for rank, (team, jobs) in enumerate(by_team.items()):
        head = jobs[0]
        share = dominant_share(usage.get(team, _NOTHING), quotas.get(team or ""), cluster)
        heap.append((share, -head.priority, head.pushed_at, rank, team, 0))
    heapify(heap)
    ordered: list[QueuedJob] = []
    while heap:
        share, _, _, rank, team, i = heappop(heap)
        jobs, mine, limit = by_team[team], used[team], limits[team]
        while True:  # this team's jobs, until another team's head goes first
            job = jobs[i]
            ordered.append(job)
            i += 1
            if i == len(jobs):
                break
            for key, amount in job.demand.total.amounts.items():
                now = mine[key] = mine.get(key, 0.0) + amount
                if amount > 0 and (most := limit.get(key)) and now / most > share:
                    share = now / most
            head = jobs[i]
            entry = (share, -head.priority, head.pushed_at, rank, team, i)
            if heap and heap[0] < entry:  # ranks differ: the comparison never reaches team
                heappush(heap, entry)
                break
    return ordered


def _limits(quota: Mapping[str, float] | None, cluster: Resources) -> dict[str, float]:
    """What each resource's share is a fraction of: the quota's limit, else the cluster's."""
    keys = set(cluster.amounts) | set(quota or ())
    return {k: (quota or {}).get(k) or cluster.get(k) for k in keys}


def dominant_share(used: Resources, quota: Mapping[str, float] | None, cluster: Resources) -> float:
    """The largest fraction of its quota (or of the cluster, where it has none) a team uses."""
    shares = [0.0]
    for key, amount in used.amounts.items():
        limit = (quota or {}).get(key) or cluster.get(key)
        if amount > 0 and limit > 0:
            shares.append(amount / limit)
    return max(shares)


def borrowed_jobs(
    running: Sequence[RunningJob], quotas: Mapping[str, Mapping[str, float]]
) -> set[str]:
    """Rule 1: per team with a quota, its jobs in the order they started; a job borrows when a
    resource it uses that the quota limits passes the limit, counting it and every job of its
    team that started before it. So a job admitted later never makes an earlier one borrow (as
    ranking by priority did), a job that uses nothing the quota limits never borrows, and a job
    becomes its team's own as the jobs before it end or the quota grows."""
    used: dict[str | None, dict[str, float]] = {}
    out: set[str] = set()
    for r in sorted(running, key=lambda r: (r.started_at, r.job_id)):
        quota = quotas.get(r.team or "")
        if not quota:
            continue
        mine, want = used.setdefault(r.team, {}), r.demand.total.amounts
        for key, limit in quota.items():
            if (amount := want.get(key, 0.0)) > 0:
                mine[key] = mine.get(key, 0.0) + amount
                if mine[key] > limit + 1e-9:
                    out.add(r.job_id)
    return out


def fits_quota(
    quota: Mapping[str, float], used: Resources, want: Resources, gone: Sequence[Resources] = ()
) -> bool:
    """Whether `want` fits `quota` beside `used` less `gone`, in each resource it uses that the
    quota limits: its team may be over another one, which is not this job's doing (rule 1)."""
    have, need = used.amounts, want.amounts  # plain dicts: asked for each of 1,000 jobs
    for key, limit in quota.items():
        if (amount := need.get(key, 0.0)) > 0:
            amount += have.get(key, 0.0)
            if gone:
                amount -= sum(g.amounts.get(key, 0.0) for g in gone)
            if amount > limit + 1e-9:
                return False
    return True


def still_over(
    quotas: Mapping[str, Mapping[str, float]], usage: Mapping[str | None, Resources],
    lender: RunningJob, without: Sequence[RunningJob],
) -> bool:  # fmt: skip
    """Whether `lender`'s team uses more than its quota of a resource `lender` uses, even
    without `without`: its release still gives the owners back some of their quota (rule 4)."""
    quota, uses = quotas.get(lender.team or "") or {}, lender.demand.total
    used = usage.get(lender.team, _NOTHING)
    gone = [v.demand.total for v in without if v.team == lender.team]
    return any(uses.get(k) > 0 and used.get(k) - sum(g.get(k) for g in gone) > limit + 1e-9
               for k, limit in quota.items())  # fmt: skip


def usage_by_team(running: Sequence[RunningJob]) -> dict[str | None, Resources]:
    usage: dict[str | None, Resources] = {}
    for r in running:
        usage[r.team] = usage.get(r.team, Resources()) + r.demand.total
    return usage
