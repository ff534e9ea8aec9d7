"""`orchestrator logs`: a job's logs, from the storage root (also after the cluster is gone)."""

from __future__ import annotations

from typing import Annotated

import typer

from orchestrator.cli.jobs_common import follow, pick_job
from orchestrator.cli.options import JobId, Project, StorageRootOption


def logs(
    job_id: JobId = None,
    project: Project = None,
    tail: Annotated[bool, typer.Option("--tail", help="Follow until the job ends")] = False,
    storage_root: StorageRootOption = None,
) -> None:
    """Print a job's logs."""
    job = pick_job(job_id, project, storage_root)
    if tail:
        follow(job)
        return
    for line in job.logs():
        print(line)
