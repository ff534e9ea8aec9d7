"""The embedded local Ray cluster, for real: one loopback-only cluster per module."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from orchestrator.cli.cmd_cluster import cluster_app
from orchestrator.cluster.auth import TOKEN_FILE, token_file
from orchestrator.cluster.local import (
    LocalCluster,
    LocalClusterError,
    LocalClusterInfo,
    embedded_env,
    use_embedded_env,
)
from orchestrator.home import ORCHESTRATOR_HOME_ENV

pytestmark = pytest.mark.cluster  # starts Ray itself (a simulated or local cluster)

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("orchestrator-home")


@pytest.fixture(scope="module")
def cluster(home: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(home / "local-cluster")
    temp_dir = None
    try:
        began = time.monotonic()
        temp_dir = local.ensure_running(num_cpus=2).temp_dir
        print(f"local cluster started in {time.monotonic() - began:.2f} s")
        yield local
    finally:
        local.stop()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)  # Ray's logs for this test cluster


@pytest.fixture(scope="module")
def info(cluster: LocalCluster) -> LocalClusterInfo:
    running = cluster.status()
    assert running is not None
    return running


def get_json(url: str, token: str | None = None) -> object:
    """A GET with the cluster's token (the embedded cluster demands it)."""
    request = urllib.request.Request(url)
    request.add_header("Authorization", f"Bearer {token or token_file().read_text()}")
    with NO_PROXY.open(request, timeout=5) as response:
        assert response.status == 200
        return json.loads(response.read())


def process_group(pid: int) -> list[psutil.Process]:
    """The process and every other live process in its process group (and its descendants)."""
    leader = psutil.Process(pid)
    pgid = os.getpgid(pid)
    members = {leader.pid: leader, **{c.pid: c for c in leader.children(recursive=True)}}
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                members[p.pid] = p
        except (OSError, psutil.Error):
            continue
    return list(members.values())


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    living = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                living.append(p)
        except psutil.Error:
            continue
    return living


def wait_until_gone(processes: list[psutil.Process], timeout: float = 20) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(processes)


def test_cluster_answers_on_loopback_only(cluster: LocalCluster, info: LocalClusterInfo):
    assert info.dashboard_url.startswith("http://127.0.0.1:")
    assert info.gcs_address.startswith("127.0.0.1:")
    assert get_json(info.dashboard_url + "/api/version")
    assert isinstance(get_json(info.dashboard_url + "/api/jobs/"), list)
    assert psutil.pid_exists(info.pid)
    assert json.loads(cluster.state_file.read_text())["pid"] == info.pid

    listening = [
        (p.pid, conn.laddr.ip)
        for p in process_group(info.pid)
        for conn in p.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    ]
    assert listening
    exposed = [(pid, ip) for pid, ip in listening if ip not in ("127.0.0.1", "::ffff:127.0.0.1")]
    assert not exposed, f"Ray processes listen beyond loopback: {exposed}"


def test_ensure_running_reuses_the_cluster(cluster: LocalCluster, info: LocalClusterInfo):
    began = time.monotonic()
    again = cluster.ensure_running()
    elapsed = time.monotonic() - began
    print(f"local cluster reused in {elapsed * 1000:.1f} ms")
    assert again == info
    assert elapsed < 1
    # A second handle on the same state dir (as the next CLI command would have) finds it too.
    assert LocalCluster(cluster.state_dir).ensure_running() == info


def test_start_refuses_a_second_cluster(cluster: LocalCluster, info: LocalClusterInfo):
    with pytest.raises(LocalClusterError, match="already running"):
        cluster.start()


@contextlib.contextmanager
def frozen_dashboard(info: LocalClusterInfo) -> Iterator[None]:
    """The head's dashboard process stopped (SIGSTOP), as a loaded machine leaves it unanswered
    for seconds; continued after, whatever happens."""
    (dashboard,) = [p for p in process_group(info.pid)
                    if "dashboard/dashboard.py" in " ".join(p.cmdline())]  # fmt: skip
    dashboard.suspend()
    try:
        yield
    finally:
        dashboard.resume()


def test_a_cluster_whose_dashboard_is_slow_to_answer_is_waited_for_not_replaced(
    cluster: LocalCluster, info: LocalClusterInfo, monkeypatch: pytest.MonkeyPatch
):
    """A busy head's dashboard answering late used to read as a stale record: a second cluster
    started beside it and the first was orphaned with its jobs."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    with frozen_dashboard(info):
        found = pool.submit(LocalCluster(cluster.state_dir).ensure_running)
        time.sleep(4)  # the pause a command must sit out: longer than one request's 2 s
        assert not found.done()
    assert found.result(timeout=60) == info
    assert cluster.status() == info
    ray_starts = [p for p in psutil.process_iter(["cmdline"])
                  if "--block" in (p.info["cmdline"] or []) and p.pid != info.pid
                  and str(cluster.state_dir) in _cwd(p)]  # fmt: skip
    assert not ray_starts, "a second cluster was started beside the running one"

    # One that never answers is named, and left running: its jobs are not ours to end.
    monkeypatch.setattr("orchestrator.cluster.local.DASHBOARD_PATIENCE_S", 1.0)
    with frozen_dashboard(info), pytest.raises(LocalClusterError, match="left running") as e:
        LocalCluster(cluster.state_dir).ensure_running()
    assert f"pid {info.pid}" in str(e.value)
    assert cluster.status() == info


def _cwd(process: psutil.Process) -> str:
    try:
        return process.cwd()
    except psutil.Error:
        return ""


def test_job_submission_api_runs_a_job(info: LocalClusterInfo):
    from ray.job_submission import JobStatus, JobSubmissionClient

    use_embedded_env()  # RAY_AUTH_TOKEN_PATH: what `ray job submit` on this machine needs
    client = JobSubmissionClient(info.dashboard_url)
    # `python` in an entrypoint is the interpreter the cluster runs on, Ray included.
    job_id = client.submit_job(entrypoint="python -c \"import ray; print('hi')\"")
    deadline = time.monotonic() + 45
    status = client.get_job_status(job_id)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(0.2)
        status = client.get_job_status(job_id)
    assert status == JobStatus.SUCCEEDED, client.get_job_logs(job_id)
    assert "hi" in client.get_job_logs(job_id)


def test_cli_reports_the_running_cluster(
    home: Path, info: LocalClusterInfo, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(ORCHESTRATOR_HOME_ENV, str(home))
    result = CliRunner().invoke(cluster_app, ["status"])
    assert result.exit_code == 0, result.output
    assert "running" in result.output and info.dashboard_url in result.output


def test_concurrent_commands_share_one_cluster_that_outlives_them_and_stops(tmp_path: Path):
    """Two processes racing to start get one cluster; it survives them; stop() ends it all."""
    state_dir = tmp_path / "local-cluster"
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from orchestrator.cluster.local import LocalCluster
        print(LocalCluster(Path({str(state_dir)!r})).ensure_running().pid)
        """
    )
    racers = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    cluster = LocalCluster(state_dir)
    try:
        pids = {int(r.communicate(timeout=90)[0].strip()) for r in racers}
        assert all(r.returncode == 0 for r in racers)
        assert len(pids) == 1
        info = cluster.status()
        assert info is not None and info.pid in pids  # outlived the processes that started it
        family = process_group(info.pid)
        assert len(family) > 3  # gcs_server, raylet, dashboard, ...
    finally:
        began = time.monotonic()
        stopped = cluster.stop()
        print(f"local cluster stopped in {time.monotonic() - began:.2f} s")
    assert stopped
    if info.temp_dir:
        shutil.rmtree(info.temp_dir, ignore_errors=True)
    assert wait_until_gone(family) == []
    assert cluster.status() is None
    assert not cluster.state_file.exists()
    assert cluster.stop() is False


def test_status_clears_a_stale_state_file(tmp_path: Path):
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    dead_pid = int(finished.stdout)
    cluster = LocalCluster(tmp_path)
    cluster.state_file.write_text(
        json.dumps(
            {
                "dashboard_url": "http://127.0.0.1:9",
                "gcs_address": "127.0.0.1:9",
                "pid": dead_pid,
                "temp_dir": None,
                "started_at": 0,
            }
        )
    )
    assert cluster.status() is None
    assert not cluster.state_file.exists()
    assert cluster.stop() is False


def test_embedded_env_keeps_clients_on_loopback_and_names_the_token_by_its_file():
    env = embedded_env()
    assert env == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
                   "RAY_AUTH_TOKEN_PATH": str(token_file())}  # fmt: skip
    assert token_file().read_text() not in "".join(env.values())
    assert stat.S_IMODE(token_file().stat().st_mode) == 0o600


def test_the_cluster_refuses_a_request_without_its_token_or_with_another(info):
    for token, code in ((None, 401), ("not-the-token", 403)):
        request = urllib.request.Request(f"{info.dashboard_url}/api/jobs/")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with pytest.raises(urllib.error.HTTPError) as refused:
            NO_PROXY.open(request, timeout=5)
        assert refused.value.code == code
    assert isinstance(get_json(f"{info.dashboard_url}/api/jobs/"), list)  # with it


def test_two_first_uses_at_once_make_one_token(tmp_path: Path):
    """Two commands starting on a new home at once: one token file, whole, that both use."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(lambda _: token_file(tmp_path), range(8)))
    assert set(paths) == {tmp_path / TOKEN_FILE}
    assert len(paths[0].read_text()) == 64 and list(tmp_path.iterdir()) == [paths[0]]


def test_a_failed_start_reports_rays_own_message_and_leaves_nothing(tmp_path: Path):
    cluster = LocalCluster(tmp_path / "local-cluster")
    with pytest.raises(LocalClusterError, match="exited with code") as failure:
        cluster.ensure_running(resources={"CPU": 1}, timeout=30)  # Ray wants --num-cpus for CPU
    assert "--num-cpus" in str(failure.value)  # the tail of ray-start.log
    assert not cluster.state_file.exists()
    assert cluster.status() is None


def test_a_client_given_the_embedded_clusters_address_uses_its_token(home: Path, info):
    """`--address http://127.0.0.1:PORT` (what `cluster status` prints) reaches the embedded
    cluster as well as no address does: the client finds the token the cluster started with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env[ORCHESTRATOR_HOME_ENV] = str(home)
    client = f"connect({info.dashboard_url!r}).client()"
    code = ("from orchestrator.client.connection import connect; "
            f"print(type({client}.list_jobs()).__name__)")  # fmt: skip
    listed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert listed.returncode == 0 and listed.stdout.strip() == "list", listed.stderr
