"""The controller host lives in a Ray job of its own whose driver stays, so that the raylet's
workers started ahead are taken by the next job's node agent instead of being ended with a
finished Ray job (controller/warm_workers.py): a queue of jobs does not start a worker process
per job between DEPLOYING and RUNNING."""

from __future__ import annotations

import shlex
import sys
import time

from conftest import controller_host_up, eventually, host_jobs, make_job
from ray.job_submission import JobStatus, JobSubmissionClient

from orchestrator.actor_names import CONTROLLER_HOST, NAMESPACE
from orchestrator.client.api import push
from orchestrator.lifecycle import JobState

JOB = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="warm-workers",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(cpu_count=1, memory="512Mi"),
        runtime=d.Runtime(start_commands=["python run.py"]),
    ),
)
"""
# Prints when the node agent above this command (a Ray worker process) was started.
AGENT_BORN = """
import psutil
agent = next(p for p in psutil.Process().parents() if "NodeAgent" in " ".join(p.cmdline()))
print("AGENT-BORN", agent.create_time(), flush=True)
"""

# The same, then a second more: the job before the measured one runs long enough for the
# host to have asked for its successor's worker (it asks once the commands started).
AGENT_BORN_THEN_A_SECOND = AGENT_BORN + "import time\ntime.sleep(1)\n"

KILL = f"""
import ray
ray.init(address="auto")
ray.kill(ray.get_actor({CONTROLLER_HOST!r}, namespace={NAMESPACE!r}))
"""


def agent_born(job) -> float:
    (line,) = [line for line in job.logs() if "AGENT-BORN" in line]
    return float(line.split("AGENT-BORN")[1])


def test_the_next_hosted_jobs_agent_takes_a_worker_started_before_it_was_pushed(
    tmp_path, ray_cluster
):
    root = str(tmp_path / "root")
    first = push(make_job(tmp_path / "first", JOB, {"run.py": AGENT_BORN}), storage_root=root)
    assert first.wait(timeout=120) == JobState.COMPLETED, first.logs()
    # The host belongs to its resident Ray job, which the dashboard shows running.
    eventually(lambda: controller_host_up(ray_cluster.dashboard_url), "the host's Ray job", 60)

    # A hosted job's agent, then the next one: its worker was started while the one before ran.
    for i in range(2):
        pushed_at = time.time()
        files = {"run.py": AGENT_BORN_THEN_A_SECOND}
        job = push(make_job(tmp_path / f"next{i}", JOB, files), storage_root=root)
        assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
    assert agent_born(job) < pushed_at, "the agent's worker started after the job was pushed"


def test_a_host_whose_resident_job_was_stopped_runs_jobs_on(tmp_path, ray_cluster):
    root = str(tmp_path / "root")
    first = push(make_job(tmp_path / "first", JOB, {"run.py": AGENT_BORN}), storage_root=root)
    assert first.wait(timeout=120) == JobState.COMPLETED, first.logs()
    client = JobSubmissionClient(ray_cluster.dashboard_url)
    eventually(lambda: controller_host_up(ray_cluster.dashboard_url), "the host's Ray job", 60)
    (resident,) = [j for j in host_jobs(client) if j.status == JobStatus.RUNNING]
    client.stop_job(resident.submission_id)  # `ray job stop` of it: the host is detached
    eventually(lambda: client.get_job_status(resident.submission_id).is_terminal(),
               "the host's Ray job to end", 60)  # fmt: skip

    for i in range(2):  # hosted still, its agents started cold (Ray ends a dead job's workers)
        job = push(make_job(tmp_path / f"after{i}", JOB, {"run.py": AGENT_BORN}), storage_root=root)
        assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
        info = client.get_job_info(job.id)
        assert info.metadata["orchestrator_controller"] == "hosted"

    # The host dies: the next jobs' controllers are Ray jobs, each starting it if none runs;
    # three at once start one resident Ray job, not three.
    killer = client.submit_job(entrypoint=f"{shlex.quote(sys.executable)} -c {shlex.quote(KILL)}")
    eventually(lambda: client.get_job_status(killer) == JobStatus.SUCCEEDED, "the kill", 60)
    before = len(host_jobs(client))
    jobs = [push(make_job(tmp_path / f"again{i}", JOB, {"run.py": AGENT_BORN}),
                 storage_root=str(tmp_path / f"root{i}")) for i in range(3)]  # fmt: skip
    for job in jobs:
        assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
    eventually(lambda: controller_host_up(ray_cluster.dashboard_url),
               "a new host in a new resident Ray job", 60)  # fmt: skip
    assert len(host_jobs(client)) == before + 1, [j.submission_id for j in host_jobs(client)]
