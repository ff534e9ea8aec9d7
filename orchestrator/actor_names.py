"""Every named actor's name, and the namespace they live in: one place to look them up.

Names are part of a running cluster's state (a detached actor outlives the code that started it),
so they change only with care: a new name starts a new actor beside the old one.
"""

from __future__ import annotations

NAMESPACE = "orchestrator"

QUEUE_SERVICE = "orchestrator-queue"  # one per cluster: every storage root's queue
SECRET_STORE = "orchestrator-secret-store"  # one per cluster, on the head node
WEIGHT_MIRROR = "orchestrator-weight-mirror"  # one per cluster
CONTROLLER_HOST = "orchestrator-controllers"  # one per cluster, on the head: hosted controllers


def weight_cache(node_id: str) -> str:
    """The weight cache of one node (mirrored weight sets on its disk)."""
    return f"orchestrator-node-cache-{node_id[:16]}"


def training_cache_seeder(node_id: str) -> str:
    """The training cache seeder of one node."""
    return f"orchestrator-cache-seeder-{node_id[:16]}"


def image_puller(node_id: str) -> str:
    """The image puller of one node (jobs' images, pulled as their nodes are chosen)."""
    return f"orchestrator-image-puller-{node_id[:16]}"


def node_agent(job_id: str, rank: int) -> str:
    """A job's agent on the node of `rank`."""
    return f"orchestrator-{job_id}-rank-{rank}"


def checkpoint_uploader(job_id: str, rank: int) -> str:
    """A job's checkpoint uploader beside the agent of `rank`."""
    return f"orchestrator-{job_id}-uploader-{rank}"


def rendezvous(job_id: str, attempt: int) -> str:
    """Where the ranks of one attempt of a job find their leader."""
    return f"orchestrator-{job_id}-rendezvous-{attempt}"


def placement_group(job_id: str) -> str:
    return f"orchestrator-{job_id}"
