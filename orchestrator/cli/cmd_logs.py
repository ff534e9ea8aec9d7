"""`orchestrator logs`: a job's logs, from the storage root (also after the cluster is gone)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from orchestrator.cli.jobs_common import ending_code, follow, pick_job
from orchestrator.cli.options import JobId, Project, StorageRootOption
from orchestrator.cli.render import OutputFormat
from orchestrator.storage.logs import is_progress


def logs(
    job_id: JobId = None,
    project: Project = None,
    tail: Annotated[bool, typer.Option("--tail", help="Follow until the job ends")] = False,
    storage_root: StorageRootOption = None,
    output: Annotated[
        OutputFormat,
        typer.Option("-o", "--output", help="json: one JSON object per line, as it arrives"),
    ] = OutputFormat.text,
) -> None:
    """Print a job's logs. Following on a terminal, a progress bar is drawn in place."""
    job = pick_job(job_id, project, storage_root)
    if output is OutputFormat.json:
        lines = job.logs(follow=True, progress_every_s=0) if tail else job.logs()
        for line in lines:
            print(json.dumps({"line": line, "progress": is_progress(line)}), flush=True)
        if tail:
            raise typer.Exit(ending_code(job.refresh()))
        return
    if tail:
        follow(job)
        return
    for line in job.logs():
        print(line)
