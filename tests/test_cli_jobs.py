"""The job verbs of the CLI against a real local Ray: view, logs, stop."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import make_job

from orchestrator.client.api import get_job
from orchestrator.lifecycle import JobState

pytestmark = pytest.mark.usefixtures("ray_cluster")

SLEEPY = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="cli-project",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        name="sleepy",
        compute=d.Compute(memory="256Mi", availability_model="spot"),  # push warns: JSON stays
        runtime=d.Runtime(start_commands=["python -u sleepy.py"]),
    ),
)
"""


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_push_view_logs_and_stop_the_most_recent_job(tmp_path, storage_root):
    config = make_job(
        tmp_path / "job", SLEEPY, {"sleepy.py": "import time\nprint('up')\ntime.sleep(600)\n"}
    )
    pushed = cli("push", str(config), "--storage-root", storage_root, "-o", "json")
    assert pushed.returncode == 0, pushed.stderr
    announced = json.loads(pushed.stdout)
    job_id = announced["training_job"]["id"]
    assert any(w.startswith("availability_model spot is recorded") for w in announced["warnings"])
    # The session's cluster runs jobs on the host: push says what that means.
    assert any(w.startswith("this cluster runs jobs' commands in its nodes' own environment, as "
                            "trusted code: image.base_image is recorded only")
               for w in announced["warnings"]), announced["warnings"]  # fmt: skip
    job = get_job(job_id, storage_root=storage_root)

    deadline = time.monotonic() + 60
    while not any(line.endswith("] up") for line in job.logs()):
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.2)

    overview = json.loads(cli("view", "--storage-root", storage_root, "-o", "json").stdout)
    assert [(r["id"], r["project"], r["status"]) for r in overview["active_jobs"]] == [
        (job_id, "cli-project", "RUNNING")
    ]
    assert [(p["name"], p["latest_job_id"]) for p in overview["projects"]] == [
        ("cli-project", job_id)
    ]
    detail = json.loads(cli("view", "--job-id", job_id, "--storage-root", storage_root,
                            "-o", "json").stdout)  # fmt: skip
    assert [e["state"] for e in detail["history"]] == ["CREATED", "DEPLOYING", "RUNNING"]
    assert detail["nodes_detail"][0]["rank"] == 0
    assert detail["dashboard_url"].endswith(f"/#/jobs/{job_id}")
    assert detail["dashboard_url"].startswith("http://127.0.0.1:")
    shown = cli("view", "--job-id", job_id, "--storage-root", storage_root).stdout
    assert detail["dashboard_url"] in shown.replace("\n", "")
    host = "host (each node's own environment; trusted code)"
    assert detail["runtime"] == host
    assert "runtime" in shown and host in shown

    logs = cli("logs", "--storage-root", storage_root)
    assert f"using the most recent job, {job_id}" in logs.stdout
    assert "] up" in logs.stdout

    stopped = cli("stop", "--storage-root", storage_root)
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped by user" in stopped.stdout
    assert job.status() == JobState.STOPPED
    again = cli("stop", "--job-id", job_id, "--storage-root", storage_root)
    assert "already ended: STOPPED" in again.stdout


def test_job_verbs_with_no_jobs_say_so(storage_root):
    result = cli("logs", "--storage-root", storage_root)
    assert result.returncode == 1 and "no jobs yet" in result.stderr
    missing = cli("view", "--job-id", "jnope", "--storage-root", storage_root)
    assert missing.returncode == 1 and "no job 'jnope'" in missing.stderr
