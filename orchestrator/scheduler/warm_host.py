"""The warm controller host: one process on the head, started by the queue service (when
ORCHESTRATOR_WARM_CONTROLLERS is on), that has a controller's modules imported and forks each
controller that starts on the head.

A cold controller pays a Python interpreter's start and ~1.2 s of imports (ray, pydantic,
fsspec, ours) before its first line; on a 2-core head that CPU is also what slows a sweep of
short jobs. Forked from here, a controller starts with all of it done, and shares the imported
modules' pages with the host (copy on write) instead of holding its own copy.

Each controller is still its own process, its own Ray driver of its own Ray job, as a cold one:
the Ray job's entrypoint is still `python -m orchestrator.controller ...`, whose first act
(warm_start.py, standard library only) is to hand its stdin, stdout, stderr, environment and
working directory to the host over a Unix socket and stand in for the forked controller:
relaying `ray job stop`'s signals, exiting with its code. The dashboard, `ray job stop` and logs
are as before. The host only forks: it never connects to Ray itself (a process with Ray's
threads and sockets cannot be forked safely), and it ends when the service that started it
does; the controllers it forked run on.

The socket is in Linux's abstract namespace (no file, no path length limit, gone with the
process) and the host answers only processes of its own user (SO_PEERCRED).
"""

from __future__ import annotations

import array
import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from orchestrator.scheduler import warm_start

MODULE = "orchestrator.controller"  # the only command it runs: `python -m orchestrator.controller`
# What a controller imports, also what it imports late (the storage retry's exception types:
# aiohttp builds an SSL context as it imports, which the one crash seen was doing).
PRELOAD = (
    "ray", "orchestrator.agents.services", "orchestrator.scheduler", f"{MODULE}.controller",
    "aiohttp", "botocore.exceptions", "google.auth.exceptions",
)  # fmt: skip
_POLL_S = 0.5  # how often it reaps its children and looks for its parent


class WarmHost:
    """The service's handle on its host process (which ends by itself when the service does)."""

    def __init__(self, address: str, process: subprocess.Popen) -> None:
        self.address, self.process = address, process

    @classmethod
    def start(cls, gcs_address: str) -> WarmHost | None:
        """A host for this cluster, on Linux (fork, abstract sockets); None elsewhere. Its
        output goes with the service's (the actor's log in the dashboard)."""
        if not sys.platform.startswith("linux"):
            return None
        address = warm_start.address_for(gcs_address)
        process = subprocess.Popen(
            [sys.executable, "-m", __name__, address], stdin=subprocess.DEVNULL,
            start_new_session=True,  # a signal to the service's group reaches no controller
        )  # fmt: skip
        return cls(address, process)


# --- inside the host --------------------------------------------------------------------------


def serve(address: str, parent: int, module: str = MODULE) -> dict[str, Any]:
    """Fork a controller for each stand-in that connects, until the parent (the service) is
    gone. Returns only in a forked child, with its request; the host itself exits."""
    listener = _listen(address)
    children: dict[int, socket.socket] = {}  # a forked controller -> its stand-in's connection
    ended, wake = socket.socketpair()  # a controller's end wakes the loop at once (SIGCHLD)
    wake.setblocking(False)
    signal.set_wakeup_fd(wake.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, ended], [], [], _POLL_S)
        if ended in ready:
            ended.recv(4096)
        _reap(children)
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError) as e:
            print(f"warm host: a hand-over broke off ({e})", file=sys.stderr, flush=True)
            conn.close()
            continue
        if (why := _declined(conn, request, module)) is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"cold: {why}\n".encode())
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for own in (listener, ended, wake):
                own.close()
            for other in children.values():
                other.close()
            _become(request, fds, conn)
            return request
        for fd in fds:
            os.close(fd)
        children[pid] = conn
    sys.exit(0)


def _listen(address: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + 10
    while True:  # the host of a service that just died may hold it for one more poll
        try:
            listener.bind("\0" + address.removeprefix("@"))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    listener.listen(64)
    return listener


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The stand-in's stdin, stdout and stderr (SCM_RIGHTS), then its length-prefixed request."""
    conn.settimeout(5)  # a stand-in that stalls holds up no other job
    _, ancillary, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(3 * 4))
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += array.array("i", data[: len(data) - len(data) % 4]).tolist()
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected stdin, stdout and stderr, got {len(fds)} descriptors")
    try:
        size = int.from_bytes(_exactly(conn, 8), "big")
        request = json.loads(_exactly(conn, size))
    except Exception:
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return request, fds


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ValueError("the stand-in hung up mid-request")
        data += chunk
    return data


def _declined(conn: socket.socket, request: dict[str, Any], module: str) -> str | None:
    """Why this host will not run it (the stand-in then runs it cold), or None."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    if struct.unpack("3i", creds)[1] != os.getuid():
        return "another user's"
    if request["module"] != module:
        return f"this host runs {module}, not {request['module']}"
    if not _same_interpreter(request["executable"], sys.executable):
        return f"{request['executable']} is not this host's interpreter ({sys.executable})"
    if request["package"] != sys.modules[module.split(".")[0]].__file__:
        return f"another install of {module.split('.')[0]} ({request['package']})"
    return None


def _same_interpreter(a: str, b: str) -> bool:
    """The same binary in the same bin directory (a venv's python and python3 are one
    environment; the base interpreter a venv links to is another)."""
    same_dir = os.path.dirname(os.path.abspath(a)) == os.path.dirname(os.path.abspath(b))
    return same_dir and os.path.realpath(a) == os.path.realpath(b)


def _reap(children: dict[int, socket.socket]) -> None:
    """Tell each ended controller's stand-in how it ended."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if (conn := children.pop(pid, None)) is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def _become(request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
    """In the forked child: take the stand-in's place, as a cold start would have it."""
    os.setpgid(0, 0)  # its own group: a signal to the host's reaches no controller
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    sys.argv = [sys.argv[0], *request["argv"]]  # runpy puts the module's path first
    warm_start.FORKED = True
    # Said by the child, not the host: a host that dies after the fork cannot leave a stand-in
    # that saw no answer, went on cold, and ran the job's controller a second time.
    conn.sendall(f"pid {os.getpid()}\n".encode())
    threading.Thread(target=_relay, args=(conn,), name="warm-relay", daemon=True).start()


def _relay(conn: socket.socket) -> None:
    """The stand-in's signals, delivered to this controller; its hang-up (SIGKILLed with its
    process group by `ray job stop`) ends the controller as it would have ended a cold one."""
    for line in conn.makefile("r"):
        if line.startswith("signal "):
            os.kill(os.getpid(), int(line.split()[1]))
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    """`python -m orchestrator.scheduler.warm_host ADDRESS [MODULE]` (MODULE: tests' probe)."""
    address, module = argv[1], argv[2] if len(argv) > 2 else MODULE
    parent = os.getppid()
    for name in (*PRELOAD, module):
        with contextlib.suppress(ImportError):  # an optional storage client not installed
            importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the imported objects' pages stay shared: no collection touches them
    print(f"warm host: ready on {address}", file=sys.stderr, flush=True)
    serve(address, parent, module)
    runpy.run_module(module, run_name="__main__", alter_sys=True)  # a forked controller


if __name__ == "__main__":
    main(sys.argv)
