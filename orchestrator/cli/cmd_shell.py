"""`orchestrator shell --job-id ID [--rank N] [-- CMD]`: a shell, or one command, in a job."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from orchestrator.cli.options import JobId, StorageRootOption
from orchestrator.client.api import get_job
from orchestrator.errors import OrchestratorError


def shell(
    command: Annotated[
        list[str] | None, typer.Argument(help="The command, after `--`: run by /bin/sh -c")
    ] = None,
    job_id: JobId = None,
    rank: Annotated[int, typer.Option("--rank", min=0, help="Node rank")] = 0,
    timeout: Annotated[
        float, typer.Option("--timeout", min=1, help="Seconds before the command is killed")
    ] = 600,
    storage_root: StorageRootOption = None,
) -> None:
    """An interactive shell in a running job's rank (its working directory and environment), or
    with `-- CMD` one command; exit with the shell's or the command's exit code."""
    if not job_id:
        raise OrchestratorError("shell needs --job-id: the job to open the shell in")
    job = get_job(job_id, storage_root=storage_root)
    if not command:
        raise typer.Exit(job.attach(rank=rank))
    code, output = job.exec(" ".join(command), rank=rank, timeout_s=timeout)
    sys.stdout.write(output)
    sys.stdout.flush()
    raise typer.Exit(code)
