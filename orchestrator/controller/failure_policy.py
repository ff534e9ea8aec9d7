"""What a fault means for a job: retry it, retry after a wait, or end it.

Pure: the controller records each attempt's fault and asks `FailurePolicy.decide`; nothing here
touches Ray, so every rule is tested directly (tests/test_failure_policy.py), as Ray Train v2's
FailurePolicy/FailureDecision are. The rules (docs/architecture.md#faults-and-retries):

- a lost node or node agent is the cluster's fault: retried while `retries` lasts;
- a preemption (a node drained for preemption) is expected on spot capacity: retried without
  using `retries`, up to `max_preemptions`, after which the job ends PREEMPTED;
- a start command that exits non-zero usually fails again: retried only with
  `retry_on_failure`, after `delay_s`, and it uses `retries`;
- a checkpoint directory over `volume_size_gib` is never retried;
- a stuck attempt (a rank silent for its window, controller/stuck.py) is retried while
  `retries` lasts, but a second stuck attempt in a row with no checkpoint stored between them
  ends the job (a retry would only hang again where it did);
- a job past its `max_duration` (controller/time_limit.py) is never retried: it ends FAILED;
- a stop by the user is never retried.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.lifecycle import FaultKind, JobState
from orchestrator.storage.records import RetryPolicy

INFRASTRUCTURE = frozenset({FaultKind.NODE_LOST, FaultKind.AGENT_LOST})
NEVER_RETRIED = frozenset({FaultKind.STOPPED, FaultKind.OVER_VOLUME, FaultKind.MAX_DURATION})


@dataclass(frozen=True)
class Fault:
    """How one attempt ended badly, with what the user needs to know of it."""

    kind: FaultKind
    reason: str  # in words: "rank 1's node 3f2a... was removed"
    rank: int | None = None
    node_id: str | None = None
    deadline: float = 0.0  # a preemption notice's: when the nodes go (epoch seconds)
    checkpoint: str | None = None  # STUCK: the job's newest stored checkpoint at the time


class Action(str, enum.Enum):
    RETRY = "retry"  # at once: replace what was lost, run every rank again
    WAIT = "wait"  # retry after `delay_s`
    END = "end"  # the job ends in `FailureDecision.state`


@dataclass(frozen=True)
class FailureDecision:
    action: Action
    why: str  # "retry 1 of 2", "retries spent (2 of 2)", ...
    state: JobState | None = None  # the job's end, for END
    delay_s: float = 0.0


class FailurePolicy:
    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy

    def decide(self, fault: Fault, earlier: Sequence[Fault] = ()) -> FailureDecision:
        """What follows `fault`, given the faults of the attempts before it."""
        policy, kind = self.policy, fault.kind
        if kind == FaultKind.STOPPED:
            return FailureDecision(Action.END, "stopped by user", JobState.STOPPED)
        if kind == FaultKind.OVER_VOLUME:
            why = "a checkpoint directory over volume_size_gib is not retried"
            return FailureDecision(Action.END, why, JobState.FAILED)
        if kind == FaultKind.MAX_DURATION:
            why = "a job past its max_duration is not retried"
            return FailureDecision(Action.END, why, JobState.FAILED)
        if kind == FaultKind.PREEMPTED:
            used = sum(f.kind == FaultKind.PREEMPTED for f in earlier) + 1
            if used > policy.max_preemptions:
                why = f"preempted {used} times, more than max_preemptions={policy.max_preemptions}"
                return FailureDecision(Action.END, why, JobState.PREEMPTED)
            why = f"preemption {used} of at most {policy.max_preemptions}; not counted in retries"
            return FailureDecision(Action.RETRY, why)
        if kind == FaultKind.COMMAND_FAILED and not policy.retry_on_failure:
            why = "a failed command is not retried without retry_on_failure"
            return FailureDecision(Action.END, why, JobState.FAILED)
        if kind == FaultKind.STUCK and _stuck_again(fault, earlier):
            why = "stuck twice in a row with no checkpoint stored between the attempts"
            return FailureDecision(Action.END, why, JobState.FAILED)
        used = sum(f.kind != FaultKind.PREEMPTED for f in earlier) + 1
        if used > policy.retries:
            why = f"retries spent ({policy.retries} of {policy.retries})"
            if not policy.retries:
                why = "the job allows no retries (--retries, ORCHESTRATOR_MAX_RETRIES)"
            return FailureDecision(Action.END, why, JobState.FAILED)
        why = f"retry {used} of {policy.retries}"
        if kind == FaultKind.COMMAND_FAILED:
            return FailureDecision(Action.WAIT, why, delay_s=policy.delay_s)
        return FailureDecision(Action.RETRY, why)


def _stuck_again(fault: Fault, earlier: Sequence[Fault]) -> bool:
    """The attempt before was stuck too, and no checkpoint was stored since."""
    last = earlier[-1] if earlier else None
    return last is not None and last.kind == FaultKind.STUCK and last.checkpoint == fault.checkpoint
