"""`orchestrator download`: a job's code, as it was pushed, unpacked (`truss train download`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from orchestrator.cli.jobs_common import pick_job
from orchestrator.cli.options import JobId, Project, StorageRootOption


def download(
    job_id: JobId = None,
    project: Project = None,
    target_directory: Annotated[
        Path | None,
        typer.Option("--target-directory", help="Default: ./<job_id>-workspace"),
    ] = None,
    storage_root: StorageRootOption = None,
) -> None:
    """Download a job's code archive and unpack it; print where it went."""
    job = pick_job(job_id, project, storage_root)
    target = job.download_code(target_directory or Path(f"{job.id}-workspace"))
    print(target.resolve())
