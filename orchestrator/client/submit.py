"""Submitting a prepared job: store its archive and record, then put it in the cluster's queue,
whose service starts its controller (or, for a root's first push, start it here: bootstrap.py)."""

from __future__ import annotations

import secrets
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from orchestrator import ray_private, settings
from orchestrator.agents.runtimes import cluster_runtime_kind, push_notices
from orchestrator.client import bootstrap
from orchestrator.client.connection import Connection
from orchestrator.client.prepare import PreparedJob
from orchestrator.client.workspace import write_archive
from orchestrator.cluster.auth import refusal
from orchestrator.errors import OrchestratorError, SubmitError
from orchestrator.lifecycle import JobState
from orchestrator.scheduler.entries import entry_for
from orchestrator.storage.checkpoints import UploadSettings
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.projects import ProjectRecord, ProjectStore
from orchestrator.storage.queue_store import INCOMING, Launch, QueueStore
from orchestrator.storage.records import ArchiveRef, Failure, JobRecord, JobStatus, RetryPolicy
from orchestrator.storage.retry import StorageSettings
from orchestrator.storage.root import StorageRoot

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

REMOTE_PYTHON_ENV = settings.PYTHON.name
SHARED_FS_ENV = settings.SHARED_FILESYSTEM.name
SCHEDULING_TIMEOUT_ENV = settings.SCHEDULING_TIMEOUT_S.name
SUBMIT_WAIT_ENV = settings.SUBMIT_WAIT_S.name

T = TypeVar("T")

_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


def new_job_id() -> str:
    """Short, unique, safe in paths and Ray names: 'j' + 9 base-36 characters."""
    return "j" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def scheduling_timeout() -> float:
    return settings.SCHEDULING_TIMEOUT_S.get()


def store_job(
    prepared: PreparedJob,
    root: StorageRoot,
    job_id: str,
    ray_address: str | None,
    submitted_via: str = "push",
    colocate_ranks: bool = False,
    embedded: bool = False,
    upload_settings: UploadSettings | None = None,
    storage_settings: StorageSettings | None = None,
    retry: RetryPolicy | None = None,
    notices: list[str] | None = None,
) -> JobRecord:
    """Upload the code archive (skipped if the same bytes are stored) and write the record;
    `notices`: what push says beside the config's own warnings."""
    store = JobStore(root)
    with tempfile.TemporaryDirectory(prefix="orchestrator-push-") as tmp:
        info = write_archive(prepared.plan, Path(tmp) / "workspace.tar")
        archive_path = store.put_archive(info.path, info.sha256)
    project = prepared.project
    registered = register_project(root, project.name)
    record = JobRecord(
        job_id=job_id,
        project=project.name,
        project_id=registered.id,
        team=project.team_name,
        job_name=project.job.name,
        created_at=time.time(),
        spec=project,
        archive=ArchiveRef(
            path=archive_path,
            sha256=info.sha256,
            size_bytes=info.size_bytes,
            file_count=info.file_count,
            config_dir=prepared.plan.config_relpath,
        ),
        storage_root=root.url,
        ray_address=ray_address,
        submitted_via=submitted_via,
        colocate_ranks=colocate_ranks,
        embedded_cluster=embedded,
        checkpoint_upload=upload_settings or UploadSettings.from_env(),
        storage=storage_settings or StorageSettings.from_env(),
        retry=retry or RetryPolicy.resolve(),
        queue_timeout_s=settings.QUEUE_TIMEOUT_S.get(),
        metrics_interval_s=settings.METRICS_INTERVAL_S.get(),
        notices=[*prepared.warnings, *(notices or [])],
    )
    store.create(record, JobStatus.new(job_id, "submitted"))
    return record


def register_project(root: StorageRoot, name: str) -> ProjectRecord:
    """The project's id, given now if this is its first push. A name whose jobs were stored
    before ids existed keeps itself as its id, so their checkpoints and cache stay found."""
    projects = ProjectStore(root)
    if (found := projects.by_name(name)) is not None:
        return found
    legacy = any(r.project == name and r.project_id is None for r in JobStore(root).records())
    return projects.ensure(name, legacy=legacy)


def remote_python(embedded: bool) -> str:
    """The interpreter a Ray job's entrypoint runs on the head node. The embedded cluster runs
    here: this very interpreter, which has orchestrator installed. Any other cluster uses its own
    `python` (or $ORCHESTRATOR_PYTHON)."""
    return settings.PYTHON.get() or (sys.executable if embedded else "python")


def controller_entrypoint(
    job_id: str, root: StorageRoot, connection: Connection, runs: str = ""
) -> str:
    """The controller's command, after a no-op saying what the job runs (`runs`, quoted: never
    expanded): the dashboard's Entrypoint column shows its start, cut to the column's width.
    `exec` keeps the controller the process Ray's job supervisor started, as without it."""
    python = remote_python(connection.embedded)
    command = " ".join(
        shlex.quote(part)
        for part in (
            python, "-m", "orchestrator.controller", "--job-id", job_id,
            "--storage-root", root.url, "--scheduling-timeout", f"{scheduling_timeout():g}",
        )
    )  # fmt: skip
    return f": {shlex.quote(runs)}; exec {command}" if runs else command


# The dashboard shows the entrypoint on one line of a table: what the job runs is cut to this.
_RUNS_MAX_CHARS = 300


def runs_comment(record: JobRecord) -> str:
    """What the job runs, for the dashboard: its name and start commands, on one line."""
    commands = " && ".join(record.spec.job.runtime.start_commands)
    line = " ".join(f"{dashboard_name(record)}: {commands}".split())
    return line if len(line) <= _RUNS_MAX_CHARS else line[: _RUNS_MAX_CHARS - 3] + "..."


def dashboard_name(record: JobRecord) -> str:
    """The Ray dashboard's Name column (the Ray job's `job_name` metadata): project/job."""
    return f"{record.project}/{record.job_name or record.job_id}"


def ray_job_metadata(record: JobRecord, root: StorageRoot) -> dict[str, str]:
    """What the controller's Ray job carries: the dashboard's Name column and filter
    (`job_name`), and ours, which the cluster's reaper and `cluster stop` read."""
    return {
        "job_name": dashboard_name(record),
        "orchestrator_project": record.project,
        "orchestrator_job_name": record.job_name or "",
        "orchestrator_team": record.team or "",
        "orchestrator_storage_root": root.url,
        "base_image": record.spec.job.image.base_image,
    }


def check_storage_reachable(connection: Connection, root: StorageRoot) -> None:
    """A cluster elsewhere cannot read a directory on this machine: refuse before creating."""
    if root.is_local and not connection.on_this_machine and not settings.SHARED_FILESYSTEM.get():
        raise OrchestratorError(
            f"the storage root {root.url} is a local directory, but the cluster at "
            f"{connection.address} is another machine and cannot read it. Use an object store "
            "both can reach (--storage-root s3://bucket/prefix or ORCHESTRATOR_STORAGE_ROOT), "
            f"or set {SHARED_FS_ENV}=1 if that path is a filesystem shared with the cluster"
        )


def submit(
    prepared: PreparedJob,
    connection: Connection,
    root: StorageRoot,
    colocate_ranks: bool = False,
    retry: RetryPolicy | None = None,
) -> JobRecord:
    """Store the job, then put it in the cluster's queue (`submit_record`)."""
    check_storage_reachable(connection, root)
    # A bad value is refused before anything exists.
    upload_settings, storage_settings = UploadSettings.from_env(), StorageSettings.from_env()
    retry = retry or RetryPolicy.resolve()
    # Where the cluster runs the commands: as the queue services watching the root say (one
    # cluster's, as a rule); the embedded cluster's is this environment's.
    said = QueueStore(root).runtimes()
    runtime = said.pop() if len(said) == 1 else None
    if runtime is None and connection.embedded:
        runtime = cluster_runtime_kind().said
    job_id = new_job_id()
    record = store_job(
        prepared, root, job_id, connection.address, colocate_ranks=colocate_ranks,
        embedded=connection.embedded, upload_settings=upload_settings,
        storage_settings=storage_settings, retry=retry,
        notices=push_notices(prepared.project.job, runtime),
    )  # fmt: skip
    submit_record(record, connection, root)
    return record


def recreate_job(earlier: JobRecord, connection: Connection, root: StorageRoot) -> JobRecord:
    """A new job from an earlier one's record: the same code archive (not uploaded again), the
    same config and settings, a new id, submitted to `connection`'s cluster."""
    check_storage_reachable(connection, root)
    check_recreatable(earlier, root)
    job_id = new_job_id()
    record = earlier.model_copy(
        update={
            "job_id": job_id,
            "created_at": time.time(),
            "storage_root": root.url,
            "ray_address": connection.address,
            "submitted_via": "recreate",
            "recreated_from": earlier.job_id,
            "embedded_cluster": connection.embedded,
        }
    )
    JobStore(root).create(record, JobStatus.new(job_id, f"recreated from job {earlier.job_id}"))
    submit_record(record, connection, root)
    return record


def check_recreatable(earlier: JobRecord, root: StorageRoot) -> None:
    """An earlier job can run again only while its code archive is in the storage root."""
    if not JobStore(root).has_archive(earlier.archive.sha256):
        raise OrchestratorError(
            f"job {earlier.job_id}'s code archive {earlier.archive.path} is no longer in "
            f"{root.url}: push its config again instead"
        )


def submit_record(record: JobRecord, connection: Connection, root: StorageRoot) -> None:
    """Put a stored job in the cluster's queue: it is queued from the moment this returns, with
    no process of its own, and the queue service starts its controller once it is admitted
    (scheduler/launcher.py lists every way a controller starts). The push submits the
    controller itself, as a Ray job whose submission id is the job id, only where no service
    would start it in time: a root's first push to the cluster (client/bootstrap.py: that
    controller starts the service), and a job that mirrors weights while it waits. A refusal
    is recorded as DEPLOY_FAILED, then raised."""
    job_id = record.job_id
    launch = Launch(
        entrypoint=controller_entrypoint(job_id, root, connection, runs_comment(record)),
        metadata=ray_job_metadata(record, root),
        storage_root=root.url,
        scheduling_timeout_s=scheduling_timeout(),
    )
    queue = QueueStore(root)
    starter = ""  # the cluster session whose queue service this push starts here, if it does
    try:
        session = checked_session(connection)
        mirrors = bool(record.spec.job.weights)  # its controller mirrors them while it waits
        entry = entry_for(
            record, launch=launch, cluster=session, queue_timeout_s=record.queue_timeout_s,
            launched_at=time.time() if mirrors else None,
        )  # fmt: skip
        queue.put_incoming(entry)  # queued from here on; a service takes it
        if not mirrors:
            if bootstrap.service_takes_it(connection, queue, session, root):
                return
            # The bootstrap: it is ours to start, and its controller starts the service.
            queue.put_incoming(entry.model_copy(update={"launched_at": time.time()}))
            starter = session
        submit_ray_job(
            connection.client, connection.address, job_id, exists_is_ours=True,
            entrypoint=launch.entrypoint, metadata=launch.metadata, entrypoint_num_cpus=0,
        )  # fmt: skip
    except Exception as e:
        # Never retried: inside this handler a storage error would read as the Ray error's.
        root.discard(f"{INCOMING}/{job_id}.json")
        if starter:
            bootstrap.give_up_claim(root, starter)
        store = JobStore(root)
        failure = Failure(cause=str(e))
        status = store.status(job_id).moved_to(JobState.DEPLOY_FAILED, failure.cause)
        store.put_status(status.model_copy(update={"failure": failure}))
        raise


def cluster_version(connection: Connection) -> dict[str, Any]:
    """The cluster's `/api/version` (its ray_version, session_name), waiting out a head that is
    still starting."""
    return while_head_starts(
        connection.address, lambda: ray_private.cluster_version(connection.client())
    )


def checked_session(connection: Connection) -> str:
    """The cluster's session name (what its queue service beats with), once this client's Ray is
    known to be the cluster's: a client of another release (or a cluster outside the supported
    range) is a RayVersionError naming both versions and what to install, before anything is
    queued or submitted."""
    version = cluster_version(connection)
    if version.get("ray_version"):
        ray_private.check_cluster_ray(str(version["ray_version"]), connection.address)
    return str(version["session_name"])


# What Ray's Job API answers while a head that has just started cannot take jobs yet: nothing
# listens on the dashboard's port, or the dashboard listens before the head's agent has reported
# in (HTTP 500 "No available agent to submit job, please try again later").
_NOT_READY_MESSAGES = ("No available agent", "try again later")
_SUBMIT_RETRY_INTERVAL_S = 0.5


def submit_ray_job(
    client: Callable[[], JobSubmissionClient], address: str, submission_id: str,
    exists_is_ours: bool = False, **job: Any,
) -> None:  # fmt: skip
    """`client().submit_job(submission_id=..., **job)`, waiting out a head that is still starting
    (`while_head_starts`).

    The submission id is Ray's idempotency key: a retry after an attempt that did reach Ray is
    answered "already exists", and that job, being there, is ours. `exists_is_ours`: so is one
    there before the first attempt (a job's controller, which the queue service may have started
    meanwhile).
    """
    tried: list[bool] = [True] if exists_is_ours else []

    def submit_once() -> None:
        try:
            client().submit_job(submission_id=submission_id, **job)
        except Exception as e:
            if tried and "already exists" in str(e) and _has_job(client, submission_id):
                return
            raise
        finally:
            tried.append(True)

    while_head_starts(address, submit_once)


def while_head_starts(address: str, call: Callable[[], T]) -> T:
    """`call()`, made again while the head at `address` is still starting, for up to
    ORCHESTRATOR_SUBMIT_WAIT_S (`push` right after `ray start --head` used to fail). Anything
    else, or a head not ready in time, is a one-line SubmitError."""
    wait_s = settings.SUBMIT_WAIT_S.get()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return call()
        except Exception as e:
            refused = refusal(e, address)
            if refused:
                raise SubmitError(refused) from e
            reason = _one_line(e)
            if not _not_ready(e):
                raise SubmitError(f"submitting to Ray at {address} failed: {reason}") from e
            if time.monotonic() >= deadline:
                raise SubmitError(
                    f"the Ray cluster at {address} did not take the job within {wait_s:g} s "
                    f"({reason}): if it has just started, wait until `ray status` lists its "
                    f"head node and push again, or raise {SUBMIT_WAIT_ENV}"
                ) from e
        time.sleep(_SUBMIT_RETRY_INTERVAL_S)


def _not_ready(error: Exception) -> bool:
    """Connection refused (Ray's client raises the builtin ConnectionError when it is made,
    requests' own while a call is made), or Ray's own "try again later"."""
    import requests

    if isinstance(error, (ConnectionError, requests.exceptions.ConnectionError)):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _NOT_READY_MESSAGES)


def _has_job(client: Callable[[], JobSubmissionClient], submission_id: str) -> bool:
    try:
        client().get_job_info(submission_id)
    except Exception:
        return False
    return True


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text.removeprefix("Request failed with status code ").rstrip(".")
