"""`orchestrator run CONFIG`: run a job as the entrypoint of a `ray job submit`.

`ray job submit --working-dir . -- python -m orchestrator run config.py` makes that Ray job the
training job itself (same records, logs and states as `push`), with no second submission.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from orchestrator import actor_names, ray_private
from orchestrator.cli.options import RETRIES, RETRY_ON_FAILURE, StorageRootOption
from orchestrator.client.connection import storage
from orchestrator.client.prepare import prepare_job
from orchestrator.client.submit import scheduling_timeout, store_job
from orchestrator.errors import OrchestratorError
from orchestrator.storage.records import RetryPolicy

_RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def run(
    config: Annotated[Path, typer.Argument(help="Path to the job's config.py")],
    storage_root: StorageRootOption = None,
    retries: Annotated[int | None, RETRIES] = None,
    retry_on_failure: Annotated[bool, RETRY_ON_FAILURE] = False,
) -> None:
    """Run a job inside the current Ray job (the entrypoint of `ray job submit`)."""
    submission_id = _submission_id()
    retry = RetryPolicy.resolve(retries, retry_on_failure)
    prepared = prepare_job(config)
    root = storage(storage_root)
    store_job(
        prepared, root, submission_id, _dashboard_url(), submitted_via="ray-job-submit",
        retry=retry,
    )  # fmt: skip
    from orchestrator.controller.controller import run_controller  # needs ray: import late

    raise typer.Exit(run_controller(submission_id, root.url, scheduling_timeout()))


def _submission_id() -> str:
    raw = os.environ.get(_RAY_JOB_CONFIG_ENV)
    job_id = json.loads(raw).get("metadata", {}).get("job_submission_id") if raw else None
    if not job_id:
        raise OrchestratorError(
            "`orchestrator run` is the entrypoint of a Ray job: use it as "
            "`ray job submit --working-dir . -- python -m orchestrator run config.py`, "
            "or push from here with `orchestrator push config.py`"
        )
    return str(job_id)


def _dashboard_url() -> str | None:
    """The cluster's Job API address, so `stop` can reach this job later."""
    import ray

    said = ray_private.unsupported(ray_private.ray_version())
    if said:
        raise OrchestratorError(said)
    try:
        ray.init(address="auto", namespace=actor_names.NAMESPACE, log_to_driver=False)
    except Exception as e:  # Ray's "Version mismatch" paragraph, said as one line of ours
        mismatch = ray_private.init_mismatch(e)
        if mismatch is None:
            raise
        raise mismatch from e
    url = ray_private.dashboard_address()
    return f"http://{url}" if url and "://" not in url else url
