"""What `orchestrator queue` and `capacity view` read (`QueueViewWriter`): the last decision's
positions and reasons, each waiting job's estimated start, and the nodes' resources, in the
root's queue/view.json, rewritten only when what it says changed (a tick each second would
otherwise write it each second).

The estimates (`scheduler/estimate.py`: a simulation of many decisions, seconds for 1,000
waiting jobs) are worked out again at most every `ESTIMATE_EVERY_S` (or ten times as long as
the last one took), and sooner, but not within `ESTIMATE_AFTER_S`, when the waiting jobs
change. A short queue's (`INLINE_JOBS`, quick) go into the view being written; a long
queue's are worked out on a thread of their own, never under the queue's lock, and a view shows
the latest finished: a job that came since says it is not estimated yet.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence

from orchestrator.scheduler.estimate import Estimate
from orchestrator.scheduler.model import ClusterSnapshot, Decision, Node
from orchestrator.storage.queue_store import NodeView, QueueStore, QueueView, WaitingView

ESTIMATE_EVERY_S = 5.0
ESTIMATE_AFTER_S = 1.0  # the least time between two estimates (pushes may come 20 a second)
# Estimated at once, under the lock, for this many waiting jobs at most while the last estimate
# took less than this (20 jobs on 64 busy nodes: 2 ms); else on a thread of their own.
INLINE_JOBS, INLINE_S = 20, 0.02
SAME_START_S = 60.0  # estimates this close are the same (the view is not rewritten for them)
NOT_YET = Estimate(None, "")  # came since the last estimate
FAILED = Estimate(None, "cannot estimate: the estimate failed (the queue service's log says why)")

# Takes what the estimate needs from a decision's snapshot (under the queue's lock, quickly)
# and gives the work itself, done off the lock.
Estimator = Callable[[ClusterSnapshot], Callable[[], Mapping[str, Estimate]]]


class QueueViewWriter:
    def __init__(
        self, store: QueueStore, estimator: Estimator | None = None,
        clock: Callable[[], float] = time.monotonic, background: bool = True,
    ) -> None:  # fmt: skip
        """`background`: estimates on their own thread (False: at once, as tests want)."""
        self.store = store
        self.shown: QueueView | None = None
        self.estimator, self.clock, self.background = estimator, clock, background
        self.estimates: Mapping[str, Estimate] = {}  # the latest finished
        self.estimated_for: tuple[str, ...] | None = None  # the waiting jobs then
        self.estimated_at = -float("inf")
        self.took_s = 0.0  # how long the last estimate took
        self.estimating: threading.Thread | None = None

    def show(
        self, decision: Decision, nodes: Sequence[Node], now: float,
        snap: ClusterSnapshot | None = None,
    ) -> bool:  # fmt: skip
        """Whether the view was written. `snap`: what `decision` was decided on (estimates)."""
        if snap is not None and decision.waiting:
            self._estimate_if_due(decision, snap)
        estimates = self.estimates
        waiting = []
        for w in decision.waiting:
            e = estimates.get(w.job_id, NOT_YET)
            waiting.append(WaitingView(job_id=w.job_id, position=w.position, reason=w.reason,
                                       estimated_start=e.start, estimate=e.how))  # fmt: skip
        view = QueueView(
            decided_at=now,
            waiting=waiting,
            impossible=dict(decision.impossible),
            spared=dict(decision.spared),
            reserved={job: list(held) for job, held in decision.reserved.items()},
            nodes=[
                NodeView(
                    node_id=n.node_id, capacity=dict(n.capacity.amounts), free=dict(n.free.amounts)
                )
                for n in nodes
            ],
        )
        if self.shown is not None and _said(view) == _said(self.shown):
            return False
        self.store.write_view(view)
        self.shown = view
        return True

    def _estimate_if_due(self, decision: Decision, snap: ClusterSnapshot) -> None:
        if self.estimator is None or (self.estimating and self.estimating.is_alive()):
            return
        waiting = tuple(w.job_id for w in decision.waiting)
        since = self.clock() - self.estimated_at
        every = max(ESTIMATE_EVERY_S, 10 * self.took_s)
        if since < every and (waiting == self.estimated_for or since < ESTIMATE_AFTER_S):
            return
        self.estimated_for, self.estimated_at = waiting, self.clock()
        try:
            work = self.estimator(snap)
        except Exception:  # a fault in the estimate never stops the queue
            traceback.print_exc()
            self.estimates = dict.fromkeys(waiting, FAILED)
            return
        quick = len(waiting) <= INLINE_JOBS and self.took_s < INLINE_S
        if quick or not self.background:  # in this view already: the estimate of a short queue
            self._run(work, waiting)
            return
        self.estimating = threading.Thread(target=self._run, args=(work, waiting), daemon=True,
                                           name="queue-estimates")  # fmt: skip
        self.estimating.start()

    def _run(self, work: Callable[[], Mapping[str, Estimate]], waiting: tuple[str, ...]) -> None:
        started = self.clock()
        try:
            self.estimates = dict(work())  # one reference swapped: the writer reads either
        except Exception:
            traceback.print_exc()
            self.estimates = dict.fromkeys(waiting, FAILED)
        self.took_s = self.clock() - started


def _said(view: QueueView) -> dict:
    said = view.model_dump(exclude={"decided_at"})
    for w in said["waiting"]:
        if w["estimated_start"] is not None:
            w["estimated_start"] = round(w["estimated_start"] / SAME_START_S)
    return said
