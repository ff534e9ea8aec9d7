"""A job's time limit (`TimeLimitWatcher`): `max_duration` of holding its nodes, then FAILED.

The clock runs only while the job holds its nodes: from each admission by the queue to the
release of its nodes (`JobStatus.holds`, one `Hold` per admission), so neither the first wait in
the queue nor the wait after a queue preemption counts; a retry's wait for a lost rank's
replacement does (the job keeps its other nodes meanwhile). `held_seconds` is that sum, pure
(tests/test_time_limit.py).

At the limit the watcher answers a `max_duration` fault at the attempt's next poll (the loop
polls every 0.2 s, controller/attempts.py): the failure policy never retries it, so the job's
end sends every rank's commands SIGTERM (SIGKILL 10 s later), flushes the checkpoints and
records FAILED with the cause `max_duration 2h reached (...)`. A poll that shows the ranks
ended (or one failed) is left to their own end: commands that finish just past the limit
complete. Between attempts (a retry being placed and prepared) nothing runs to stop: a limit
passed then is acted on at the next attempt's first poll.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from orchestrator.controller.failure_policy import Fault, FaultKind
from orchestrator.controller.rank_group import GroupPoll
from orchestrator.controller.watchers import WatchScope, register
from orchestrator.lifecycle import JobState
from orchestrator.spec.durations import format_duration, spelled
from orchestrator.storage.records import Hold, JobStatus, StatusEvent


def held_seconds(holds: Sequence[Hold], now: float) -> float:
    """Seconds the job held its nodes by `now`, over every admission. An open hold (`until`
    None) runs to `now` if it is the last, else to the next admission (a controller that died
    holding it left it open)."""
    total = 0.0
    for i, hold in enumerate(holds):
        until = hold.until
        if until is None:
            until = holds[i + 1].since if i + 1 < len(holds) else now
        total += max(0.0, min(until, now) - hold.since)
    return total


REQUEUED = "back in the queue"  # how a queue preemption's PENDING reason ends
QUEUED = "waiting in the queue"  # how the queue's own reasons start (they replace that one)


def held_from_history(history: Sequence[StatusEvent], now: float) -> float:
    """For a status without holds (written before they were): the time from each DEPLOYING
    that followed a wait in the queue until the job went back in the queue or ended."""
    total, since = 0.0, None
    for event in history:
        if since is None and event.state == JobState.DEPLOYING:
            since = event.at
        elif since is not None and (event.state.is_terminal or _requeued(event)):
            total += max(0.0, event.at - since)
            since = None
    if since is not None:
        total += max(0.0, now - since)
    return total


def _requeued(event: StatusEvent) -> bool:
    reason = event.reason or ""
    return event.state == JobState.PENDING and (
        reason.endswith(REQUEUED) or reason.startswith(QUEUED)
    )


def held_time(status: JobStatus, now: float) -> float:
    """What the job's time limit counts: its holds, else what its history shows."""
    if status.holds:
        return held_seconds(status.holds, now)
    return held_from_history(status.history, now)


def limit_cause(max_duration: str | float | int, held_s: float, waited_s: float) -> str:
    """`max_duration 2h reached (held its nodes 2h 0m; 5m 3s queued, not counted)`."""
    waited = f"{format_duration(waited_s)} queued, not counted" if waited_s >= 1 else (
        "queued time not counted"
    )  # fmt: skip
    return (
        f"max_duration {spelled(max_duration)} reached (held its nodes "
        f"{format_duration(held_s)}; {waited})"
    )


@register
class TimeLimitWatcher:
    """The job held its nodes for its `max_duration`: the fault `max_duration`, never retried."""

    def __init__(self, scope: WatchScope) -> None:
        self.job = scope.job
        spec = scope.job.record.spec.job
        self.max_duration = spec.max_duration
        self.limit_s = spec.max_duration_s
        self.checkpointing = spec.runtime.checkpointing_config.enabled

    def watch(self, poll: GroupPoll) -> Fault | None:
        if self.limit_s is None or self.max_duration is None:
            return None
        if poll.ended or poll.failed is not None:  # the ranks' own end, in this poll, is theirs
            return None
        now = time.time()
        held = held_time(self.job.status, now)
        if held < self.limit_s:
            return None
        waited = max(0.0, now - self.job.record.created_at - held)
        uploads = " and its checkpoints uploaded" if self.checkpointing else ""
        self.job.say(
            f"max_duration {spelled(self.max_duration)} reached: SIGTERM to every rank's "
            f"commands; the job ends FAILED once they are stopped{uploads}"
        )
        return Fault(FaultKind.MAX_DURATION, limit_cause(self.max_duration, held, waited))
