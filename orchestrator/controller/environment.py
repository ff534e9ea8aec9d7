"""The environment contract every rank's commands get (docs/configuration.md lists it)."""

from __future__ import annotations

from orchestrator.spec.secrets import SecretReference
from orchestrator.storage.records import JobRecord, NodeInfo


def job_environment(record: JobRecord, node: NodeInfo) -> dict[str, str]:
    """BT_* variables plus the user's plain variables.

    The node agent adds the group's variables (leader, ranks; after the rendezvous) and secrets.
    """
    job = record.spec.job
    assert node.working_dir is not None
    scratch = node.working_dir.rsplit("/", 1)[0] + "/scratch"
    env = {
        "BT_TRAINING_JOB_ID": record.job_id,
        "BT_TRAINING_JOB_NAME": job.name or record.job_id,
        "BT_TRAINING_PROJECT_ID": record.project,
        "BT_TRAINING_PROJECT_NAME": record.project,
        "BT_NUM_GPUS": str(job.compute.gpus_per_node),
        "BT_WORKING_DIR": node.working_dir,
        "BT_SCRATCH_DIR": scratch,
        "BT_RETRY_COUNT": "0",
    }
    checkpointing = job.runtime.checkpointing_config
    if checkpointing.enabled:
        env["BT_CHECKPOINT_DIR"] = checkpointing.checkpoint_path or (
            node.working_dir.rsplit("/", 1)[0] + "/checkpoints"
        )
    for name, value in job.runtime.environment_variables.items():
        if not isinstance(value, SecretReference):
            env[name] = value
    return env
