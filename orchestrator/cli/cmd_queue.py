"""`orchestrator queue`: the jobs waiting for the cluster, next to start first, and why."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from orchestrator.cli.options import StorageRootOption
from orchestrator.cli.render import OutputFormat, console, print_json, when
from orchestrator.client.queue import queue as queued_jobs


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
    columns = ("position", "job", "name", "team", "priority", "waiting since", "needs", "reason")
    for column in columns:
        table.add_column(column, no_wrap=column == "job")
    for r in rows:
        position = str(r["position"]) if r["position"] is not None else "-"
        reason = escape(r["reason"])
        if r["state"] == "impossible":
            position, reason = "-", f"[red]impossible: {reason}[/red]"
        elif r["state"] == "admitted":
            position = "running"
        table.add_row(position, r["job_id"], escape(_name(r)), escape(r["team"] or "-"),
                      str(r["priority"]), when(r["pushed_at"]), r["demand"], reason)  # fmt: skip
    console.print(table)


def _name(row: dict) -> str:
    """`<project>/<job name>`, the project alone for a job without a name; "-" when the job's
    record could not be read."""
    if row["project"] is None:
        return "-"
    return f"{row['project']}/{row['job_name']}" if row["job_name"] else row["project"]
