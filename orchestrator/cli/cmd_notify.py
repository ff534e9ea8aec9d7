"""`orchestrator notify add|list|remove`: webhooks told of jobs that fail, complete, are
preempted or get stuck (delivered by the cluster's queue service)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from orchestrator.cli.options import StorageRootOption
from orchestrator.cli.render import OutputFormat, console, print_json, when
from orchestrator.client.notify import add_webhook, remove_webhook, webhooks
from orchestrator.storage.notify_store import ALL_KINDS, Subscription

notify_app = typer.Typer(help="Webhooks for jobs' failures, completions, preemptions and hangs.",
                         no_args_is_help=True)  # fmt: skip
Output = Annotated[OutputFormat, typer.Option("-o", "--output")]
SECRET_HELP = ("Name of the secret whose value signs each body (X-Orchestrator-Signature); set "
               "it with `orchestrator secrets set NAME`")  # fmt: skip


@notify_app.command("add")
def add(
    url: Annotated[str, typer.Option("--url", help="Where the JSON events are POSTed")],
    secret: Annotated[str, typer.Option("--secret", help=SECRET_HELP)],
    team: Annotated[
        str | None, typer.Option("--team", help="Only this team's jobs; default: every job")
    ] = None,
    events: Annotated[
        str, typer.Option("--events", help=f"Comma-separated, among {','.join(ALL_KINDS)}")
    ] = ",".join(ALL_KINDS),
    storage_root: StorageRootOption = None,
    output: Output = OutputFormat.text,
) -> None:
    """Subscribe a webhook to jobs' events from now on."""
    sub = add_webhook(url, secret=secret, team=team, events=[events], storage_root=storage_root)
    if output is OutputFormat.json:
        print_json(sub.model_dump())
        return
    console.print(f"webhook {sub.id}: {', '.join(sub.events)} of {_whose(sub)} to "
                  f"{escape(sub.url)}, signed with secret {escape(sub.secret)}")  # fmt: skip
    scope = f" --team {sub.team}" if sub.team else ""
    console.print(f"the cluster's secret store must hold it: orchestrator secrets set "
                  f"{escape(sub.secret)}{escape(scope)}")  # fmt: skip


@notify_app.command("list")
def list_(
    team: Annotated[
        str | None, typer.Option("--team", help="Only those that see this team's jobs")
    ] = None,
    storage_root: StorageRootOption = None,
    output: Output = OutputFormat.text,
) -> None:
    """The webhooks, oldest first."""
    found = webhooks(team=team, storage_root=storage_root)
    if output is OutputFormat.json:
        print_json([s.model_dump() for s in found])
        return
    if not found:
        console.print("no webhooks")
        return
    table = Table()
    for column in ("id", "url", "jobs", "events", "secret", "created"):
        table.add_column(column)
    for s in found:
        created = f"{when(s.created_at)} by {escape(s.created_by)}"
        table.add_row(s.id, escape(s.url), escape(_whose(s)), ",".join(s.events),
                      escape(s.secret), created)  # fmt: skip
    console.print(table)


@notify_app.command("remove")
def remove(
    webhook_id: Annotated[str, typer.Argument(help="The webhook's id (notify list)")],
    storage_root: StorageRootOption = None,
) -> None:
    """Remove a webhook: nothing more is delivered to it."""
    sub = remove_webhook(webhook_id, storage_root=storage_root)
    console.print(f"webhook {sub.id} removed ({escape(sub.url)})")


def _whose(sub: Subscription) -> str:
    return f"team {sub.team}'s jobs" if sub.team else "every job"
