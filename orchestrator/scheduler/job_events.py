"""The events a job's durable status says happened, for webhooks (scheduler/webhooks.py): pure,
so a restarted queue service derives the same events, with the same ids, from the same status.

- **preempted**: an attempt ended by a node's preemption (`preempted`) or by the queue giving its
  nodes to another job (`preempted_by_job`); the PREEMPTED end is its last attempt's event,
  marked `final`.
- **stuck**: an attempt ended because a rank made no progress (`stuck`).
- **failed**: the job ended FAILED or DEPLOY_FAILED. **completed**: it ended COMPLETED.

An attempt's event is derived once the job has moved on from it (a later attempt, or a state
other than RUNNING), so the state it carries says what followed. Ids are
`<job_id>:<attempt>:<kind>`, one per attempt and kind; a STOPPED job tells nothing.
"""

from __future__ import annotations

from orchestrator.lifecycle import FaultKind, JobState
from orchestrator.storage.notify_store import EventKind, NotifyEvent
from orchestrator.storage.records import Attempt, JobRecord, JobStatus

_ATTEMPT_KINDS = {
    FaultKind.PREEMPTED.value: EventKind.PREEMPTED,
    FaultKind.PREEMPTED_BY_JOB.value: EventKind.PREEMPTED,
    FaultKind.STUCK.value: EventKind.STUCK,
}
_ENDS = {
    JobState.COMPLETED: EventKind.COMPLETED,
    JobState.FAILED: EventKind.FAILED,
    JobState.DEPLOY_FAILED: EventKind.FAILED,
    JobState.PREEMPTED: EventKind.PREEMPTED,
}


def events_of(record: JobRecord, status: JobStatus) -> list[NotifyEvent]:
    """The job's events so far, in the order they happened (each event keeps its place as the
    status grows: attempts are only appended, and the end comes last)."""
    found: list[NotifyEvent] = []
    attempts = status.attempts
    for i, attempt in enumerate(attempts):
        kind = _ATTEMPT_KINDS.get(str(attempt.cause)) if attempt.cause is not None else None
        moved_on = i < len(attempts) - 1 or status.state != JobState.RUNNING
        if kind is None or attempt.ended_at is None or not moved_on:
            continue
        last = i == len(attempts) - 1
        final = last and status.state == JobState.PREEMPTED and kind is EventKind.PREEMPTED
        found.append(_event(record, status, kind, attempt, attempt.ended_at, final))
    end = _ENDS.get(status.state)
    if end is not None:
        last_attempt = attempts[-1] if attempts else None
        event = _event(record, status, end, last_attempt, _entered(status), True)
        if all(e.id != event.id for e in found):  # PREEMPTED: its last attempt's event already
            found.append(event)
    return found


def _event(
    record: JobRecord, status: JobStatus, kind: EventKind, attempt: Attempt | None, at: float,
    final: bool,
) -> NotifyEvent:  # fmt: skip
    number = attempt.number if attempt is not None else 0
    if kind in (EventKind.PREEMPTED, EventKind.STUCK) and attempt is not None:
        reason = attempt.reason
    elif kind is EventKind.FAILED and status.failure is not None:
        reason = status.failure.cause
    else:
        reason = None
    return NotifyEvent(
        id=f"{record.job_id}:{number}:{kind.value}", kind=kind.value, job_id=record.job_id,
        project=record.project, team=record.team, job_name=record.job_name,
        state=status.state.value, attempt=number,
        cause=str(attempt.cause) if attempt is not None and attempt.cause is not None else None,
        reason=reason, at=at, final=final, links=_links(record),
    )  # fmt: skip


def _entered(status: JobStatus) -> float:
    """When the job entered its current state."""
    for event in reversed(status.history):
        if event.state == status.state:
            return event.at
    return status.history[-1].at


def _links(record: JobRecord) -> dict[str, str]:
    """The job's page in the Ray dashboard, where it was pushed through the dashboard."""
    address = (record.ray_address or "").rstrip("/")
    if not address.startswith(("http://", "https://")):
        return {}
    return {"dashboard": f"{address}/#/jobs/{record.job_id}"}
