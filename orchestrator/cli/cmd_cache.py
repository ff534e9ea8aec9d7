"""`orchestrator cache summarize|delete`: a project's training cache, read off the storage root."""

from __future__ import annotations

import enum
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from orchestrator.cli.options import SortOrder, StorageRootOption
from orchestrator.cli.render import OutputFormat, console, human_bytes, print_json, when
from orchestrator.client.training_cache import cache_summary, delete_cache, project_team

cache_app = typer.Typer(help="Inspect and empty a project's training cache.", no_args_is_help=True)

Team = Annotated[
    str | None,
    typer.Option("--team", help="The project's team; default: the team of its latest job"),
]


class SortKey(str, enum.Enum):
    filepath = "filepath"
    size = "size"
    modified = "modified"


@cache_app.command("summarize")
def summarize(
    project: Annotated[str, typer.Argument(help="Project name or id")],
    team: Team = None,
    storage_root: StorageRootOption = None,
    sort: Annotated[SortKey, typer.Option("--sort")] = SortKey.filepath,
    order: Annotated[SortOrder, typer.Option("--order")] = SortOrder.asc,
    output: Annotated[OutputFormat, typer.Option("-o", "--output")] = OutputFormat.text,
) -> None:
    """List the files in a project's cache with their sizes and times."""
    team = team if team is not None else project_team(project, storage_root)
    entries = cache_summary(project, team, storage_root=storage_root)
    key = {
        SortKey.filepath: lambda e: e.path,
        SortKey.size: lambda e: (e.size_bytes, e.path),
        SortKey.modified: lambda e: (e.modified, e.path),
    }[sort]
    entries = sorted(entries, key=key, reverse=order is SortOrder.desc)
    if output is OutputFormat.json:
        print_json(
            {
                "project": project,
                "team": team,
                "total_bytes": sum(e.size_bytes for e in entries),
                "files": [
                    {"path": e.path, "size_bytes": e.size_bytes, "modified": when(e.modified)}
                    for e in entries
                ],
            }
        )
        return
    scope = f"project {project!r}" + (f" of team {team!r}" if team else "")
    if not entries:
        console.print(f"the training cache of {scope} is empty", markup=False)
        return
    table = Table(title=f"training cache of {escape(scope)}")
    table.add_column("path")
    table.add_column("size", justify="right")
    table.add_column("modified")
    for e in entries:
        table.add_row(escape(e.path), human_bytes(e.size_bytes), when(e.modified))
    console.print(table)
    total = sum(e.size_bytes for e in entries)
    console.print(f"{len(entries)} file(s), {human_bytes(total)}")


@cache_app.command("delete")
def delete(
    project: Annotated[str, typer.Argument(help="Project name or id")],
    team: Team = None,
    storage_root: StorageRootOption = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
) -> None:
    """Empty a project's cache (the durable copy; nodes drop theirs when next seeded)."""
    team = team if team is not None else project_team(project, storage_root)
    scope = f"project {project!r}" + (f" of team {team!r}" if team else "")
    if not yes:
        typer.confirm(f"Empty the training cache of {scope}?", abort=True)
    files, size = delete_cache(project, team, storage_root=storage_root)
    console.print(
        f"emptied the training cache of {scope}: {files} file(s), {human_bytes(size)}", markup=False
    )
