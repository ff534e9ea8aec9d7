"""The embedded local Ray cluster: a loopback-only `ray start --head --block` that outlives the CLI.

With no `RAY_ADDRESS` and no `--address`, commands start (or reuse) one such cluster per state
directory. It runs in its own session, so jobs keep running after `orchestrator push` returns; its
pid and addresses are recorded in `cluster.json` so the next command finds it. A file lock keeps
two commands from starting two clusters at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from orchestrator.errors import LocalClusterError
from orchestrator.home import orchestrator_home

LOOPBACK = "127.0.0.1"

_STATE_FILE = "cluster.json"
_LOCK_FILE = "lock"
_LOG_FILE = "ray-start.log"
_START_ATTEMPTS = 3  # a picked port can be taken before Ray binds it: retry with fresh ones
_POLL_INTERVAL_S = 0.1
# Our requests to the dashboard go straight to loopback, whatever HTTP(S)_PROXY says.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# What every cluster that runs orchestrator jobs should have in `ray start`'s environment (the
# job supervisor reads it from there): a stopping job's controller gets 60 s, not Ray's 3 s, to
# stop its commands and record STOPPED. Passing it per job as a runtime_env would cost every
# job's actors Ray's pooled workers (0.3-0.6 s each, docs/performance.md).
#
# GRPC_ENABLE_FORK_SUPPORT=false: the Ray Client server (behind `orchestrator shell`) forks a
# server per client from a process busy with gRPC; with gRPC's fork handlers on, about 1 start in
# 12 died here at once or after 30 s (ray-project/ray#63202); with them off, none in 66. Every
# such fork is followed by exec, the case gRPC documents that setting for.
CLUSTER_ENV = {"RAY_JOB_STOP_WAIT_TIME_S": "60", "GRPC_ENABLE_FORK_SUPPORT": "false"}


def embedded_env() -> dict[str, str]:
    """Environment every process talking to the embedded cluster needs (the cluster's own too).

    Without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 Ray replaces 127.0.0.1 by the machine's interface
    address and clients hang; Ray 2.60 turns token auth on for local clusters, which a cluster that
    only listens on loopback does not need.
    """
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


@dataclass(frozen=True)
class LocalClusterInfo:
    """Where the embedded cluster listens and which process owns it."""

    dashboard_url: str  # the Job Submission API endpoint, "http://127.0.0.1:<port>"
    gcs_address: str  # "127.0.0.1:<port>", for ray.init(address=...)
    pid: int  # our `ray start --head --block` process
    temp_dir: str | None
    client_address: str | None = None  # "ray://127.0.0.1:<port>": Ray Client (`shell`'s terminal)


class LocalCluster:
    """Start, find and stop the embedded Ray cluster recorded in `state_dir`."""

    def __init__(self, state_dir: Path | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir else orchestrator_home() / "local-cluster"
        self.state_file = self.state_dir / _STATE_FILE
        self.log_file = self.state_dir / _LOG_FILE
        self._process: subprocess.Popen[bytes] | None = None  # set when we started it

    # -- public API --------------------------------------------------------------------------

    def status(self) -> LocalClusterInfo | None:
        """The recorded cluster if it is alive and its dashboard answers; clears a stale record."""
        with self._locked():
            return self._status_locked()

    def ensure_running(
        self,
        *,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        resources: dict[str, float] | None = None,
        timeout: float = 60,
    ) -> LocalClusterInfo:
        """The running cluster, starting one if there is none (resource arguments apply then)."""
        with self._locked():
            info = self._status_locked()
            if info is not None:
                return info
            return self._start_locked(num_cpus, num_gpus, resources, timeout)

    def start(
        self,
        *,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        resources: dict[str, float] | None = None,
        timeout: float = 60,
    ) -> LocalClusterInfo:
        """Start a new cluster; fails if one is already running."""
        with self._locked():
            info = self._status_locked()
            if info is not None:
                raise LocalClusterError(
                    f"a local Ray cluster is already running at {info.dashboard_url} "
                    f"(pid {info.pid}); stop it first with `orchestrator cluster stop`"
                )
            return self._start_locked(num_cpus, num_gpus, resources, timeout)

    def stop(self, timeout: float = 30) -> bool:
        """Stop the cluster's jobs, then the cluster and every process it started.

        Jobs are stopped through the Job API first, so each records STOPPED (and Ray does not
        spend 30 s draining busy workers). False if no cluster was running.
        """
        with self._locked():
            state = self._read_state()
            if state is None:
                return False
            process = _recorded_process(state)
            info = _info_from_state(state)
            if process is not None and info is not None:
                _stop_jobs(info.dashboard_url, timeout)
            self.state_file.unlink(missing_ok=True)
            if process is None:
                return False
            _terminate(process, timeout, self._process)
            self._process = None
            return True

    # -- internals (callers hold the lock) ---------------------------------------------------

    def _status_locked(self) -> LocalClusterInfo | None:
        state = self._read_state()
        if state is None:
            return None
        info = _info_from_state(state)
        if (
            info is not None
            and _recorded_process(state) is not None
            and _dashboard_answers(info.dashboard_url)
        ):
            return info
        self.state_file.unlink(missing_ok=True)
        return None

    def _start_locked(
        self,
        num_cpus: int | None,
        num_gpus: int | None,
        resources: dict[str, float] | None,
        timeout: float,
    ) -> LocalClusterInfo:
        deadline = time.monotonic() + timeout
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                return self._launch(num_cpus, num_gpus, resources, deadline)
            except _PortTakenError:
                if attempt == _START_ATTEMPTS or time.monotonic() >= deadline:
                    raise LocalClusterError(
                        f"could not start the local Ray cluster: other programs took its ports "
                        f"({attempt} attempts); try again. Log tail:\n{self._log_tail()}"
                    ) from None
        raise AssertionError("unreachable")

    def _launch(
        self,
        num_cpus: int | None,
        num_gpus: int | None,
        resources: dict[str, float] | None,
        deadline: float,
    ) -> LocalClusterInfo:
        temp_dir = _temp_dir_for(self.state_dir)
        command, gcs_port, dashboard_port, client_port = ray_start_command(
            temp_dir, num_cpus=num_cpus, num_gpus=num_gpus, resources=resources
        )
        env = {**os.environ, **embedded_env(), **CLUSTER_ENV}
        env.pop("RAY_ADDRESS", None)
        # `stop` ends the jobs through the Job API first; what is left (detached actors, e.g.
        # Ray Train's autoscaling coordinator) is not worth Ray's 30 s drain on SIGTERM.
        env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "5")
        # Job entrypoints are shell commands: let their `python` be this (Ray-equipped) one.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        with open(self.log_file, "wb") as log:
            log.write(f"$ {shlex.join(command)}\n".encode())
            log.flush()
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.state_dir,
                env=env,
                start_new_session=True,  # survives the CLI, and is its own process group
            )
        self._process = process
        info = LocalClusterInfo(
            dashboard_url=f"http://{LOOPBACK}:{dashboard_port}",
            gcs_address=f"{LOOPBACK}:{gcs_port}",
            pid=process.pid,
            temp_dir=temp_dir,
            client_address=f"ray://{LOOPBACK}:{client_port}",
        )
        # Record it before waiting, so a CLI killed mid-start leaves a cluster we can still stop.
        self._write_state(info, psutil.Process(process.pid).create_time())
        try:
            self._wait_until_ready(info, process, deadline)
        except BaseException:
            with contextlib.suppress(psutil.NoSuchProcess):
                _terminate(psutil.Process(process.pid), 10, process)
            process.poll()
            self.state_file.unlink(missing_ok=True)
            self._process = None
            raise
        return info

    def _wait_until_ready(
        self, info: LocalClusterInfo, process: subprocess.Popen[bytes], deadline: float
    ) -> None:
        # In order: the dashboard, its job module (loads a moment later), and the head node's
        # agent reporting in. Job submissions go through that agent, and a head stopped before
        # its raylet registers spends 30 s draining.
        for path, ready in (
            ("/api/version", _answers),
            ("/api/jobs/", _answers),
            ("/nodes?view=summary", _has_a_node),
        ):
            while not ready(info.dashboard_url + path):
                if process.poll() is not None:
                    tail = self._log_tail()
                    if "already occupied" in tail or "already in use" in tail:
                        raise _PortTakenError()
                    raise LocalClusterError(
                        f"`ray start` exited with code {process.returncode} before the local "
                        f"cluster was ready; see {self.log_file}. Log tail:\n{tail}"
                    )
                if time.monotonic() >= deadline:
                    raise LocalClusterError(
                        f"the local Ray cluster was not ready ({info.dashboard_url}{path}) in "
                        f"time; pass a longer timeout or see {self.log_file}. Log tail:\n"
                        f"{self._log_tail()}"
                    )
                time.sleep(_POLL_INTERVAL_S)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.state_dir / _LOCK_FILE, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read_state(self) -> dict[str, object] | None:
        try:
            state = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            self.state_file.unlink(missing_ok=True)  # unreadable: treat as stale
            return None
        return state if isinstance(state, dict) else None

    def _write_state(self, info: LocalClusterInfo, create_time: float) -> None:
        state = {**asdict(info), "create_time": create_time, "started_at": time.time()}
        partial = self.state_file.with_suffix(".json.tmp")
        partial.write_text(json.dumps(state, indent=2))
        partial.replace(self.state_file)

    def _log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class _PortTakenError(Exception):
    """A port we picked was taken before Ray could bind it."""


def ray_start_command(
    temp_dir: str,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    resources: dict[str, float] | None = None,
) -> tuple[list[str], int, int, int]:
    """The `ray start` command line for a loopback-only head, with its GCS, dashboard and Ray
    Client ports.

    Every port Ray would otherwise take at a fixed default (6379, 8265, 10001, 52365) is picked
    free, so the cluster coexists with any other Ray on this machine.
    """
    gcs, dashboard, client, agent_http, agent_grpc, runtime_env, metrics = _free_ports(7)
    command = [
        _ray_executable(),
        "start",
        "--head",
        "--block",
        f"--node-ip-address={LOOPBACK}",
        f"--port={gcs}",
        "--include-dashboard=true",
        f"--dashboard-host={LOOPBACK}",
        f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        command.append(f"--num-cpus={num_cpus}")
    if num_gpus is not None:
        command.append(f"--num-gpus={num_gpus}")
    if resources:
        command.append(f"--resources={json.dumps(resources)}")
    return command, gcs, dashboard, client


def _ray_executable() -> str:
    beside_python = Path(sys.executable).parent / "ray"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("ray")
    if found is None:
        raise LocalClusterError(
            "cannot find the `ray` command: install orchestrator's dependencies "
            "(`pip install 'ray[default]'`) in this environment"
        )
    return found


def _free_ports(count: int) -> list[int]:
    """Distinct ports free on loopback right now (all held open together, so no duplicates)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _temp_dir_for(state_dir: Path) -> str:
    """Ray's temp dir for this state dir: our own, so we never touch /tmp/ray of other clusters.

    Kept short because Ray puts unix sockets under it and their paths are limited to 107 bytes.
    """
    digest = hashlib.sha1(str(state_dir.resolve()).encode()).hexdigest()[:10]
    return os.path.join(tempfile.gettempdir(), f"orch-ray-{os.getuid()}-{digest}")


def _info_from_state(state: dict[str, object]) -> LocalClusterInfo | None:
    try:
        return LocalClusterInfo(
            dashboard_url=str(state["dashboard_url"]),
            gcs_address=str(state["gcs_address"]),
            pid=int(state["pid"]),  # type: ignore[call-overload]
            temp_dir=str(state["temp_dir"]) if state.get("temp_dir") else None,
            client_address=str(state["client_address"]) if state.get("client_address") else None,
        )
    except (KeyError, TypeError, ValueError):
        return None


def _recorded_process(state: dict[str, object]) -> psutil.Process | None:
    """The recorded `ray start` process if it still runs (and its pid was not reused)."""
    try:
        process = psutil.Process(int(state["pid"]))  # type: ignore[call-overload]
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        create_time = state.get("create_time")
        if isinstance(create_time, (int, float)) and abs(process.create_time() - create_time) > 1:
            return None
        return process
    except (KeyError, TypeError, ValueError, psutil.Error):
        return None


def _get_json(url: str, timeout: float = 2) -> object | None:
    """The decoded JSON body of a 2xx answer, or None if there was no such answer."""
    try:
        with _HTTP.open(url, timeout=timeout) as response:
            if not 200 <= response.status < 300:
                return None
            return json.loads(response.read() or b"null")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _answers(url: str) -> bool:
    return _get_json(url) is not None


def _has_a_node(url: str) -> bool:
    body = _get_json(url)
    try:
        return bool(body["data"]["summary"])  # type: ignore[index]
    except (KeyError, TypeError):
        return False


def _dashboard_answers(dashboard_url: str) -> bool:
    return _answers(dashboard_url + "/api/version")


def _stop_jobs(dashboard_url: str, timeout: float) -> None:
    """Ask every unfinished Ray job to stop, and wait (up to `timeout`) for them to end."""
    os.environ.update(embedded_env())
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(dashboard_url)
        active = [j.submission_id for j in client.list_jobs()
                  if j.submission_id and not j.status.is_terminal()]  # fmt: skip
        for job_id in active:
            client.stop_job(job_id)
        deadline = time.monotonic() + timeout
        while active and time.monotonic() < deadline:
            active = [j for j in active if not client.get_job_status(j).is_terminal()]
            time.sleep(_POLL_INTERVAL_S)
    except Exception:  # an unhealthy cluster: stopping it is all that is left to do
        return


def _terminate(
    process: psutil.Process, timeout: float, handle: subprocess.Popen[bytes] | None
) -> None:
    """SIGTERM `ray start --block` (it tears its processes down); SIGKILL what is left after."""
    try:
        pgid = os.getpgid(process.pid)
    except OSError:
        pgid = None
    members = _family(process, pgid)
    with contextlib.suppress(psutil.Error):
        process.terminate()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if handle is not None:
            handle.poll()  # reap our own child so it does not linger as a zombie
        if not _any_alive(members):
            return
        time.sleep(_POLL_INTERVAL_S)
    if pgid is not None and pgid != os.getpgrp():
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    for member in members:
        with contextlib.suppress(psutil.Error):
            member.kill()
    if handle is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            handle.wait(timeout=5)
    psutil.wait_procs(members, timeout=5)


def _family(process: psutil.Process, pgid: int | None) -> list[psutil.Process]:
    """The process, its descendants, and the rest of its process group."""
    family = {process.pid: process}
    with contextlib.suppress(psutil.Error):
        family.update((child.pid, child) for child in process.children(recursive=True))
    if pgid is not None:
        for candidate in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if candidate.pid not in family and os.getpgid(candidate.pid) == pgid:
                    family[candidate.pid] = candidate
    return list(family.values())


def _any_alive(processes: list[psutil.Process]) -> bool:
    for p in processes:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                return True
    return False
