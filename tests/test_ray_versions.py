"""The Ray versions orchestrator supports, and each private Ray call with its API absent: the
public fallback runs (said once in the log) or our error names the Ray found and the range. No
Ray is started: these run on every Ray of the range (tests/ray-floor-lane.sh runs them on the
floor)."""

from __future__ import annotations

import logging
import re
import sys
import types
from pathlib import Path

import pytest

from orchestrator import ray_private
from orchestrator.client.connection import Connection
from orchestrator.errors import OrchestratorError, RayPrivateApiMissing, RayVersionError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_told(monkeypatch):
    monkeypatch.setattr(ray_private, "_told", set())


def test_the_supported_range_is_pyprojects_and_the_docs_say_it():
    pyproject = (REPO / "pyproject.toml").read_text()
    found = re.search(r'"ray\[default,train,serve\](>=[0-9.]+,<[0-9.]+)"', pyproject)
    assert found and found.group(1) == ray_private.SUPPORTED_RAY
    assert f'"ray[llm]{ray_private.SUPPORTED_RAY}"' in pyproject
    for doc in ("README.md", "docs/cluster.md"):
        assert ray_private.SUPPORTED_RAY in (REPO / doc).read_text(), doc


def test_the_installed_ray_is_in_the_range_and_has_every_private_api_we_call():
    """On this Ray no fallback is taken: every private API ray_private uses is there."""
    assert ray_private.is_supported(ray_private.ray_version())
    for module, name in [
        ("ray._private.state", "available_resources_per_node"),
        ("ray._private.state", "jobs"),
        ("ray._private.services", "get_webui_url_from_internal_kv"),
        ("ray._private.worker", "global_worker"),
        ("ray._private.ray_constants", "KV_NAMESPACE_JOB"),
        ("ray.experimental.internal_kv", "_internal_kv_get"),
        ("ray.experimental.internal_kv", "_internal_kv_put"),
        ("ray.dashboard.modules.job.common", "JobInfo"),
        ("ray.dashboard.modules.job.common", "JobInfoStorageClient"),
        ("ray.dashboard.modules.serve.sdk", "ServeSubmissionClient"),
        ("ray._raylet", "AuthenticationTokenLoader"),
        ("ray._raylet", "Config"),
        ("ray.core.generated.node_manager_pb2", "PrestartWorkersRequest"),
        ("ray._private.grpc_utils", "init_grpc_channel"),
    ]:
        assert ray_private._private(module, name) is not None
    from ray._private.state import state
    from ray.job_submission import JobSubmissionClient

    assert hasattr(state, "get_draining_nodes")
    assert hasattr(JobSubmissionClient, "_do_request")


@pytest.mark.parametrize(
    ("version", "ok"),
    [("2.52.1", True), ("2.55.1", True), ("2.60.0", True), ("2.60.1", True), ("2.52.0", False),
     ("2.51.2", False), ("2.50.1", False), ("2.61.0", False), ("3.0.0", False),
     ("not-a-version", False)],
)  # fmt: skip
def test_the_range(version, ok):
    assert ray_private.is_supported(version) is ok
    said = ray_private.unsupported(version)
    assert (said is None) is ok
    if not ok:
        assert version in said and ray_private.SUPPORTED_RAY in said and "pip install" in said


def test_a_mismatch_says_both_versions_and_what_to_install():
    assert ray_private.mismatch("2.60.0", "2.60.0", "http://h:8265") is None
    said = ray_private.mismatch("2.60.0", "2.58.0", "http://h:8265")
    assert "2.60.0" in said and "2.58.0" in said and "http://h:8265" in said
    assert "pip install 'ray[default,train,serve]==2.58.0'" in said
    old = ray_private.mismatch("2.60.0", "2.50.1", "http://h:8265")
    assert "2.50.1" in old and "upgrade the cluster" in old and ray_private.SUPPORTED_RAY in old


def test_a_cluster_outside_the_range_is_refused_even_when_the_client_matches(monkeypatch):
    monkeypatch.setattr(ray_private, "ray_version", lambda: "2.62.0")
    with pytest.raises(RayVersionError, match=r"2\.62\.0.*does not support"):
        ray_private.check_cluster_ray("2.62.0", "http://h:8265")


def test_rays_own_init_mismatch_becomes_one_line_of_ours():
    text = ("Version mismatch: The cluster was started with:\n    Ray: 2.58.0\n    Python: 3.11.7"
            "\nThis process on node 127.0.0.1 was started with:\n    Ray: 2.60.0\n"
            "    Python: 3.11.7\n")  # fmt: skip
    error = ray_private.init_mismatch(RuntimeError(text))
    assert isinstance(error, RayVersionError)
    assert "this client runs Ray 2.60.0" in str(error) and "runs Ray 2.58.0" in str(error)
    assert ray_private.init_mismatch(RuntimeError("something else")) is None
    python = ray_private.init_mismatch(
        RuntimeError(text.replace("2.58.0", "2.60.0").replace("3.11.7\nThis", "3.12.1\nThis"))
    )
    assert "Python 3.11.7 and the cluster Python 3.12.1" in str(python)  # fmt: skip


# -- push: the mismatch said before anything is stored -------------------------------------------


def test_push_to_a_cluster_of_another_ray_submits_nothing_and_says_both(tmp_path, monkeypatch):
    """Refused before anything is queued or submitted; the job is recorded DEPLOY_FAILED with
    the reason, as any refusal of the cluster's is."""
    from conftest import make_job

    from orchestrator.client import submit
    from orchestrator.client.prepare import prepare_job
    from orchestrator.lifecycle import JobState
    from orchestrator.storage.job_store import JobStore
    from orchestrator.storage.queue_store import QueueStore
    from orchestrator.storage.root import StorageRoot

    submitted = []
    monkeypatch.setattr(
        ray_private,
        "cluster_version",
        lambda client: {"ray_version": "2.58.0", "session_name": "s"},
    )
    monkeypatch.setattr(Connection, "client", lambda self: object())
    monkeypatch.setattr(submit, "submit_ray_job", lambda *a, **k: submitted.append(a))  # fmt: skip
    config = make_job(tmp_path / "job", CONFIG)
    root = StorageRoot(tmp_path / "storage")
    connection = Connection(address="http://10.0.0.7:8265", embedded=False)
    monkeypatch.setenv("ORCHESTRATOR_SHARED_FILESYSTEM", "1")
    with pytest.raises(RayVersionError) as raised:
        submit.submit(prepare_job(config), connection, root)
    said = str(raised.value)
    assert ray_private.ray_version() in said and "2.58.0" in said and "10.0.0.7" in said
    assert "pip install 'ray[default,train,serve]==2.58.0'" in said
    assert isinstance(raised.value, OrchestratorError)  # the CLI prints it as one line
    assert submitted == []
    assert QueueStore(root).incoming() == [] and QueueStore(root).entries() == []
    (job_id,) = JobStore(root).job_ids()
    status = JobStore(root).status(job_id)
    assert status.state == JobState.DEPLOY_FAILED and "2.58.0" in status.failure.cause


CONFIG = """
from orchestrator import definitions as d
project = d.TrainingProject(name="versions", job=d.TrainingJob(
    image=d.Image(base_image="python:3.11"), compute=d.Compute(cpu_count=1),
    runtime=d.Runtime(start_commands=["true"])))
"""


# -- each private call with its API absent --------------------------------------------------------


def _absent(monkeypatch, module: str, name: str | None = None) -> None:
    """`module` (or its attribute `name`) as a Ray without it has it."""
    import importlib

    if name is None:
        real = importlib.import_module

        def without(target, *args, **kwargs):
            if target == module:
                raise ImportError(f"No module named {module!r}")
            return real(target, *args, **kwargs)

        monkeypatch.setattr(importlib, "import_module", without)
    else:
        monkeypatch.delattr(importlib.import_module(module), name)


@pytest.mark.parametrize(
    ("call", "module", "name"),
    [
        (ray_private.available_resources_per_node, "ray._private.state",
         "available_resources_per_node"),
        (ray_private.driver_jobs, "ray._private.state", "jobs"),
        (lambda: ray_private.kv_get(b"k"), "ray.experimental.internal_kv", "_internal_kv_get"),
        (lambda: ray_private.kv_put(b"k", b"v"), "ray.experimental.internal_kv",
         "_internal_kv_put"),
        (lambda: ray_private.serve_submission_client("http://h:8265"),
         "ray.dashboard.modules.serve.sdk", None),
    ],
)  # fmt: skip
def test_a_call_with_no_public_way_raises_ours_naming_the_versions(monkeypatch, call, module, name):
    _absent(monkeypatch, module, name)
    with pytest.raises(RayPrivateApiMissing) as raised:
        call()
    said = str(raised.value)
    assert f"this Ray ({ray_private.ray_version()})" in said and module in said
    assert ray_private.SUPPORTED_RAY in said and "pip install" in said


def test_the_job_drivers_place_without_the_workers_node_raises_ours(monkeypatch):
    import ray._private.worker

    monkeypatch.setattr(
        ray._private.worker, "global_worker", types.SimpleNamespace(connected=False)
    )
    with pytest.raises(RayPrivateApiMissing) as raised:
        ray_private.job_driver_place()
    said = str(raised.value)
    assert "global_worker.node" in said and ray_private.SUPPORTED_RAY in said


def test_draining_nodes_falls_back_to_none_and_says_so_once(monkeypatch, caplog):
    from ray._private import state

    monkeypatch.delattr(type(state.state), "get_draining_nodes")
    with caplog.at_level(logging.WARNING, logger="orchestrator.ray_private"):
        assert ray_private.draining_nodes() == {}
        assert ray_private.draining_nodes() == {}
    lost = [r.getMessage() for r in caplog.records]
    assert len(lost) == 1 and "drain" in lost[0] and ray_private.ray_version() in lost[0]


def test_dashboard_address_falls_back_to_none_and_says_so(monkeypatch, caplog):
    import ray._private.worker

    _absent(monkeypatch, "ray._private.services", "get_webui_url_from_internal_kv")
    # a worker with no node info (Ray's own logging filter reads global_worker: keep one)
    monkeypatch.setattr(
        ray._private.worker, "global_worker", types.SimpleNamespace(connected=False)
    )
    with caplog.at_level(logging.WARNING, logger="orchestrator.ray_private"):
        assert ray_private.dashboard_address() is None
    assert "--address" in caplog.records[0].getMessage()


def test_the_dashboards_job_row_is_skipped_and_said_without_rays_table(monkeypatch, caplog):
    _absent(monkeypatch, "ray.dashboard.modules.job.common")
    with caplog.at_level(logging.WARNING, logger="orchestrator.ray_private"):
        ray_private.put_job_row("j1", {"status": "RUNNING", "entrypoint": "x"})
        ray_private.end_job_row("j1", "SUCCEEDED", "done")
    assert len(caplog.records) == 1 and "Jobs page" in caplog.records[0].getMessage()


def test_prestarting_workers_is_skipped_and_said_without_the_raylet_call(monkeypatch, caplog):
    from ray.core.generated import node_manager_pb2

    monkeypatch.delattr(node_manager_pb2, "PrestartWorkersRequest")
    with caplog.at_level(logging.WARNING, logger="orchestrator.ray_private"):
        ray_private.prestart_workers("127.0.0.1:1", "01000000", "{}", 1, 10)
        ray_private.prestart_workers("127.0.0.1:1", "01000000", "{}", 1, 10)
    assert len(caplog.records) == 1 and "slower" in caplog.records[0].getMessage()


def test_the_version_is_asked_over_plain_http_without_do_request(monkeypatch, caplog, tmp_path):
    import requests

    asked = {}

    class Answer:
        status_code = 200

        def json(self):
            return {"ray_version": "2.60.0", "session_name": "session_x"}

    def get(url, headers, timeout):
        asked.update(url=url, headers=headers)
        return Answer()

    class OldClient:  # a JobSubmissionClient of a Ray whose _do_request has another name
        def get_address(self):
            return "http://127.0.0.1:8265"

    token = tmp_path / "token"
    token.write_text("tok-123\n")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.setattr(requests, "get", get)
    with caplog.at_level(logging.WARNING, logger="orchestrator.ray_private"):
        assert ray_private.cluster_version(OldClient())["session_name"] == "session_x"
    assert asked == {"url": "http://127.0.0.1:8265/api/version",
                     "headers": {"Authorization": "Bearer tok-123"}}  # fmt: skip
    assert "_do_request" in caplog.records[0].getMessage()


def test_the_token_cache_reset_without_rays_loader_raises_ours(monkeypatch, tmp_path):
    from orchestrator.cluster import auth

    monkeypatch.setitem(sys.modules, "ray._raylet", types.ModuleType("ray._raylet"))
    monkeypatch.setattr(auth, "_told", None)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    with pytest.raises(RayPrivateApiMissing) as raised:
        auth.use_token(tmp_path / "token")
    said = str(raised.value)
    assert "AuthenticationTokenLoader" in said and ray_private.SUPPORTED_RAY in said


def test_the_token_cache_reset_reaches_rays_loader(monkeypatch, tmp_path):
    from orchestrator.cluster import auth

    calls = []
    fake = types.ModuleType("ray._raylet")
    fake.Config = types.SimpleNamespace(initialize=lambda s: calls.append("config"))  # type: ignore[attr-defined]
    loader = types.SimpleNamespace(reset_cache=lambda: calls.append("reset"))
    fake.AuthenticationTokenLoader = types.SimpleNamespace(instance=lambda: loader)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray._raylet", fake)
    monkeypatch.setattr(auth, "_told", None)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    auth.use_token(tmp_path / "token")
    assert calls == ["config", "reset"]


# -- on a real cluster: what the floor lane's smoke needs besides the tests it borrows -----------


@pytest.mark.cluster
def test_a_job_queued_behind_another_is_admitted_when_it_ends(tmp_path, storage_root, ray_cluster):
    """The queue on this Ray: a job that finds every CPU held waits PENDING in the queue, and is
    admitted (once) when the job ahead of it ends."""
    from conftest import eventually
    from ray.util.state import list_nodes
    from test_jobs import cpu_job

    from orchestrator.client.api import push
    from orchestrator.lifecycle import JobState

    cpus = int(max(n.resources_total.get("CPU", 0) for n in
                   list_nodes(address=ray_cluster.dashboard_url, detail=True)))  # fmt: skip
    gate = tmp_path / "gate"
    wait = (
        f"import pathlib, time\nwhile not pathlib.Path({str(gate)!r}).exists(): time.sleep(0.1)\n"
    )
    first = push(cpu_job(tmp_path / "first", ["python wait.py"], {"wait.py": wait}, name="first",
                         cpus=cpus), storage_root=storage_root)  # fmt: skip
    eventually(lambda: first.status() == JobState.RUNNING, "the first job to hold every CPU", 90)
    second = push(cpu_job(tmp_path / "second", ["echo admitted"], name="second", cpus=cpus),
                  storage_root=storage_root)  # fmt: skip
    eventually(lambda: second.status() == JobState.PENDING, "the second job to queue", 60)
    eventually(lambda: "waiting in the queue" in (second.details().history[-1].reason or ""),
               "its reason", 30)  # fmt: skip
    gate.touch()
    assert first.wait(timeout=120) == JobState.COMPLETED
    assert second.wait(timeout=120) == JobState.COMPLETED, second.details().failure
    history = second.details().history
    ended = next(e.at for e in first.details().history if e.state == JobState.COMPLETED)
    running = next(e.at for e in history if e.state == JobState.RUNNING)
    assert running >= ended - 1.0  # admitted once the first let go (its end is recorded first)
    assert sum(1 for e in history if e.state == JobState.DEPLOYING) == 1
    assert any("admitted" in line for line in second.logs())


def test_the_session_name_comes_from_the_node_where_the_runtime_context_has_none(monkeypatch):
    """Ray 2.52's RuntimeContext has no get_session_name."""
    import ray
    import ray._private.worker

    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace())
    node = types.SimpleNamespace(session_name="session_2026-12-02_x")
    monkeypatch.setattr(
        ray._private.worker, "global_worker", types.SimpleNamespace(node=node, connected=False)
    )
    assert ray_private.session_name() == "session_2026-12-02_x"
    monkeypatch.setattr(
        ray._private.worker, "global_worker", types.SimpleNamespace(connected=False)
    )
    with pytest.raises(RayPrivateApiMissing, match="get_session_name"):
        ray_private.session_name()


def test_orchestrator_run_under_ray_job_submit_says_a_mismatch_in_one_line(monkeypatch):
    """`ray job submit -- python -m orchestrator run` with a Python whose Ray is not the
    cluster's: Ray's ray.init refuses with a paragraph; ours names both and what to install."""
    import ray

    from orchestrator.cli import cmd_run

    def refuse(**kwargs):
        raise RuntimeError("Version mismatch: The cluster was started with:\n    Ray: 2.58.0\n"
                           "    Python: 3.11.7\nThis process on node 10.0.0.7 was started with:"
                           f"\n    Ray: {ray.__version__}\n    Python: 3.11.7\n")  # fmt: skip

    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(RayVersionError) as raised:
        cmd_run._dashboard_url()
    said = str(raised.value)
    assert f"this client runs Ray {ray.__version__}" in said and "runs Ray 2.58.0" in said
    assert "pip install 'ray[default,train,serve]==2.58.0'" in said


def test_the_floor_lane_runs_the_floor_of_the_range_and_tests_that_exist():
    """tests/ray-floor-lane.sh reads its Ray from pyproject.toml's range, and every test it
    names is still there (a rename would make the lane run nothing of it)."""
    import subprocess

    script = (REPO / "tests" / "ray-floor-lane.sh").read_text()
    reader = re.search(r"floor=\$\(python3 -c '(.+?)'\)", script)
    assert reader is not None
    floor = subprocess.run(["python3", "-c", reader.group(1)], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.strip()  # fmt: skip
    assert ray_private.SUPPORTED_RAY.startswith(f">={floor},")
    named = re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", script)
    assert len(named) >= 6
    for path, test in named:
        assert (REPO / path).is_file(), path
        if test:
            assert f"def {test}(" in (REPO / path).read_text(), f"{path}::{test}"
    assert "tests/ray-floor-lane.sh" in (REPO / ".ci" / "run").read_text()


def test_a_ray_outside_the_range_failing_on_what_it_lacks_is_one_line(monkeypatch, capsys):
    """The net under ray_private: any verb on an unsupported Ray that hits a missing name."""
    from orchestrator.cli import app as cli_app

    def lacking():
        raise ImportError("cannot import name 'AuthenticationTokenLoader' from 'ray._raylet'")

    monkeypatch.setattr(cli_app, "app", lacking)
    monkeypatch.setattr(ray_private, "ray_version", lambda: "2.50.1")
    with pytest.raises(SystemExit) as exited:
        cli_app.main()
    assert exited.value.code == 1
    said = capsys.readouterr().err
    assert "2.50.1" in said and ray_private.SUPPORTED_RAY in said
    assert "AuthenticationTokenLoader" in said
    monkeypatch.setattr(ray_private, "ray_version", lambda: "2.60.0")
    with pytest.raises(ImportError):  # a supported Ray: a bug of ours, shown as one
        cli_app.main()
