"""Images of waiting jobs pulled ahead, onto the nodes that could run them: a job admitted
after a wait finds its image on its nodes instead of pulling it then.

For the first `AHEAD` waiting jobs (queue order): onto the nodes held for the job if it is held,
else onto every node whose capacity fits its bundle. Each node is asked once per job and image
while the job is among the next (a node that has the image answers at once). Its puller
(agents/image_puller.py) pulls the image through the node's image cache where jobs run in
containers, and does nothing where they run on the host. Asking is a remote call made off the
deciding thread: a slow node never holds up a decision.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from orchestrator.scheduler.model import Decision, Node
from orchestrator.scheduler.resources import Resources
from orchestrator.storage.queue_store import QueueEntry

AHEAD = 2  # jobs: the next to start; pulling for all 1,000 would fill every node's disk

Pull = Callable[[str, QueueEntry], None]  # (node id, the job's entry): ask that node's puller


class ImagePrefetch:
    def __init__(self, pull: Pull, pool: Executor, ahead: int = AHEAD) -> None:
        self.pull, self.pool, self.ahead = pull, pool, ahead
        self.asked: set[tuple[str, str, str]] = set()  # (job id, image, node id)

    def consider(
        self, decision: Decision, entry: Callable[[str], QueueEntry | None], nodes: Sequence[Node]
    ) -> None:
        """Ask for the images of the next waiting jobs (`entry`: a job's queue entry) on the
        nodes they could start on."""
        waiting = sorted(decision.waiting, key=lambda w: w.position)[: self.ahead]
        next_ids = {job.job_id for job in waiting}
        self.asked = {asked for asked in self.asked if asked[0] in next_ids}  # bounded
        for job in waiting:
            found = entry(job.job_id)
            if found is None or found.image is None:
                continue
            for node_id in self._nodes_for(found, decision, nodes):
                if (found.job_id, found.image, node_id) not in self.asked:
                    self.asked.add((found.job_id, found.image, node_id))
                    self.pool.submit(self.pull, node_id, found)

    @staticmethod
    def _nodes_for(entry: QueueEntry, decision: Decision, nodes: Sequence[Node]) -> list[str]:
        held = decision.reserved.get(entry.job_id)
        if held:
            return list(dict.fromkeys(held))
        bundle = Resources(dict(entry.bundle))
        return [node.node_id for node in nodes if bundle.fits_in(node.capacity)]


def ray_pull(node_id: str, entry: QueueEntry) -> None:
    """Ask node `node_id`'s puller (started there if need be) to pull the entry's image."""
    from orchestrator.agents.image_puller import image_puller

    image_puller(node_id).prefetch.remote(
        entry.image, entry.job_id, entry.image_registry, entry.image_secret, entry.team
    )
