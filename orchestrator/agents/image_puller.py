"""A node's image puller: a job's image pulled onto each of its nodes as soon as they are
chosen, while the job's agents' workers start there, not after; and, asked by the queue service,
the image of a job that waits in the queue and could start here, before it is admitted.

One per node, started on first use and kept (as the weight cache is), so a node's later jobs do
not wait for its worker to start either. It pulls through the node's image cache
(node/image_cache.py), on behalf of the agent that will run there: the agent's own prepare then
finds the image, or waits on the pull under way. A pull that fails is not said here: the agent's
prepare tries it and fails the deploy, naming the image and why.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

from orchestrator import actor_names
from orchestrator.agents.runtimes import cluster_runtime_kind
from orchestrator.agents.services import actor_alive, shared_actor
from orchestrator.node import podman
from orchestrator.node.rank_runtime import PodmanPull


class ImagePuller:
    def __init__(self) -> None:
        # Image -> the directory of its top layer, for the images found here: while it exists,
        # the image is taken to be here without asking podman, whose start costs CPU the
        # agents' starting workers want (the agent's own prepare asks podman anyway).
        self._found: dict[str, str] = {}

    def pull(
        self, image: str, holder: str, registry: str | None = None,
        secret_name: str | None = None, team: str | None = None,
    ) -> Iterator[str]:  # fmt: skip
        """`image` onto this node for `holder` (the agent that will run there), saying the
        pull's lines as they come; nothing if the node has it."""
        if (layer := self._found.get(image)) and os.path.isdir(layer):
            return
        if podman.exists(image):
            self._remember(image)
            return
        lines: queue.Queue[str | None] = queue.Queue()

        def pull() -> None:
            try:
                with contextlib.suppress(Exception):  # the agent's prepare says why
                    PodmanPull(image, holder, registry, secret_name, team, lines.put,
                               actor_alive).pull()  # fmt: skip
                    self._remember(image)
            finally:
                lines.put(None)

        threading.Thread(target=pull, name="image-pull", daemon=True).start()
        while (line := lines.get()) is not None:
            yield line

    def prefetch(
        self, image: str, job_id: str, registry: str | None = None,
        secret_name: str | None = None, team: str | None = None,
    ) -> bool:  # fmt: skip
        """Start pulling `image` for a job that waits in the queue and could start here (the
        queue service asks); whether it is pulled or on its way. Nothing on a node whose jobs
        run on the host. A failure is left to the job's own pull, which says why."""
        if not cluster_runtime_kind().nodes_pull_images:
            return False
        if (layer := self._found.get(image)) and os.path.isdir(layer):
            return True

        def pull() -> None:
            with contextlib.suppress(Exception):
                # Held by no job until its agent holds it: a later pull's eviction may take it
                # before the job starts, and the job's own pull brings it back.
                queued = PodmanPull(image, f"queued:{job_id}", registry, secret_name, team,
                                    alive=actor_alive)  # fmt: skip
                try:
                    queued.pull()
                finally:
                    queued.release()
                self._remember(image)

        threading.Thread(target=pull, name="image-prefetch", daemon=True).start()
        return True

    def _remember(self, image: str) -> None:
        if (layer := podman.storage_dir(image)) != "/":
            self._found[image] = layer


def image_puller(node_id: str) -> Any:
    """The puller of node `node_id`, started there if it is not running."""
    name = actor_names.image_puller(node_id)
    return shared_actor(ImagePuller, name, on_node=node_id, max_concurrency=16)
