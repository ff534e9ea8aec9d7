"""Picking the job a verb acts on, and following its logs."""

from __future__ import annotations

from orchestrator.cli.render import console
from orchestrator.client.api import get_job, latest_job
from orchestrator.client.jobs import JobHandle
from orchestrator.lifecycle import JobState

ENDINGS = {
    JobState.COMPLETED: "[green]completed successfully[/green]",
    JobState.FAILED: "[red]failed during execution[/red]",
    JobState.STOPPED: "[yellow]stopped by user[/yellow]",
    JobState.DEPLOY_FAILED: "[red]failed during deployment[/red]",
}


def pick_job(job_id: str | None, project: str | None, storage_root: str | None) -> JobHandle:
    if job_id:
        return get_job(job_id, storage_root=storage_root)
    job = latest_job(project, storage_root=storage_root)
    console.print(f"[dim]no --job-id given: using the most recent job, {job.id}[/dim]", markup=True)
    return job


def follow(job: JobHandle) -> JobState:
    """Print the job's log lines as they arrive, then how it ended."""
    for line in job.logs(follow=True):
        print(line, flush=True)
    return print_ending(job)


def print_ending(job: JobHandle) -> JobState:
    details = job.details()
    state = details.state
    if state in ENDINGS:
        console.print(f"job {job.id} {ENDINGS[state]}", markup=True)
        if details.failure is not None:
            console.print(f"  cause: {details.failure.cause}", markup=False)
    return state
