"""`orchestrator isession --job-id ID --update-timeout M`: hold a job's nodes for a session."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from orchestrator.cli.options import JobId, StorageRootOption
from orchestrator.cli.render import console
from orchestrator.client.api import get_job
from orchestrator.errors import OrchestratorError


def isession(
    job_id: JobId = None,
    update_timeout: Annotated[
        float,
        typer.Option("--update-timeout", min=0, help="Minutes from now to hold the nodes"),
    ] = 60,
    storage_root: StorageRootOption = None,
) -> None:
    """Keep a running job's nodes once its commands end, for `orchestrator shell`."""
    if not job_id:
        raise OrchestratorError("isession needs --job-id")
    until = get_job(job_id, storage_root=storage_root).update_session(update_timeout)
    clock = time.strftime("%H:%M:%S", time.localtime(until))
    console.print(f"job {job_id}: its nodes stay until {clock} once its commands end "
                  f"(orchestrator shell --job-id {job_id} -- CMD)")  # fmt: skip
