"""A new storage root's first push on the embedded cluster: queued through the running queue
service's inbox, with no Ray job of its own; a service that does not take it in time leaves the
job to a Ray job, which runs it once."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import psutil
from conftest import controller_host_up, eventually, make_job
from ray.job_submission import JobStatus, JobSubmissionClient
from ray.util.state import list_actors

from orchestrator.client.api import push
from orchestrator.lifecycle import JobState
from orchestrator.scheduler.roots_inbox import FRESH_S, SERVICE_FILE, Inbox, ask
from orchestrator.storage.queue_store import QueueStore
from orchestrator.storage.root import StorageRoot

JOB = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="inbox",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(cpu_count=1, memory="512Mi"),
        runtime=d.Runtime(start_commands=["python run.py"]),
    ),
)
"""
QUICK = "print('ran', flush=True)\n"
SLEEPER = "import time\nprint('up', flush=True)\ntime.sleep(600)\n"


def wait_for_line(job, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not any(line.endswith(text) for line in job.logs()):
        assert time.monotonic() < deadline, (job.status(), job.logs()[-10:])
        time.sleep(0.1)


def test_a_new_roots_first_push_is_queued_with_no_ray_job_of_its_own(tmp_path, ray_cluster):
    # Any push has the service running (this one may start it, through a Ray job).
    warm = push(make_job(tmp_path / "warm", JOB, {"run.py": QUICK}),
                storage_root=str(tmp_path / "a-root"))  # fmt: skip
    assert warm.wait(timeout=120) == JobState.COMPLETED, warm.logs()
    eventually(lambda: controller_host_up(ray_cluster.dashboard_url), "the controller host", 60)

    fresh = str(tmp_path / "a-new-root")
    began = time.monotonic()
    job = push(make_job(tmp_path / "sleeper", JOB, {"run.py": SLEEPER}), storage_root=fresh)
    try:
        wait_for_line(job, "] up")
        print(f"push to the first line: {time.monotonic() - began:.2f} s")
        entry = QueueStore(StorageRoot(fresh)).entry(job.id)
        assert entry is not None and entry.hosted, "its controller is a Ray job of its own"
        info = JobSubmissionClient(ray_cluster.dashboard_url).get_job_info(job.id)
        assert info.metadata["orchestrator_controller"] == "hosted"  # the dashboard shows it
    finally:
        job.stop()
    assert job.wait(timeout=60) == JobState.STOPPED


def test_a_service_that_does_not_take_the_root_in_time_leaves_the_job_to_a_ray_job(
    tmp_path, ray_cluster
):
    warm = push(make_job(tmp_path / "warm", JOB, {"run.py": QUICK}),
                storage_root=str(tmp_path / "a-root"))  # fmt: skip
    assert warm.wait(timeout=120) == JobState.COMPLETED, warm.logs()
    (service,) = list_actors(address=ray_cluster.dashboard_url,
                             filters=[("class_name", "=", "QueueService"),
                                      ("state", "=", "ALIVE")])  # fmt: skip
    frozen = psutil.Process(service.pid)
    fresh = str(tmp_path / "a-new-root")
    config = make_job(tmp_path / "job", JOB, {"run.py": QUICK})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        frozen.suspend()  # as busy as a service can be: it reads no request
        try:
            pushed = pool.submit(push, config, storage_root=fresh)
            time.sleep(6)  # past the push's 5 s wait for the service
        finally:
            frozen.resume()
        job = pushed.result(timeout=120)
    assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
    assert len([line for line in job.logs() if line.endswith("] ran")]) == 1, "ran once"
    client = JobSubmissionClient(ray_cluster.dashboard_url)
    deadline = time.monotonic() + 60  # the record is written before the controller exits
    while not client.get_job_status(job.id).is_terminal():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    info = client.get_job_info(job.id)
    assert "orchestrator_controller" not in info.metadata, "its controller was its own Ray job"
    assert info.status == JobStatus.SUCCEEDED and info.job_id, "a Ray job with a driver"


def test_only_a_fresh_service_of_the_session_is_asked(tmp_path: Path):
    inbox = tmp_path / "inbox"
    assert not ask(tmp_path / "missing", "/roots/a", "session_1"), "no directory: no service"
    box = Inbox(inbox, "session_1")
    assert not ask(inbox, "/roots/a", "session_1"), "a service that has not said it polls"
    box.say()
    assert not ask(inbox, "/roots/a", "session_2"), "another cluster's service"
    assert ask(inbox, "/roots/a", "session_1")
    assert ask(inbox, "/roots/b", "session_1")
    assert sorted(box.take()) == ["/roots/a", "/roots/b"]
    assert box.take() == [], "each request is taken once"
    said = json.loads((inbox / SERVICE_FILE).read_text())
    (inbox / SERVICE_FILE).write_text(json.dumps({**said, "at": time.time() - FRESH_S - 1}))
    assert not ask(inbox, "/roots/a", "session_1"), "a service that said so too long ago"
    for unreadable in ("[1, 2]", '{"session": "session_1"}', '{"session": "session_1", "at": "x"}'):
        (inbox / SERVICE_FILE).write_text(unreadable)
        assert not ask(inbox, "/roots/a", "session_1"), unreadable
    box.said_at = 0.0
    box.say()
    box.close()
    assert not ask(inbox, "/roots/a", "session_1"), "a service that ended"


def test_a_torn_or_foreign_request_is_dropped_and_the_others_taken(tmp_path: Path):
    box = Inbox(tmp_path / "inbox", "s")
    box.say()
    (box.path / "cut.root.json").write_text('{"root": "/ro')
    (box.path / "other.root.json").write_text('["not", "a", "request"]')
    (box.path / "notes.txt").write_text("not a request at all")
    assert ask(box.path, "/roots/kept", "s")
    assert box.take() == ["/roots/kept"]
    assert sorted(p.name for p in box.path.iterdir()) == ["notes.txt", SERVICE_FILE]
    assert (box.path.stat().st_mode & 0o777) == 0o700
