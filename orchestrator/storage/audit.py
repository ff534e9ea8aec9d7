"""The audit trail: one event for each change made through us (a push, a stop, a secret set, a
quota, a shell opened, ...), whoever made it and whether it worked.

Append-only: each event is its own object, created once under a name no other event can take
(its time, then random hex), never rewritten; so writers on many machines need no lock, and an
object store's conditional put keeps one from overwriting another. Events name what was
changed, never a secret's value or a command's text.
"""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict

from orchestrator.storage.parallel import parallel_map
from orchestrator.storage.root import StorageRoot

AUDIT = "audit"
_READ_WORKERS = 16


class AuditEvent(BaseModel):
    """What was done, to what, by whom and from where, and how it ended."""

    model_config = ConfigDict(frozen=True)

    at: float  # unix time, when it ended
    verb: str  # push, stop, update, secrets set, capacity set, shell, ...
    result: str  # "ok", or "failed: <why, one line>"
    user: str  # the OS user who ran it
    host: str  # the machine it ran on
    job: str | None = None
    project: str | None = None
    team: str | None = None
    target: str | None = None  # what else it changed: a secret's name, a deployment, a quota
    detail: str | None = None  # e.g. "priority 5", "terminal", "90 minutes"


def event_path(at: float) -> str:
    """A name of its own, sorted by time: audit/<YYYY-MM>/<unix time, 6 decimals>-<hex>.json."""
    month = time.strftime("%Y-%m", time.gmtime(at))
    return f"{AUDIT}/{month}/{at:017.6f}-{uuid.uuid4().hex[:12]}.json"


def append(root: StorageRoot, event: AuditEvent) -> None:
    """Record `event` (created, never replacing another)."""
    body = event.model_dump(exclude_none=True)
    while True:
        path = event_path(event.at)
        # Not created: ours already (a retried put whose first reply was lost), or another
        # event's (the same microsecond and 48 random bits), then under another name.
        if root.create_json(path, body) or root.read_json(path) == body:
            return


def read(
    root: StorageRoot,
    *,
    job: str | None = None,
    project: str | None = None,
    team: str | None = None,
    since: float | None = None,
) -> list[AuditEvent]:
    """The events that match every filter given, oldest first."""
    months = root.list_names(AUDIT)
    if since is not None:
        first = time.strftime("%Y-%m", time.gmtime(since))
        months = [m for m in months if m >= first]
    paths = [f"{AUDIT}/{m}/{n}" for m in months for n in root.list_names(f"{AUDIT}/{m}")
             if n.endswith(".json")]  # fmt: skip
    events = parallel_map(lambda p: AuditEvent.model_validate(root.read_json(p)), paths,
                          _READ_WORKERS)  # fmt: skip
    return sorted(
        (e for e in events
         if (job is None or e.job == job) and (project is None or e.project == project)
         and (team is None or e.team == team) and (since is None or e.at >= since)),
        key=lambda e: e.at,
    )  # fmt: skip
