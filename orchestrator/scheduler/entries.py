"""A job's queue entry, made from its record: by `push` (the job has no process while it waits)
and by a controller that enqueues its own job."""

from __future__ import annotations

from orchestrator.scheduler.cluster_view import bundle_of
from orchestrator.storage.queue_store import QueueEntry
from orchestrator.storage.records import JobRecord


def entry_for(record: JobRecord, **fields: object) -> QueueEntry:
    """What the queue needs of the job (team, priority, per-node bundle, ...), and `fields`."""
    compute = record.spec.job.compute
    image = record.spec.job.image
    auth = image.docker_auth.registry_secret_docker_auth if image.docker_auth else None
    return QueueEntry.model_validate({
        "job_id": record.job_id,
        "team": record.team,
        "priority": record.spec.job.priority or 0,
        "pushed_at": record.created_at,
        "bundle": bundle_of(compute),
        "nodes": compute.node_count,
        "colocated": record.colocate_ranks and compute.node_count > 1,
        "resumable": record.spec.job.runtime.checkpointing_config.enabled,
        "image": image.base_image,
        "image_registry": image.docker_auth.registry if auth else None,
        "image_secret": auth.secret_ref.name if auth else None,
        "project": record.project_key,
        "max_duration_s": record.spec.job.max_duration_s,
        **fields,
    })  # fmt: skip
