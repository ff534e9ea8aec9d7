"""`orchestrator queue`: the jobs waiting for the cluster, next to start first, why, and when
each should start."""

from __future__ import annotations

import datetime as dt
import time
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from orchestrator.cli.options import StorageRootOption
from orchestrator.cli.render import OutputFormat, console, print_json, when
from orchestrator.client.queue import queue as queued_jobs

CANNOT = "cannot estimate:"


def queue(
    include_running: Annotated[
        bool, typer.Option("--all", help="Running (admitted) jobs too")
    ] = False,
    storage_root: StorageRootOption = None,
    output: Annotated[OutputFormat, typer.Option("-o", "--output")] = OutputFormat.text,
) -> None:
    """The waiting jobs, next to start first: what each needs and why it waits."""
    rows = queued_jobs(include_running=include_running, storage_root=storage_root)
    if output is OutputFormat.json:
        print_json(rows)
        return
    if not rows:
        console.print("the queue is empty: no job is waiting")
        return
    table = Table(title="queue")
    columns = ("position", "job", "name", "team", "priority", "waiting since", "needs",
               "estimated start", "reason")  # fmt: skip
    for column in columns:
        table.add_column(column, no_wrap=column == "job")
    now = time.time()
    for r in rows:
        position = str(r["position"]) if r["position"] is not None else "-"
        reason = escape(r["reason"])
        start = escape(start_text(r["estimated_start"], r["estimate"], now))
        if r["state"] == "impossible":
            position, reason, start = "-", f"[red]impossible: {reason}[/red]", "never"
        elif r["state"] == "admitted":
            position, start = "running", "-"
        table.add_row(position, r["job_id"], escape(_name(r)), escape(r["team"] or "-"),
                      str(r["priority"]), when(r["pushed_at"]), r["demand"], start,
                      reason)  # fmt: skip
    console.print(table)


def start_text(estimated_start: float | None, estimate: str, now: float) -> str:
    """A waiting job's estimated start as people read it: "~14:05 (in 25 min)", a date too
    when not today; "unknown: <why>" when the queue cannot estimate it."""
    if estimated_start is None:
        why = estimate.removeprefix(CANNOT).strip() or "not estimated yet"
        return f"unknown: {why}"
    at = dt.datetime.fromtimestamp(estimated_start)
    today = at.date() == dt.datetime.fromtimestamp(now).date()
    clock = at.strftime("%H:%M" if today else "%Y-%m-%d %H:%M")
    return f"~{clock} ({_in(estimated_start - now)})"


def _in(seconds: float) -> str:
    if seconds < 60:
        return "now" if seconds <= 0 else "in under a minute"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"in {minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"in {hours} h {minutes} min" if minutes else f"in {hours} h"
    days, hours = divmod(hours, 24)
    return f"in {days} d {hours} h" if hours else f"in {days} d"


def _name(row: dict) -> str:
    """`<project>/<job name>`, the project alone for a job without a name; "-" when the job's
    record could not be read."""
    if row["project"] is None:
        return "-"
    return f"{row['project']}/{row['job_name']}" if row["job_name"] else row["project"]
