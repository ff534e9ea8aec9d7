"""The BT_* environment every rank's commands see (docs/configuration.md lists the contract).

The controller names the job's variables for each rank (`job_environment`); the node agent adds
the group's once the ranks have met (`group_environment`). No Ray: a stored job and the nodes a
prepare would report.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator import definitions as d
from orchestrator.agents.messages import Group
from orchestrator.agents.rendezvous import group_environment
from orchestrator.client.prepare import prepare_job
from orchestrator.client.submit import store_job
from orchestrator.controller.environment import job_environment
from orchestrator.storage.records import JobRecord, NodeInfo
from orchestrator.storage.root import StorageRoot


def stored(tmp_path: Path, runtime: d.Runtime, node_count: int = 2) -> JobRecord:
    (tmp_path / "code").mkdir(exist_ok=True)
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    project = d.TrainingProject(
        name="envs",
        job=d.TrainingJob(
            name="llama-sft",
            image=d.Image(base_image="python:3.11"),
            compute=d.Compute(node_count=node_count, accelerator=d.AcceleratorSpec(
                accelerator="H100", count=8)),
            runtime=runtime,
        ),
    )  # fmt: skip
    prepared = prepare_job(project, source_dir=tmp_path / "code")
    return store_job(prepared, StorageRoot(str(tmp_path / "storage")), "jenv00001", None)


def node(rank: int) -> NodeInfo:
    return NodeInfo(
        rank=rank,
        node_id=f"node-{rank}",
        ip=f"10.0.0.{rank + 1}",
        hostname=f"host-{rank}",
        working_dir=f"/data/orchestrator/jobs/jenv00001/rank-{rank}/workspace",
    )


def test_each_rank_of_a_two_node_job_gets_the_job_and_its_own_directories(tmp_path):
    record = stored(
        tmp_path,
        d.Runtime(
            start_commands=["python train.py"],
            environment_variables={"LR": "3e-4", "HF_TOKEN": d.SecretReference(name="hf")},
            checkpointing_config=d.CheckpointingConfig(enabled=True),
        ),
    )
    envs = [job_environment(record, node(rank), attempt=0) for rank in (0, 1)]
    for rank, env in enumerate(envs):
        base = f"/data/orchestrator/jobs/jenv00001/rank-{rank}"
        assert env["BT_TRAINING_JOB_ID"] == "jenv00001"
        assert env["BT_TRAINING_JOB_NAME"] == "llama-sft"
        assert env["BT_TRAINING_PROJECT_NAME"] == "envs"
        assert env["BT_TRAINING_PROJECT_ID"] == record.project_key
        assert env["BT_NUM_GPUS"] == "8"
        assert env["BT_RETRY_COUNT"] == "0"
        assert env["BT_WORKING_DIR"] == f"{base}/workspace"
        assert env["BT_SCRATCH_DIR"] == f"{base}/scratch"
        assert env["BT_CHECKPOINT_DIR"] == f"{base}/checkpoints"  # private to the job and rank
        assert env["LR"] == "3e-4"
        assert "HF_TOKEN" not in env  # a secret's value is the node agent's to add, never here
        assert "BT_LOAD_CHECKPOINT_DIR" not in env  # nothing to load


def test_a_retry_counts_in_bt_retry_count(tmp_path):
    record = stored(tmp_path, d.Runtime(start_commands=["python train.py"]))
    assert job_environment(record, node(1), attempt=2)["BT_RETRY_COUNT"] == "2"
    assert "BT_CHECKPOINT_DIR" not in job_environment(record, node(1))  # checkpointing is off


def test_checkpoint_dirs_follow_the_config_where_it_names_them(tmp_path):
    record = stored(
        tmp_path,
        d.Runtime(
            start_commands=["python train.py"],
            checkpointing_config=d.CheckpointingConfig(enabled=True, checkpoint_path="/ckpt"),
            load_checkpoint_config=d.LoadCheckpointConfig(
                enabled=True,
                checkpoints=[d.BasetenCheckpoint.from_latest_checkpoint(project_name="envs")],
                download_folder="/loaded",
            ),
        ),
    )
    env = job_environment(record, node(0))
    assert env["BT_CHECKPOINT_DIR"] == "/ckpt"
    assert env["BT_LOAD_CHECKPOINT_DIR"] == "/loaded"


def test_the_default_download_folder_becomes_private_to_the_job(tmp_path):
    """Baseten's shared default would mix two jobs' checkpoints on one node."""
    record = stored(
        tmp_path,
        d.Runtime(
            start_commands=["python train.py"],
            load_checkpoint_config=d.LoadCheckpointConfig(
                enabled=True,
                checkpoints=[d.BasetenCheckpoint.from_latest_checkpoint(project_name="envs")],
            ),
        ),
    )
    env = job_environment(record, node(1))
    base = "/data/orchestrator/jobs/jenv00001/rank-1"
    assert env["BT_LOAD_CHECKPOINT_DIR"] == f"{base}/loaded_checkpoints"


@pytest.mark.parametrize("rank", [0, 1])
def test_the_group_variables_name_the_leader_and_each_rank(rank):
    group = Group(leader_addr="10.0.0.1", master_port=29500, addresses=("10.0.0.1", "10.0.0.2"))
    env = group_environment(rank, group, gpus_per_node=8)
    assert env["BT_GROUP_SIZE"] == "2" and env["BT_NODE_RANK"] == str(rank)
    assert env["BT_LEADER_ADDR"] == "10.0.0.1"
    # The names torchrun and torch.distributed read, the same group.
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29500")
    assert (env["NNODES"], env["NODE_RANK"], env["NPROC_PER_NODE"]) == ("2", str(rank), "8")
