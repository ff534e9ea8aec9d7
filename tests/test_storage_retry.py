"""Riding out storage outages, without Ray: which errors pass, retries, and the job journal.

The outages are real: the session's moto server is stopped and started again on its port (its
buckets survive), and a bucket is deleted for an error that will not pass.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from botocore.exceptions import ClientError
from conftest import S3Server

from orchestrator.lifecycle import JobState
from orchestrator.storage.checkpoints import CheckpointChanged, CheckpointStore
from orchestrator.storage.journal import JobJournal, LineSpool
from orchestrator.storage.logs import read_logs
from orchestrator.storage.records import JobStatus
from orchestrator.storage.retry import StorageRetry, StorageUnavailable, is_transient
from orchestrator.storage.root import StorageRoot


def _bucket_root() -> StorageRoot:
    bucket = f"outage-{uuid.uuid4().hex[:8]}"
    root = StorageRoot(f"s3://{bucket}/orchestrator")
    root.fs.mkdir(bucket)
    return root


def _error_of(fn) -> BaseException:
    try:
        fn()
    except Exception as e:
        return e
    raise AssertionError("no error")


def test_which_storage_errors_pass(s3_outage: S3Server) -> None:
    root = _bucket_root()
    bucket = root.url.split("/")[2]
    s3_outage.down()
    try:
        refused = _error_of(lambda: root.fs.pipe_file(root.path("x"), b"1"))
    finally:
        s3_outage.up()
    assert is_transient(refused), repr(refused)

    root.fs.rm(bucket, recursive=True)
    gone = _error_of(lambda: root.fs.pipe_file(root.path("x"), b"1"))
    assert not is_transient(gone), repr(gone)

    throttled = ClientError(
        {"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
         "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")  # fmt: skip
    wrapped = OSError(errno.EIO, "SlowDown")  # as s3fs raises it, the ClientError its cause
    wrapped.__cause__ = throttled
    assert is_transient(wrapped)
    denied = ClientError({"Error": {"Code": "AccessDenied"},
                          "ResponseMetadata": {"HTTPStatusCode": 403}}, "PutObject")  # fmt: skip
    assert not is_transient(denied)
    assert not is_transient(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_transient(PermissionError(errno.EACCES, "Permission denied"))


def test_a_file_not_there_yet_is_an_answer_given_without_the_clients_error_types() -> None:
    """A job's first read of its metrics (none stored yet) must not cost the import of
    botocore, aiohttp and google.auth (0.15 s on the path to its first line)."""
    probe = (
        "import sys\n"
        "from orchestrator.storage.retry import is_transient\n"
        "assert not is_transient(FileNotFoundError(2, 'No such file'))\n"
        "print(sorted({'botocore', 'aiohttp', 'google.auth'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_an_upload_into_a_deleted_bucket_says_so_not_that_a_file_vanished(
    s3_server: str, tmp_path: Path
) -> None:
    root = _bucket_root()
    local = tmp_path / "checkpoint-1"
    local.mkdir()
    (local / "model.bin").write_bytes(b"weights")
    root.fs.rm(root.url.split("/")[2], recursive=True)
    with pytest.raises(FileNotFoundError, match="bucket does not exist") as info:
        CheckpointStore(root).upload(local, "p", "j", 0)
    assert not isinstance(info.value, CheckpointChanged)


def test_a_call_rides_out_an_outage_and_says_so_twice(s3_outage: S3Server) -> None:
    root = _bucket_root()
    said: list[str] = []
    retry = StorageRetry(root.url, budget_s=120, say=said.append)
    s3_outage.down()
    result: list[str] = []

    def put() -> str:
        root.fs.pipe_file(root.path("a"), b"kept")
        return "ok"

    writer = threading.Thread(target=lambda: result.append(retry.call(put)))
    writer.start()
    try:
        deadline = time.monotonic() + 30
        while not retry.in_outage:  # the first failure takes botocore's own retries (~8 s)
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(3)  # several of our retries while it is down
    finally:
        s3_outage.up()
    writer.join(timeout=60)
    assert result == ["ok"]
    assert root.fs.cat_file(root.path("a")) == b"kept"
    assert len(said) == 2, said
    assert "unreachable since" in said[0] and "EndpointConnectionError" in said[0]
    assert "reachable again after" in said[1]


def test_an_outage_past_its_budget_is_an_error_that_says_how_long(s3_outage: S3Server) -> None:
    root = _bucket_root()
    retry = StorageRetry(root.url, budget_s=2, say=lambda _: None)
    s3_outage.down()
    try:
        error = _error_of(lambda: retry.call(root.fs.cat_file, root.path("a")))
    finally:
        s3_outage.up()
    assert isinstance(error, StorageUnavailable)
    assert "unreachable since" in str(error) and root.url in str(error)


def test_a_permanent_error_is_raised_at_once(s3_server: str) -> None:
    root = _bucket_root()
    root.fs.rm(root.url.split("/")[2], recursive=True)
    retry = StorageRetry(root.url, budget_s=600, say=pytest.fail)
    started = time.monotonic()
    with pytest.raises(FileNotFoundError):
        retry.call(root.fs.pipe_file, root.path("x"), b"1")
    assert time.monotonic() - started < 5


def test_spooled_lines_come_back_in_order_from_memory_and_the_spill_file(tmp_path: Path) -> None:
    spool = LineSpool(tmp_path / "spill" / "logs.txt", memory_bytes=100)
    lines = [f"line {i:04d}" for i in range(300)]
    for i in range(0, 300, 7):
        spool.add("".join(line + "\n" for line in lines[i : i + 7]).encode())
    assert (tmp_path / "spill" / "logs.txt").exists()  # past 100 bytes it went to disk
    out = b""
    while chunk := spool.pop(64):
        assert chunk.endswith(b"\n")  # whole lines
        out += chunk
    assert out.decode().splitlines() == lines
    assert not (tmp_path / "spill" / "logs.txt").exists()


def _status(job_id: str, state: JobState) -> JobStatus:
    status = JobStatus.new(job_id)
    if state != JobState.CREATED:
        status = status.moved_to(JobState.DEPLOYING).moved_to(state)
    return status


def _journal_on_s3(job_id: str, tmp_path: Path) -> tuple[StorageRoot, JobJournal, list[str]]:
    """A journal on a fresh bucket; what it (and its root's retry) said."""
    root = _bucket_root()
    said: list[str] = []
    root.retry = StorageRetry(root.url, budget_s=300, say=said.append)
    return root, JobJournal(root, job_id, tmp_path / "spill", said.append), said


def test_the_journal_stores_every_line_once_in_order_after_an_outage(
    s3_outage: S3Server, tmp_path: Path
) -> None:
    root, journal, said = _journal_on_s3("j1", tmp_path)
    journal.lines(["before 0", "before 1"])
    journal.status(_status("j1", JobState.DEPLOYING))
    assert journal.wait_stored(10)
    s3_outage.down()
    try:
        for i in range(30):
            journal.lines([f"during {i}"])
            if i == 15:
                journal.status(_status("j1", JobState.RUNNING))
            time.sleep(0.05)
        assert not journal.wait_stored(1)  # it says so instead of holding the caller
    finally:
        s3_outage.up()
    journal.lines(["after"])
    assert journal.close(timeout=60) == []
    lines, _ = read_logs(root, "j1")
    assert lines == ["before 0", "before 1", *(f"during {i}" for i in range(30)), "after"]
    stored = JobStatus.model_validate(root.read_json("jobs/j1/status.json"))
    assert stored.state == JobState.RUNNING
    assert sum("unreachable since" in line for line in said) == 1, said
    assert sum("reachable again" in line for line in said) == 1, said


def test_a_journal_that_cannot_store_keeps_the_lines_on_this_machine(
    s3_outage: S3Server, tmp_path: Path
) -> None:
    root, journal, said = _journal_on_s3("j2", tmp_path)
    journal.lines(["stored"])
    assert journal.wait_stored(10)
    s3_outage.down()
    try:
        journal.lines(["kept 1", "kept 2"])
        journal.status(_status("j2", JobState.RUNNING))
        unstored = journal.close(timeout=3)
    finally:
        s3_outage.up()
    assert unstored[0] == "the job's status (RUNNING)"
    assert unstored[1].startswith("2 log line(s), kept in ")
    kept = Path(unstored[1].split("kept in ", 1)[1])
    assert kept.read_text().splitlines() == ["kept 1", "kept 2"]
    assert read_logs(root, "j2")[0] == ["stored"]
    started = [line for line in said if line.startswith(f"storage root {root.url} unreachable")]
    assert len(started) == 1, said


def test_a_deleted_bucket_is_said_once_and_storing_resumes_when_it_is_back(
    s3_server: str, tmp_path: Path
) -> None:
    root = _bucket_root()
    bucket = root.url.split("/")[2]
    said: list[str] = []
    journal = JobJournal(root, "j3", tmp_path / "spill", said.append, interval=0.05)
    journal.lines(["one"])
    assert journal.wait_stored(10)
    root.fs.rm(bucket, recursive=True)
    for i in range(20):
        journal.lines([f"lost? {i}"])
        time.sleep(0.05)
    deadline = time.monotonic() + 10
    while journal.problem is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not journal.wait_stored(1)
    problems = [line for line in said if "cannot be stored" in line]
    assert len(problems) == 1 and "bucket does not exist" in problems[0], said
    root.fs.mkdir(bucket)
    unstored = journal.close(timeout=10)  # its last try finds the bucket back
    assert unstored == []
    assert read_logs(root, "j3")[0] == [f"lost? {i}" for i in range(20)]
    assert any("stored in" in line and "again" in line for line in said), said
