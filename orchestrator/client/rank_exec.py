"""One shell command in a running job's rank (`JobHandle.exec`, `orchestrator shell -- CMD`):
a short Ray job of its own through the Job API, which runs it where the rank's commands run
(controller/job_shell.py) and prints its output after a marker."""

from __future__ import annotations

import shlex
import time
import uuid
from typing import TYPE_CHECKING

from orchestrator.errors import OrchestratorError

if TYPE_CHECKING:
    from orchestrator.client.jobs import JobHandle

POLL_S = 0.25  # as JobHandle polls


def run_on_rank(job: JobHandle, command: str, rank: int, timeout_s: float) -> tuple[int, str]:
    """`command`'s exit code and output, on rank `rank` of `job`."""
    from orchestrator.client.submit import dashboard_name, remote_python, submit_ray_job
    from orchestrator.controller.job_shell import NOT_RUN_EXIT, OUTPUT_MARKER

    client = job._client()
    entrypoint = shlex.join([
        remote_python(job.record.embedded_cluster), "-m", "orchestrator.controller.job_shell",
        "--job-id", job.id, "--rank", str(rank), "--timeout", f"{timeout_s:g}", command,
    ])  # fmt: skip
    shell_id = f"{job.id}-shell-{uuid.uuid4().hex[:8]}"
    submit_ray_job(
        job._client, str(job.record.ray_address), shell_id, entrypoint=entrypoint,
        entrypoint_num_cpus=0, metadata={
            "orchestrator_shell_of": job.id,
            "job_name": f"{dashboard_name(job.record)}: exec on rank {rank}",
        },
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s + 120
    while not client.get_job_status(shell_id).is_terminal():
        if time.monotonic() > deadline:
            client.stop_job(shell_id)
            raise OrchestratorError(f"the command on rank {rank} did not end in time")
        time.sleep(POLL_S)
    info, logs = client.get_job_info(shell_id), client.get_job_logs(shell_id)
    code = info.driver_exit_code
    if OUTPUT_MARKER not in logs or code is None or code == NOT_RUN_EXIT:
        why = logs.strip().splitlines()[-1:] or [info.message or "no output"]
        raise OrchestratorError(f"could not run a command in job {job.id}: {why[0]}")
    return code, logs.split(OUTPUT_MARKER + "\n", 1)[1]
