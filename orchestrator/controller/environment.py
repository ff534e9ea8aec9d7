"""The environment contract every rank's commands get (docs/configuration.md lists it)."""

from __future__ import annotations

from orchestrator.node.node_root import RankDirs
from orchestrator.spec.checkpoints import DEFAULT_DOWNLOAD_FOLDER
from orchestrator.spec.secrets import SecretReference
from orchestrator.storage.records import JobRecord, NodeInfo


def _dirs(node: NodeInfo) -> RankDirs:
    assert node.working_dir is not None
    return RankDirs.around(node.working_dir)


def checkpoint_dir(record: JobRecord, node: NodeInfo) -> str:
    """`checkpoint_path` if set, else a directory private to this job on the node."""
    path = record.spec.job.runtime.checkpointing_config.checkpoint_path
    return path or str(_dirs(node).checkpoints)


def load_dir(record: JobRecord, node: NodeInfo) -> str:
    """`download_folder`; its shared default becomes a directory private to this job."""
    load = record.spec.job.runtime.load_checkpoint_config
    folder = load.download_folder if load is not None else DEFAULT_DOWNLOAD_FOLDER
    if folder == DEFAULT_DOWNLOAD_FOLDER:
        return str(_dirs(node).loaded_checkpoints)
    return folder


def job_environment(record: JobRecord, node: NodeInfo, attempt: int = 0) -> dict[str, str]:
    """BT_* variables plus the user's plain variables; `attempt` is BT_RETRY_COUNT.

    The node agent adds the group's variables (leader, ranks; after the rendezvous) and secrets.
    """
    job = record.spec.job
    assert node.working_dir is not None
    env = {
        "BT_TRAINING_JOB_ID": record.job_id,
        "BT_TRAINING_JOB_NAME": job.name or record.job_id,
        "BT_TRAINING_PROJECT_ID": record.project_key,
        "BT_TRAINING_PROJECT_NAME": record.project,
        "BT_NUM_GPUS": str(job.compute.gpus_per_node),
        "BT_WORKING_DIR": node.working_dir,
        "BT_SCRATCH_DIR": str(_dirs(node).scratch),
        "BT_RETRY_COUNT": str(attempt),
    }
    if job.runtime.checkpointing_config.enabled:
        env["BT_CHECKPOINT_DIR"] = checkpoint_dir(record, node)
    load = job.runtime.load_checkpoint_config
    if load is not None and load.enabled:
        env["BT_LOAD_CHECKPOINT_DIR"] = load_dir(record, node)
    for name, value in job.runtime.environment_variables.items():
        if not isinstance(value, SecretReference):
            env[name] = value
    return env
