"""The launchers' answers, without Ray: what the Job API or the controller host said, as the
typed outcomes the queue and its reaper act on (scheduler/launcher.py). A fake Job API client
stands in for the head's; the host is found gone by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrator.scheduler import launcher as launchers
from orchestrator.scheduler.launcher import (
    NOT_STARTED,
    RUNNING_OR_UNKNOWN,
    ControllerStanding,
    HostedLauncher,
    Launched,
    RayJobLauncher,
    launcher_for,
)
from orchestrator.storage.queue_store import Launch, QueueEntry


class FakeJobApi:
    """The head's Job API: the Ray jobs it knows (id: status, message), and what it refuses."""

    def __init__(self) -> None:
        self.jobs: dict[str, tuple[str, str | None]] = {}
        self.refusal: Exception | None = None
        self.submitted: list[dict[str, object]] = []

    def submit_job(self, **job: object) -> str:
        if self.refusal is not None:
            raise self.refusal
        if job["submission_id"] in self.jobs:
            raise RuntimeError(f"Job with submission_id {job['submission_id']} already exists.")
        self.submitted.append(job)
        self.jobs[str(job["submission_id"])] = ("PENDING", None)
        return str(job["submission_id"])

    def get_job_info(self, job_id: str) -> SimpleNamespace:
        if self.refusal is not None:
            raise self.refusal
        if job_id not in self.jobs:
            raise RuntimeError(f"Request failed with status code 404: Job {job_id} does not exist.")
        status, message = self.jobs[job_id]
        return SimpleNamespace(status=SimpleNamespace(value=status), message=message)


def entry(job_id: str = "j1", *, hosted: bool = False, hostable: bool = True) -> QueueEntry:
    launch = Launch(entrypoint=f"python -m orchestrator.controller --job-id {job_id}",
                    metadata={"job_name": "p/j"}, storage_root="/root" if hostable else None,
                    scheduling_timeout_s=600.0 if hostable else None)  # fmt: skip
    return QueueEntry(job_id=job_id, pushed_at=1.0, bundle={}, launch=launch, hosted=hosted)


@pytest.fixture
def api() -> FakeJobApi:
    return FakeJobApi()


@pytest.fixture
def ray_jobs(api: FakeJobApi) -> RayJobLauncher:
    launcher = RayJobLauncher()
    launcher._client = api
    return launcher


def test_each_head_setting_names_its_launcher():
    assert type(launcher_for("hosted")) is HostedLauncher
    assert type(launcher_for("ray-job")) is RayJobLauncher


def test_a_ray_job_is_submitted_once_as_the_job_id_and_a_refusal_says_why(ray_jobs, api):
    assert ray_jobs.launch(entry()).launched is Launched.RAY_JOB
    (submitted,) = api.submitted
    assert submitted["submission_id"] == "j1" and submitted["entrypoint_num_cpus"] == 0
    assert submitted["metadata"] == {"job_name": "p/j"}
    again = ray_jobs.launch(entry())  # a service that restarted before recording it
    assert again.launched is Launched.RAY_JOB and len(api.submitted) == 1
    api.refusal = RuntimeError("Request failed with status code 500:\n  no agent")
    refused = ray_jobs.launch(entry("j2"))
    assert refused.launched is Launched.REFUSED
    assert refused.cause == "Request failed with status code 500: no agent"  # one line


def test_a_head_without_a_dashboard_refuses_to_start_ray_jobs(monkeypatch):
    monkeypatch.setattr(launchers.ray_private, "dashboard_address", lambda: None)
    refused = RayJobLauncher().launch(entry())
    assert refused.launched is Launched.REFUSED
    assert refused.cause.startswith("this Ray cluster runs no dashboard")


def test_a_ray_jobs_standing_is_what_ray_says_of_it(ray_jobs, api):
    assert ray_jobs.standing(entry()) == NOT_STARTED  # marked started, not submitted yet
    api.jobs["j1"] = ("RUNNING", None)
    assert ray_jobs.standing(entry()) == RUNNING_OR_UNKNOWN
    api.jobs["j1"] = ("FAILED", "entrypoint exited with 1")
    assert ray_jobs.standing(entry()) == ControllerStanding.ended(
        "FAILED: entrypoint exited with 1"
    )
    api.jobs["j1"] = ("SUCCEEDED", None)
    assert ray_jobs.standing(entry()) == ControllerStanding.ended("SUCCEEDED: no message")
    assert ray_jobs.standing(entry(hosted=True)) == RUNNING_OR_UNKNOWN  # a host's, not Ray's
    api.refusal = ConnectionError("the head does not answer")
    assert ray_jobs.standing(entry()) == RUNNING_OR_UNKNOWN  # cannot be told: nothing failed


def test_with_no_host_running_a_job_is_not_hosted_and_one_marked_so_is_told_host_gone(
    monkeypatch, api
):
    hosted = HostedLauncher()
    hosted._client = api

    def no_host() -> None:
        raise ValueError("Failed to look up actor with name 'orchestrator-controllers'")

    monkeypatch.setattr(hosted, "_host", no_host)
    assert not hosted.hosts(entry())  # no host: the queue marks it a Ray job
    outcome = hosted.launch(entry(hosted=True))  # marked hosted as the host died
    assert outcome.launched is Launched.HOST_GONE and outcome.host is None
    assert api.submitted == []  # nothing started: the queue marks it a Ray job first
    assert hosted.launch(entry()).launched is Launched.RAY_JOB
    assert [job["submission_id"] for job in api.submitted] == ["j1"]
    gone = hosted.standing(entry(hosted=True).model_copy(update={"hosted_by": "inc-1"}))
    assert gone.cause.startswith("the controller host's process on the head ended")


def test_an_entry_without_what_the_host_needs_is_never_hosted(monkeypatch):
    hosted = HostedLauncher()
    monkeypatch.setattr(hosted, "table", lambda: launchers.HostTable("inc-1"))
    assert hosted.hosts(entry())
    assert not hosted.hosts(entry(hostable=False))  # pushed by an older client
