"""`orchestrator capacity set|view|price`: teams' quotas, what the cluster has and holds, and
what an hour of it costs."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from orchestrator.cli.options import StorageRootOption
from orchestrator.cli.render import OutputFormat, console, print_json, when
from orchestrator.client.books import describe_prices, prices, set_prices
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
    """The cluster's prices; per team: its quota, what its running jobs hold and its queued
    jobs ask for; per accelerator type: the cluster's total and free."""
    found = capacity(storage_root=storage_root)
    cost = prices(storage_root=storage_root)
    if output is OutputFormat.json:
        print_json({**found, "prices": cost.model_dump()})
        return
    console.print(f"prices: {escape(describe_prices(cost))}")
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


@capacity_app.command("price")
def price(
    gpu: Annotated[
        list[str] | None,
        typer.Option("--gpu", help="TYPE=PRICE per GPU-hour, e.g. H100=2.49; repeat for others"),
    ] = None,
    cpu_hour: Annotated[
        float | None, typer.Option("--cpu-hour", min=0, help="Per CPU-hour")
    ] = None,
    memory_gib_hour: Annotated[
        float | None, typer.Option("--memory-gib-hour", min=0, help="Per GiB-hour of memory")
    ] = None,
    currency: Annotated[str | None, typer.Option("--currency", help="e.g. USD, EUR")] = None,
    clear: Annotated[bool, typer.Option("--clear", help="Start from no prices")] = False,
    storage_root: StorageRootOption = None,
    output: Output = OutputFormat.text,
) -> None:
    """Set what an hour of the cluster costs (what is not given stays); with no option, show
    the prices. Jobs are costed at the prices of their admission: a change never rewrites
    what already ran."""
    given = bool(gpu) or cpu_hour is not None or memory_gib_hour is not None or currency
    if given or clear:
        found = set_prices(_parse_gpus(gpu or [], "--gpu", "PRICE", "H100=2.49"), cpu_hour,
                           memory_gib_hour, currency, clear=clear,
                           storage_root=storage_root)  # fmt: skip
    else:
        found = prices(storage_root=storage_root)
    if output is OutputFormat.json:
        print_json(found.model_dump())
        return
    console.print(f"prices: {escape(describe_prices(found))}")


def _parse_gpus(
    values: list[str], option: str = "--gpus", what: str = "COUNT", example: str = "H100=16"
) -> dict[str, float]:
    """["H100=16", "A100=8"] -> {"H100": 16, "A100": 8}; ConfigError naming the option."""
    gpus: dict[str, float] = {}
    for value in values:
        name, sep, count = value.partition("=")
        try:
            number = float(count)
        except ValueError:
            number = -1.0
        if not sep or not number >= 0:
            raise ConfigError(f"{option} {value!r}: write TYPE={what} with {what} 0 or more, "
                              f"for example {option} {example}")  # fmt: skip
        try:
            gpus[accelerator_type(name)] = number
        except ConfigError as e:
            raise ConfigError(f"{option} {value!r}: {e}") from None
    return gpus


def _quota_text(quota: dict[str, float]) -> str:
    return describe(quota) if quota else "none (unlimited)"


def _amounts(amounts: dict[str, Any]) -> str:
    return describe(amounts) if amounts else "-"
