"""Options shared by several verbs."""

from __future__ import annotations

import enum
from typing import Annotated

import typer

Address = Annotated[
    str | None,
    typer.Option("--address", help="Ray dashboard (Job API) address; default: $RAY_ADDRESS, "
                 "else an embedded local cluster"),
]  # fmt: skip
StorageRootOption = Annotated[
    str | None,
    typer.Option("--storage-root", help="fsspec URL of the storage root; default: "
                 "$ORCHESTRATOR_STORAGE_ROOT, else $ORCHESTRATOR_HOME/storage"),
]  # fmt: skip
JobId = Annotated[
    str | None, typer.Option("--job-id", help="Default: the most recent job (said so)")
]


class SortOrder(str, enum.Enum):
    asc = "asc"
    desc = "desc"


Project = Annotated[str | None, typer.Option("--project", help="Project name or id")]
RETRIES = typer.Option(
    "--retries", min=0,
    help="Attempts after the first for a lost node or agent (and a failed command with "
    "--retry-on-failure), each from the job's latest checkpoint; default: "
    "$ORCHESTRATOR_MAX_RETRIES, else 0. Preemptions are retried without using it",
)  # fmt: skip
RETRY_ON_FAILURE = typer.Option(
    "--retry-on-failure", help="Retry a start command that exits non-zero too (uses --retries)"
)
MAX_DURATION = typer.Option(
    "--max-duration",
    help="How long the job may hold its nodes, e.g. 2h, 90m, 1h30m or seconds (time in the "
    "queue not counted); then SIGTERM, its checkpoints flushed, and FAILED. Overrides the "
    "config's max_duration",
)
