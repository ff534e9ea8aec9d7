"""A secret reaches its command and nowhere else: not the storage root, Ray's job API, Ray's
job logs or our logs, even when the command prints it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import NODE_SECRET_NAME, NODE_SECRET_VALUE, make_job

from orchestrator.client.api import push
from orchestrator.cluster.local import embedded_env
from orchestrator.lifecycle import JobState

pytestmark = pytest.mark.usefixtures("ray_cluster")

LEAKY = f"""
from orchestrator import definitions as d
project = d.TrainingProject(
    name="leaky",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(memory="256Mi"),
        runtime=d.Runtime(
            start_commands=[
                "echo token is $API_TOKEN",
                "python check_token.py",
            ],
            environment_variables={{"API_TOKEN": d.SecretReference(name="{NODE_SECRET_NAME}")}},
        ),
    ),
)
"""


# The job checks the value by its hash, so the config and code archive never hold the value.
CHECK_TOKEN = f"""
import hashlib, os, sys
wanted = "{hashlib.sha256(NODE_SECRET_VALUE.encode()).hexdigest()}"
sys.exit(0 if hashlib.sha256(os.environ["API_TOKEN"].encode()).hexdigest() == wanted else 9)
"""


def files_containing(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def test_a_printed_secret_appears_nowhere(tmp_path, storage_root, ray_cluster):
    job = push(
        make_job(tmp_path / "job", LEAKY, {"check_token.py": CHECK_TOKEN}),
        storage_root=storage_root,
    )
    # The last command compares the value: the secret did reach the command, unmasked.
    assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
    lines = job.logs()
    assert any(line.endswith("token is *****") for line in lines)

    assert files_containing(Path(storage_root), NODE_SECRET_VALUE) == []
    with urllib.request.urlopen(f"{ray_cluster.dashboard_url}/api/jobs/{job.id}") as response:
        api = response.read().decode()
    assert json.loads(api)["submission_id"] == job.id
    assert NODE_SECRET_VALUE not in api
    ray_logs = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "job", "logs", job.id,
         "--address", ray_cluster.dashboard_url],
        capture_output=True, text=True, timeout=60, env={**os.environ, **embedded_env()},
    )  # fmt: skip
    assert ray_logs.returncode == 0 and "token is *****" in ray_logs.stdout
    assert NODE_SECRET_VALUE not in ray_logs.stdout + ray_logs.stderr
    ours = subprocess.run(
        [sys.executable, "-m", "orchestrator", "logs", "--job-id", job.id,
         "--storage-root", storage_root],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ours.returncode == 0 and "token is *****" in ours.stdout
    assert NODE_SECRET_VALUE not in ours.stdout
