"""`job.stacks()`: every rank's Python stacks, taken now from a running job through a short Ray
job (controller/job_stacks.py, as `exec` goes through controller/job_shell.py), or the last set
stored with an ended one (storage/stacks.py)."""

from __future__ import annotations

import shlex
import time
import uuid
from typing import Any, Protocol

from orchestrator.errors import OrchestratorError
from orchestrator.lifecycle import JobState
from orchestrator.storage.records import JobRecord, JobStatus
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.stacks import StackStore

POLL_S = 0.25


class JobHandle(Protocol):
    """What of a job handle (client/jobs.py) taking its stacks needs."""

    id: Any
    record: JobRecord

    def refresh(self) -> JobStatus: ...

    def _client(self) -> Any: ...


def job_stacks(job: JobHandle, root: StorageRoot, timeout_s: float) -> dict[int, str]:
    store = StackStore(root, job.id)
    state = job.refresh().state
    if state != JobState.RUNNING:
        sets = store.sets()
        if not sets:
            raise OrchestratorError(f"job {job.id} is {state.value} and has no stacks stored")
        return store.read(sets[-1])
    return store.read(_take(job, timeout_s))


def _take(job: JobHandle, timeout_s: float) -> str:
    """Every running rank's stacks, stored by a short Ray job; the set's name."""
    from orchestrator.client.submit import dashboard_name, remote_python, submit_ray_job
    from orchestrator.controller.job_stacks import SET_MARKER

    record = job.record
    client = job._client()
    entrypoint = shlex.join([
        remote_python(record.embedded_cluster), "-m", "orchestrator.controller.job_stacks",
        "--job-id", job.id, "--ranks", str(record.spec.job.compute.node_count),
        "--storage-root", record.storage_root,
    ])  # fmt: skip
    stacks_id = f"{job.id}-stacks-{uuid.uuid4().hex[:8]}"
    submit_ray_job(
        job._client, str(record.ray_address), stacks_id, entrypoint=entrypoint,
        entrypoint_num_cpus=0, metadata={
            "orchestrator_stacks_of": job.id,
            "job_name": f"{dashboard_name(record)}: stacks",
        },
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not client.get_job_status(stacks_id).is_terminal():
        if time.monotonic() > deadline:
            client.stop_job(stacks_id)
            raise OrchestratorError(f"job {job.id}'s stacks were not taken in time")
        time.sleep(POLL_S)
    logs = client.get_job_logs(stacks_id)
    if SET_MARKER not in logs:
        why = logs.strip().splitlines()[-1:] or ["no output"]
        raise OrchestratorError(f"could not take job {job.id}'s stacks: {why[0]}")
    return logs.split(SET_MARKER + "\n", 1)[1].split()[0]
