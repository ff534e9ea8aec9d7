"""Interactive sessions on your own cluster: nodes held after the commands, reached with `shell`.

Real jobs on the session's Ray: `on_failure` keeps a failed job's nodes and files for its
timeout and then releases everything; `on_startup` holds until stopped; `on_demand` holds only
when `isession --update-timeout` asks.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import make_job
from ray.util.state import list_actors, list_placement_groups

from orchestrator.client.api import push
from orchestrator.client.audit import events
from orchestrator.client.jobs import JobHandle
from orchestrator.errors import OrchestratorError
from orchestrator.lifecycle import JobState

pytestmark = pytest.mark.usefixtures("ray_cluster")

CONFIG = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="sessions",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(memory="512Mi"),
        runtime=d.Runtime(start_commands=["python train.py"],
                          checkpointing_config=d.CheckpointingConfig(enabled=True)),
        interactive_session={session},
    ),
)
"""

TRAIN = """
import os, pathlib, sys, time
(pathlib.Path(os.environ["BT_CHECKPOINT_DIR"]) / "note.txt").write_text("left by the job")
signal = pathlib.Path({signal!r})
while {wait} and not signal.exists():
    time.sleep(0.1)
print("done", flush=True)
sys.exit({code})
"""


def session_job(tmp_path, session: str, code: int = 0, wait: bool = False) -> JobHandle:
    train = TRAIN.format(signal=str(tmp_path / "go"), wait=wait, code=code)
    config = make_job(tmp_path / "job", CONFIG.format(session=session), {"train.py": train})
    return push(config, storage_root=str(tmp_path / "storage"))


def wait_held(job: JobHandle, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while job.details().held_until is None:
        assert time.monotonic() < deadline, job.logs()[-10:]
        assert not job.status().is_terminal, job.logs()[-10:]
        time.sleep(0.2)


def released(job: JobHandle, cluster) -> bool:
    """The job's placement group removed, its agent and uploader dead (looked up by name: a
    session's cluster holds more than the state API's default 100 rows)."""
    name = f"orchestrator-{job.id}"
    groups = list_placement_groups(address=cluster.dashboard_url, filters=[("name", "=", name)])
    actors = [
        a for actor in (f"{name}-rank-0", f"{name}-uploader-0")
        for a in list_actors(address=cluster.dashboard_url, filters=[("name", "=", actor)])
    ]  # fmt: skip
    assert groups and actors, "the job's placement group and actors were never seen"
    return all(g.state == "REMOVED" for g in groups) and all(a.state == "DEAD" for a in actors)


def test_on_failure_keeps_a_failed_job_s_nodes_and_files(tmp_path, ray_cluster):
    job = session_job(tmp_path, 'd.InteractiveSession(trigger="on_failure", timeout_minutes=1)',
                      code=7)  # fmt: skip
    wait_held(job)
    seen_held_at = time.time()
    held = job.details()
    assert held.state == JobState.RUNNING
    assert "held for an interactive session until" in held.history[-1].reason
    assert "exited with code 7" in held.history[-1].reason
    code, output = job.exec("cat $BT_CHECKPOINT_DIR/note.txt")
    assert (code, output) == (0, "left by the job")
    assert not released(job, ray_cluster)
    # Held for its minute from the failure, which came after RUNNING began and before the hold
    # was seen (as `view` shows it); and still held, after the exec.
    assert held.history[-1].at + 60 <= held.held_until <= seen_held_at + 60, held.held_until
    still = job.details()
    assert (still.state, still.held_until) == (JobState.RUNNING, held.held_until)

    assert job.stop() == JobState.FAILED  # the hold ends; the failure is what is recorded
    assert job.details().failure.exit_code == 7
    # The stop ended the session, not its time (the minute was not up).
    assert any("interactive session over (stopped)" in line for line in job.logs())
    deadline = time.monotonic() + 30
    while not released(job, ray_cluster):
        assert time.monotonic() < deadline, "a held job left its nodes reserved"
        time.sleep(0.5)


def test_on_startup_holds_the_nodes_until_stopped(tmp_path, ray_cluster):
    job = session_job(tmp_path, 'd.InteractiveSession(trigger="on_startup")')
    wait_held(job)
    assert any(line.endswith("] done") for line in job.logs())  # the commands have ended
    assert job.exec("echo still here") == (0, "still here\n")
    assert job.stop() == JobState.COMPLETED  # stop ends the session; the commands' outcome stays
    deadline = time.monotonic() + 30
    while not released(job, ray_cluster):
        assert time.monotonic() < deadline
        time.sleep(0.5)


def test_on_demand_holds_only_when_asked(tmp_path, ray_cluster):
    job = session_job(tmp_path, 'd.InteractiveSession(trigger="on_demand")', wait=True)
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator", "isession", "--job-id", job.id,
         "--update-timeout", "0.25", "--storage-root", job.record.storage_root],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "its nodes stay until" in result.stdout
    (event,) = [e for e in events(job=job.id, storage_root=job.record.storage_root)
                if e.verb == "isession"]  # fmt: skip
    assert (event.result, event.detail) == ("ok", "hold 0.25 minutes")
    (tmp_path / "go").touch()
    wait_held(job)
    assert job.wait(timeout=60) == JobState.COMPLETED  # its time is up: released, no stop
    history = job.details().history
    held = [e for e in history if "held for an interactive session" in (e.reason or "")]
    assert held and history[-1].at - held[0].at >= 5
    deadline = time.monotonic() + 30
    while not released(job, ray_cluster):
        assert time.monotonic() < deadline, "a held job left its nodes reserved"
        time.sleep(0.5)


def test_isession_needs_an_interactive_session_in_the_config(tmp_path):
    job = session_job(tmp_path, "None", wait=True)
    try:
        with pytest.raises(OrchestratorError, match="has no interactive_session"):
            job.update_session(5)
    finally:
        (tmp_path / "go").touch()
        assert job.wait(timeout=60) == JobState.COMPLETED
    assert job.details().held_until is None
