"""What ends an attempt before its ranks do (`AttemptWatcher`): each watcher looks at every poll
of the rank group and answers a fault, or nothing; the failure policy then decides, as for a
rank's own end. Like Ray Train v2's controller callbacks, a new concern is one watcher plus one
`register` line, and the attempt loop (attempts.py) is not edited.

The first four: a stop (the user's, or the storage root lost with on_error=stop), a node being
drained (a preemption notice), the queue taking the nodes back for another job, and a
checkpoint directory over its volume.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from orchestrator import settings
from orchestrator.controller.failure_policy import Fault, FaultKind
from orchestrator.controller.job_run import JobRun
from orchestrator.controller.plan import GroupPlan
from orchestrator.controller.rank_group import GroupPoll
from orchestrator.controller.run_port import RunPort

DRAIN_POLL_S = 1.0  # how often the nodes are asked whether one is being preempted


@dataclass(frozen=True)
class WatchScope:
    """What a watcher of one attempt may look at besides the polls."""

    job: JobRun
    port: RunPort
    plan: GroupPlan


class AttemptWatcher(Protocol):
    def watch(self, poll: GroupPoll) -> Fault | None:
        """The fault that ends the attempt now, or None."""


WatcherFactory = Callable[[WatchScope], AttemptWatcher]
_FACTORIES: list[WatcherFactory] = []  # asked in this order, each poll


def register(factory: WatcherFactory) -> WatcherFactory:
    """Watch every attempt with what `factory(scope)` makes (a class decorator works)."""
    if factory not in _FACTORIES:
        _FACTORIES.append(factory)
    return factory


def unregister(factory: WatcherFactory) -> None:
    if factory in _FACTORIES:
        _FACTORIES.remove(factory)


def watchers_for(scope: WatchScope) -> list[AttemptWatcher]:
    """Fresh watchers for one attempt: what a watcher learns of an attempt ends with it."""
    return [factory(scope) for factory in _FACTORIES]


@register
class StopWatcher:
    """A stop ends the job from wherever it is (JobStopped, StorageLost): while an attempt
    runs, this is where it is noticed. The job's end stops and flushes every rank."""

    def __init__(self, scope: WatchScope) -> None:
        self.job = scope.job

    def watch(self, poll: GroupPoll) -> Fault | None:
        self.job.check_stop()
        return None


@register
class DrainWatcher:
    """A node of the job being drained with a preemption notice: the attempt ends at once, so
    that its ranks get most of the notice to save and the uploads the rest."""

    def __init__(self, scope: WatchScope) -> None:
        self.port = scope.port
        self.next_look = 0.0

    def watch(self, poll: GroupPoll) -> Fault | None:
        if time.monotonic() < self.next_look:
            return None
        self.next_look = time.monotonic() + DRAIN_POLL_S
        nodes = self.port.nodes
        drains = nodes.judge.draining(nodes.group.node_ids)
        if not drains:
            return None
        rank, deadline = min(drains.items(), key=lambda item: item[1] or 1e18)
        node_id = nodes.group.node_ids[rank]
        until = f"{deadline - time.time():.0f} s" if deadline else "no deadline"
        why = f"rank {rank}'s node {node_id[:12]} is being preempted ({until} left)"
        return Fault(FaultKind.PREEMPTED, why, rank, node_id, deadline)


@register
class QueuePreemptionWatcher:
    """The queue wants the job's nodes for another job: it gives way, with the preemption
    grace to save, and goes back in line (not a fault of its own: no retry is used)."""

    def __init__(self, scope: WatchScope) -> None:
        self.port = scope.port

    def watch(self, poll: GroupPoll) -> Fault | None:
        why = self.port.preemption()
        if not why:
            return None
        deadline = time.time() + settings.PREEMPTION_GRACE_S.get()
        return Fault(FaultKind.PREEMPTED_BY_JOB, why, deadline=deadline)


@register
class CheckpointVolumeWatcher:
    """A rank's checkpoint directory holds more than `volume_size_gib`."""

    def __init__(self, scope: WatchScope) -> None:
        pass

    def watch(self, poll: GroupPoll) -> Fault | None:
        if poll.over_volume is None:
            return None
        return Fault(FaultKind.OVER_VOLUME, poll.over_volume)
