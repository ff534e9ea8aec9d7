"""Why a job waits, in a user's words: the texts of the policy's reasons (`queue`, `view`)."""

from __future__ import annotations

from collections.abc import Mapping

from orchestrator import settings
from orchestrator.scheduler.fitting import needs
from orchestrator.scheduler.model import Demand, WithinTeam
from orchestrator.scheduler.resources import Resources, describe

WITHIN_TEAM_SETTING = settings.QUEUE_PREEMPT_WITHIN_TEAM.name


def needs_text(demand: Demand) -> str:
    """ "needs 2 nodes with 8 H100, 32 CPU" """
    need, count = needs(demand)
    return f"needs {count} node{'s' if count > 1 else ''} with {need.describe()}"


def room_text(needs: str, fitting: int, kept: bool) -> str:
    """How many nodes could take the job now; `kept`: some are kept for jobs past the hold."""
    text = f"{needs} free: {fitting} such node{'' if fitting == 1 else 's'} free"
    return text + (" (not counting nodes kept for jobs that waited longest)" if kept else "")


def quota_text(
    team: str | None, quota: Mapping[str, float], used: Resources, want: Resources, room: str
) -> str:
    """Why a job beyond its team's quota waits: the quota it would pass, and no idle room."""
    over = [k for k in quota if used.get(k) + want.get(k) > quota[k] + 1e-9]
    key = over[0] if over else next(iter(quota))
    return (
        f"team {team} is at its quota of {describe({key: quota[key]})} "
        f"({used.get(key):g} in use) and the cluster has no idle capacity to lend: {room}"
    )


def spared_text(mode: WithinTeam) -> str:
    """Why jobs of a team were not preempted for a higher-priority job of the same team."""
    if mode is WithinTeam.NEVER:
        return f"preemption within a team is off ({WITHIN_TEAM_SETTING}={mode.value})"
    return (
        f"they have no checkpointing and would lose their work ({WITHIN_TEAM_SETTING}={mode.value})"
    )


def never_fits_cause(why: str) -> str:
    """A job's DEPLOY_FAILED cause when it fits the cluster not even when it is idle."""
    autoscales = settings.CLUSTER_AUTOSCALES.name
    return (
        f"cannot be placed on this cluster even when it is idle: {why}. If nodes join on "
        f"demand (an autoscaler), set {autoscales}=1 in the head node's `ray start` "
        "environment and such a job waits for them"
    )


def queue_timeout_cause(timeout_s: float, why: str) -> str:
    """A job's DEPLOY_FAILED cause when it waited past its queue timeout."""
    return (
        f"waited in the queue longer than its {timeout_s:g} s queue timeout "
        f"({settings.QUEUE_TIMEOUT_S.name}): {why}"
    )
