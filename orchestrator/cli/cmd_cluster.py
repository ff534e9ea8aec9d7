"""`orchestrator cluster start|status|stop`: the embedded local Ray cluster on this machine."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from orchestrator.cli.render import console
from orchestrator.cluster.local import LocalCluster, LocalClusterInfo

cluster_app = typer.Typer(help="The embedded local Ray cluster", no_args_is_help=True)


def _describe(info: LocalClusterInfo) -> str:
    return f"dashboard {info.dashboard_url}  gcs {info.gcs_address}  pid {info.pid}"


def _say(line: str) -> None:
    console.print(line, soft_wrap=True)  # one line, however narrow the terminal


@cluster_app.command("start")
def start(
    num_cpus: Annotated[int | None, typer.Option("--num-cpus", help="CPUs to offer")] = None,
    num_gpus: Annotated[int | None, typer.Option("--num-gpus", help="GPUs to offer")] = None,
) -> None:
    """Start the local cluster (or report the one already running)."""
    cluster = LocalCluster()
    running = cluster.status()
    if running is not None:
        _say(f"already running: {_describe(running)}")
        return
    began = time.monotonic()
    info = cluster.ensure_running(num_cpus=num_cpus, num_gpus=num_gpus)
    _say(f"started in {time.monotonic() - began:.1f} s: {_describe(info)}")


@cluster_app.command("status")
def status() -> None:
    """Show whether the local cluster is running, and where."""
    info = LocalCluster().status()
    _say(f"running: {_describe(info)}" if info else "not running")


@cluster_app.command("stop")
def stop() -> None:
    """Stop the local cluster and every Ray process it started."""
    _say("stopped" if LocalCluster().stop() else "not running")
