"""`orchestrator stacks --job-id ID [--rank N]`: every rank's Python stacks, now or as stored."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from orchestrator.cli.jobs_common import pick_job
from orchestrator.cli.options import JobId, Project, StorageRootOption


def stacks(
    job_id: JobId = None,
    project: Project = None,
    rank: Annotated[int | None, typer.Option("--rank", min=0, help="Only this rank")] = None,
    storage_root: StorageRootOption = None,
) -> None:
    """Print every rank's Python stacks (py-spy, all threads): taken now from a running job
    (and stored with it), else the last set stored (a stuck attempt's)."""
    job = pick_job(job_id, project, storage_root)
    found = job.stacks()
    for r, text in found.items():
        if rank is not None and r != rank:
            continue
        sys.stdout.write(f"===== rank {r} =====\n{text.rstrip()}\n\n")
    sys.stdout.flush()
