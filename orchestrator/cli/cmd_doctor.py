"""`orchestrator doctor`: what a cluster lacks for orchestrator's jobs, one line per item."""

from __future__ import annotations

from typing import Annotated

import typer

from orchestrator.cli.options import Address, StorageRootOption
from orchestrator.cli.render import OutputFormat, print_json
from orchestrator.client.doctor import FAIL, OK
from orchestrator.client.doctor import doctor as run_doctor

_MARKS = {OK: "ok  ", "warn": "warn", FAIL: "FAIL"}


def doctor(
    address: Address = None,
    storage_root: StorageRootOption = None,
    output: Annotated[OutputFormat, typer.Option("-o", "--output")] = OutputFormat.text,
) -> None:
    """Check the cluster: Ray versions, token, storage root, container tools, GPUs, disk, queue.
    Exits 1 when something a job needs is missing."""
    report = run_doctor(address, storage_root)
    if output is OutputFormat.json:
        print_json(report.to_json())
    else:
        width = max((len(c.item) for c in report.checks), default=0)
        for check in report.checks:
            fix = f" -- fix: {check.fix}" if check.fix and check.status != OK else ""
            typer.echo(f"{_MARKS.get(check.status, check.status)}  {check.item:<{width}}  "
                       f"{check.detail}{fix}")  # fmt: skip
    if not report.ok:
        raise typer.Exit(1)
