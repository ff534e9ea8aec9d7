"""`orchestrator recreate`: an earlier job again, same code and config (`truss train recreate`)."""

from __future__ import annotations

from typing import Annotated

import typer

from orchestrator.cli.jobs_common import announce, follow
from orchestrator.cli.options import Address, JobId, Project, StorageRootOption
from orchestrator.cli.render import OutputFormat
from orchestrator.client.api import recreate as recreate_job


def recreate(
    job_id: JobId = None,
    project: Project = None,
    tail: Annotated[bool, typer.Option("--tail", help="Follow the new job's logs")] = False,
    address: Address = None,
    storage_root: StorageRootOption = None,
    output: Annotated[OutputFormat, typer.Option("-o", "--output")] = OutputFormat.text,
) -> None:
    """Run an earlier job again (default: the most recent): same code, same config, new id."""
    job = recreate_job(job_id, project=project, address=address, storage_root=storage_root)
    what = f"recreated job {job.record.recreated_from} as [bold]{job.id}[/bold]"
    announce(job, what, output)
    if tail and (code := follow(job)):
        raise typer.Exit(code)
