"""The first thing a controller's process does (`python -m orchestrator.controller`, the Ray
job's entrypoint): hand itself over to the head's warm controller host (warm_host.py), if one
runs for this cluster, and stand in for the controller the host forks.

Standard library only: it runs before any of the imports a forked controller skips. It hands
this process's stdin, stdout, stderr, environment and working directory to the host over a
Unix socket, then relays the signals Ray's `ray job stop` sends and exits with the controller's
code (or dies of its signal). If it dies itself (SIGKILL with its process group), the controller
sees the connection close and dies too, as it would have in that group. No host, or a host that
declines (another interpreter, another install of orchestrator): it returns, and the process
goes on as a cold controller. So the Ray job, its entrypoint and logs are what they always were.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket
import sys
from typing import BinaryIO

RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FORKED = False  # set in a controller the host forked: it must not hand itself over again


def address_for(gcs_address: str) -> str:
    """The host's socket for a cluster, named by its GCS port (one per machine and network
    namespace, as the abstract socket namespace is); "@": Linux's abstract namespace."""
    return f"@orchestrator-controllers-{gcs_address.rsplit(':', 1)[-1]}"


def hand_over_or_return(module: str) -> None:
    """Stand in for a warm controller and exit; return if there is no host to take it."""
    gcs = os.environ.get("RAY_ADDRESS", "")  # what Ray's job supervisor gives an entrypoint
    if FORKED or not sys.platform.startswith("linux") or ":" not in gcs or "://" in gcs:
        return
    handed = _hand_over(address_for(gcs), module)
    if handed is None:
        return
    code = _stand_in(*handed)
    sys.stdout.flush()
    if code < 0:  # it died of a signal: so does its stand-in, for Ray to see the same
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _hand_over(address: str, module: str) -> tuple[socket.socket, BinaryIO, int] | None:
    """The connection to the controller the host forked, and its pid; None if it did not."""
    package = sys.modules[module.split(".")[0]].__file__
    request = {
        "module": module, "argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(),
        "executable": sys.executable, "package": package,
    }  # fmt: skip
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect("\0" + address.removeprefix("@"))
        fds = array.array("i", [0, 1, 2])
        conn.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        body = json.dumps(request).encode()
        conn.sendall(len(body).to_bytes(8, "big") + body)
        reader = conn.makefile("rb")
        reply = _line(reader)  # the forked controller's own first word: it runs
    except OSError:
        return None
    if not reply.startswith("pid "):  # declined ("cold: why"), or the host broke off first
        conn.close()
        return None
    return conn, reader, int(reply.split()[1])


def _stand_in(conn: socket.socket, reader: BinaryIO, pid: int) -> int:
    """Relay signals to the controller until the host reports how it ended."""

    def relay(signum: int, _frame: object) -> None:
        with contextlib.suppress(OSError):  # it is gone already: its end comes next
            conn.sendall(f"signal {signum}\n".encode())

    for signum in RELAYED:
        signal.signal(signum, relay)
    reply = _line(reader)
    if reply.startswith("exit "):
        return int(reply.split()[1])
    print(f"the controller (pid {pid}) ended, but its exit code went with the warm host that "
          "started it", file=sys.stderr)  # fmt: skip
    return 1


def _line(reader: BinaryIO) -> str:
    try:
        return reader.readline().decode().strip()
    except OSError:
        return ""
