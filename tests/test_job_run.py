"""A job's run: its status changes only by a transition (said in a line, then stored) or an
amendment (stored, no line of its own), as `view` and `logs` read them afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator import definitions as d
from orchestrator.client.prepare import prepare_job
from orchestrator.client.submit import store_job
from orchestrator.controller.job_run import JobRun, JobStopped
from orchestrator.lifecycle import JobState
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.logs import read_logs
from orchestrator.storage.records import NodeInfo
from orchestrator.storage.root import StorageRoot


@pytest.fixture
def job_run(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    project = d.TrainingProject(
        name="runs",
        job=d.TrainingJob(image=d.Image(base_image="python:3.11"),
                          runtime=d.Runtime(start_commands=["python train.py"])),
    )  # fmt: skip
    store = JobStore(StorageRoot(str(tmp_path / "storage")))
    store_job(prepare_job(project, source_dir=tmp_path / "code"), store.root, "jrun00001", None)
    run = JobRun(store, "jrun00001")
    yield run, store
    run.close()


def logs(store: JobStore) -> list[str]:
    return read_logs(store.root, "jrun00001")[0]


def test_a_transition_is_said_then_stored_before_the_job_goes_on(job_run):
    run, store = job_run
    run.transition(JobState.PENDING, "waiting in the queue (position 2)")
    stored = store.status("jrun00001")
    assert stored.state == JobState.PENDING  # stored already: a transition waits for it
    assert stored.history[-1].reason == "waiting in the queue (position 2)"
    assert logs(store)[-1].endswith("] PENDING: waiting in the queue (position 2)")


def test_an_amendment_is_stored_without_a_line_or_a_state_of_its_own(job_run):
    run, store = job_run
    run.transition(JobState.DEPLOYING, "preparing 1 node(s)")
    said = len(logs(store))
    node = NodeInfo(rank=0, node_id="node-0", ip="10.0.0.1", hostname="host-0")
    run.amend(nodes=[node])
    run.close()  # what is queued is stored
    stored = store.status("jrun00001")
    assert stored.state == JobState.DEPLOYING and stored.nodes == [node]
    assert [e.state for e in stored.history] == [JobState.CREATED, JobState.DEPLOYING]
    assert len(logs(store)) == said
    assert run.status.nodes == [node]


def test_a_stop_is_noticed_at_the_next_check(job_run):
    run, _ = job_run
    run.check_stop()  # nothing asked yet
    run.stop_requested.set()
    with pytest.raises(JobStopped):
        run.check_stop()
