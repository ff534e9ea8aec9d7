"""An admitted job's Ray entrypoint when the head runs a warm controller host (warm_host.py):
`python -S warm_start.py ADDRESS -- python -m orchestrator.controller ...`.

Standard library only, run with `-S`: it starts in a few tens of ms. It hands this process's
stdin, stdout, stderr, environment and working directory to the host, which forks a controller
that has its modules imported already, then stands in for it: the signals Ray's `ray job stop`
sends are relayed to the controller, and it exits with the controller's code (or dies of its
signal). If it dies itself (SIGKILL), the controller sees the connection close and dies too, as
it would in the entrypoint's process group. No host, or a host that declines the command: the
command runs here as a plain process (the cold start), so nothing depends on the host.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket
import sys

RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def hand_over(address: str, command: list[str]) -> tuple[socket.socket, int] | None:
    """The connection to the controller the host forked, and its pid; None if it did not."""
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(address)
        fds = array.array("i", [0, 1, 2])
        conn.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        request = {"argv": command, "env": dict(os.environ), "cwd": os.getcwd()}
        body = json.dumps(request).encode()
        conn.sendall(len(body).to_bytes(8, "big") + body)
        reply = _line(conn)
    except OSError:
        return None
    if not reply.startswith("pid "):  # declined ("cold: why"), or the host broke off
        conn.close()
        return None
    return conn, int(reply.split()[1])


def stand_in(conn: socket.socket, pid: int) -> int:
    """Relay signals to the controller until the host reports how it ended."""

    def relay(signum: int, _frame: object) -> None:
        with contextlib.suppress(OSError):  # it is gone already: its end comes next
            conn.sendall(f"signal {signum}\n".encode())

    for signum in RELAYED:
        signal.signal(signum, relay)
    reply = _line(conn)
    if reply.startswith("exit "):
        return int(reply.split()[1])
    print(f"warm_start: the controller (pid {pid}) ended, but its exit code went with the warm "
          "host that started it", file=sys.stderr)  # fmt: skip
    return 1


def _line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        try:
            chunk = conn.recv(64)
        except InterruptedError:
            continue
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: warm_start.py ADDRESS -- COMMAND...")
    address, command = argv[1], argv[3:]
    if address.startswith("@"):  # Linux's abstract namespace: no file to leave behind
        address = "\0" + address[1:]
    handed = hand_over(address, command)
    if handed is None:
        os.execvp(command[0], command)
    code = stand_in(*handed)
    if code < 0:  # it died of a signal: so does its stand-in, for Ray to see the same
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv)
