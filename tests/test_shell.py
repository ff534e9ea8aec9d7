"""`orchestrator shell -- CMD`: a command inside a running job, through the Job API only."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import NODE_SECRET_NAME, NODE_SECRET_VALUE, make_job

from orchestrator.client.api import push
from orchestrator.lifecycle import JobState

pytestmark = pytest.mark.usefixtures("ray_cluster")

CONFIG = f"""
from orchestrator import definitions as d
project = d.TrainingProject(
    name="shell",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(memory="512Mi"),
        runtime=d.Runtime(
            start_commands=["python train.py"],
            environment_variables={{"API_TOKEN": d.SecretReference(name="{NODE_SECRET_NAME}"),
                                    "LR": "0.1"}},
            checkpointing_config=d.CheckpointingConfig(enabled=True),
        ),
    ),
)
"""

TRAIN = """
import os, pathlib, time
(pathlib.Path(os.environ["BT_CHECKPOINT_DIR"]) / "note.txt").write_text("written by the job")
print("up", flush=True)
time.sleep(600)
"""


def shell(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator", "shell", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_a_command_runs_in_the_job_with_its_files_and_environment(tmp_path, storage_root):
    job = push(make_job(tmp_path / "job", CONFIG, {"train.py": TRAIN}), storage_root=storage_root)
    deadline = time.monotonic() + 60
    while not any(line.endswith("] up") for line in job.logs()):
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.2)
    try:
        command = ("cat $BT_CHECKPOINT_DIR/note.txt; echo; echo lr=$LR token=$API_TOKEN; pwd; "
                   "exit 3")  # fmt: skip
        result = shell("--job-id", job.id, "--storage-root", storage_root, "--", command)
        assert result.returncode == 3, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == "written by the job"
        assert lines[1] == "lr=0.1 token=*****"  # resolved on the node, masked on the way out
        assert lines[2] == job.details().nodes[0].working_dir
        assert NODE_SECRET_VALUE not in result.stdout + result.stderr

        missing = shell("--job-id", job.id, "--rank", "3", "--storage-root", storage_root,
                        "--", "true")  # fmt: skip
        assert missing.returncode == 1 and "has no rank 3" in missing.stderr
        slow = shell("--job-id", job.id, "--timeout", "1", "--storage-root", storage_root,
                     "--", "echo started; sleep 30")  # fmt: skip
        assert slow.returncode == 124 and slow.stdout == "started\n"  # killed, as timeout(1)
        bare = shell("--job-id", job.id, "--storage-root", storage_root)
        assert bare.returncode == 1 and "not built yet" in bare.stderr
    finally:
        assert job.stop() == JobState.STOPPED
    ended = shell("--job-id", job.id, "--storage-root", storage_root, "--", "true")
    assert ended.returncode == 1 and "has ended (STOPPED)" in ended.stderr
