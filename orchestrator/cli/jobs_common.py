"""Picking the job a verb acts on, and following its logs."""

from __future__ import annotations

import sys

from rich.markup import escape

from orchestrator.cli.render import OutputFormat, console, print_json, print_warnings
from orchestrator.client.api import get_job, latest_job
from orchestrator.client.jobs import JobHandle
from orchestrator.client.log_view import LineRenderer
from orchestrator.lifecycle import CHECKPOINTS_NOT_STORED_EXIT, JobState
from orchestrator.storage.records import JobStatus

ENDINGS = {
    JobState.COMPLETED: "[green]completed successfully[/green]",
    JobState.FAILED: "[red]failed during execution[/red]",
    JobState.STOPPED: "[yellow]stopped by user[/yellow]",
    JobState.DEPLOY_FAILED: "[red]failed during deployment[/red]",
    JobState.PREEMPTED: "[red]preempted more often than it may be retried[/red]",
}


def pick_job(job_id: str | None, project: str | None, storage_root: str | None) -> JobHandle:
    if job_id:
        return get_job(job_id, storage_root=storage_root)
    job = latest_job(project, storage_root=storage_root)
    console.print(f"[dim]no --job-id given: using the most recent job, {job.id}[/dim]", markup=True)
    return job


def announce(job: JobHandle, what: str, output: OutputFormat) -> None:
    """A submitted job: its Baseten-shaped ids and push's warnings (JSON), or the warnings and
    where to follow it."""
    warnings = list(job.record.notices)
    if output is OutputFormat.json:
        print_json({
            "training_project": job["training_project"], "training_job": job["training_job"],
            "warnings": warnings,
        })  # fmt: skip
        return
    print_warnings(warnings)
    try:
        cost = job.cost_per_hour()
    except Exception:  # the job is pushed: a price it cannot read changes nothing
        cost = None
    lines = [f"{what} of project {escape(job.project)} to {job.record.ray_address}"]
    if cost:
        lines.append(f"  cost:  {escape(cost)}")
    lines += [f"  logs:  orchestrator logs --job-id {job.id} --tail",
              f"  view:  orchestrator view --job-id {job.id}",
              f"  stop:  orchestrator stop --job-id {job.id}"]  # fmt: skip
    console.print("\n".join(lines), markup=True)


def follow(job: JobHandle) -> int:
    """Print the job's log lines as they arrive (on a terminal, a progress bar's states drawn
    over each other), then how it ended; its exit code."""
    shown = LineRenderer(sys.stdout, sys.stdout.isatty())
    for line in job.logs(follow=True, progress_every_s=0):
        shown.show(line)
    shown.close()
    return print_ending(job)


def print_ending(job: JobHandle) -> int:
    """How the job ended, and any checkpoint it did not store whole; the exit code that says so:
    0 completed, 3 completed without every checkpoint stored, 1 anything else."""
    details = job.refresh()
    state = details.state
    summary = details.checkpoints
    unstored = summary is not None and not summary.all_uploaded
    if state == JobState.COMPLETED and unstored:
        console.print(f"job {job.id} [yellow]completed, but its checkpoints were not all "
                      "stored[/yellow]", markup=True)  # fmt: skip
    elif state in ENDINGS:
        console.print(f"job {job.id} {ENDINGS[state]}", markup=True)
    if details.failure is not None:
        console.print(f"  cause: {details.failure.cause}", markup=False)
    for problem in summary.problems() if summary else []:
        console.print(f"  checkpoint {problem}", markup=False)
    return ending_code(details)


def ending_code(details: JobStatus) -> int:
    """0 completed, 3 completed without every checkpoint stored, 1 anything else."""
    summary = details.checkpoints
    if details.state != JobState.COMPLETED:
        return 1
    return CHECKPOINTS_NOT_STORED_EXIT if summary and not summary.all_uploaded else 0
