"""Whom a job preempts: the order victims go in, and the minimal set whose release lets it
start (rule 4 of policy.py), as Kueue's minimal preemptions."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from orchestrator.scheduler.fitting import Room
from orchestrator.scheduler.model import QueuedJob, RunningJob
from orchestrator.scheduler.resources import Resources


def minimal_victims(
    job: QueuedJob, base: Mapping[str, Resources], candidates: Sequence[RunningJob],
    leaving: Sequence[RunningJob], useful: set[str], fitting: set[str] | None,
    within: Callable[[Sequence[RunningJob]], bool],
    over_quota: Callable[[str | None, Sequence[RunningJob]], bool],
) -> list[RunningJob] | None:  # fmt: skip
    """A minimal set of `candidates` whose release lets `job` start: added in order until it
    fits, then each one it fits without is dropped again. Another team's job counts only while
    its team, without the victims before it, is still over its quota (`over_quota`). `useful`:
    the nodes that could hold one of its bundles; `fitting`: those that hold one now (None:
    work it out, as when `leaving` jobs change `base`); `within(victims)`: whether the job fits
    its team's quota once `victims` are gone. None: no such set."""
    candidates = [c for c in candidates if not useful.isdisjoint(c.placed_on)]
    if not candidates:
        return None
    if not within([*candidates, *leaving]):
        return None  # not even all of them would bring it within its quota
    room = Room(job.demand, base, useful, fitting)
    everyone = Room(job.demand, base, useful, room.fitting)
    for c in candidates:
        everyone.release(c)
    if not everyone.fits():
        return None  # not even all of them would free enough
    chosen: list[RunningJob] = []
    for c in candidates:
        if c.team != job.team and not over_quota(c.team, chosen):
            continue
        chosen.append(c)
        room.release(c)
        if room.fits() and within([*chosen, *leaving]):
            break
    else:
        return None
    for v in reversed(chosen[:-1]):
        trial = [c for c in chosen if c is not v]
        room.release(v, back=True)
        if room.fits() and within([*trial, *leaving]):
            chosen = trial
        else:
            room.release(v)
    return chosen


def victim_order(jobs: list[RunningJob]) -> list[RunningJob]:
    return sorted(jobs, key=lambda r: (r.priority, -r.started_at, r.job_id))


def why_preempted(victim: RunningJob, job: QueuedJob) -> str:
    if victim.team != job.team:
        return "borrowed capacity its team's quota needs"
    return f"priority {victim.priority} is below its priority {job.priority}"
