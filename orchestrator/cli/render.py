"""Rich rendering of job summaries for the terminal."""

from __future__ import annotations

import datetime as dt
import enum
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from orchestrator.sizes import human_bytes
from orchestrator.spec.durations import spelled

console = Console(highlight=False)


class OutputFormat(str, enum.Enum):
    text = "text"
    json = "json"


def when(ts: float) -> str:
    """A timestamp as local date and time, the way every verb prints one."""
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def print_warnings(warnings: list[str]) -> None:
    for w in warnings:
        console.print(f"[yellow]warning:[/yellow] {w}", markup=True)


def print_job_summary(summary: dict[str, Any]) -> None:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    node = summary["per_node"]
    accel = node["accelerator"] or "none (CPU)"
    project = summary["project"] + (f" (team {summary['team']})" if summary["team"] else "")
    table.add_row("project", project)
    table.add_row("job name", summary["job_name"] or "-")
    table.add_row("image", summary["image"])
    table.add_row(
        "nodes",
        f"{summary['nodes']} x (cpu {node['cpu']}, memory {node['memory']}, accelerator {accel})",
    )
    table.add_row("availability", summary["availability_model"])
    if summary.get("ray_train"):
        table.add_row("ray train", summary["ray_train"])
    if summary.get("max_duration") is not None:
        limit = spelled(summary["max_duration"])
        table.add_row("max duration", f"{limit} holding its nodes (queued time not counted)")
    commands = summary["start_commands"]
    table.add_row("start commands", "\n".join(commands) if commands else "(none)")
    env = summary["environment"]
    table.add_row(
        "environment",
        "\n".join(f"{k}  <- {v}" if v.startswith("secret:") else k for k, v in env.items())
        or "(none)",
    )
    weights = summary["weights"]
    table.add_row(
        "weights",
        "\n".join(f"{w['source']} -> {w['mount_location']}" for w in weights) or "(none)",
    )
    ckpt = summary["checkpointing"]
    table.add_row(
        "checkpointing",
        ("enabled" + (f" at {ckpt['checkpoint_path']}" if ckpt["checkpoint_path"] else ""))
        if ckpt["enabled"]
        else "disabled",
    )
    cache = summary["cache"]
    table.add_row("cache", "enabled" if cache and cache["enabled"] else "disabled")
    load = summary["load_checkpoints"]
    if load and load["enabled"]:
        table.add_row("load checkpoints", "\n".join(_describe_ref(r) for r in load["checkpoints"]))
    archive = summary.get("archive")
    if archive:
        table.add_row(
            "archive",
            f"{archive['files']} files, {human_bytes(archive['bytes'])} from {archive['root']}",
        )
        for note in archive["skipped"]:
            table.add_row("", f"[dim]skipped: {note}[/dim]")
    console.print(table)
    print_warnings([f"{n}" for n in summary["notices"]])
    for e in summary["unsupported"]:
        console.print(f"[red]unsupported:[/red] {e}", markup=True)


def _describe_ref(ref: dict[str, Any]) -> str:
    if ref["typ"] == "baseten_named_checkpoint":
        return f"{ref['checkpoint_name']} of job {ref['job_id']}"
    if ref["typ"] == "baseten_latest_checkpoint":
        scope = [f"job {ref['job_id']}"] if ref.get("job_id") else []
        scope += [f"project {ref['project_name']}"] if ref.get("project_name") else []
        return "latest of " + (", ".join(scope) or "this project")
    return f"loops run {ref['run_id']} {ref['checkpoint_name']}"
