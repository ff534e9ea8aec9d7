"""deploy_checkpoints with the vllm engine when the engine cannot run the model: vLLM's CPU build
under Ray Serve LLM on the embedded cluster, for real.

A deployment is ready only once its engine answered a warm-up request (serving/vllm_server.py).
A GPT-2 of head_dim 16 starts vLLM's CPU engine, which then dies at the first request: the
deploy must fail with the engine's own root cause, which only its processes' output has. A
healthy model's engine that dies later, and cannot come back, is listed with why.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import psutil
import pytest
from ray.dashboard.modules.serve.sdk import ServeSubmissionClient
from recipe_serving import broken_checkpoints, serve_port_of_its_own

from orchestrator.client.deploy import (
    DeployError,
    Deployment,
    deploy_checkpoints,
    get_deployment,
    list_deployments,
    stop_deployment,
)
from orchestrator.client.jobs import JobHandle
from orchestrator.storage.root import StorageRoot

pytestmark = pytest.mark.timeout(900)

HEAD_DIM = "RuntimeError: Unsupported CPU attention configuration: head_dim=16"


@pytest.fixture(scope="module")
def broken(ray_cluster, tmp_path_factory) -> Iterator[tuple[JobHandle, str]]:
    """The job of checkpoints an engine cannot run (recipe_serving.py) on a local storage root,
    which vLLM loads from in place; a Serve port of its own, every deployment stopped at the end."""
    storage_root = str(tmp_path_factory.mktemp("vllm-broken-storage"))
    with serve_port_of_its_own():
        yield broken_checkpoints(storage_root, tmp_path_factory.mktemp("broken-job")), storage_root


def test_an_engine_that_dies_at_its_first_request_fails_the_deploy_with_the_root_cause(broken):
    job, storage_root = broken
    start = time.monotonic()
    with pytest.raises(DeployError, match=re.escape(HEAD_DIM)):
        deploy_checkpoints(job_id=job.id, checkpoints=["headdim16-checkpoint-1"], engine="vllm",
                           model_name="hd16", storage_root=storage_root, timeout=600)  # fmt: skip
    print(f"hd16 (vllm) failed in {time.monotonic() - start:.1f} s")
    failed = get_deployment("hd16")  # listed, with why, until stopped
    assert failed.status == "DEPLOY_FAILED" and HEAD_DIM in failed.cause, failed
    stop_deployment("hd16", storage_root=storage_root)
    assert list_deployments() == []


def test_an_engine_that_dies_later_and_cannot_come_back_is_listed_with_why(broken, ray_cluster):
    job, storage_root = broken
    start = time.monotonic()
    deployment = deploy_checkpoints(job_id=job.id, checkpoints=["healthy-checkpoint-1"],
                                    engine="vllm", model_name="healthy", storage_root=storage_root,
                                    timeout=600)  # fmt: skip
    print(f"healthy (vllm) ready in {time.monotonic() - start:.1f} s")
    assert deployment.status == "RUNNING" and deployment.cause == ""
    client = openai.OpenAI(base_url=deployment.url, api_key="unused", max_retries=0)
    done = client.completions.create(model="healthy", prompt="the dog", max_tokens=4, temperature=0)
    assert done.usage is not None and done.usage.completion_tokens >= 1

    # Its checkpoint changes under it where vLLM loads it from, so that no engine can load it
    # again; then its engine is killed, as the kernel's OOM killer would.
    (manifest,) = [m for m in job.checkpoints() if m.name == "healthy-checkpoint-1"]
    config = Path(StorageRoot(storage_root).path(manifest.files_dir)) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "no-such-arch"}))
    _engine_core(ray_cluster.dashboard_url, "healthy").kill()

    _listed("healthy", lambda d: d.status != "RUNNING", "the dead engine noticed", 60)
    listed = _listed("healthy", lambda d: "no-such-arch" in d.cause,
                     "the replacement's failure listed", 300)  # fmt: skip
    assert listed.status in ("UNHEALTHY", "DEPLOY_FAILED"), listed
    assert listed.cause.startswith("RuntimeError: the vllm engine could not start"), listed.cause
    stop_deployment("healthy", storage_root=storage_root)


def _listed(name: str, done: Callable[[Deployment], bool], what: str, timeout: float) -> Deployment:
    """The deployment as listed once `done` holds; the last listing if it never does."""
    deadline = time.monotonic() + timeout
    while not done(listed := get_deployment(name)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {listed}"
        time.sleep(1)
    return listed


def _engine_core(dashboard_url: str, app: str) -> psutil.Process:
    """The vLLM EngineCore process under the application's engine replica."""
    details = ServeSubmissionClient(dashboard_url).get_serve_details()
    deployments = details["applications"][app]["deployments"]
    pids = [r["pid"] for name, d in deployments.items() if "Server" in name
            for r in d["replicas"] if r["state"] == "RUNNING"]  # fmt: skip
    (pid,) = pids
    cores = [p for p in psutil.Process(pid).children(recursive=True) if "EngineCore" in p.name()]
    (core,) = cores
    return core
