"""`orchestrator capacity set|view`: teams' quotas, and what the cluster has and holds."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from orchestrator.cli.options import StorageRootOption
from orchestrator.cli.render import OutputFormat, console, print_json, when
from orchestrator.client.queue import accelerator_type, capacity, set_capacity
from orchestrator.errors import ConfigError
from orchestrator.scheduler.resources import describe
from orchestrator.sizes import human_bytes

capacity_app = typer.Typer(help="Teams' quotas and the cluster's capacity.", no_args_is_help=True)
Output = Annotated[OutputFormat, typer.Option("-o", "--output")]


@capacity_app.command("set")
def set_(
    team: Annotated[str, typer.Option("--team", help="The team (a job's `team`)")],
    gpus: Annotated[
        list[str] | None,
        typer.Option("--gpus", help="TYPE=COUNT, e.g. H100=16; repeat for other types"),
    ] = None,
    cpus: Annotated[float | None, typer.Option("--cpus", min=0, help="CPUs")] = None,
    memory: Annotated[str | None, typer.Option("--memory", help="Memory, e.g. 512Gi")] = None,
    clear: Annotated[bool, typer.Option("--clear", help="Remove the quota: unlimited")] = False,
    storage_root: StorageRootOption = None,
    output: Output = OutputFormat.text,
) -> None:
    """Replace a team's quota (what its jobs may hold without borrowing), or --clear it."""
    limited = bool(gpus) or cpus is not None or memory is not None
    if clear == limited:
        raise ConfigError("give --gpus, --cpus or --memory for the team's quota, or --clear "
                          "alone to remove it")  # fmt: skip
    quotas = set_capacity(team, _parse_gpus(gpus or []), cpus, memory, storage_root=storage_root)
    if output is OutputFormat.json:
        print_json(quotas)
        return
    console.print(f"team {escape(team)}: {_quota_text(quotas.get(team, {}))}")


@capacity_app.command("view")
def view(storage_root: StorageRootOption = None, output: Output = OutputFormat.text) -> None:
    """Per team: its quota, what its running jobs hold and its queued jobs ask for; per
    accelerator type: the cluster's total and free."""
    found = capacity(storage_root=storage_root)
    if output is OutputFormat.json:
        print_json(found)
        return
    if found["teams"]:
        table = Table(title="teams")
        for column in ("team", "quota", "in use", "queued", "jobs running", "jobs queued"):
            table.add_column(column)
        for team, t in found["teams"].items():
            table.add_row(escape(team), _quota_text(t["quota"]), _amounts(t["in_use"]),
                          _amounts(t["queued"]), str(t["jobs_running"]),
                          str(t["jobs_queued"]))  # fmt: skip
        console.print(table)
    else:
        console.print("no quotas and no queued or running jobs")
    if found["decided_at"] is None:
        console.print("the cluster's capacity is unknown: no queue service has reported yet")
        return
    table = Table(title=f"cluster (as of {when(found['decided_at'])})")
    for column in ("resource", "total", "free"):
        table.add_column(column)
    for name, a in found["accelerators"].items():
        table.add_row(f"{escape(name)} GPUs", f"{a['total']:g}", f"{a['free']:g}")
    if found["cpus"]:
        table.add_row("CPUs", f"{found['cpus']['total']:g}", f"{found['cpus']['free']:g}")
    if found["memory"]:
        m = found["memory"]
        table.add_row("memory", human_bytes(m["total"]), human_bytes(m["free"]))
    console.print(table)


def _parse_gpus(values: list[str]) -> dict[str, float]:
    """["H100=16", "A100=8"] -> {"H100": 16, "A100": 8}; ConfigError naming --gpus."""
    gpus: dict[str, float] = {}
    for value in values:
        name, sep, count = value.partition("=")
        try:
            number = float(count)
        except ValueError:
            number = -1.0
        if not sep or number < 0:
            raise ConfigError(f"--gpus {value!r}: write TYPE=COUNT with COUNT 0 or more, for "
                              "example --gpus H100=16")  # fmt: skip
        try:
            gpus[accelerator_type(name)] = number
        except ConfigError as e:
            raise ConfigError(f"--gpus {value!r}: {e}") from None
    return gpus


def _quota_text(quota: dict[str, float]) -> str:
    return describe(quota) if quota else "none (unlimited)"


def _amounts(amounts: dict[str, Any]) -> str:
    return describe(amounts) if amounts else "-"
