"""The `ray start` command line of the embedded cluster: loopback only, every port picked free."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from orchestrator.errors import LocalClusterError

LOOPBACK = "127.0.0.1"


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
    gcs, dashboard, client, agent_http, agent_grpc, runtime_env, metrics = free_ports(7)
    command = [
        ray_executable(),
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


def ray_executable() -> str:
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


def free_ports(count: int) -> list[int]:
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


def temp_dir_for(state_dir: Path) -> str:
    """Ray's temp dir for this state dir: our own, so we never touch /tmp/ray of other clusters.

    Kept short because Ray puts unix sockets under it and their paths are limited to 107 bytes.
    """
    digest = hashlib.sha1(str(state_dir.resolve()).encode()).hexdigest()[:10]
    return os.path.join(tempfile.gettempdir(), f"orch-ray-{os.getuid()}-{digest}")
