"""A job handle's reads are reads: only `refresh()` (and the verbs that wait or act) ask Ray and
record what it says."""

from __future__ import annotations

import textwrap
from pathlib import Path

from orchestrator.client.jobs import JobHandle
from orchestrator.client.prepare import prepare_job
from orchestrator.client.submit import store_job
from orchestrator.lifecycle import JobState
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.root import StorageRoot

CONFIG = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="reads", job=d.TrainingJob(image=d.Image(base_image="python:3.11"))
)
"""


def running_job_of_a_vanished_cluster(tmp_path: Path) -> JobHandle:
    """A job recorded RUNNING on an embedded cluster nothing answers for any more."""
    config = tmp_path / "job" / "config.py"
    config.parent.mkdir()
    config.write_text(textwrap.dedent(CONFIG))
    root = StorageRoot(str(tmp_path / "storage"))
    record = store_job(
        prepare_job(config), root, "jreads0001", ray_address="http://127.0.0.1:9", embedded=True
    )
    store = JobStore(root)
    status = store.status(record.job_id)
    for state in (JobState.DEPLOYING, JobState.RUNNING):
        status = status.moved_to(state)
    store.put_status(status)
    return JobHandle(store, record)


def test_showing_a_handle_changes_nothing_and_refresh_records_what_ray_says(tmp_path):
    job = running_job_of_a_vanished_cluster(tmp_path)
    # A notebook displays the handle, reads its status and details: nothing is written.
    assert repr(job) == "<TrainingJob jreads0001 project='reads' status=RUNNING>"
    assert job.status() == JobState.RUNNING
    assert job["training_job"]["current_status"] == "RUNNING"
    assert job.details().failure is None
    # Asking Ray explicitly finds the cluster gone and records it, once, with why.
    refreshed = job.refresh()
    assert refreshed.state == JobState.FAILED
    assert "is no longer running" in refreshed.failure.cause
    assert job.status() == JobState.FAILED  # now stored
    assert job.wait(timeout=5) == JobState.FAILED
