"""`orchestrator events`: the audit trail, every change made through us (client/audit.py)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from orchestrator.cli.options import StorageRootOption
from orchestrator.cli.render import OutputFormat, console, print_json, when
from orchestrator.client.audit import events as read_events

Output = Annotated[OutputFormat, typer.Option("-o", "--output")]


def events(
    job_id: Annotated[str | None, typer.Option("--job", "--job-id", help="Of this job")] = None,
    project: Annotated[str | None, typer.Option("--project", help="Of this project")] = None,
    team: Annotated[str | None, typer.Option("--team", help="Of this team")] = None,
    storage_root: StorageRootOption = None,
    output: Output = OutputFormat.text,
) -> None:
    """Every push, stop, update, secret, quota, deployment, shell and cache change, oldest
    first: when, who (OS user and host), what, and how it ended."""
    found = read_events(job=job_id, project=project, team=team, storage_root=storage_root)
    if output is OutputFormat.json:
        print_json([e.model_dump(exclude_none=True) for e in found])
        return
    if not found:
        console.print("no events")
        return
    table = Table(title="events")
    for column in ("time", "who", "verb", "on", "result"):
        table.add_column(column, overflow="fold")
    for e in found:
        on = [f"job {e.job}" if e.job else "", f"project {e.project}" if e.project else "",
              f"team {e.team}" if e.team else "", e.target or "", e.detail or ""]  # fmt: skip
        table.add_row(when(e.at), f"{e.user}@{e.host}", e.verb,
                      escape(", ".join(p for p in on if p)), escape(e.result))  # fmt: skip
    console.print(table)
