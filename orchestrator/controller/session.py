"""Interactive sessions: whether a job's nodes stay held once its commands end, and until when.

`on_failure`: a failed command holds the nodes for `timeout_minutes`. `on_startup`: the nodes
stay until `timeout_minutes` after the commands started, however they end. `on_demand`: only as
long as `orchestrator isession --update-timeout M` asked. An `isession` request extends any of
them. While held, `orchestrator shell --job-id ID -- CMD` reaches the job's files and environment.
"""

from __future__ import annotations

from orchestrator.spec.training import InteractiveSession, InteractiveSessionTrigger
from orchestrator.storage import layout
from orchestrator.storage.root import StorageRoot

FOREVER_S = 10 * 365 * 86400


def hold_until(
    session: InteractiveSession | None,
    failed: bool,
    started_at: float,
    requested: float | None,
    now: float,
) -> float | None:
    """The time the nodes are held until, or None when they are released now."""
    until = None
    if session is not None:
        minutes = session.timeout_minutes
        length = minutes * 60 if minutes >= 0 else FOREVER_S  # Baseten: -1 is ten years
        if session.trigger == InteractiveSessionTrigger.ON_FAILURE and failed:
            until = now + length
        elif session.trigger == InteractiveSessionTrigger.ON_STARTUP:
            until = started_at + length
    if requested is not None:
        until = max(until or requested, requested)
    return until if until is not None and until > now else None


def requested_until(root: StorageRoot, job_id: str) -> float | None:
    """What `orchestrator isession --update-timeout` last asked, if anything."""
    try:
        return float(root.read_json(layout.session(job_id))["held_until"])
    except FileNotFoundError:
        return None
