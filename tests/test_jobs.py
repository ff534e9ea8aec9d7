"""Jobs on a real local Ray: the lifecycle a user sees through the Python API."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import eventually, make_job
from ray.job_submission import JobSubmissionClient
from ray.util.state import list_actors, list_nodes, list_placement_groups

from orchestrator import ConfigError
from orchestrator.client.api import get_job, list_jobs, list_projects, push
from orchestrator.client.jobs import JobHandle
from orchestrator.lifecycle import JobState

pytestmark = pytest.mark.usefixtures("ray_cluster")

CPU_JOB = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="{project}",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        name="{name}",
        compute=d.Compute(cpu_count={cpus}, memory="512Mi"),
        runtime=d.Runtime(
            start_commands={commands!r},
            environment_variables={{"GREETING": "hello from config"}},
            checkpointing_config=d.CheckpointingConfig(enabled=True),
        ),
    ),
)
"""


def cpu_job(directory: Path, commands: list[str], files: dict[str, str] | None = None,
            project: str = "tests", name: str = "job", cpus: int = 1) -> Path:  # fmt: skip
    body = CPU_JOB.format(project=project, name=name, cpus=cpus, commands=commands)
    return make_job(directory, body, files)


def wait_for(job: JobHandle, predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; job is {job.status().value}")
        time.sleep(0.2)


CHECK_ENV = """
import json, os, pathlib
keys = ["BT_TRAINING_JOB_ID", "BT_TRAINING_JOB_NAME", "BT_TRAINING_PROJECT_ID",
        "BT_TRAINING_PROJECT_NAME", "BT_NUM_GPUS", "BT_WORKING_DIR", "BT_SCRATCH_DIR",
        "BT_RETRY_COUNT", "BT_GROUP_SIZE", "BT_NODE_RANK", "BT_LEADER_ADDR",
        "BT_CHECKPOINT_DIR", "GREETING"]
env = {k: os.environ.get(k) for k in keys}
assert pathlib.Path(env["BT_SCRATCH_DIR"]).is_dir(), "scratch dir missing"
assert pathlib.Path(env["BT_CHECKPOINT_DIR"]).is_dir(), "checkpoint dir missing"
assert os.getcwd() == env["BT_WORKING_DIR"], (os.getcwd(), env["BT_WORKING_DIR"])
assert pathlib.Path("check_env.py").is_file(), "the workspace was not unpacked"
print("ENV " + json.dumps(env))
"""


def test_job_completes_with_the_env_contract(tmp_path, storage_root):
    commands = ["python check_env.py", "echo second command ran"]
    files = {"check_env.py": CHECK_ENV}
    config = cpu_job(tmp_path / "job", commands, files, project="env-contract", name="contract")
    job = push(config, storage_root=storage_root)
    assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
    lines = job.logs()
    env = json.loads(next(line for line in lines if "ENV {" in line).split("ENV ", 1)[1])
    assert env["BT_TRAINING_JOB_ID"] == job.id
    assert env["BT_TRAINING_JOB_NAME"] == "contract"
    assert env["BT_TRAINING_PROJECT_NAME"] == "env-contract"
    assert env["BT_TRAINING_PROJECT_ID"] == job.project_id and job.project_id.startswith("p")
    assert (env["BT_NUM_GPUS"], env["BT_GROUP_SIZE"], env["BT_NODE_RANK"]) == ("0", "1", "0")
    assert env["BT_RETRY_COUNT"] == "0" and env["BT_LEADER_ADDR"]
    assert env["GREETING"] == "hello from config"
    assert any(line.endswith("second command ran") for line in lines)
    assert any(line.startswith("[rank 0 ") for line in lines)
    history = [e.state for e in job.details().history]
    assert history == [JobState.CREATED, JobState.DEPLOYING, JobState.RUNNING, JobState.COMPLETED]
    scratch = Path(env["BT_SCRATCH_DIR"])  # deleted as the job's nodes are released, just after
    eventually(lambda: not scratch.exists(), "the scratch directory to be deleted")


def test_failing_command_records_exit_code_command_and_last_lines(tmp_path, storage_root):
    config = cpu_job(
        tmp_path / "job",
        ["echo scratch=$BT_SCRATCH_DIR", "python fail.py", "echo must not run"],
        {"fail.py": "import sys\nprint('about to fail')\nsys.exit(3)\n"},
    )
    job = push(config, storage_root=storage_root)
    assert job.wait(timeout=120) == JobState.FAILED
    failure = job.details().failure
    assert failure is not None
    assert failure.exit_code == 3 and failure.command == "python fail.py"
    assert failure.node_rank == 0
    assert failure.last_lines[-1] == "about to fail"
    assert "exited with code 3" in failure.cause
    assert not any("must not run" in line for line in job.logs())
    scratch = next(line for line in job.logs() if "scratch=" in line).split("scratch=")[1]
    assert scratch
    eventually(lambda: not Path(scratch).exists(), "the scratch directory to be deleted")


SLEEPER = """
import os, time
print(f"SCRATCH {os.environ['BT_SCRATCH_DIR']}", flush=True)
print(f"PID {os.getpid()}", flush=True)
while True:
    print("still training", flush=True)
    time.sleep(0.5)
"""


def test_stop_ends_the_processes_and_removes_the_placement_group(
    tmp_path, storage_root, ray_cluster
):
    config = cpu_job(tmp_path / "job", ["python sleeper.py"], {"sleeper.py": SLEEPER})
    job = push(config, storage_root=storage_root)
    wait_for(job, lambda: any("PID " in line for line in job.logs()), "the job's first line")
    pid = int(next(line for line in job.logs() if "PID " in line).rsplit(" ", 1)[1])
    assert psutil.pid_exists(pid)
    assert job.status() == JobState.RUNNING

    assert job.stop() == JobState.STOPPED

    deadline = time.monotonic() + 20
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the training process outlived stop"
        time.sleep(0.2)

    # The controller records STOPPED, then gives the nodes back: they are free soon after.
    # Filtered by name: a session's cluster holds more than the state API's default 100 rows.
    def released() -> bool:
        address, name = ray_cluster.dashboard_url, f"orchestrator-{job.id}"
        groups = list_placement_groups(address=address, detail=True,
                                       filters=[("name", "=", name)])  # fmt: skip
        agents = list_actors(address=address, detail=True,
                             filters=[("name", "=", f"{name}-rank-0")])  # fmt: skip
        return (
            bool(groups and agents)
            and all(g.state == "REMOVED" for g in groups)
            and all(a.state == "DEAD" for a in agents)
        )

    eventually(released, "the placement group removed and the agent gone", 30)
    assert job.details().history[-1].reason == "stopped by user"
    scratch = next(line for line in job.logs() if "SCRATCH " in line).split("SCRATCH ")[1]
    assert not Path(scratch).exists(), "scratch must be deleted after a stop"


def test_a_job_larger_than_any_node_is_deploy_failed_at_once_with_why(tmp_path, storage_root):
    config = cpu_job(tmp_path / "job", ["echo never"], cpus=64)
    job = push(config, storage_root=storage_root)
    assert job.wait(timeout=60) == JobState.DEPLOY_FAILED
    assert not [e for e in job.details().history if e.state == JobState.PENDING]  # no wait
    failure = job.details().failure
    assert failure is not None
    assert "cannot be placed on this cluster even when it is idle" in failure.cause
    assert "needs 1 node with 64 CPU" in failure.cause
    assert "ORCHESTRATOR_CLUSTER_AUTOSCALES=1" in failure.cause  # what to do if it grows


def test_a_job_that_fits_but_finds_the_cluster_busy_waits_with_a_reason(
    tmp_path, storage_root, ray_cluster, monkeypatch
):
    cpus = int(max(n.resources_total.get("CPU", 0) for n in
                   list_nodes(address=ray_cluster.dashboard_url, detail=True)))  # fmt: skip
    hog = push(cpu_job(tmp_path / "hog", ["sleep 60"], name="hog", cpus=cpus),
               storage_root=storage_root)  # fmt: skip
    wait_for(hog, lambda: hog.status() == JobState.RUNNING, "the first job to hold every CPU")
    try:
        monkeypatch.setenv("ORCHESTRATOR_QUEUE_TIMEOUT_S", "3")  # no limit unless set
        job = push(cpu_job(tmp_path / "job", ["echo never"], cpus=cpus), storage_root=storage_root)
        assert job.wait(timeout=60) == JobState.DEPLOY_FAILED
        pending = [e for e in job.details().history if e.state == JobState.PENDING]
        assert pending and pending[0].reason == (
            f"waiting in the queue (position 1): needs 1 node with {cpus} CPU, 512.0 MiB memory "
            "free: 0 such nodes free"
        )
        failure = job.details().failure
        assert failure is not None and "longer than its 3 s queue timeout" in failure.cause
    finally:
        hog.stop()


def test_missing_secret_fails_the_deploy_naming_it(tmp_path, storage_root):
    config = make_job(
        tmp_path / "job",
        """
        from orchestrator import definitions as d
        project = d.TrainingProject(
            name="tests",
            job=d.TrainingJob(
                image=d.Image(base_image="x"),
                compute=d.Compute(memory="256Mi"),
                runtime=d.Runtime(
                    start_commands=["echo never"],
                    environment_variables={"TOKEN": d.SecretReference(name="no_such_secret")},
                ),
            ),
        )
        """,
    )
    job = push(config, storage_root=storage_root)
    assert job.wait(timeout=60) == JobState.DEPLOY_FAILED
    assert "no_such_secret" in job.details().failure.cause


def test_python_api_handles(tmp_path, storage_root):
    config = cpu_job(tmp_path / "job", ["echo api"], project="api-project", name="api-job")
    job = push(config, storage_root=storage_root)
    assert job.project == "api-project"
    assert job["training_project"]["name"] == "api-project"
    assert job["training_job"]["id"] == job.id
    job.wait(timeout=60)
    assert repr(job) == f"<TrainingJob {job.id} project='api-project' status=COMPLETED>"
    again = get_job(job.id, storage_root=storage_root)
    assert again.logs() == job.logs()
    assert [j.id for j in list_jobs("api-project", storage_root=storage_root)] == [job.id]
    assert list_jobs(status="failed", storage_root=storage_root) == []
    assert list_projects(storage_root=storage_root) == ["api-project"]


def test_wait_times_out_with_a_clear_error(tmp_path, storage_root):
    config = cpu_job(tmp_path / "job", ["python sleeper.py"], {"sleeper.py": SLEEPER})
    job = push(config, storage_root=storage_root)
    with pytest.raises(TimeoutError, match=f"job {job.id} is still"):
        job.wait(timeout=0.5)
    assert job.stop() == JobState.STOPPED


def test_invalid_config_creates_nothing(tmp_path, storage_root, ray_cluster):
    client = JobSubmissionClient(ray_cluster.dashboard_url)
    before = len(client.list_jobs())
    config = make_job(
        tmp_path / "bad",
        """
        from orchestrator import definitions as d
        project = d.TrainingProject(name="p", job=d.TrainingJob(image=d.Image(base_image="x")))
        project.job.compute.node_count = 0
        """,
    )
    with pytest.raises(ConfigError, match=r"Compute\.node_count"):
        push(config, storage_root=storage_root)
    assert not Path(storage_root).exists()
    assert len(client.list_jobs()) == before


def test_ray_job_metadata_names_the_job_and_holds_no_spec(tmp_path, storage_root, ray_cluster):
    config = cpu_job(tmp_path / "job", ["echo meta"], project="meta-project", name="meta-job")
    job = push(config, storage_root=storage_root)
    info = JobSubmissionClient(ray_cluster.dashboard_url).get_job_info(job.id)
    assert info.submission_id == job.id
    assert info.metadata["orchestrator_project"] == "meta-project"
    assert info.metadata["orchestrator_job_name"] == "meta-job"
    assert info.metadata["job_name"] == "meta-project/meta-job"  # the dashboard's Name column
    assert info.entrypoint.startswith(": 'meta-project/meta-job: echo meta'; exec ")
    assert "orchestrator.controller" in info.entrypoint
    job.wait(timeout=60)


def test_job_on_an_s3_storage_root(tmp_path, s3_server):
    import s3fs

    bucket = f"jobs-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem().mkdir(bucket)
    root = f"s3://{bucket}/orchestrator"
    config = cpu_job(tmp_path / "job", ["python hello.py"], {"hello.py": "print('from s3')\n"})
    job = push(config, storage_root=root)
    assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
    assert any(line.endswith("from s3") for line in get_job(job.id, storage_root=root).logs())
    keys = s3fs.S3FileSystem().find(f"{bucket}/orchestrator")
    assert f"{bucket}/orchestrator/jobs/{job.id}/record.json" in keys
    assert any(k.startswith(f"{bucket}/orchestrator/archives/") for k in keys)


def test_colocated_ranks_run_a_gang_on_one_machine(tmp_path, storage_root):
    command = "echo rank=$NODE_RANK of $NNODES port=$MASTER_PORT"
    body = CPU_JOB.format(project="colocated", name="gang", cpus=1, commands=[command])
    config = make_job(tmp_path / "job", body.replace("Compute(", "Compute(node_count=2, "))
    job = push(config, storage_root=storage_root, colocate_ranks=True)
    assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
    said = sorted(line.split("] ", 1)[1] for line in job.logs() if "rank=" in line)
    ports = {line.rsplit("port=", 1)[1] for line in said}
    assert [line.split(" port")[0] for line in said] == ["rank=0 of 2", "rank=1 of 2"]
    assert len(ports) == 1
    assert len(job.details().nodes) == 2


def test_a_gang_larger_than_the_cluster_fails_at_once_with_a_reason(tmp_path, storage_root):
    body = CPU_JOB.format(project="gang", name="gang", cpus=1, commands=["echo never"])
    config = make_job(tmp_path / "job", body.replace("Compute(", "Compute(node_count=2, "))
    job = push(config, storage_root=storage_root)
    assert job.wait(timeout=60) == JobState.DEPLOY_FAILED
    failure = job.details().failure
    assert failure is not None and "needs 2 nodes with 1 CPU" in failure.cause
    assert "1 of the cluster's 1 node has that much even when empty" in failure.cause
