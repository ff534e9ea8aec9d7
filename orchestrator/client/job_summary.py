"""A plain-data description of a resolved job: what `validate` and `push --dry-run` show."""

from __future__ import annotations

from typing import Any

from orchestrator.client.support import check_support
from orchestrator.client.workspace import WorkspacePlan
from orchestrator.spec.secrets import SecretReference
from orchestrator.spec.training import TrainingJob, TrainingProject


def describe_job(project: TrainingProject, plan: WorkspacePlan | None = None) -> dict[str, Any]:
    """JSON-ready summary. Secrets appear only as references, never as values."""
    job = project.job
    compute, runtime = job.compute, job.runtime
    support = check_support(job)
    summary: dict[str, Any] = {
        "project": project.name,
        "team": project.team_name,
        "job_name": job.name,
        "image": job.image.base_image,
        "nodes": compute.node_count,
        "per_node": {
            "cpu": compute.cpu_count,
            "memory": compute.memory,
            "memory_bytes": compute.memory_bytes,
            "accelerator": str(compute.accelerator) if compute.gpus_per_node else None,
            "gpus": compute.gpus_per_node,
        },
        "availability_model": compute.availability_model.value,
        "ray_train": _ray_train(project.job),
        "priority": job.priority,
        "max_duration": job.max_duration,  # as written: "2h", or seconds
        "interactive_session": (
            job.interactive_session.model_dump(mode="json") if job.interactive_session else None
        ),
        "start_commands": list(runtime.start_commands),
        "environment": {
            name: (str(value) if isinstance(value, SecretReference) else "(set)")
            for name, value in runtime.environment_variables.items()
        },
        "secrets": sorted({ref.name for ref in job.secret_references()}),
        "weights": [
            {
                "source": w.source,
                "mount_location": w.mount_location,
                "allow_patterns": w.allow_patterns,
                "ignore_patterns": w.ignore_patterns,
                "secret": w.secret_name,
            }
            for w in job.weights
        ],
        "checkpointing": runtime.checkpointing_config.model_dump(mode="json"),
        "cache": runtime.cache_config.model_dump(mode="json") if runtime.cache_config else None,
        "load_checkpoints": (
            runtime.load_checkpoint_config.model_dump(mode="json")
            if runtime.load_checkpoint_config
            else None
        ),
        "unsupported": list(support.errors),
        "notices": list(support.notices),
    }
    if plan is not None:
        summary["archive"] = {
            "root": str(plan.root),
            "config_dir": plan.config_relpath,
            "files": plan.file_count,
            "bytes": plan.total_bytes,
            "skipped": list(plan.skipped),
        }
    return summary


def _ray_train(job: TrainingJob) -> str | None:
    """`4 Ray Train workers: 2 nodes \u00d7 2, 1 GPU each`: what the script's ScalingConfig says."""
    if job.ray_train is None:
        return None
    compute, per_node = job.compute, job.ray_train.per_node(job.compute)
    nodes = f"{compute.node_count} node{'s' if compute.node_count > 1 else ''}"
    line = f"{job.ray_train.workers(compute)} Ray Train workers: {nodes} \u00d7 {per_node}"
    if compute.gpus_per_node and compute.gpus_per_node % per_node == 0:
        each = compute.gpus_per_node // per_node
        line += f", {each} GPU{'s' if each > 1 else ''} each"
    return line
