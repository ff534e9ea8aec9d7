"""The embedded local Ray cluster: a loopback-only `ray start --head --block` that outlives the CLI.

With no `RAY_ADDRESS` and no `--address`, commands start (or reuse) one such cluster per state
directory. It runs in its own session, so jobs keep running after `orchestrator push` returns; its
pid and addresses are recorded in `cluster.json` so the next command finds it. A file lock keeps
two commands from starting two clusters at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from orchestrator import actor_names, settings
from orchestrator.cluster.auth import token_file, use_token
from orchestrator.cluster.processes import (
    POLL_INTERVAL_S,
    answers,
    dashboard_answers,
    has_a_node,
    recorded_process,
    terminate,
)
from orchestrator.cluster.ray_start import LOOPBACK, ray_start_command, temp_dir_for
from orchestrator.errors import LocalClusterError
from orchestrator.home import orchestrator_home

__all__ = ["CLUSTER_ENV", "LOOPBACK", "LocalCluster", "LocalClusterInfo", "embedded_env",
           "ray_start_command", "use_embedded_env"]  # fmt: skip


_STATE_FILE = "cluster.json"
_LOCK_FILE = "lock"
_LOG_FILE = "ray-start.log"
_START_ATTEMPTS = 3  # a picked port can be taken before Ray binds it: retry with fresh ones
DASHBOARD_PATIENCE_S = 60.0  # how long a running cluster's dashboard may take to answer


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
    address and clients hang. Token authentication is on: loopback is shared by every user and
    process of the machine, a job's code among them (cluster/auth.py); the token is named by
    its file, never its value.
    """
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token_file())}  # fmt: skip


def use_embedded_env(token: str | None = None) -> None:
    """This process as a client of the embedded cluster (`embedded_env` in os.environ), whose
    token is in the file `token` (default: this home's)."""
    env = embedded_env()
    if token:
        env["RAY_AUTH_TOKEN_PATH"] = token
    use_token(Path(env["RAY_AUTH_TOKEN_PATH"]))
    os.environ.update(env)


@dataclass(frozen=True)
class LocalClusterInfo:
    """Where the embedded cluster listens and which process owns it."""

    dashboard_url: str  # the Job Submission API endpoint, "http://127.0.0.1:<port>"
    gcs_address: str  # "127.0.0.1:<port>", for ray.init(address=...)
    pid: int  # our `ray start --head --block` process
    temp_dir: str | None
    client_address: str | None = None  # "ray://127.0.0.1:<port>": Ray Client (`shell`'s terminal)
    token_file: str | None = None  # its token's file (cluster/auth.py); None: started without


class LocalCluster:
    """Start, find and stop the embedded Ray cluster recorded in `state_dir`."""

    def __init__(self, state_dir: Path | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir else orchestrator_home() / "local-cluster"
        self.state_file = self.state_dir / _STATE_FILE
        self.log_file = self.state_dir / _LOG_FILE
        # Where its queue service takes a new storage root's first push (roots_inbox.py)
        self.roots_inbox = self.state_dir / "roots-inbox"
        self._process: subprocess.Popen[bytes] | None = None  # set when we started it

    # -- public API --------------------------------------------------------------------------

    def status(self) -> LocalClusterInfo | None:
        """The recorded cluster if it is alive and its dashboard answers; clears a stale record."""
        with self._locked():
            return self._status_locked()

    def recorded(self) -> LocalClusterInfo | None:
        """The cluster as recorded, without asking whether it still runs (cheap)."""
        with contextlib.suppress(OSError, ValueError):
            state = json.loads(self.state_file.read_text())
            return _info_from_state(state) if isinstance(state, dict) else None
        return None

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
            process = recorded_process(state)
            info = _info_from_state(state)
            if process is not None and info is not None:
                _stop_jobs(info, timeout)
            self.state_file.unlink(missing_ok=True)
            if process is None:
                return False
            terminate(process, timeout, self._process)
            self._process = None
            return True

    # -- internals (callers hold the lock) ---------------------------------------------------

    def _status_locked(self) -> LocalClusterInfo | None:
        """The recorded cluster, or None (and the record cleared) if its process is gone.

        A live process whose dashboard does not answer is a busy head, not a stale record: it
        gets DASHBOARD_PATIENCE_S. Treating it as gone used to start a second cluster beside
        it and orphan the first, jobs and all (a loaded 2-core machine answers in over 2 s).
        """
        state = self._read_state()
        if state is None:
            return None
        info = _info_from_state(state)
        deadline = time.monotonic() + DASHBOARD_PATIENCE_S
        while info is not None and recorded_process(state) is not None:
            if dashboard_answers(info.dashboard_url, _token(info)):
                return info
            if time.monotonic() >= deadline:
                raise LocalClusterError(
                    f"the local Ray cluster (pid {info.pid}, {info.dashboard_url}) runs but its "
                    f"dashboard has not answered for {DASHBOARD_PATIENCE_S:g} s; it is left "
                    "running: try again, or stop it with `orchestrator cluster stop`"
                )
            time.sleep(POLL_INTERVAL_S)
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
        temp_dir = temp_dir_for(self.state_dir)
        command, gcs_port, dashboard_port, client_port = ray_start_command(
            temp_dir, num_cpus=num_cpus, num_gpus=num_gpus, resources=resources
        )
        env = {**os.environ, **embedded_env(), **CLUSTER_ENV}
        env.pop("RAY_ADDRESS", None)
        env[settings.ROOTS_INBOX.name] = str(self.roots_inbox)
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
            token_file=env["RAY_AUTH_TOKEN_PATH"],
        )
        # Record it before waiting, so a CLI killed mid-start leaves a cluster we can still stop.
        self._write_state(info, psutil.Process(process.pid).create_time())
        try:
            self._wait_until_ready(info, process, deadline)
        except BaseException:
            with contextlib.suppress(psutil.NoSuchProcess):
                terminate(psutil.Process(process.pid), 10, process)
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
            ("/api/version", answers),
            ("/api/jobs/", answers),
            ("/nodes?view=summary", has_a_node),
        ):
            while not ready(info.dashboard_url + path, _token(info)):
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
                time.sleep(POLL_INTERVAL_S)

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


def _token(info: LocalClusterInfo) -> str | None:
    """The cluster's token, from the file it was started with."""
    try:
        return Path(info.token_file).read_text().strip() if info.token_file else None
    except OSError:
        return None


def _info_from_state(state: dict[str, object]) -> LocalClusterInfo | None:
    try:
        return LocalClusterInfo(
            dashboard_url=str(state["dashboard_url"]),
            gcs_address=str(state["gcs_address"]),
            pid=int(state["pid"]),  # type: ignore[call-overload]
            temp_dir=str(state["temp_dir"]) if state.get("temp_dir") else None,
            client_address=str(state["client_address"]) if state.get("client_address") else None,
            token_file=str(state["token_file"]) if state.get("token_file") else None,
        )
    except (KeyError, TypeError, ValueError):
        return None


def _hosts_controllers(dashboard_url: str) -> bool:
    """Whether the cluster's controller host runs (the state API: no driver needed)."""
    from ray.util.state import list_actors

    filters = [("name", "=", actor_names.CONTROLLER_HOST), ("state", "=", "ALIVE")]
    return bool(list_actors(address=dashboard_url, filters=filters, raise_on_missing_output=False))


def _stop_jobs(info: LocalClusterInfo, timeout: float) -> None:
    """Ask every unfinished Ray job to stop, and wait (up to `timeout`) for them to end."""
    use_embedded_env(info.token_file)
    from ray.job_submission import JobSubmissionClient

    dashboard_url = info.dashboard_url
    try:
        client = JobSubmissionClient(dashboard_url)
        active = [j.submission_id for j in client.list_jobs()
                  if j.submission_id and not j.status.is_terminal()]  # fmt: skip
        for job_id in active:
            client.stop_job(job_id)
        if _hosts_controllers(dashboard_url):  # their stop, in a Ray job of its own
            active.append(client.submit_job(
                entrypoint=f"{shlex.quote(sys.executable)} -m "
                f"orchestrator.controller.host --stop-all {max(timeout - 5, 1):g}",
                entrypoint_num_cpus=0,
            ))  # fmt: skip
        deadline = time.monotonic() + timeout
        while active and time.monotonic() < deadline:
            active = [j for j in active if not client.get_job_status(j).is_terminal()]
            time.sleep(POLL_INTERVAL_S)
    except Exception:  # an unhealthy cluster: stopping it is all that is left to do
        return
