"""`orchestrator usage`: what each job and team held, waited, lost and cost (client/books.py)."""

from __future__ import annotations

import csv
import datetime as dt
import enum
import sys
import time
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from orchestrator.books.usage import JobUsage, Usage
from orchestrator.cli.options import StorageRootOption
from orchestrator.cli.render import console, print_json, when
from orchestrator.client.books import by_team
from orchestrator.client.books import usage as read_usage
from orchestrator.client.metrics_text import duration
from orchestrator.client.queue import NO_TEAM
from orchestrator.errors import ConfigError
from orchestrator.spec.durations import parse_duration


class UsageFormat(str, enum.Enum):
    table = "table"
    json = "json"
    csv = "csv"


CSV_FIELDS = ("job_id", "project", "team", "job_name", "state", "pushed_at", "ended_at",
              "held_s", "gpu_hours", "gpu_types", "cpu_hours", "memory_gib_hours", "cost",
              "waiting_s", "lost_gpu_hours", "lost_cost", "unpriced")  # fmt: skip


def usage(
    team: Annotated[str | None, typer.Option("--team", help="Of this team")] = None,
    project: Annotated[str | None, typer.Option("--project", help="Of this project")] = None,
    since: Annotated[
        str | None, typer.Option("--since", help="From: 2026-12-01, 2026-12-01T09:00, or 24h ago")
    ] = None,
    until: Annotated[str | None, typer.Option("--until", help="To (as --since)")] = None,
    storage_root: StorageRootOption = None,
    output: Annotated[UsageFormat, typer.Option("-o", "--output")] = UsageFormat.table,
) -> None:
    """Per job, then per team: GPU-hours by type, CPU- and memory-hours held (from admission to
    release), the cost at the prices of each admission, time waiting in the queue, and what
    faults and preemptions lost (from the last stored checkpoint to the attempt's end)."""
    start, end = moment("--since", since), moment("--until", until)
    jobs = read_usage(team=team, project=project, since=start, until=end,
                      storage_root=storage_root)  # fmt: skip
    if output is UsageFormat.json:
        print_json({"jobs": [j.model_dump() for j in jobs],
                    "teams": {k: _team_json(v) for k, v in by_team(jobs).items()}})  # fmt: skip
        return
    if output is UsageFormat.csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=CSV_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(csv_row(j) for j in jobs)
        return
    if not jobs:
        console.print("no jobs in that window")
        return
    table = Table(title="usage by job")
    for column in ("job", "team", "state", "GPU-hours", "CPU-hours", "cost", "waiting",
                   "lost GPU-hours", "lost cost"):  # fmt: skip
        table.add_column(column, no_wrap=column == "job")
    for j in jobs:
        table.add_row(j.job_id, escape(j.team or NO_TEAM), j.state, gpu_text(j.usage),
                      f"{j.usage.cpu_s / 3600:.2f}", cost_text(j.usage),
                      duration(j.waiting_s), gpu_text(j.lost), cost_text(j.lost))  # fmt: skip
    console.print(table)
    teams = Table(title="usage by team")
    for column in ("team", "jobs", "GPU-hours", "CPU-hours", "memory GiB-hours", "cost",
                   "waiting", "lost GPU-hours", "lost cost"):  # fmt: skip
        teams.add_column(column)
    for name, t in by_team(jobs).items():
        u, lost = t["usage"], t["lost"]
        teams.add_row(escape(name), str(t["jobs"]), gpu_text(u), f"{u.cpu_s / 3600:.2f}",
                      f"{u.memory_gib_s / 3600:.2f}", cost_text(u), duration(t["waiting_s"]),
                      gpu_text(lost), cost_text(lost))  # fmt: skip
    console.print(teams)


def moment(option: str, value: str | None, now: float | None = None) -> float | None:
    """A time given on the command line: an ISO date or date and time (local), or a duration
    ago ("24h", "7d"); ConfigError naming the option."""
    if value is None:
        return None
    try:
        return dt.datetime.fromisoformat(value.strip()).timestamp()
    except ValueError:
        pass
    try:
        return (now if now is not None else time.time()) - parse_duration(value)
    except ValueError:
        raise ConfigError(f"{option} {value!r}: give a date (2026-12-01), a date and time "
                          "(2026-12-01T09:00) or how long ago (24h, 7d)") from None  # fmt: skip


def gpu_text(u: Usage) -> str:
    """`12.50 (A100 2.50, H100 10.00)`; `-` for none."""
    if not u.gpu_s:
        return "-"
    kinds = ", ".join(f"{k} {s / 3600:.2f}" for k, s in sorted(u.gpu_s.items()))
    return f"{u.gpu_hours:.2f} ({kinds})"


def cost_text(u: Usage) -> str:
    text = f"{u.cost:.2f}" if u.cost or not u.unpriced else "?"
    return text + (f" (no price: {', '.join(u.unpriced)})" if u.unpriced else "")


def usage_line(j: JobUsage) -> str:
    """`view`'s line: `GPU-hours 2.00 (H100 2.00), CPU-hours 8.00, cost 4.98; waited 1m 5s;
    lost GPU-hours 0.50, cost 1.25`."""
    u = j.usage
    line = (f"GPU-hours {gpu_text(u)}, CPU-hours {u.cpu_s / 3600:.2f}, cost {cost_text(u)}; "
            f"waited {duration(j.waiting_s)}")  # fmt: skip
    if j.lost.held_s:
        line += f"; lost GPU-hours {gpu_text(j.lost)}, cost {cost_text(j.lost)}"
    return line


def csv_row(j: JobUsage) -> dict[str, Any]:
    u, lost = j.usage, j.lost
    return {
        "job_id": j.job_id, "project": j.project, "team": j.team or "",
        "job_name": j.job_name or "", "state": j.state, "pushed_at": when(j.pushed_at),
        "ended_at": when(j.ended_at) if j.ended_at else "", "held_s": round(u.held_s, 1),
        "gpu_hours": round(u.gpu_hours, 4),
        "gpu_types": " ".join(f"{k}={s / 3600:.4f}" for k, s in sorted(u.gpu_s.items())),
        "cpu_hours": round(u.cpu_s / 3600, 4), "memory_gib_hours": round(u.memory_gib_s / 3600, 4),
        "cost": round(u.cost, 4), "waiting_s": round(j.waiting_s, 1),
        "lost_gpu_hours": round(lost.gpu_hours, 4), "lost_cost": round(lost.cost, 4),
        "unpriced": " ".join(u.unpriced),
    }  # fmt: skip


def _team_json(t: dict[str, Any]) -> dict[str, Any]:
    return {"jobs": t["jobs"], "usage": t["usage"].model_dump(), "lost": t["lost"].model_dump(),
            "waiting_s": t["waiting_s"]}  # fmt: skip
