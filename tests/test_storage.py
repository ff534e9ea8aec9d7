"""The storage layer on a local directory, a real S3 server (moto) and fake-gcs-server. No Ray."""

from __future__ import annotations

import time

import pytest

from orchestrator import definitions as d
from orchestrator.lifecycle import IllegalTransition, JobState
from orchestrator.storage.job_store import JobNotFound, JobStore
from orchestrator.storage.journal import JobJournal
from orchestrator.storage.logs import read_logs
from orchestrator.storage.records import ArchiveRef, JobRecord, JobStatus


def record(job_id: str, created_at: float) -> JobRecord:
    project = d.TrainingProject(
        name="p",
        job=d.TrainingJob(
            image=d.Image(base_image="x"),
            runtime=d.Runtime(environment_variables={"T": d.SecretReference(name="tok")}),
        ),
    )
    archive = ArchiveRef(path="archives/x.tar", sha256="x", size_bytes=1, file_count=1,
                         config_dir=".")  # fmt: skip
    return JobRecord(job_id=job_id, project="p", created_at=created_at, spec=project,
                     archive=archive, storage_root="somewhere")  # fmt: skip


def test_records_and_statuses_round_trip(root):
    store = JobStore(root)
    store.create(record("j1", 1.0), JobStatus.new("j1"))
    store.create(record("j2", 2.0), JobStatus.new("j2"))
    assert [r.job_id for r in store.records()] == ["j1", "j2"]
    loaded = store.record("j1")
    assert loaded.spec.job.runtime.environment_variables["T"] == d.SecretReference(name="tok")
    status = store.status("j1").moved_to(JobState.PENDING, "needs 64 CPU")
    status = status.moved_to(JobState.PENDING, "needs 64 CPU; 1 node alive")
    store.put_status(status)
    again = store.status("j1")
    assert again.state == JobState.PENDING
    assert [(e.state, e.reason) for e in again.history] == [
        (JobState.CREATED, None),
        (JobState.PENDING, "needs 64 CPU; 1 node alive"),
    ]
    with pytest.raises(JobNotFound, match="no job 'nope'"):
        store.status("nope")


def test_a_job_id_is_created_once(root):
    store = JobStore(root)
    store.create(record("j1", 1.0), JobStatus.new("j1"))
    with pytest.raises(Exception, match="already exists"):
        store.create(record("j1", 2.0), JobStatus.new("j1"))


def test_logs_are_segments_read_in_order_and_resumable(root, tmp_path):
    journal = JobJournal(root, "j1", tmp_path / "spill", print, interval=60)
    journal.lines(["one", "two"])  # the first lines after a quiet spell go at once
    assert journal.wait_stored(10)
    journal.lines(["three"])  # waits for the next write
    assert read_logs(root, "j1") == (["one", "two"], 0)
    assert journal.close(timeout=10) == []
    lines, cursor = read_logs(root, "j1")
    assert lines == ["one", "two", "three"]
    assert read_logs(root, "j1", cursor) == ([], cursor)
    later = JobJournal(root, "j1", tmp_path / "spill", print)  # continues the numbering
    later.lines(["four"])
    later.close(timeout=10)
    assert read_logs(root, "j1", cursor)[0] == ["four"]


def test_a_line_followed_by_silence_is_stored_in_the_background(root, tmp_path):
    journal = JobJournal(root, "j1", tmp_path / "spill", print, interval=0.1)
    journal.lines(["first"])
    journal.lines(["second"])
    deadline = time.monotonic() + 10
    while read_logs(root, "j1")[0] != ["first", "second"]:
        assert time.monotonic() < deadline, read_logs(root, "j1")
        time.sleep(0.05)
    journal.close(timeout=10)


def test_a_status_is_stored_after_the_lines_before_it(root, tmp_path):
    journal = JobJournal(root, "j1", tmp_path / "spill", print, interval=60)
    journal.lines(["deploying the nodes"])
    journal.status(JobStatus.new("j1").moved_to(JobState.DEPLOYING))
    assert journal.wait_stored(10)
    assert read_logs(root, "j1")[0] == ["deploying the nodes"]
    assert JobStore(root).status("j1").state == JobState.DEPLOYING
    journal.close(timeout=10)


def test_status_transitions_follow_the_state_machine():
    status = JobStatus.new("j")
    with pytest.raises(IllegalTransition, match="from CREATED to RUNNING"):
        status.moved_to(JobState.RUNNING)
    done = status.moved_to(JobState.DEPLOYING).moved_to(JobState.RUNNING)
    done = done.moved_to(JobState.COMPLETED)
    assert done.state.is_terminal
    with pytest.raises(IllegalTransition):
        done.moved_to(JobState.STOPPED)


def test_archives_are_stored_once_by_content(root, tmp_path):
    store = JobStore(root)
    tar = tmp_path / "a.tar"
    tar.write_bytes(b"archive bytes")
    path = store.put_archive(tar, "abc")
    assert store.has_archive("abc") and root.read_bytes(path) == b"archive bytes"
    tar.write_bytes(b"different bytes, same key")
    store.put_archive(tar, "abc")
    assert root.read_bytes(path) == b"archive bytes"
