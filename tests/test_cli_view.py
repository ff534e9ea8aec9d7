"""`orchestrator view` as a user runs it: projects and active jobs, one project's, every job.

No Ray: records and statuses are written straight to a storage root, as the controller would.
"""

from __future__ import annotations

import json

import pytest
from test_cli_checkpoints import cli, make_record

from orchestrator.lifecycle import JobState
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.records import CheckpointSummary, JobStatus
from orchestrator.storage.root import StorageRoot


def _ended(job_id: str, state: JobState, **updates) -> JobStatus:
    status = JobStatus.new(job_id).moved_to(JobState.DEPLOYING)
    if state != JobState.DEPLOYING:
        status = status.moved_to(JobState.RUNNING)
    if state.is_terminal:
        status = status.moved_to(state, "how it ended")
    return status.model_copy(update=updates)


@pytest.fixture(scope="module")
def root_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """alpha: an old COMPLETED job, then a RUNNING one; beta: a job that COMPLETED without
    storing a checkpoint; gamma: a DEPLOYING job, pushed first; delta: a job that did not store
    a checkpoint, then one that stored all, pushed last."""
    root = StorageRoot(tmp_path_factory.mktemp("view") / "storage")
    store = JobStore(root)
    unsynced = CheckpointSummary(pending=["rank-0/checkpoint-9"], all_uploaded=False)
    synced = CheckpointSummary(uploaded=["rank-0/checkpoint-9"])
    jobs = [
        ("job-g", "gamma", 1.0, _ended("job-g", JobState.DEPLOYING)),
        ("job-a1", "alpha", 2.0, _ended("job-a1", JobState.COMPLETED)),
        ("job-a2", "alpha", 3.0, _ended("job-a2", JobState.RUNNING)),
        ("job-b", "beta", 4.0, _ended("job-b", JobState.COMPLETED, checkpoints=unsynced)),
        ("job-d1", "delta", 0.5, _ended("job-d1", JobState.FAILED, checkpoints=unsynced)),
        ("job-d2", "delta", 5.0, _ended("job-d2", JobState.COMPLETED, checkpoints=synced)),
    ]
    for job_id, project, created, status in jobs:
        store.create(make_record(job_id, project, created), JobStatus.new(job_id))
        store.put_status(status)
    return root.url


def test_view_shows_projects_with_their_latest_job_then_the_active_jobs(root_url):
    result = cli("view", "--storage-root", root_url, "-o", "json")
    assert result.returncode == 0, result.stderr
    overview = json.loads(result.stdout)
    projects = [(p["name"], p["job_count"], p["latest_job_id"], p["latest_job_status"],
                 p["checkpoint_sync_status"]) for p in overview["projects"]]  # fmt: skip
    assert projects == [
        ("gamma", 1, "job-g", "DEPLOYING", None),
        ("alpha", 2, "job-a2", "RUNNING", None),
        ("beta", 1, "job-b", "COMPLETED", "not_synced"),
        ("delta", 2, "job-d2", "COMPLETED", "synced"),
    ]
    assert [(j["id"], j["status"]) for j in overview["active_jobs"]] == [
        ("job-g", "DEPLOYING"), ("job-a2", "RUNNING")
    ]  # fmt: skip

    text = cli("view", "--storage-root", root_url).stdout
    assert text.index("projects") < text.index("active jobs")
    assert "job-a1" not in text  # neither a latest job nor an active one
    assert "project beta: its latest job, job-b, did not store all its checkpoints" in text
    assert "project delta" not in text  # its latest job stored them all


def test_view_all_and_one_project_list_jobs_oldest_first(root_url):
    every = json.loads(cli("view", "--all", "--storage-root", root_url, "-o", "json").stdout)
    assert [r["id"] for r in every] == ["job-d1", "job-g", "job-a1", "job-a2", "job-b", "job-d2"]
    alpha = json.loads(cli("view", "--project", "alpha", "--storage-root", root_url,
                           "-o", "json").stdout)  # fmt: skip
    assert [(r["id"], r["status"]) for r in alpha] == [("job-a1", "COMPLETED"),
                                                       ("job-a2", "RUNNING")]  # fmt: skip


def test_view_of_an_empty_root_says_what_to_do(tmp_path):
    result = cli("view", "--storage-root", tmp_path / "empty")
    assert result.returncode == 0, result.stderr
    assert "no projects yet" in result.stdout and "no active jobs" in result.stdout
