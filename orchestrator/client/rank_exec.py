"""One shell command in a running job's rank (`JobHandle.exec`, `orchestrator shell -- CMD`):
a short Ray job of its own through the Job API, which runs it where the rank's commands run
(controller/job_shell.py) and prints its output after a marker."""

from __future__ import annotations

import shlex
import time
import uuid
from collections.abc import Callable
from typing import Any

from orchestrator.errors import OrchestratorError
from orchestrator.storage.records import JobRecord

POLL_S = 0.25  # as JobHandle polls


def run_on_rank(
    record: JobRecord, client: Callable[[], Any], command: str, rank: int, timeout_s: float
) -> tuple[int, str]:
    """`command`'s exit code and output, on rank `rank` of the job of `record`; `client`
    makes the Job API client of the job's cluster."""
    from orchestrator.client.submit import dashboard_name, remote_python, submit_ray_job
    from orchestrator.controller.job_shell import NOT_RUN_EXIT, OUTPUT_MARKER

    job_api = client()
    entrypoint = shlex.join([
        remote_python(record.embedded_cluster), "-m", "orchestrator.controller.job_shell",
        "--job-id", record.job_id, "--rank", str(rank), "--timeout", f"{timeout_s:g}", command,
    ])  # fmt: skip
    shell_id = f"{record.job_id}-shell-{uuid.uuid4().hex[:8]}"
    submit_ray_job(
        client, str(record.ray_address), shell_id, entrypoint=entrypoint,
        entrypoint_num_cpus=0, metadata={
            "orchestrator_shell_of": record.job_id,
            "job_name": f"{dashboard_name(record)}: exec on rank {rank}",
        },
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s + 120
    while not job_api.get_job_status(shell_id).is_terminal():
        if time.monotonic() > deadline:
            job_api.stop_job(shell_id)
            raise OrchestratorError(f"the command on rank {rank} did not end in time")
        time.sleep(POLL_S)
    info, logs = job_api.get_job_info(shell_id), job_api.get_job_logs(shell_id)
    code = info.driver_exit_code
    if OUTPUT_MARKER not in logs or code is None or code == NOT_RUN_EXIT:
        why = logs.strip().splitlines()[-1:] or [info.message or "no output"]
        raise OrchestratorError(f"could not run a command in job {record.job_id}: {why[0]}")
    return code, logs.split(OUTPUT_MARKER + "\n", 1)[1]
