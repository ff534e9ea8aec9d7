"""`orchestrator push CONFIG`: submit a training job (or show what would be submitted)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer

from orchestrator.cli.jobs_common import announce, follow
from orchestrator.cli.options import Address, StorageRootOption
from orchestrator.cli.render import (
    OutputFormat,
    console,
    human_bytes,
    print_job_summary,
    print_json,
    print_warnings,
)
from orchestrator.client.connection import connect, storage
from orchestrator.client.job_summary import describe_job
from orchestrator.client.jobs import JobHandle
from orchestrator.client.overrides import Overrides
from orchestrator.client.prepare import PreparedJob, prepare_job
from orchestrator.client.submit import submit
from orchestrator.client.workspace import write_archive
from orchestrator.spec.training import InteractiveSessionTrigger
from orchestrator.storage.job_store import JobStore


def push(
    config: Annotated[Path, typer.Argument(help="Path to the job's config.py")],
    tail: Annotated[bool, typer.Option("--tail", help="Stream the job's logs")] = False,
    job_name: Annotated[str | None, typer.Option("--job-name")] = None,
    team: Annotated[str | None, typer.Option("--team")] = None,
    node_count: Annotated[int | None, typer.Option("--node-count")] = None,
    accelerator: Annotated[str | None, typer.Option("--accelerator", help="e.g. H100:8")] = None,
    entrypoint: Annotated[
        str | None, typer.Option("--entrypoint", help="Replaces start_commands")
    ] = None,
    interactive: Annotated[
        InteractiveSessionTrigger | None,
        typer.Option("--interactive", help="Hold the nodes for `shell` (an interactive_session)"),
    ] = None,
    interactive_timeout_minutes: Annotated[
        int | None, typer.Option("--interactive-timeout-minutes", help="How long they are held")
    ] = None,
    priority: Annotated[int | None, typer.Option("--priority")] = None,
    spot: Annotated[bool, typer.Option("--spot", help="availability_model spot")] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Do everything short of submitting")
    ] = False,
    colocate_ranks: Annotated[
        bool,
        typer.Option("--colocate-ranks", help="Run all ranks on one node (a dev machine)"),
    ] = False,
    address: Address = None,
    storage_root: StorageRootOption = None,
    output: Annotated[OutputFormat, typer.Option("-o", "--output")] = OutputFormat.text,
) -> None:
    """Push a training job."""
    overrides = Overrides(
        job_name, team, node_count, accelerator, entrypoint,
        interactive.value if interactive else None, interactive_timeout_minutes, priority, spot,
    )  # fmt: skip
    prepared = prepare_job(config, overrides=overrides)
    if dry_run:
        _dry_run(prepared, output)
        return
    print_warnings(list(prepared.warnings))
    connection = connect(address)
    store = JobStore(storage(storage_root))
    record = submit(prepared, connection, store.root, colocate_ranks=colocate_ranks)
    job = JobHandle(store, record)
    announce(job, f"pushed job [bold]{job.id}[/bold]", output)
    if tail and (code := follow(job)):
        raise typer.Exit(code)


def _dry_run(prepared: PreparedJob, output: OutputFormat) -> None:
    with tempfile.TemporaryDirectory(prefix="orchestrator-dry-run-") as tmp:
        archive = write_archive(prepared.plan, Path(tmp) / "workspace.tar")
    summary = describe_job(prepared.project, prepared.plan)
    summary["archive"].update(tar_bytes=archive.size_bytes, sha256=archive.sha256)
    if output is OutputFormat.json:
        print_json({"summary": summary, "warnings": list(prepared.warnings)})
        return
    print_warnings(list(prepared.warnings))
    print_job_summary({**summary, "notices": []})
    console.print(
        f"dry run: archive {human_bytes(archive.size_bytes)} sha256 {archive.sha256[:12]}; "
        "nothing was submitted"
    )
