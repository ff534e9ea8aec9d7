"""What the benchmarks share: which code they measured, a private embedded cluster's
environment, and a moto S3 server of its own."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
from multiprocessing.connection import Connection
from pathlib import Path


def code_state() -> str:
    """The commit measured, and whether the working tree differs from it."""
    repo = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return commit + (" + uncommitted changes" if dirty else "")


def private_environment(work: Path) -> None:
    """Point orchestrator at `work` before a private embedded cluster starts there: its home
    (cluster state and token), the agents' node dirs, the nodes' weights cache, and a free
    Serve port; never a developer's own cluster (RAY_ADDRESS)."""
    from orchestrator.agents.weight_cache import NODE_CACHE_DIR_ENV
    from orchestrator.cluster.local import CLUSTER_ENV, embedded_env

    os.environ.pop("RAY_ADDRESS", None)
    # First: embedded_env names this home's token file (and makes it if need be).
    os.environ["ORCHESTRATOR_HOME"] = str(work / "home")
    os.environ.update({**embedded_env(), **CLUSTER_ENV})
    os.environ["ORCHESTRATOR_NODE_ROOT"] = str(work / "nodes")
    os.environ[NODE_CACHE_DIR_ENV] = str(work / "weights-cache")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["ORCHESTRATOR_SERVE_PORT"] = str(s.getsockname()[1])


def serve_moto(conn: Connection) -> None:
    """Run moto on loopback in this process (it must not share the measured code's GIL) until
    told to stop; send its port, then answer 'cpu' (seconds used) and 'peak_rss' (MB)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    conn.send(server.get_host_and_port()[1])
    while (msg := conn.recv()) != "stop":
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = usage.ru_utime + usage.ru_stime
        conn.send(usage.ru_maxrss / 1024 if msg == "peak_rss" else cpu)
    server.stop()
    conn.send("stopped")
