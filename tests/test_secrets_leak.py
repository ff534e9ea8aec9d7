"""A secret reaches its command and nowhere else: not the storage root, Ray's job API, Ray's
job logs or our logs, even when the command prints it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
from conftest import NODE_SECRET_NAME, NODE_SECRET_VALUE, make_job

from orchestrator.client.api import push
from orchestrator.cluster.auth import token_file
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

    assert_nowhere(job.id, NODE_SECRET_VALUE, storage_root, ray_cluster.dashboard_url)


def assert_nowhere(job_id: str, value: str, storage_root: str, dashboard_url: str) -> None:
    """Not in the storage root, Ray's job API, `ray job logs` or `orchestrator logs`; nor is the
    cluster's token."""
    token = token_file().read_text()
    assert files_containing(Path(storage_root), value) == []
    assert files_containing(Path(storage_root), token) == []
    request = urllib.request.Request(f"{dashboard_url}/api/jobs/{job_id}")
    request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request) as response:
        api = response.read().decode()
    assert json.loads(api)["submission_id"] == job_id
    assert value not in api and token not in api  # its runtime_env and metadata included
    ray_logs = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "job", "logs", job_id,
         "--address", dashboard_url],
        capture_output=True, text=True, timeout=60, env={**os.environ, **embedded_env()},
    )  # fmt: skip
    assert ray_logs.returncode == 0 and "token is *****" in ray_logs.stdout
    assert value not in ray_logs.stdout + ray_logs.stderr
    ours = subprocess.run(
        [sys.executable, "-m", "orchestrator", "logs", "--job-id", job_id,
         "--storage-root", storage_root],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ours.returncode == 0 and "token is *****" in ours.stdout
    assert value not in ours.stdout


STORE_JOB = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="leaky-store",
    team_name="{team}",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(memory="256Mi"),
        weights=[d.WeightsSource(source="hf://{repo}", mount_location="{mount}",
                                 auth_secret_name="leak_hf_token")],
        runtime=d.Runtime(
            start_commands=["echo token is $API_TOKEN", "python check_token.py"],
            environment_variables={{"API_TOKEN": d.SecretReference(name="leak_store_token")}},
        ),
    ),
)
"""


def secrets_cli(*args: str, value: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "secrets", *args],
        input=value, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_store_secrets_of_a_team_reach_its_job_and_appear_nowhere(
    tmp_path, storage_root, ray_cluster, hub
):
    """Set with `orchestrator secrets set` (read from stdin): an env var's secret and a weights
    source's token, both scoped to a team; another team's job cannot have them."""
    token, hf_token = "st0re-9f2c61d07e3b", "hf_st0re_4a8e2b6c1d"
    repo = f"acme/leak-{uuid.uuid4().hex[:6]}"
    hub.add_repo(repo, {"model.bin": b"weights"}, token=hf_token)
    for name, value in (("leak_store_token", token), ("leak_hf_token", hf_token)):
        set_ = secrets_cli("set", name, "--team", "leakers", value=value + "\n")
        assert set_.returncode == 0, set_.stderr
        assert value not in set_.stdout + set_.stderr
    try:
        check = CHECK_TOKEN.replace(
            hashlib.sha256(NODE_SECRET_VALUE.encode()).hexdigest(),
            hashlib.sha256(token.encode()).hexdigest(),
        )
        config = STORE_JOB.format(team="leakers", repo=repo, mount=tmp_path / "mnt")
        job = push(make_job(tmp_path / "job", config, {"check_token.py": check}),
                   storage_root=storage_root)  # fmt: skip
        assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
        for value in (token, hf_token):
            assert_nowhere(job.id, value, storage_root, ray_cluster.dashboard_url)

        config = STORE_JOB.format(team="others", repo=repo, mount=tmp_path / "mnt2")
        other = push(make_job(tmp_path / "other", config, {"check_token.py": check}),
                     storage_root=storage_root)  # fmt: skip
        assert other.wait(timeout=120) == JobState.DEPLOY_FAILED
        cause = other.details().failure.cause
        assert "secret 'leak_hf_token' is not set for team 'others'" in cause
        assert hf_token not in cause
        # Without the weights, the node refuses it the env var's secret.
        no_weights = "\n".join(
            line for line in config.splitlines() if "WeightsSource" not in line
            and "auth_secret_name" not in line
        )  # fmt: skip
        other = push(make_job(tmp_path / "other2", no_weights, {"check_token.py": check}),
                     storage_root=storage_root)  # fmt: skip
        assert other.wait(timeout=120) == JobState.DEPLOY_FAILED
        cause = other.details().failure.cause
        assert "secret 'leak_store_token' is not set for team 'others'" in cause
        assert token not in cause
    finally:
        for name in ("leak_store_token", "leak_hf_token"):
            secrets_cli("delete", name, "--team", "leakers")
