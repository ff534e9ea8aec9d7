"""`orchestrator push CONFIG`: submit a training job (or show what would be submitted)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer

from orchestrator.cli.render import (
    OutputFormat,
    console,
    human_bytes,
    print_job_summary,
    print_json,
    print_warnings,
)
from orchestrator.client.job_summary import describe_job
from orchestrator.client.overrides import Overrides
from orchestrator.client.prepare import prepare_job
from orchestrator.client.workspace import write_archive
from orchestrator.errors import OrchestratorError


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
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Do everything short of submitting")
    ] = False,
    address: Annotated[str | None, typer.Option("--address", help="Ray dashboard address")] = None,
    output: Annotated[OutputFormat, typer.Option("-o", "--output")] = OutputFormat.text,
) -> None:
    """Push a training job."""
    overrides = Overrides(job_name, team, node_count, accelerator, entrypoint)
    prepared = prepare_job(config, overrides=overrides)
    if not dry_run:
        raise OrchestratorError(
            "submitting to Ray is not implemented in this version; "
            "`orchestrator push --dry-run` shows what would be submitted"
        )
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
