"""The `orchestrator` command: one small module per verb, each a thin layer over the SDK."""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console
from rich.markup import escape

from orchestrator.cli import (
    cmd_deploy,
    cmd_doctor,
    cmd_download,
    cmd_events,
    cmd_init,
    cmd_isession,
    cmd_logs,
    cmd_metrics,
    cmd_push,
    cmd_queue,
    cmd_recreate,
    cmd_run,
    cmd_shell,
    cmd_stacks,
    cmd_stop,
    cmd_update,
    cmd_usage,
    cmd_validate,
    cmd_view,
)
from orchestrator.cli.cmd_cache import cache_app
from orchestrator.cli.cmd_capacity import capacity_app
from orchestrator.cli.cmd_checkpoints import checkpoints_app
from orchestrator.cli.cmd_cluster import cluster_app
from orchestrator.cli.cmd_deployments import deployments_app
from orchestrator.cli.cmd_notify import notify_app
from orchestrator.cli.cmd_secrets import secrets_app
from orchestrator.cluster.auth import refusal
from orchestrator.errors import ConfigError, OrchestratorError

app = typer.Typer(
    name="orchestrator",
    help="Baseten-Training-style jobs on your own Ray cluster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("validate")(cmd_validate.validate)
app.command("init")(cmd_init.init)
app.command("push")(cmd_push.push)
app.command("recreate")(cmd_recreate.recreate)
app.command("logs")(cmd_logs.logs)
app.command("view")(cmd_view.view)
app.command("metrics")(cmd_metrics.metrics)
app.command("stop")(cmd_stop.stop)
app.command("download")(cmd_download.download)
app.command("run")(cmd_run.run)
app.command("shell")(cmd_shell.shell)
app.command("stacks")(cmd_stacks.stacks)
app.command("isession")(cmd_isession.isession)
app.command("deploy_checkpoints")(cmd_deploy.deploy_checkpoints)
app.command("queue")(cmd_queue.queue)
app.command("update")(cmd_update.update)
app.command("events")(cmd_events.events)
app.command("usage")(cmd_usage.usage)
app.command("doctor")(cmd_doctor.doctor)
app.add_typer(cluster_app, name="cluster")
app.add_typer(checkpoints_app, name="checkpoints")
app.add_typer(cache_app, name="cache")
app.add_typer(secrets_app, name="secrets")
app.add_typer(deployments_app, name="deployments")
app.add_typer(capacity_app, name="capacity")
app.add_typer(notify_app, name="notify")

_stderr = Console(stderr=True)


def main() -> None:
    try:
        app()
    except ConfigError as e:
        _print_error(e)
        sys.exit(2)
    except OrchestratorError as e:
        _print_error(e)
        sys.exit(1)
    except Exception as e:
        refused = refusal(e, os.environ.get("RAY_ADDRESS"))  # any verb: one line, no traceback
        if refused is None:
            refused = _outside_the_range(e)
        if refused is None:
            raise
        _print_error(OrchestratorError(refused))
        sys.exit(1)


def _outside_the_range(error: Exception) -> str | None:
    """A Ray outside the supported range that failed on what it lacks: which Ray, which range
    (ray_private feature-detects what it calls; this is the net under the rest)."""
    if not isinstance(error, (ImportError, AttributeError)):
        return None
    from orchestrator import ray_private

    try:
        said = ray_private.unsupported(ray_private.ray_version())
    except Exception:
        return None
    return f"{said} ({type(error).__name__}: {error})" if said else None


def _print_error(error: OrchestratorError) -> None:
    """The message as written: a name in it may hold '[' (`[/x]` is not markup to end)."""
    _stderr.print(f"[red]error:[/red] {escape(str(error))}", markup=True, highlight=False)
