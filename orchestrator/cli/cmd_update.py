"""`orchestrator update`: change a waiting job's priority (as `truss train update`)."""

from __future__ import annotations

from typing import Annotated

import typer

from orchestrator.cli.options import StorageRootOption
from orchestrator.cli.render import console
from orchestrator.client.queue import update_priority


def update(
    job_id: Annotated[str, typer.Option("--job-id", help="A PENDING job waiting in the queue")],
    priority: Annotated[int, typer.Option("--priority", help="Higher starts first")],
    timeout: Annotated[
        float, typer.Option("--timeout", min=0, help="Seconds to wait for the queue service")
    ] = 15.0,
    storage_root: StorageRootOption = None,
) -> None:
    """Re-prioritise a PENDING job; the queue service applies it at once."""
    applied = update_priority(job_id, priority, storage_root=storage_root, timeout_s=timeout)
    console.print(f"job {job_id}: priority {applied}")
