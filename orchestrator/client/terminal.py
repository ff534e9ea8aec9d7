"""`orchestrator shell --job-id ID`: this terminal, attached to a shell in a running job's rank.

The shell runs on the rank's node on a real PTY (node/terminal.py). This side connects with
Ray Client (`ray://HEAD:10001`, Ray's own way for a laptop to reach a cluster: no SSH keys, no
open ports on the nodes), puts the local terminal in raw mode, and relays: keystrokes in order,
one write in flight at a time; output by long-polling; window size changes as they happen.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import termios
import threading
import tty
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from orchestrator import settings
from orchestrator.errors import OrchestratorError, last_line

RAY_CLIENT_ADDRESS_ENV = settings.RAY_CLIENT_ADDRESS.name
RAY_CLIENT_PORT = 10001  # `ray start --head`'s default --ray-client-server-port
LOST_AFTER_ENV = settings.TERMINAL_LOST_S.name
READ_WAIT_S = 0.5
NOT_ATTACHED_EXIT = 255


def ray_client_address(record: Any) -> str:
    """$ORCHESTRATOR_RAY_CLIENT_ADDRESS, else the embedded cluster's, else the dashboard's host at
    Ray Client's default port."""
    if address := settings.RAY_CLIENT_ADDRESS.get():
        return address if address.startswith("ray://") else f"ray://{address}"
    if record.embedded_cluster:
        from orchestrator.cluster.local import LocalCluster

        info = LocalCluster().status()
        if info is None or not info.client_address:
            raise OrchestratorError(
                "the local Ray cluster that runs this job is not running, or was started by an "
                "older orchestrator without a Ray Client port: restart it with "
                "`orchestrator cluster stop` (its jobs end)"
            )
        return info.client_address
    host = urlsplit(record.ray_address or "").hostname
    if not host:
        raise OrchestratorError(f"no cluster address is recorded for job {record.job_id}")
    return f"ray://{host}:{RAY_CLIENT_PORT}"


def attach(job: Any, rank: int, stdin_fd: int = 0, stdout_fd: int = 1) -> int:
    """Run an interactive shell in `job`'s rank `rank` on this terminal; its exit code."""
    import ray

    from orchestrator.agents.node_agent import agent_name
    from orchestrator.agents.services import NAMESPACE

    address = ray_client_address(job.record)
    if job.record.embedded_cluster:
        from orchestrator.cluster.local import use_embedded_env

        use_embedded_env()
    try:
        ray.init(address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
    except Exception as e:
        why = last_line(e) or type(e).__name__
        raise OrchestratorError(
            f"could not reach the cluster's Ray Client at {address}: {why} (the shell "
            f"needs that port besides the dashboard's; set {RAY_CLIENT_ADDRESS_ENV} if it is "
            "elsewhere)"
        ) from None
    try:
        try:
            agent = ray.get_actor(agent_name(job.id, rank), namespace=NAMESPACE)
        except ValueError:
            raise OrchestratorError(
                f"job {job.id} has no rank {rank} running on this cluster: it has ended, or its "
                "nodes are not prepared yet"
            ) from None
        rows, cols = _size(stdout_fd)
        lost_after_s = settings.TERMINAL_LOST_S.get()
        term = os.environ.get("TERM", "xterm-256color")
        try:
            terminal_id = ray.get(agent.terminal_open.remote(rows, cols, term, lost_after_s))
        except Exception as e:
            raise OrchestratorError(
                f"could not open a shell on rank {rank}: {last_line(e) or type(e).__name__}"
            ) from None
        return _relay(ray, agent, terminal_id, stdin_fd, stdout_fd)
    finally:
        ray.shutdown()


def _relay(ray: Any, agent: Any, terminal_id: str, stdin_fd: int, stdout_fd: int) -> int:
    ended = threading.Event()
    result: dict[str, Any] = {}

    def pump_output() -> None:
        try:
            while not ended.is_set():
                data, code = ray.get(agent.terminal_read.remote(terminal_id, READ_WAIT_S))
                _write_all(stdout_fd, data)
                if code is not None:
                    result["code"] = code
                    break
        except Exception as e:  # the node or the job went away
            result["error"] = last_line(e) or type(e).__name__
        finally:
            ended.set()

    resized = threading.Event()
    output = threading.Thread(target=pump_output, name="terminal-output", daemon=True)
    output.start()
    previous = signal.signal(signal.SIGWINCH, lambda *_: resized.set())
    stdin_open = True
    try:
        with _raw(stdin_fd):
            while not ended.is_set():
                if resized.is_set():
                    resized.clear()
                    ray.get(agent.terminal_resize.remote(terminal_id, *_size(stdout_fd)))
                if not stdin_open:
                    ended.wait(READ_WAIT_S)
                    continue
                ready, _, _ = select.select([stdin_fd], [], [], 0.1)
                if not ready:
                    continue
                data = os.read(stdin_fd, 4096)
                if not data:  # input closed (not a terminal): end the shell as Ctrl-D would
                    stdin_open, data = False, b"\x04"
                ray.get(agent.terminal_write.remote(terminal_id, data))
    except Exception as e:
        result.setdefault("error", last_line(e) or type(e).__name__)
    finally:
        signal.signal(signal.SIGWINCH, previous)
        if not ended.is_set():
            ended.set()
            with contextlib.suppress(Exception):
                ray.get(agent.terminal_close.remote(terminal_id), timeout=10)
        output.join(timeout=READ_WAIT_S + 5)
    if "code" in result:
        return int(result["code"])
    print(f"\r\nthe shell was cut off: {result.get('error', 'unknown')}", file=sys.stderr)
    return NOT_ATTACHED_EXIT


@contextlib.contextmanager
def _raw(fd: int) -> Iterator[None]:
    """Keystrokes (Ctrl-C too) go to the remote shell unchanged; the terminal is restored after."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)  # not the default TCSAFLUSH: keep what was typed ahead
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 24, 80
    return size.lines, size.columns


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
