"""Whom a job preempts: the order victims go in, the minimal set whose release lets it start
(rule 4 of policy.py, as Kueue's minimal preemptions), and why a teammate is spared."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from orchestrator import settings
from orchestrator.scheduler.fitting import Room
from orchestrator.scheduler.model import QueuedJob, RunningJob, WithinTeam
from orchestrator.scheduler.reasons import spared_text
from orchestrator.scheduler.resources import Resources

HOLD_SETTING = settings.QUEUE_HOLD_AFTER_S.name


def minimal_victims(
    job: QueuedJob, base: Mapping[str, Resources], candidates: Sequence[RunningJob],
    leaving: Sequence[RunningJob], useful: set[str], fitting: set[str] | None,
    within: Callable[[Sequence[RunningJob]], bool],
    over_quota: Callable[[RunningJob, Sequence[RunningJob]], bool],
) -> list[RunningJob] | None:  # fmt: skip
    """A minimal set of `candidates` whose release lets `job` start: added in order until it
    fits, then each one it fits without is dropped again. Another team's job counts only while
    its team, without the victims before it, is still over its quota in a resource that job
    uses (`over_quota`). `useful`: the nodes that could hold one of its bundles; `fitting`:
    those that hold one now (None: work it out, as when `leaving` jobs change `base`);
    `within(victims)`: whether the job fits its team's quota once `victims` are gone. None: no
    such set."""
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
        if c.team != job.team and not over_quota(c, chosen):
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


def why_spared(victim: RunningJob, mode: WithinTeam, ran_s: float, hold_s: float) -> str | None:
    """Why a lower-priority job of the preempting job's team stays (None: it may go): `mode`
    forbids it, or it has run less than `hold_s`. Else a job the hold started (rule 5) could be
    started and stopped for ever by a busy team, each time before its first checkpoint."""
    if mode is WithinTeam.NEVER or (mode is WithinTeam.RESUMABLE and not victim.resumable):
        return spared_text(mode)
    if ran_s < hold_s - 1e-6:
        return (f"it has run {int(max(ran_s, 0.0))} s, and a job runs {HOLD_SETTING} "
                f"({hold_s:g} s) before its own team may preempt it")  # fmt: skip
    return None


def would_make_room(whys: Mapping[str, str]) -> str:
    """What a waiting job adds to its reason when preempting the spared teammates (job -> why)
    would make room: the reason they share, else each one's."""
    if len(set(whys.values())) == 1:
        why = next(iter(whys.values()))
    else:
        why = "; ".join(f"{job}: {why}" for job, why in whys.items())
    return f"; preempting {', '.join(whys)} of its own team would make room, but {why}"
