"""The other ways in: `ray job submit`, the CLI's push --tail, and logs once the cluster is gone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import controller_host_up, eventually, make_job

from orchestrator.client.api import get_job, push
from orchestrator.cluster.local import LocalCluster, embedded_env
from orchestrator.home import ORCHESTRATOR_HOME_ENV
from orchestrator.lifecycle import JobState
from orchestrator.storage.queue_store import QueueStore
from orchestrator.storage.root import StorageRoot

pytestmark = pytest.mark.cluster  # starts Ray itself (a simulated or local cluster)

MNIST = Path(__file__).resolve().parents[1] / "recipes" / "mnist-pytorch" / "config.py"
RAY = str(Path(sys.executable).parent / "ray")

HELLO = """
from truss_train import definitions
project = definitions.TrainingProject(
    name="submitted",
    job=definitions.TrainingJob(
        image=definitions.Image(base_image="python:3.11"),
        compute=definitions.Compute(memory="256Mi"),
        runtime=definitions.Runtime(start_commands=["python hello.py"]),
    ),
)
"""


def test_ray_job_submit_runs_the_job_inside_that_ray_job(tmp_path, storage_root, ray_cluster):
    config = make_job(tmp_path / "job", HELLO, {"hello.py": "print('hello via ray job submit')\n"})
    result = subprocess.run(
        [RAY, "job", "submit", "--address", ray_cluster.dashboard_url,
         "--submission-id", "viaray1", "--working-dir", str(config.parent), "--",
         "python", "-m", "orchestrator", "run", "config.py", "--storage-root", storage_root],
        capture_output=True, text=True, timeout=180, env={**os.environ, **embedded_env()},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hello via ray job submit" in result.stdout  # the Ray job's own log shows our lines
    job = get_job("viaray1", storage_root=storage_root)
    assert job.record.submitted_via == "ray-job-submit"
    assert job.status() == JobState.COMPLETED
    assert any(line.endswith("hello via ray job submit") for line in job.logs())
    states = [e.state for e in job.details().history]
    assert states == [JobState.CREATED, JobState.DEPLOYING, JobState.RUNNING, JobState.COMPLETED]


def test_a_laptop_with_the_clusters_token_in_rays_default_place_pushes_and_one_without_is_told(
    tmp_path, storage_root, ray_cluster
):
    """cluster.yaml's way: the token in ~/.ray/auth_token and RAY_AUTH_MODE=token, nothing of
    ours (another home, no RAY_AUTH_TOKEN_PATH). `orchestrator push` and `ray job` work; with
    no token, or another, each says so in one line."""
    config = make_job(tmp_path / "job", HELLO, {"hello.py": "print('hello from a laptop')\n"})
    laptop = tmp_path / "laptop"
    (laptop / ".ray").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(laptop), RAY_ADDRESS=ray_cluster.dashboard_url, RAY_AUTH_MODE="token")
    env[ORCHESTRATOR_HOME_ENV] = str(laptop / ".orchestrator")

    def cli(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True,
                              text=True, timeout=180, env={**env, **extra})  # fmt: skip

    token = Path(ray_cluster.token_file).read_text()
    refusals = {
        "": "demands a token and this client has none (~/.ray/auth_token is missing or empty)",
        "x" * 64: "refused this client's token (~/.ray/auth_token): it is not the cluster's",
    }
    for content, said in refusals.items():
        (laptop / ".ray" / "auth_token").write_text(content)
        refused = cli("push", str(config), "--storage-root", storage_root)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        line = " ".join(refused.stderr.split())
        assert line == f"error: the Ray cluster at {ray_cluster.dashboard_url} {said}; put the " \
            "cluster's token there", refused.stderr  # fmt: skip
    refused = cli("push", str(config), "--storage-root", storage_root, RAY_AUTH_MODE="disabled")
    assert "demands a token: export RAY_AUTH_MODE=token" in " ".join(refused.stderr.split())

    (laptop / ".ray" / "auth_token").write_text(token)
    pushed = cli("push", str(config), "--storage-root", storage_root, "--tail")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert "hello from a laptop" in pushed.stdout
    listed = subprocess.run([RAY, "job", "list", "--address", ray_cluster.dashboard_url],
                            capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    job_id = pushed.stdout.split("pushed job ")[1].split()[0]
    assert job_id in listed.stdout

    # A running job: a stop without the token is told so and stops nothing; with it, it stops.
    sleeper = make_job(tmp_path / "sleeper", HELLO, {
        "hello.py": "import time\nprint('up', flush=True)\ntime.sleep(600)\n"})  # fmt: skip
    pushed = cli("push", str(sleeper), "--storage-root", storage_root)
    assert pushed.returncode == 0, pushed.stderr
    job = get_job(pushed.stdout.split("pushed job ")[1].split()[0], storage_root=storage_root)
    deadline = time.monotonic() + 120
    while not any(line.endswith("] up") for line in job.logs()):
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.2)
    (laptop / ".ray" / "auth_token").write_text("")
    refused = cli("stop", "--job-id", job.id, "--storage-root", storage_root)
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 1 and "this client has none" in said, refused.stderr
    assert job.status() == JobState.RUNNING
    (laptop / ".ray" / "auth_token").write_text(token)
    stopped = cli("stop", "--job-id", job.id, "--storage-root", storage_root)
    assert stopped.returncode == 0, stopped.stderr
    assert job.status() == JobState.STOPPED


def test_cli_push_tail_runs_the_mnist_recipe_to_completed(storage_root, ray_cluster):
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator", "push", str(MNIST), "--tail",
         "--storage-root", storage_root],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "final test accuracy: 0.9" in result.stdout
    assert "completed successfully" in result.stdout
    accuracy = float(result.stdout.split("final test accuracy: ")[1].split()[0])
    assert accuracy >= 0.9


def test_stopping_the_cluster_stops_its_jobs_and_what_they_stored_outlives_it(
    tmp_path, storage_root, ray_cluster
):
    """One short-lived cluster: a job that completed and one still running when it stops.
    (`ray_cluster`: this process as a client of the home's clusters, with their token; the
    test failed when run alone without it.)"""
    cluster = LocalCluster(state_dir=tmp_path / "short-lived-cluster")
    info = cluster.start()
    try:
        # Runs past the first resource sample (1 s in).
        hello = "import time\nprint('kept after shutdown', flush=True)\ntime.sleep(1.5)\n"
        config = make_job(tmp_path / "job", HELLO, {"hello.py": hello})
        done = push(config, address=info.dashboard_url, storage_root=storage_root)
        assert done.wait(timeout=120) == JobState.COMPLETED
        eventually(lambda: controller_host_up(info.dashboard_url), "the controller host", 60)
        config = make_job(tmp_path / "sleeper", HELLO, {"hello.py": SLEEPER})
        running = push(config, address=info.dashboard_url, storage_root=storage_root)
        wait_for_line(running, "up")
        # Its controller is a thread of the controller host: the stop reaches it there.
        assert QueueStore(StorageRoot(storage_root)).entry(running.id).hosted
    finally:
        cluster.stop()
    assert cluster.status() is None
    assert running.status() == JobState.STOPPED
    again = get_job(done.id, storage_root=storage_root)
    assert again.status() == JobState.COMPLETED
    assert any(line.endswith("kept after shutdown") for line in again.logs())
    cli = subprocess.run(
        [sys.executable, "-m", "orchestrator", "logs", "--job-id", done.id,
         "--storage-root", storage_root],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert "kept after shutdown" in cli.stdout
    # The resource samples are stored beside the logs, and read back without the cluster.
    (rank,) = again.metrics().ranks
    assert rank.samples and rank.node_id == again.details().nodes[0].node_id


def test_a_job_whose_local_cluster_died_is_failed_not_running_forever(
    tmp_path, storage_root, monkeypatch
):
    monkeypatch.setenv(ORCHESTRATOR_HOME_ENV, str(tmp_path / "home"))
    cluster = LocalCluster()  # the embedded cluster of that home: push finds it by itself
    info = cluster.start()
    try:
        config = make_job(tmp_path / "job", HELLO, {"hello.py": SLEEPER})
        job = push(config, storage_root=storage_root)
        assert job.record.embedded_cluster and job.record.ray_address == info.dashboard_url
        wait_for_line(job, "up")
        # "pid" is printed just after "up" but may be stored in a later batch of lines.
        command_pid = int(wait_for_line(job, "pid ", anywhere=True).split("pid ")[1])
        power_loss(info.pid, command_pid)  # the cluster crashes: nobody records anything
    finally:
        cluster.stop()
    assert job.status() == JobState.RUNNING  # a plain read: what was last recorded
    assert job.refresh().state == JobState.FAILED  # asking Ray finds the cluster gone
    assert "is no longer running" in job.details().failure.cause


def power_loss(root_pid: int, *extra_pids: int) -> None:
    """Every process of the cluster dies at once, as when a machine loses power.

    All are frozen before any is killed, so none sees another die and records it (the controller
    would otherwise note its command's exit and the test would not reach reconciliation).
    """
    root = psutil.Process(root_pid)
    victims = [root, *root.children(recursive=True)]
    for pid in extra_pids:  # the command runs in its own session, possibly reparented
        with contextlib.suppress(psutil.NoSuchProcess):
            victims.append(psutil.Process(pid))
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for process in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(sig)


SLEEPER = """
import os, time
print("up", flush=True)
print(f"pid {os.getpid()}", flush=True)
time.sleep(600)
"""


def wait_for_line(job, text: str, anywhere: bool = False) -> str:
    """The first line of the job's log that ends with `text` (holds it, `anywhere`)."""
    deadline = time.monotonic() + 60
    while True:
        found = [line for line in job.logs() if (text in line if anywhere else line.endswith(text))]
        if found:
            return found[0]
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.2)
