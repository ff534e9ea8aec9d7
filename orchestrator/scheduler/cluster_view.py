"""From what Ray and the job spec say to what the policy reads: demands, nodes, a snapshot.

Pure conversions (Ray's node table and available resources are passed in as plain dicts), so
they are tested without a cluster; the queue service does the Ray calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from orchestrator.scheduler.policy import ClusterSnapshot, Demand, Node, QueuedJob, RunningJob
from orchestrator.scheduler.resources import GPU_PREFIX, Resources
from orchestrator.spec.placement import ACCELERATOR_RESOURCE_PREFIX, bundle_for
from orchestrator.spec.training import Compute
from orchestrator.storage.queue_store import QueueEntry, Quotas


def bundle_of(compute: Compute) -> dict[str, float]:
    """One node's demand in the policy's keys: CPU, memory, and GPUs of their type."""
    ray_bundle = bundle_for(compute)
    out = {"CPU": float(ray_bundle["CPU"]), "memory": float(ray_bundle.get("memory", 0))}
    if compute.gpus_per_node:
        assert compute.accelerator is not None and compute.accelerator.accelerator is not None
        out[GPU_PREFIX + compute.accelerator.accelerator.value] = float(compute.gpus_per_node)
    return out


def node_resources(resources: Mapping[str, float]) -> Resources:
    """A Ray node's resources in the policy's keys: its GPUs counted under its accelerator type
    (`accelerator_type:H100`), or under `GPU:unknown` when Ray names none."""
    types = [k[len(ACCELERATOR_RESOURCE_PREFIX) :] for k in resources
             if k.startswith(ACCELERATOR_RESOURCE_PREFIX)]  # fmt: skip
    out = {"CPU": float(resources.get("CPU", 0)), "memory": float(resources.get("memory", 0))}
    gpus = float(resources.get("GPU", 0))
    if gpus:
        out[GPU_PREFIX + (types[0] if types else "unknown")] = gpus
    return Resources(out)


def nodes_from_ray(
    table: Sequence[Mapping], available: Mapping[str, Mapping[str, float]]
) -> list[Node]:
    """Alive nodes from `ray.nodes()`, with what `available_resources_per_node()` says is free.
    A node's accelerator type comes from its total resources (the free ones lose the marker
    while a bundle holds its share)."""
    nodes = []
    for entry in table:
        if not entry.get("Alive"):
            continue
        node_id = str(entry["NodeID"])
        totals = dict(entry.get("Resources") or {})
        free = dict(available.get(node_id, {}))
        for key in totals:
            if key.startswith(ACCELERATOR_RESOURCE_PREFIX):
                free.setdefault(key, totals[key])
        nodes.append(Node(node_id, node_resources(totals), node_resources(free)))
    return nodes


def snapshot(
    entries: Sequence[QueueEntry], nodes: Sequence[Node], quotas: Quotas, now: float,
    *, autoscaling: bool = False,
) -> ClusterSnapshot:  # fmt: skip
    queued, running = [], []
    for e in entries:
        demand = Demand(Resources(dict(e.bundle)), e.nodes, e.colocated)
        if e.state == "queued":
            queued.append(QueuedJob(e.job_id, e.team, e.priority, e.pushed_at, demand,
                                    preempted_by=e.preempted_by))  # fmt: skip
        else:
            running.append(RunningJob(
                e.job_id, e.team, e.priority, e.admitted_at or e.pushed_at, demand,
                tuple(e.placed_on), resumable=e.resumable, leaving=e.preemption is not None,
                leaving_for=e.preempted_by if e.preemption is not None else None,
            ))  # fmt: skip
    return ClusterSnapshot(queued, running, _less_ours(nodes, running), quotas, now, autoscaling)


def _less_ours(nodes: Sequence[Node], running: Sequence[RunningJob]) -> list[Node]:
    """Free is the lesser of what Ray says and capacity less our admitted jobs: a job admitted
    but not yet reserved (its placement group on its way) holds its nodes already, and work
    that is not ours (a Serve replica) is known to Ray only."""
    ours: dict[str, Resources] = {}
    for job in running:
        for node in job.placed_on:
            ours[node] = ours.get(node, Resources()) + job.demand.bundle
    out = []
    for n in nodes:
        left = n.capacity - ours.get(n.node_id, Resources())
        keys = set(n.free.amounts) | set(left.amounts)
        free = Resources({k: min(n.free.get(k), left.get(k)) for k in keys})
        out.append(Node(n.node_id, n.capacity, free))
    return out
