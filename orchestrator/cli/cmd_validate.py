"""`orchestrator validate CONFIG`: load, check and show a job without submitting anything."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from orchestrator.cli.render import OutputFormat, print_job_summary, print_json
from orchestrator.client.config_loader import load_config
from orchestrator.client.job_summary import describe_job
from orchestrator.client.support import check_support
from orchestrator.client.workspace import plan_workspace


def validate(
    config: Annotated[Path, typer.Argument(help="Path to the job's config.py")],
    output: Annotated[OutputFormat, typer.Option("-o", "--output")] = OutputFormat.text,
) -> None:
    """Check a config and print the resolved job: nodes, resources, env, weights, archive."""
    loaded = load_config(config)
    plan = plan_workspace(loaded.source_dir, loaded.project.job.workspace)
    summary = describe_job(loaded.project, plan)
    if output is OutputFormat.json:
        print_json(summary)
    else:
        print_job_summary(summary)
    check_support(loaded.project.job).raise_for_errors()
    if output is OutputFormat.text:
        typer.echo(f"{config}: valid")
