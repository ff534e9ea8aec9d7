"""`orchestrator push CONFIG`: submit a training job (or show what would be submitted)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from orchestrator.cli.jobs_common import announce, follow
from orchestrator.cli.options import (
    MAX_DURATION,
    RETRIES,
    RETRY_ON_FAILURE,
    Address,
    StorageRootOption,
)
from orchestrator.cli.render import (
    OutputFormat,
    console,
    human_bytes,
    print_job_summary,
    print_json,
    print_warnings,
)
from orchestrator.client import api
from orchestrator.client.overrides import Overrides
from orchestrator.spec.training import InteractiveSessionTrigger


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
    retries: Annotated[int | None, RETRIES] = None,
    retry_on_failure: Annotated[bool, RETRY_ON_FAILURE] = False,
    max_duration: Annotated[str | None, MAX_DURATION] = None,
    address: Address = None,
    storage_root: StorageRootOption = None,
    output: Annotated[OutputFormat, typer.Option("-o", "--output")] = OutputFormat.text,
) -> None:
    """Push a training job."""
    overrides = Overrides(
        job_name, team, node_count, accelerator, entrypoint,
        interactive.value if interactive else None, interactive_timeout_minutes, priority, spot,
        max_duration,
    )  # fmt: skip
    if dry_run:
        _print_dry_run(api.dry_run(config, overrides=overrides, storage_root=storage_root),
                       output)  # fmt: skip
        return
    job = api.push(
        config, address=address, storage_root=storage_root, overrides=overrides,
        colocate_ranks=colocate_ranks, retries=retries, retry_on_failure=retry_on_failure,
    )  # fmt: skip
    announce(job, f"pushed job [bold]{job.id}[/bold]", output)
    if tail and (code := follow(job)):
        raise typer.Exit(code)


def _print_dry_run(result: api.DryRun, output: OutputFormat) -> None:
    if output is OutputFormat.json:
        print_json({"summary": result.summary, "warnings": list(result.warnings)})
        return
    print_warnings(list(result.warnings))
    print_job_summary({**result.summary, "notices": []})
    cost = result.summary.get("cost_per_hour") or "no prices set (orchestrator capacity price)"
    console.print(f"cost: {escape(cost)}")
    console.print(
        f"dry run: archive {human_bytes(result.archive_bytes)} sha256 "
        f"{result.archive_sha256[:12]}; nothing was submitted"
    )
