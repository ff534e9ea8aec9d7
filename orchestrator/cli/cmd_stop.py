"""`orchestrator stop`: stop one job, or every job that has not ended."""

from __future__ import annotations

from typing import Annotated

import typer

from orchestrator.cli.jobs_common import pick_job, print_ending
from orchestrator.cli.options import JobId, Project, StorageRootOption
from orchestrator.cli.render import console
from orchestrator.client.api import list_jobs


def stop(
    job_id: JobId = None,
    project: Project = None,
    all_jobs: Annotated[bool, typer.Option("--all", help="Stop every active job")] = False,
    storage_root: StorageRootOption = None,
) -> None:
    """Stop a job: SIGTERM to its commands, SIGKILL after a grace period."""
    if all_jobs:
        active = [j for j in list_jobs(project, storage_root=storage_root)
                  if not j.status().is_terminal]  # fmt: skip
        if not active:
            console.print("no active jobs")
        for job in active:
            job.stop()
            print_ending(job)
        return
    job = pick_job(job_id, project, storage_root)
    if job.status().is_terminal:
        console.print(f"job {job.id} already ended: {job.status().value}")
        return
    job.stop()
    print_ending(job)
