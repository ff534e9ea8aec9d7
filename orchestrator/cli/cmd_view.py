"""`orchestrator view`: projects and jobs as tables, or one job in detail."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from orchestrator.books.usage import JobUsage, job_usage
from orchestrator.cli.cmd_queue import start_text
from orchestrator.cli.cmd_usage import usage_line
from orchestrator.cli.options import JobId, Project, StorageRootOption
from orchestrator.cli.render import OutputFormat, console, human_bytes, print_json, when
from orchestrator.client.api import get_job, list_jobs
from orchestrator.client.jobs import JobHandle
from orchestrator.client.queue import start_estimate
from orchestrator.lifecycle import JobState
from orchestrator.storage.records import JobRecord, JobStatus


def view(
    project: Project = None,
    job_id: JobId = None,
    all_jobs: Annotated[bool, typer.Option("--all", help="Every job, newest last")] = False,
    storage_root: StorageRootOption = None,
    output: Annotated[OutputFormat, typer.Option("-o", "--output")] = OutputFormat.text,
) -> None:
    """Show projects and active jobs; a project's jobs (--project), every job (--all), or one
    job in detail (--job-id)."""
    if job_id:
        job = get_job(job_id, storage_root=storage_root)
        if output is OutputFormat.json:
            print_json(_job_detail(job, storage_root))
        else:
            _print_detail(job, storage_root)
        return
    rows = [_job_row(j) for j in list_jobs(project, storage_root=storage_root)]
    rows.reverse()  # oldest first
    if project or all_jobs:
        _print_jobs(rows, f"jobs in project {project!r}" if project else "jobs", output)
        return
    projects = _project_rows(rows)
    active = [r for r in rows if not JobState(r["status"]).is_terminal]
    if output is OutputFormat.json:
        print_json({"projects": projects, "active_jobs": active})
        return
    table = Table(title="projects")
    for column in ("project", "id", "jobs", "latest job", "its status", "its checkpoints",
                   "pushed"):  # fmt: skip
        table.add_column(column)
    for p in projects:
        table.add_row(escape(p["name"]), p["id"], str(p["job_count"]), p["latest_job_id"],
                      p["latest_job_status"], p["latest_job_checkpoints"] or "-",
                      p["latest_job_created"])  # fmt: skip
    console.print(table if projects else "no projects yet: push a job")
    for warning in _unstored_warnings(rows):
        console.print(warning, markup=True)
    if active:
        _print_jobs(active, "active jobs", output)
    else:
        console.print("no active jobs")


def _project_rows(rows: list[dict]) -> list[dict]:
    """Per project (in the order of their latest jobs): its latest job and how that went."""
    latest: dict[str, dict] = {}
    counts: dict[str, int] = {}
    for r in rows:  # oldest first: the last one seen is the latest
        latest[r["project_id"]] = r
        counts[r["project_id"]] = counts.get(r["project_id"], 0) + 1
    return [
        {
            "id": key,
            "name": r["project"],
            "job_count": counts[key],
            "latest_job_id": r["id"],
            "latest_job_status": r["status"],
            "latest_job_checkpoints": r["checkpoints"],
            "checkpoint_sync_status": r["checkpoint_sync_status"],
            "latest_job_created": r["created"],
        }
        for key, r in sorted(latest.items(), key=lambda item: item[1]["created"])
    ]


def _print_jobs(rows: list[dict], title: str, output: OutputFormat) -> None:
    if output is OutputFormat.json:
        print_json(rows)
        return
    if not rows:
        console.print(f"no {title} yet", markup=False)
        return
    table = Table(title=escape(title))
    for column in ("job id", "project", "name", "status", "nodes", "checkpoints", "created"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["id"], escape(r["project"]), escape(r["name"] or "-"), r["status"],
                      str(r["nodes"]), r["checkpoints"] or "-", r["created"])  # fmt: skip
    console.print(table)
    for warning in _unstored_warnings(rows):
        console.print(warning, markup=True)


def _unstored_warnings(rows: list[dict]) -> list[str]:
    """Per project, when its latest job ended without every checkpoint stored."""
    latest: dict[str, dict] = {}
    for r in rows:  # oldest first
        latest[r["project_id"]] = r
    return [
        f"[yellow]project {escape(r['project'])}: its latest job, {r['id']}, did not store all "
        f"its checkpoints ({r['checkpoints']}): orchestrator view --job-id {r['id']}[/yellow]"
        for r in latest.values()
        if r["checkpoint_sync_status"] == "not_synced"
    ]


def _job_row(job: JobHandle, details: JobStatus | None = None) -> dict:
    r = job.record
    details = details or job.refresh()
    summary = details.checkpoints
    return {
        "id": job.id,
        "project": r.project,
        "project_id": r.project_key,
        "name": r.job_name,
        "status": details.state.value,
        "nodes": r.spec.job.compute.node_count,
        "checkpoints": summary.describe() if summary else None,
        "checkpoint_sync_status": summary.sync_status if summary else None,
        "created": when(r.created_at),
        "attempts": len(details.attempts),
    }


def _job_detail(job: JobHandle, storage_root: str | None = None) -> dict:
    details = job.refresh()
    summary = details.checkpoints
    waiting = details.state in (JobState.CREATED, JobState.PENDING)
    estimate = start_estimate(job.id, storage_root=storage_root) if waiting else None
    return {
        **_job_row(job, details),
        "team": job.record.team,
        "storage_root": job.record.storage_root,
        "ray_address": job.record.ray_address,
        "dashboard_url": job.dashboard_url,
        "history": [e.model_dump(mode="json") for e in details.history],
        "failure": details.failure.model_dump(mode="json") if details.failure else None,
        "nodes_detail": [n.model_dump(mode="json") for n in details.nodes],
        "runtime": _runtime(job.record, details),
        "weights": [w.model_dump(mode="json") for w in details.weights],
        "checkpoint_entries": (
            [e.model_dump(mode="json") for e in summary.entries] if summary else []
        ),
        "checkpoint_problems": summary.problems() if summary else [],
        "held_until": details.held_until,
        "notices": job.record.notices,
        "retry": job.record.retry.model_dump(mode="json"),
        "attempts": [a.model_dump(mode="json") for a in details.attempts],
        "usage": job_usage(job.record, details, time.time()).model_dump(),
        # A waiting job's, from the queue's last view (None: not waiting, or not in it yet)
        "estimated_start": estimate["estimated_start"] if estimate else None,
        "estimate": estimate["estimate"] if estimate else None,
    }


def _runtime(record: JobRecord, details: JobStatus) -> str | None:
    """Where its commands ran, once a node was prepared: in which image (as each node had it)."""
    if not details.nodes:
        return None
    digests = sorted({n.image_digest for n in details.nodes if n.image_digest})
    if not digests:
        return "host (each node's own environment; trusted code)"
    return f"container of {record.spec.job.image.base_image} ({', '.join(digests)})"


def _weights_line(w: dict) -> str:
    line = (
        f"{w['source']} -> {w['mount_location']}: {w['files_done']}/{w['files_total']} files, "
        f"{human_bytes(w['bytes_done'])} of {human_bytes(w['bytes_total'])}"
    )
    if w["mirror"]:
        line += f", mirror {w['mirror']} at {(w['revision'] or '')[:12]}"
    for node in w["nodes"]:
        how = "node cache hit" if node["tier"] == "node" else f"copied from the {node['tier']}"
        line += f"\n  rank {node['rank']}: {how} in {node['seconds']:.2f} s"
    return line


def _attempt_line(a: dict) -> str:
    """`13:02:11 to 13:05:40  node_lost: rank 1's node ... was lost -> retried: retry 1 of 2`"""
    span = when(a["started_at"]) + (f" to {when(a['ended_at'])}" if a["ended_at"] else " on")
    line = span + (f", from {a['resumed_from']}" if a["resumed_from"] else "")
    if a["cause"]:
        line += f"  {a['cause']}: {a['reason']}"
    return line + (f" -> {a['decision']}" if a["decision"] else "")


def _print_detail(job: JobHandle, storage_root: str | None = None) -> None:
    d = _job_detail(job, storage_root)
    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    for key in ("id", "project", "name", "team", "status", "created", "ray_address",
                "storage_root"):  # fmt: skip
        table.add_row(key, escape(str(d[key] if d[key] is not None else "-")))
    if d["dashboard_url"]:
        queued = d["status"] in (JobState.CREATED.value, JobState.PENDING.value)
        later = " (once the queue admits it; until then: orchestrator queue)" if queued else ""
        table.add_row("dashboard", escape(d["dashboard_url"]) + later)
    for event in d["history"]:
        reason = escape(event["reason"] or "")
        table.add_row("", f"{when(event['at'])}  {event['state']}  {reason}")
    if d["estimate"] is not None:
        start = start_text(d["estimated_start"], d["estimate"], time.time())
        if d["estimated_start"] is not None and d["estimate"]:
            start += f": {d['estimate']}"  # how: "after j1 ends (its max_duration 2h 0m), ..."
        table.add_row("estimated start", escape(start))
    if d["runtime"]:
        table.add_row("runtime", escape(d["runtime"]))
    for node in d["nodes_detail"]:
        again = f", prepared for attempt {node['prepared_for']}" if node["prepared_for"] else ""
        table.add_row(
            f"rank {node['rank']}",
            f"{node['ip']} ({node['hostname']}, {node['node_id'][:12]}{again})",
        )
    retry = d["retry"]
    if len(d["attempts"]) > 1 or retry["retries"] or retry["retry_on_failure"]:
        table.add_row(
            "retries",
            f"{retry['retries']}" + (" (failed commands too)" if retry["retry_on_failure"] else "")
            + f"; preemptions up to {retry['max_preemptions']}",
        )  # fmt: skip
        for a in d["attempts"]:
            table.add_row(f"attempt {a['number']}", _attempt_line(a))
    for i, w in enumerate(d["weights"]):
        table.add_row(f"weights[{i}]", _weights_line(w))
    if d["checkpoints"]:
        table.add_row("checkpoints", f"{d['checkpoints']}: {d['checkpoint_sync_status']}")
        for problem in d["checkpoint_problems"]:
            table.add_row("", problem)
    if d["usage"]["usage"]["held_s"] or d["usage"]["waiting_s"]:
        table.add_row("usage", escape(usage_line(JobUsage.model_validate(d["usage"]))))
    if d["failure"]:
        f = d["failure"]
        table.add_row("cause", escape(f["cause"]))
        if f["last_lines"]:
            table.add_row("last lines", escape("\n".join(f["last_lines"][-10:])))
    console.print(table)
