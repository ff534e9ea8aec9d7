"""The job lifecycle: states and the transitions allowed between them (docs/architecture.md)."""

from __future__ import annotations

import enum


class JobState(str, enum.Enum):
    CREATED = "CREATED"  # record and code archive stored; nothing reserved yet
    PENDING = "PENDING"  # the placement group cannot be placed yet (reason recorded)
    DEPLOYING = "DEPLOYING"  # nodes reserved and being prepared
    RUNNING = "RUNNING"  # start_commands executing
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    DEPLOY_FAILED = "DEPLOY_FAILED"
    STOPPED = "STOPPED"
    PREEMPTED = "PREEMPTED"  # its nodes were preempted more often than the job allows

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


class FaultKind(str, enum.Enum):
    """What ended an attempt of the job's commands (recorded as `Attempt.cause`)."""

    NODE_LOST = "node_lost"  # a node of the job's placement group died or was removed
    AGENT_LOST = "agent_lost"  # a node agent's worker died; its node lives on
    PREEMPTED = "preempted"  # a node was drained with a preemption notice
    COMMAND_FAILED = "command_failed"  # a start command exited non-zero
    STOPPED = "stopped"  # by the user
    # The queue gave its nodes to another job (scheduler/policy.py): back in the queue, not a
    # fault of the job's or the cluster's, so no retry is used (controller/attempts.py).
    PREEMPTED_BY_JOB = "preempted_by_job"
    # A rank's checkpoint directory holds more than volume_size_gib: never retried (the same
    # code fills it again).
    OVER_VOLUME = "over_volume"
    # A rank made no progress for its window (controller/stuck.py): every rank's stacks are
    # stored with the job; retried while `retries` lasts, but not twice in a row without a
    # checkpoint between.
    STUCK = "stuck"
    # The job held its nodes for its `max_duration` (controller/time_limit.py): never retried
    # (a retry would only run past the same limit); queued time does not count.
    MAX_DURATION = "max_duration"


# A job whose commands all exited 0 but whose checkpoints were not all stored ends COMPLETED
# with this exit code (the controller's, and `orchestrator push --tail`'s): not a plain success.
CHECKPOINTS_NOT_STORED_EXIT = 3
# A job whose commands all exited 0 but whose final status or logs could not be stored (the
# storage root refused them, or stayed unreachable): what could not is in its Ray job log.
OUTCOME_NOT_STORED_EXIT = 4

TERMINAL_STATES = frozenset(
    {
        JobState.COMPLETED,
        JobState.FAILED,
        JobState.DEPLOY_FAILED,
        JobState.STOPPED,
        JobState.PREEMPTED,
    }
)

_ENDINGS = {JobState.FAILED, JobState.STOPPED}
# A fault while RUNNING that the job's retry policy retries goes back to PENDING (waiting for a
# lost rank's replacement, or the retry delay), then DEPLOYING (controller/attempts.py).
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.CREATED: frozenset(
        {JobState.PENDING, JobState.DEPLOYING, JobState.DEPLOY_FAILED, *_ENDINGS}
    ),
    JobState.PENDING: frozenset({JobState.DEPLOYING, JobState.DEPLOY_FAILED, *_ENDINGS}),
    # DEPLOYING -> PENDING: a lost rank's replacement was lost too while being prepared.
    JobState.DEPLOYING: frozenset(
        {JobState.RUNNING, JobState.PENDING, JobState.DEPLOY_FAILED, *_ENDINGS}
    ),
    JobState.RUNNING: frozenset(
        {JobState.COMPLETED, JobState.PENDING, JobState.PREEMPTED, *_ENDINGS}
    ),
    **{state: frozenset() for state in TERMINAL_STATES},
}


class IllegalTransition(RuntimeError):
    """A bug: the controller tried a transition the state machine does not allow."""


def check_transition(current: JobState, new: JobState) -> None:
    if new not in TRANSITIONS[current]:
        raise IllegalTransition(f"a job cannot go from {current.value} to {new.value}")
