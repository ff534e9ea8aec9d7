"""What a fault was (`FaultJudge`): a rank's failed program, its agent lost while its node lives,
its node lost or preempted; and, when a program fails because a peer vanished, that peer's loss.

It reads the cluster only through `ClusterNodes` (cluster_nodes.py), so every judgement is tested
on a fake cluster (tests/test_fault_judge.py). It remembers the nodes it saw draining and those
it called lost while the GCS still called them alive: a replacement waits for those to go.
"""

from __future__ import annotations

import time

from orchestrator.controller.cluster_nodes import ClusterNodes, live
from orchestrator.controller.failure_policy import Fault, FaultKind
from orchestrator.controller.rank_group import GroupPoll, RankPoll, RankState, short_error

POLL_S = 0.2
NODE_DEATH_WAIT_S = 3.0  # a dead agent's node is looked at this long before it is called alive
# A node that crashed (no goodbye to the GCS) is declared dead once Ray's health checks fail:
# about 15 s with Ray's defaults. A node whose raylet does not answer is waited on this long.
NODE_VERDICT_WAIT_S = 60.0


class FaultJudge:
    def __init__(
        self,
        nodes: ClusterNodes,
        death_wait_s: float = NODE_DEATH_WAIT_S,
        verdict_wait_s: float = NODE_VERDICT_WAIT_S,
    ) -> None:
        self.nodes = nodes
        self.death_wait_s, self.verdict_wait_s = death_wait_s, verdict_wait_s
        self.drained: set[str] = set()  # nodes seen draining (preempted) during the job
        self.silent: set[str] = set()  # nodes judged lost while the GCS still called them alive

    def draining(self, node_ids: dict[int, str]) -> dict[int, float]:
        """Ranks (of `node_ids`: rank -> node) whose node is being drained, with its deadline
        (epoch seconds; 0: none given)."""
        drains = self.nodes.draining()
        found = {rank: drains[node] for rank, node in node_ids.items() if node in drains}
        self.drained.update(node_ids[rank] for rank in found)
        return found

    def fault_of(self, rank: RankPoll, node_id: str | None) -> Fault:
        """Why `rank` ended: its program failed, its agent was lost, its node lost or
        preempted."""
        if rank.state != RankState.LOST:
            assert rank.failure is not None
            return Fault(FaultKind.COMMAND_FAILED, rank.failure.cause, rank.rank, node_id)
        assert rank.lost is not None
        if self.node_lost(node_id or ""):
            return self._node_gone(rank.rank, node_id or "")
        why = f"rank {rank.rank}'s node agent died ({short_error(rank.lost)}); its node lives"
        return Fault(FaultKind.AGENT_LOST, why, rank.rank, node_id)

    def lost_elsewhere(self, poll: GroupPoll, node_ids: dict[int, str]) -> Fault | None:
        """A lost or draining node or agent among all ranks, if any: a program that failed
        because a peer vanished is that peer's fault, not its own."""
        lost = next((r for r in poll.ranks if r.state == RankState.LOST), None)
        if lost is not None:
            return self.fault_of(lost, node_ids.get(lost.rank))
        alive = live(self.nodes)
        draining = self.draining(node_ids)
        for rank, node_id in sorted(node_ids.items()):
            if rank in draining:
                why = f"rank {rank}'s node {node_id[:12]} is being preempted"
                return Fault(FaultKind.PREEMPTED, why, rank, node_id)
            if node_id not in alive:
                return self._node_gone(rank, node_id)
        # A peer that crashed a moment ago: alive to the GCS, but its raylet is silent.
        for rank, node_id in sorted(node_ids.items()):
            if not self.nodes.raylet_answers(alive[node_id]) and self.node_lost(node_id):
                return self._node_gone(rank, node_id)
        return None

    def node_lost(self, node_id: str) -> bool:
        """Whether a node whose agent vanished is gone. A removed node is told dead about as
        soon as its agent; a crashed one looks alive until Ray's health checks fail, so a node
        whose raylet does not answer is waited on for the GCS's verdict, never called alive."""
        now = time.monotonic()
        alive_after, lost_after = now + self.death_wait_s, now + self.verdict_wait_s
        while True:
            node = live(self.nodes).get(node_id)
            if node is None:
                return True
            now = time.monotonic()
            if now >= alive_after and self.nodes.raylet_answers(node):
                return False
            if now >= lost_after:  # silent for a minute: lost, whatever the GCS says yet
                self.silent.add(node_id)
                return True
            time.sleep(POLL_S)

    def why_wait(self, old_nodes: list[str]) -> str | None:
        """Why a lost rank cannot be placed again yet: a preempted node keeps its bundles until
        it is gone, and so does a crashed one until the GCS declares it dead (an agent placed
        there meanwhile never runs). None once no such node is left."""
        alive = live(self.nodes)
        leaving = [n for n in old_nodes if n in alive and n in self.drained | self.silent]
        if not leaving:
            return None
        if leaving[0] in self.drained:
            return (
                f"waiting for preempted node {leaving[0][:12]} to go, so that its rank is "
                "placed elsewhere"
            )
        return (
            f"waiting for Ray to declare node {leaving[0][:12]} dead (its raylet does not "
            "answer), so that its rank is placed elsewhere"
        )

    def _node_gone(self, rank: int, node_id: str) -> Fault:
        """A rank's node is no longer alive: preempted if it was seen draining, else lost."""
        if node_id in self.drained:
            why = f"rank {rank}'s node {node_id[:12]} was preempted and is gone"
            return Fault(FaultKind.PREEMPTED, why, rank, node_id)
        return Fault(
            FaultKind.NODE_LOST, f"rank {rank}'s node {node_id[:12]} was lost", rank, node_id
        )
