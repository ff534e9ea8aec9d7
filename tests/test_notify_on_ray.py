"""Webhooks through the real queue service on the session's local cluster: a pushed job that
fails is told once to a receiver on 127.0.0.1, signed with a secret the nodes hold, and the
delivery is in the audit trail."""

from __future__ import annotations

import time

import pytest
from conftest import NODE_SECRET_NAME, NODE_SECRET_VALUE, eventually, free_port, make_job
from notify_jobs import Receiver

from orchestrator.client.api import push
from orchestrator.client.notify import add_webhook
from orchestrator.lifecycle import JobState
from orchestrator.storage import audit
from orchestrator.storage.root import StorageRoot

pytestmark = pytest.mark.usefixtures("ray_cluster")

FAILING = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="notify-demo",
    team_name="red",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        name="fails",
        compute=d.Compute(cpu_count=1, memory="512Mi"),
        runtime=d.Runtime(start_commands=["python -c 'import sys; sys.exit(3)'"]),
    ),
)
"""


def test_a_failed_job_is_told_once_to_its_webhook(tmp_path, storage_root):
    receiver = Receiver(free_port(), secret=NODE_SECRET_VALUE)
    receiver.up()
    try:
        sub = add_webhook(receiver.url, secret=NODE_SECRET_NAME, team="red",
                          storage_root=storage_root)  # fmt: skip
        job = push(make_job(tmp_path / "job", FAILING), storage_root=storage_root)
        assert job.wait(timeout=120) == JobState.FAILED
        eventually(lambda: receiver.ids() == [f"{job.id}:0:failed"], "the webhook", 60)
        time.sleep(3)  # and nothing more
        assert receiver.ids() == [f"{job.id}:0:failed"] and receiver.bad_signatures == 0
    finally:
        receiver.down()
    body = receiver.accepted[0]
    assert (body["kind"], body["state"], body["team"], body["project"], body["job_name"]) == (
        "failed", "FAILED", "red", "notify-demo", "fails")  # fmt: skip
    assert "exited with code 3" in body["reason"]
    notified = [e for e in audit.read(StorageRoot(storage_root)) if e.verb == "notify"]
    assert [(e.job, e.target, e.result) for e in notified] == [(job.id, sub.id, "ok")]
