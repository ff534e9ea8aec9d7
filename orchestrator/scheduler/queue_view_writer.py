"""What `orchestrator queue` and `capacity view` read (`QueueViewWriter`): the last decision's
positions and reasons and the nodes' resources, in the root's queue/view.json, rewritten only
when what it says changed (a tick each second would otherwise write it each second)."""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.scheduler.model import Decision, Node
from orchestrator.storage.queue_store import NodeView, QueueStore, QueueView, WaitingView


class QueueViewWriter:
    def __init__(self, store: QueueStore) -> None:
        self.store = store
        self.shown: QueueView | None = None

    def show(self, decision: Decision, nodes: Sequence[Node], now: float) -> bool:
        """Whether the view was written."""
        view = QueueView(
            decided_at=now,
            waiting=[
                WaitingView(job_id=w.job_id, position=w.position, reason=w.reason)
                for w in decision.waiting
            ],
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


def _said(view: QueueView) -> dict:
    return view.model_dump(exclude={"decided_at"})
