"""A storage hiccup never kills a training job: real jobs on the session's Ray, storage on moto.

The session's moto server is stopped for longer than one request's own retries and started again
on its port (moto keeps its buckets), while a job prints a line every half second and writes
checkpoints; a bucket is deleted mid-job for an error that will not pass.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from checkpoint_jobs import download, s3_root, writer_job, wrote
from conftest import S3Server
from ray.job_submission import JobStatus, JobSubmissionClient

from orchestrator.client.api import push
from orchestrator.client.jobs import JobHandle
from orchestrator.lifecycle import JobState
from orchestrator.storage.retry import ON_ERROR_ENV

pytestmark = pytest.mark.usefixtures("ray_cluster")

STEPS = """
import os, pathlib, time
from ckptlib import ROOT, wrote

def checkpoint(step):
    d = ROOT / f"checkpoint-{{step}}"
    d.mkdir()
    (d / "model.bin").write_bytes(os.urandom(50_000))
    (d / "optimizer.bin").write_bytes(os.urandom(20_000))
    wrote(d.name)

for i in range({steps}):
    print(f"step {{i:02d}}", flush=True)
    if i in {checkpoints}:
        checkpoint(i)
    if i == {hold_at}:
        signal = pathlib.Path({signal!r})
        while not signal.exists():
            time.sleep(0.1)
    time.sleep(0.5)
"""


def steps_job(tmp_path: Path, steps: int, checkpoints: tuple[int, ...], hold_at: int = -1) -> Path:
    script = STEPS.format(steps=steps, checkpoints=checkpoints, hold_at=hold_at,
                          signal=str(tmp_path / "go"))  # fmt: skip
    return writer_job(tmp_path / "job", "outage", script)


def stored_steps(job: JobHandle) -> list[str]:
    return [m.group(1) for line in job.logs() if (m := re.search(r"\bstep (\d\d)$", line))]


def wait_for_step(job: JobHandle, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while f"{step:02d}" not in stored_steps(job):
        assert time.monotonic() < deadline, job.logs()[-20:]
        assert not job.status().is_terminal, job.logs()[-20:]
        time.sleep(0.2)


def ray_job_log(cluster, job: JobHandle) -> list[str]:
    return JobSubmissionClient(cluster.dashboard_url).get_job_logs(job.id).splitlines()


def controller_lines(lines: list[str], text: str) -> list[str]:
    return [line for line in lines if line.startswith("[orchestrator ") and text in line]


def cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "orchestrator", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def check_checkpoints(job: JobHandle, names: list[str], tmp_path: Path) -> None:
    versions = wrote(job)
    assert sorted(versions) == sorted(names)
    assert sorted(m.name for m in job.checkpoints()) == sorted(names)
    for name in names:
        assert download(job, name, tmp_path / "down") == versions[name][-1], name


def test_a_job_rides_out_a_storage_outage(tmp_path, s3_outage: S3Server, ray_cluster) -> None:
    root_url = s3_root()
    job = push(steps_job(tmp_path, 40, (10, 35)), storage_root=root_url)  # 20 s of steps
    tail = cli("logs", "--job-id", job.id, "--tail", "--storage-root", root_url)
    wait_for_step(job, 4)
    s3_outage.down()
    down_at = time.monotonic()
    try:
        time.sleep(6)
        view = cli("view", "--job-id", job.id, "--storage-root", root_url)
        view_err: list[str] = []
        reader = threading.Thread(target=lambda: view_err.extend(view.stderr), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60  # a loaded machine starts the CLI slowly
        while not any("unreachable since" in line for line in view_err):
            assert time.monotonic() < deadline, view_err
            time.sleep(0.2)
        time.sleep(max(0.0, 10 - (time.monotonic() - down_at)))  # 10 s at least
    finally:
        s3_outage.up()
    assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()[-20:]
    assert stored_steps(job) == [f"{i:02d}" for i in range(40)]  # all, in order, once
    check_checkpoints(job, ["checkpoint-10", "checkpoint-35"], tmp_path)
    assert job.details().checkpoints.sync_status == "synced"

    log = ray_job_log(ray_cluster, job)
    assert len(controller_lines(log, "unreachable since")) == 1, log
    assert len(controller_lines(log, "reachable again after")) == 1, log

    out, err = tail.communicate(timeout=60)
    assert tail.returncode == 0, err
    tailed = re.findall(r"\bstep (\d\d)$", out, flags=re.M)
    assert tailed == [f"{i:02d}" for i in range(40)]
    assert "unreachable since" in err and "reachable again" in err
    out, _ = view.communicate(timeout=60)
    reader.join(timeout=10)
    assert view.returncode == 0, view_err
    assert job.id in out and any("reachable again" in line for line in view_err)


def test_an_outage_as_the_job_ends_loses_nothing(
    tmp_path, s3_outage: S3Server, ray_cluster
) -> None:
    root_url = s3_root()
    job = push(steps_job(tmp_path, 6, (1, 5), hold_at=3), storage_root=root_url)
    wait_for_step(job, 3)
    s3_outage.down()
    try:
        (tmp_path / "go").touch()  # the job writes its last checkpoint and ends meanwhile
        # Longer than two attempts of one request (about 2 s each with one attempt of
        # botocore's, AWS_MAX_ATTEMPTS=1 in conftest; about 8 s each with its default 5).
        time.sleep(8)
    finally:
        s3_outage.up()
    assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()[-20:]
    assert stored_steps(job) == [f"{i:02d}" for i in range(6)]
    check_checkpoints(job, ["checkpoint-1", "checkpoint-5"], tmp_path)
    log = ray_job_log(ray_cluster, job)
    assert len(controller_lines(log, "unreachable since")) == 1, log


@pytest.mark.parametrize("on_error", ["continue", "stop"])
def test_a_deleted_bucket_is_said_once_and_named_at_the_end(
    tmp_path, ray_cluster, monkeypatch, on_error: str
) -> None:
    monkeypatch.setenv(ON_ERROR_ENV, on_error)
    root_url = s3_root()
    job = push(steps_job(tmp_path, 30, (12,)), storage_root=root_url)
    wait_for_step(job, 3)
    bucket = root_url.split("/")[2]
    deadline = time.monotonic() + 30
    while True:  # a line stored between the deletes of the objects and the bucket's: again
        try:
            job._store.root.fs.rm(bucket, recursive=True)
            break
        except OSError as e:
            assert "not empty" in str(e) and time.monotonic() < deadline, e

    client = JobSubmissionClient(ray_cluster.dashboard_url)
    deadline = time.monotonic() + 120
    while not client.get_job_status(job.id).is_terminal():
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert client.get_job_status(job.id) == JobStatus.FAILED  # not a plain success
    log = ray_job_log(ray_cluster, job)
    problem = controller_lines(log, "cannot be stored")
    assert len(problem) == 1 and "bucket does not exist" in problem[0], log
    unstored = controller_lines(log, "could not be stored")
    assert len(unstored) == 1 and "the job's status" in unstored[0], log
    kept = Path(re.search(r"kept in (\S+)", unstored[0]).group(1))
    if on_error == "continue":  # the command ran to its end, and its lines are on the head
        assert any(line.endswith("step 29") for line in log), log
        assert "step 29" in kept.read_text()
        assert any("checkpoint-12" in line for line in controller_lines(log, "not uploaded"))
    else:
        assert not any(line.endswith("step 29") for line in log), log
        assert controller_lines(log, ON_ERROR_ENV), log
