"""`orchestrator secrets set|list|delete`: the secret store on this machine (the head node).

Values are read from a hidden prompt or stdin, never from the command line (shell history, `ps`),
and never printed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer
from rich.console import Console
from rich.table import Table

from orchestrator.cli.render import OutputFormat, console, print_json, when
from orchestrator.client.audit import audited
from orchestrator.client.connection import storage
from orchestrator.errors import OrchestratorError
from orchestrator.storage.secret_store import (
    SECRETS_DIR_ENV,
    FileSecretStore,
    SecretInfo,
    check_name,
    check_team,
    scope_label,
)

secrets_app = typer.Typer(
    help="Set, list and delete the secrets jobs read (on the head node; values never shown).",
    no_args_is_help=True,
)
_stderr = Console(stderr=True, highlight=False)

Name = Annotated[str, typer.Argument(help="Secret name, as in SecretReference(name=...)")]
Team = Annotated[
    str | None,
    typer.Option(
        "--team", help="Only jobs of this team read it; default: every job (cluster-wide)"
    ),
]
SecretsDir = Annotated[
    Path | None,
    typer.Option(
        "--secrets-dir", help=f"Default: ${SECRETS_DIR_ENV}, else $ORCHESTRATOR_HOME/secrets"
    ),
]


@secrets_app.command(
    "set", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def set_secret(
    ctx: typer.Context, name: Name, team: Team = None, secrets_dir: SecretsDir = None
) -> None:
    """Set NAME from a hidden prompt, or from stdin when stdin is not a terminal.

    From stdin, one trailing newline is dropped: `orchestrator secrets set hf_token < token.txt`.
    """
    if ctx.args:
        # Never echo them: the extra argument is most likely the value itself.
        raise OrchestratorError(
            "secrets set takes the value from a prompt or stdin, never as an argument: nothing "
            "was set. If you typed the value on the command line, it is in your shell history: "
            "rotate it, then run `orchestrator secrets set NAME` and paste it at the prompt"
        )
    check_name(name)
    check_team(team)
    store = FileSecretStore(secrets_dir)
    _warn_if_remote_cluster()
    value = _read_value(name)
    with audited(storage(), "secrets set", target=name, team=team):  # the name, never the value
        store.set(name, value, team)
    console.print(f"secret {name} set ({scope_label(team)}) in {store.directory}")


@secrets_app.command("list")
def list_secrets(
    team: Annotated[
        str | None,
        typer.Option(
            "--team", help="What this team's jobs read: its secrets and cluster-wide ones"
        ),
    ] = None,
    all_teams: Annotated[
        bool, typer.Option("--all-teams", help="Every scope: cluster-wide and each team's")
    ] = False,
    secrets_dir: SecretsDir = None,
    output: Annotated[OutputFormat, typer.Option("-o", "--output")] = OutputFormat.text,
) -> None:
    """List secret names with their scope and modification time (never their values).

    Without --team: the cluster-wide secrets, which jobs without a team read.
    """
    if team and all_teams:
        raise OrchestratorError("give --team or --all-teams, not both")
    store = FileSecretStore(secrets_dir)
    if all_teams:
        found = store.names(None) + [s for t in store.teams() for s in store.names(t)]
        what = "every scope"
    else:
        found = store.visible(check_team(team))
        what = f"what jobs of team {team} read" if team else "cluster-wide"
    if output is OutputFormat.json:
        print_json([_row(s) for s in found])
        return
    if not found:
        console.print(f"no secrets ({what}) in {store.directory}")
        return
    table = Table(title=f"secrets ({what}) in {store.directory}")
    table.add_column("name", no_wrap=True)
    table.add_column("scope", no_wrap=True)
    table.add_column("modified", no_wrap=True)
    for s in found:
        table.add_row(s.name, s.scope, when(s.modified_at))
    console.print(table)


@secrets_app.command("delete")
def delete_secret(name: Name, team: Team = None, secrets_dir: SecretsDir = None) -> None:
    """Delete NAME from one scope (cluster-wide, or --team's)."""
    store = FileSecretStore(secrets_dir)
    with audited(storage(), "secrets delete", target=name, team=team):
        if not store.delete(name, team):
            hint = f"orchestrator secrets list{f' --team {team}' if team else ''}"
            raise OrchestratorError(
                f"no secret {name} ({scope_label(team)}) in {store.directory}: "
                f"`{hint}` shows what is there"
            )
    console.print(f"secret {name} deleted ({scope_label(team)})")
    if team and any(s.name == name for s in store.names(None)):
        console.print(f"jobs of team {team} now read the cluster-wide {name}")


def _read_value(name: str) -> str:
    if sys.stdin.isatty():
        value = typer.prompt(f"value of {name}", hide_input=True, confirmation_prompt=True)
    else:
        value = sys.stdin.read()
        value = value.removesuffix("\n").removesuffix("\r") if value.endswith("\n") else value
    if not value:
        raise OrchestratorError(f"the value of {name} is empty: nothing was set")
    return value


def _warn_if_remote_cluster() -> None:
    """The store is this machine's: say so when the jobs would run on a cluster elsewhere."""
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        return
    host = urlsplit(address if "://" in address else f"http://{address}").hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1"):
        _stderr.print(
            f"[yellow]note:[/yellow] this sets the secret on this machine; jobs on the cluster "
            f"at {address} read the store on its head node: run this command there",
            markup=True,
        )


def _row(s: SecretInfo) -> dict:
    return {"name": s.name, "team": s.team, "scope": s.scope, "modified_at": s.modified_at}
