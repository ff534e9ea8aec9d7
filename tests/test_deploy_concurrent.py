"""Two deploys at once on the embedded Ray with Serve: both applications are there at the end.

Serve's REST API takes the whole set of applications and deletes what it is not sent, so a
deploy reads the set, adds its own and writes it back. Each PUT here is slowed by a second (a
slow network), so two deploys that read the set before either wrote it would each write it back
without the other's application. The applications ask for more CPUs than the cluster has: their
replicas never start, so the test costs no model load.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

from orchestrator import definitions as d
from orchestrator.client.deploy import deploy_plan, stop_deployment
from orchestrator.serving.plan import Chosen, DeploymentPlan, plan_deployment
from orchestrator.storage.checkpoints import Manifest, ManifestFile
from orchestrator.storage.records import ArchiveRef, JobRecord

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
PUT_DELAY_S = 1.0


def plan(name: str) -> DeploymentPlan:
    """A full checkpoint served by transformers, its replica asking for 64 CPUs."""
    job = d.TrainingJob(image=d.Image(base_image="x"))
    archive = ArchiveRef(path="a.tar", sha256="x", size_bytes=1, file_count=1, config_dir=".")
    record = JobRecord(
        job_id="j1", project="p", created_at=time.time(), archive=archive,
        spec=d.TrainingProject(name="p", job=job), storage_root="/srv/root",
    )  # fmt: skip
    manifest = Manifest(
        project="p", job_id="j1", node_rank=0, name="checkpoint-1", version=1, size_bytes=4,
        files=[ManifestFile(path=f, size=1, sha256="x") for f in FILES], created_at=0.0,
        checkpoint_type="full",
    )  # fmt: skip
    config = d.DeployCheckpointsConfig(model_name=name, compute=d.Compute(cpu_count=64))
    return plan_deployment(config, [Chosen(manifest, record)], engine="transformers")


def applications(dashboard_url: str) -> dict[str, Any]:
    return ServeSubmissionClient(dashboard_url).get_serve_details().get("applications") or {}


@pytest.fixture
def serve_port(monkeypatch: pytest.MonkeyPatch) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("ORCHESTRATOR_SERVE_PORT", str(port))
    return port


def test_two_deploys_at_once_both_stay_deployed(ray_cluster, serve_port, monkeypatch):
    put = ServeSubmissionClient.deploy_applications

    def slow_put(self: ServeSubmissionClient, config: dict, *args: Any, **kwargs: Any) -> None:
        time.sleep(PUT_DELAY_S)
        put(self, config, *args, **kwargs)

    monkeypatch.setattr(ServeSubmissionClient, "deploy_applications", slow_put)
    plans = [plan("race-a"), plan("race-b")]
    start = threading.Barrier(len(plans))
    errors: list[BaseException] = []

    def deploy(one: DeploymentPlan) -> None:
        start.wait()
        try:
            deploy_plan(one, wait=False)
        except BaseException as e:  # said by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=deploy, args=(p,)) for p in plans]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert not errors, errors
        # An application a later write left out is DELETING, then gone: wait for that to settle.
        deadline = time.monotonic() + 60
        while True:
            apps = applications(ray_cluster.dashboard_url)
            if all(a.get("status") != "DELETING" for a in apps.values()):
                break
            assert time.monotonic() < deadline, apps
            time.sleep(0.5)
        assert sorted(apps) == ["race-a", "race-b"]
    finally:
        for name in sorted(applications(ray_cluster.dashboard_url)):
            stop_deployment(name)  # the last one takes Serve down with it
