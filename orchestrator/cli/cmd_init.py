"""`orchestrator init`: a starter config, or copies of the example recipes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer

from orchestrator.cli.render import console
from orchestrator.client.recipes import copy_recipe, list_recipes
from orchestrator.errors import OrchestratorError

_TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "init"


def init(
    target_directory: Annotated[
        Path | None, typer.Option("--target-directory", help="Where to write the files")
    ] = None,
    examples: Annotated[
        str | None, typer.Option("--examples", help="Comma-separated recipe names to copy")
    ] = None,
    list_examples: Annotated[
        bool, typer.Option("--list-examples", help="List the recipes and exit")
    ] = False,
) -> None:
    """Write a starter config.py and run.sh, or copy example recipes."""
    if list_examples:
        for name, description in list_recipes().items():
            console.print(f"[bold]{name}[/bold]  {description}", markup=True)
        return
    if examples:
        target = target_directory or Path.cwd()
        target.mkdir(parents=True, exist_ok=True)
        for name in (n.strip() for n in examples.split(",") if n.strip()):
            dest = copy_recipe(name, target)
            console.print(
                f"copied recipe {name} to {dest}; push it with: "
                f"orchestrator push {dest / 'config.py'} --tail"
            )
        return
    target = target_directory or Path.cwd() / "orchestrator-init"
    if target.exists() and any(target.iterdir()):
        raise OrchestratorError(
            f"{target} already exists and is not empty: choose --target-directory"
        )
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.py", "run.sh"):
        shutil.copy2(_TEMPLATE / name, target / name)
    console.print(
        f"wrote {target / 'config.py'} and {target / 'run.sh'}; next: "
        f"orchestrator validate {target / 'config.py'}"
    )
