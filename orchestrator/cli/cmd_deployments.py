"""`orchestrator deployments list|stop`: the checkpoints `deploy_checkpoints` serves."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from orchestrator.cli.options import Address, StorageRootOption
from orchestrator.cli.render import OutputFormat, console, print_json
from orchestrator.client.deploy import get_deployment, list_deployments, stop_deployment

deployments_app = typer.Typer(
    help="Served checkpoints (Ray Serve applications made by deploy_checkpoints).",
    no_args_is_help=True,
)
Output = Annotated[OutputFormat, typer.Option("-o", "--output")]


@deployments_app.command("list")
def list_(address: Address = None, output: Output = OutputFormat.text) -> None:
    """Each deployment: name, checkpoints, URL, status, running replicas; why, if it failed."""
    found = list_deployments(address=address)
    if output is OutputFormat.json:
        print_json([d.as_dict() for d in found])
        return
    if not found:
        console.print("no deployments")
        return
    table = Table(title="deployments")
    for column in ("name", "checkpoints", "url", "status", "replicas", "models"):
        table.add_column(column, no_wrap=column in ("name", "url"))
    for d in found:
        table.add_row(
            d.name, "\n".join(d.checkpoints), d.url, d.status, str(d.replicas),
            "\n".join(d.model_ids),
        )  # fmt: skip
    console.print(table)
    for d in found:
        if d.cause:
            console.print(f"[red]{escape(d.name)}[/red] is {d.status}: {escape(d.cause)}")


@deployments_app.command("stop")
def stop(
    name: Annotated[str, typer.Argument(help="The deployment (its model name)")],
    address: Address = None,
    output: Output = OutputFormat.text,
    storage_root: StorageRootOption = None,
) -> None:
    """Delete the deployment: its Serve application, replicas and their resources."""
    deployment = get_deployment(name, address=address)
    stop_deployment(name, address=address, storage_root=storage_root)
    if output is OutputFormat.json:
        print_json({"name": deployment.name, "stopped": True})
        return
    console.print(f"stopped {escape(deployment.name)}")
