"""The Python API: `push` a config and get a handle; find jobs and projects later."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orchestrator.client.audit import audited
from orchestrator.client.connection import connect, storage
from orchestrator.client.job_summary import describe_job
from orchestrator.client.jobs import JobHandle
from orchestrator.client.overrides import Overrides
from orchestrator.client.prepare import prepare_job
from orchestrator.client.submit import check_recreatable, recreate_job, submit
from orchestrator.client.workspace import write_archive
from orchestrator.errors import OrchestratorError
from orchestrator.lifecycle import JobState
from orchestrator.spec.training import TrainingProject
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.records import RetryPolicy


def push(
    config: str | Path | TrainingProject,
    source_dir: str | Path | None = None,
    *,
    address: str | None = None,
    storage_root: str | None = None,
    overrides: Overrides | None = None,
    colocate_ranks: bool = False,
    retries: int | None = None,
    retry_on_failure: bool = False,
    max_duration: str | float | None = None,
) -> JobHandle:
    """Validate, package and submit a job. Nothing is created if the config is invalid.

    `colocate_ranks` runs all `node_count` ranks on one node, each its own process with its own
    rank: multinode code on a single development machine. `retries`: how many times a lost
    node or agent (and, with `retry_on_failure`, a failed command) is retried from the job's
    latest checkpoint (default ORCHESTRATOR_MAX_RETRIES, else 0); preemptions are retried
    without using it. `max_duration` ("2h", "90m", or seconds) overrides the config's: how long
    the job may hold its nodes before its commands get SIGTERM and it ends FAILED.
    """
    try:
        retry = RetryPolicy.resolve(retries, retry_on_failure)
    except ValueError as e:
        raise OrchestratorError(str(e)) from None
    prepared = prepare_job(config, source_dir, _with_max_duration(overrides, max_duration))
    connection = connect(address)
    store = JobStore(storage(storage_root))
    project = prepared.project
    with audited(store.root, "push", project=project.name, team=project.team_name) as event:
        record = submit(prepared, connection, store.root, colocate_ranks=colocate_ranks,
                        retry=retry)  # fmt: skip
        event["job"] = record.job_id
    return JobHandle(store, record)


@dataclass(frozen=True)
class DryRun:
    """What `push` would submit: the resolved job, the warnings, the code archive's size and
    hash (`push --dry-run` prints this)."""

    summary: dict[str, Any]
    warnings: tuple[str, ...]
    archive_bytes: int
    archive_sha256: str


DRY_RUN_PRICES_S = 5.0  # how long push --dry-run tries to read the cluster's prices


def dry_run(
    config: str | Path | TrainingProject,
    source_dir: str | Path | None = None,
    *,
    overrides: Overrides | None = None,
    max_duration: str | float | None = None,
    storage_root: str | None = None,
) -> DryRun:
    """Everything `push` does short of submitting: load, override, validate, package. Reaches
    no cluster; reads the cluster's prices from the storage root (`cost_per_hour`: what the
    job would cost an hour, None when none are set or they cannot be read), writes nothing."""
    prepared = prepare_job(config, source_dir, _with_max_duration(overrides, max_duration))
    with tempfile.TemporaryDirectory(prefix="orchestrator-dry-run-") as tmp:
        archive = write_archive(prepared.plan, Path(tmp) / "workspace.tar")
    summary = describe_job(prepared.project, prepared.plan)
    summary["archive"].update(tar_bytes=archive.size_bytes, sha256=archive.sha256)
    summary["cost_per_hour"] = _cost(prepared.project, storage_root)
    return DryRun(summary, tuple(prepared.warnings), archive.size_bytes, archive.sha256)


def _cost(project: TrainingProject, storage_root: str | None) -> str | None:
    """The hourly cost line, its prices read within DRY_RUN_PRICES_S: a dry run offline (an
    object store out of reach) must not ride out an outage as a job's storage calls do."""
    from orchestrator.client.books import cost_line
    from orchestrator.storage.prices import read_prices
    from orchestrator.storage.retry import StorageRetry

    try:
        root = storage(storage_root)
        root.retry = StorageRetry(root.url, DRY_RUN_PRICES_S, say=lambda line: None)
        return cost_line(project.job.compute, read_prices(root))
    except Exception as e:  # nothing is submitted: a price that cannot be read is said
        return f"unknown: the cluster's prices could not be read ({type(e).__name__}: {e})"


def _with_max_duration(
    overrides: Overrides | None, max_duration: str | float | None
) -> Overrides | None:
    """`push(max_duration=...)` as the override `--max-duration` is."""
    if max_duration is None:
        return overrides
    return replace(overrides or Overrides(), max_duration=max_duration)


def recreate(
    job_id: str | None = None,
    *,
    project: str | None = None,
    address: str | None = None,
    storage_root: str | None = None,
) -> JobHandle:
    """A new job with an earlier job's code and config (default: the most recent job, of
    `project` if given), as `truss train recreate`."""
    earlier = (
        get_job(job_id, storage_root=storage_root)
        if job_id
        else latest_job(project, storage_root=storage_root)
    )
    store = JobStore(storage(storage_root))
    check_recreatable(earlier.record, store.root)  # before a cluster is started for nothing
    connection = connect(address)
    with audited(store.root, "recreate", project=earlier.project, team=earlier.record.team,
                 detail=f"from job {earlier.id}") as event:  # fmt: skip
        record = recreate_job(earlier.record, connection, store.root)
        event["job"] = record.job_id
    return JobHandle(store, record)


def get_job(job_id: str, *, storage_root: str | None = None) -> JobHandle:
    store = JobStore(storage(storage_root))
    return JobHandle(store, store.record(job_id))


def list_jobs(
    project: str | None = None,
    status: JobState | str | None = None,
    *,
    storage_root: str | None = None,
) -> list[JobHandle]:
    """Jobs, newest first, optionally of one project (its name or id) and in one state."""
    store = JobStore(storage(storage_root))
    handles = [JobHandle(store, r) for r in reversed(store.records())]
    if project is not None:
        handles = [h for h in handles if project in (h.project, h.project_id)]
    if status is not None:
        wanted = JobState(status.upper() if isinstance(status, str) else status)
        handles = [h for h in handles if h.status() == wanted]
    return handles


def list_projects(*, storage_root: str | None = None) -> list[str]:
    store = JobStore(storage(storage_root))
    return sorted({r.project for r in store.records()})


def latest_job(project: str | None = None, *, storage_root: str | None = None) -> JobHandle:
    jobs = list_jobs(project, storage_root=storage_root)
    if not jobs:
        raise OrchestratorError("no jobs yet" + (f" in project {project!r}" if project else ""))
    return jobs[0]
