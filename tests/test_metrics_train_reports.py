"""A Ray Train job's reports as stored and shown (storage/train_reports.py, `orchestrator metrics`,
`job.metrics()`, the HTML report). No Ray: the rounds are what Train's controller hands the
callback, added to the writer as the callback adds them."""

from __future__ import annotations

import json
import math
import re
import threading
import time

import pytest
from test_cli_checkpoints import cli, make_record

from orchestrator.lifecycle import JobState
from orchestrator.storage import layout
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.records import JobStatus, StatusEvent
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.train_reports import (
    TrainReportWriter,
    TrainRunHeader,
    plain_metrics,
    read_train_runs,
    train_round,
)

JOB = "job-train"


class Scalar:
    """A numpy scalar or a 0-d tensor: a number only through `.item()`."""

    def __init__(self, value: float) -> None:
        self.value = value

    def item(self) -> float:
        return self.value


def test_a_round_keeps_json_numbers_and_strings_and_rank_0s_metrics_once():
    metrics = plain_metrics({
        "loss": Scalar(0.25), "step": 3, "done": True, "lr": 1e-4, "phase": "warmup" * 100,
        "bad": float("nan"), "opt": {"lr": 0.5, "betas": [0.9, 0.99]}, "obj": object(),
    })  # fmt: skip
    assert metrics == {"loss": 0.25, "step": 3, "done": 1, "lr": 1e-4,
                       "phase": ("warmup" * 100)[:200], "bad": "nan", "opt/lr": 0.5}  # fmt: skip
    same = {"loss": 1.0}
    round_ = train_round(4, 12.5, [same, same, {"loss": 2.0}], "checkpoint_x")
    assert (round_.index, round_.at, round_.checkpoint) == (4, 12.5, "checkpoint_x")
    assert round_.metrics == {"loss": 1.0}
    assert round_.workers == {2: {"loss": 2.0}}  # only the worker whose metrics differ


def header(run_id: str = "0123456789abcdef", started_at: float = 1000.0) -> TrainRunHeader:
    return TrainRunHeader(job_id=JOB, run_id=run_id, run_name="demo", attempt=0,
                          started_at=started_at)  # fmt: skip


def test_the_writer_stores_every_round_in_whole_parts_and_the_reader_reads_them_back(tmp_path):
    root = StorageRoot(tmp_path / "storage")
    writer = TrainReportWriter(root, header(), part_size=10, min_interval_s=0)
    for i in range(25):
        writer.add(train_round(i, 1000.0 + i, [{"loss": 1 / (i + 1)}, {"loss": 1 / (i + 1)}], None))
    assert writer.close(timeout_s=10)
    names = [n for n in root.list_names(layout.metrics_dir(JOB)) if n.startswith("train-")]
    assert len(names) == 3  # 10 + 10 + 5 rounds
    for name in names:  # each part is one JSON document, written whole
        json.loads(root.read_bytes(f"{layout.metrics_dir(JOB)}/{name}"))
    (run,) = read_train_runs(root, JOB)
    assert (run.run_id, run.run_name, run.attempt) == ("0123456789abcdef", "demo", 0)
    assert [r.index for r in run.reports] == list(range(25))
    assert run.reports[7].metrics == {"loss": 1 / 8} and run.reports[7].workers == {}
    # A second fit() in the same job is a run of its own, after the first.
    second = TrainReportWriter(root, header("fedcba9876543210", 2000.0), min_interval_s=0)
    second.add(train_round(0, 2000.0, [{"loss": 9.0}], "checkpoint_y"))
    assert second.close(timeout_s=10)
    first, later = read_train_runs(root, JOB)
    assert first.run_id == run.run_id and later.run_id == "fedcba9876543210"
    assert later.reports[0].checkpoint == "checkpoint_y"


class FlakyRoot:
    """A storage root whose writes fail until `healed` is set; every write is recorded."""

    def __init__(self, real: StorageRoot) -> None:
        self.real, self.healed, self.attempts = real, threading.Event(), 0

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.attempts += 1
        if not self.healed.is_set():
            raise OSError("storage unreachable")
        self.real.write_bytes(rel, data)


def test_a_failed_write_never_holds_up_training_is_said_once_and_retried(tmp_path):
    root = FlakyRoot(StorageRoot(tmp_path / "storage"))
    said: list[str] = []
    writer = TrainReportWriter(root, header(), min_interval_s=0, retry_s=0.05,  # type: ignore[arg-type]
                               say=said.append)  # fmt: skip
    started = time.monotonic()
    for i in range(5):
        writer.add(train_round(i, float(i), [{"loss": float(i)}], None))
    assert time.monotonic() - started < 0.5  # adding never waits on storage
    deadline = time.monotonic() + 10
    while root.attempts < 3 and time.monotonic() < deadline:  # tried again while it fails
        time.sleep(0.01)
    assert root.attempts >= 3
    assert len(said) == 1 and "storage unreachable" in said[0], said
    root.healed.set()
    assert writer.close(timeout_s=10)
    assert len(said) == 2 and "stored again" in said[1], said
    (run,) = read_train_runs(root.real, JOB)
    assert [r.metrics for r in run.reports] == [{"loss": float(i)} for i in range(5)]


def test_rounds_faster_than_the_write_interval_are_stored_together(tmp_path):
    root = FlakyRoot(StorageRoot(tmp_path / "storage"))
    root.healed.set()
    writer = TrainReportWriter(root, header(), min_interval_s=30)  # type: ignore[arg-type]
    writer.add(train_round(0, 0.0, [{"loss": 0.0}], None))
    deadline = time.monotonic() + 10
    while not read_train_runs(root.real, JOB) and time.monotonic() < deadline:
        time.sleep(0.01)
    for i in range(1, 21):  # within the 30 s after the first write
        writer.add(train_round(i, float(i), [{"loss": float(i)}], None))
    assert writer.close(timeout_s=10)  # the close stores them at once, in one write
    assert root.attempts == 2
    (run,) = read_train_runs(root.real, JOB)
    assert [r.index for r in run.reports] == list(range(21))


def test_a_close_gives_up_on_a_storage_that_stays_down_and_says_what_is_lost(tmp_path):
    root = FlakyRoot(StorageRoot(tmp_path / "storage"))
    said: list[str] = []
    writer = TrainReportWriter(root, header(), min_interval_s=0, retry_s=0.05,  # type: ignore[arg-type]
                               say=said.append)  # fmt: skip
    writer.add(train_round(0, 0.0, [{"loss": 0.0}], None))
    started = time.monotonic()
    assert not writer.close(timeout_s=0.3)
    assert time.monotonic() - started < 5
    assert "1 Ray Train report(s) of run 0123456789ab not stored" in said[-1], said
    assert read_train_runs(root.real, JOB) == []


@pytest.fixture
def root_with_reports(tmp_path) -> str:
    """An ended job whose one Ray Train run reported loss and a phase for 3 steps."""
    root = StorageRoot(tmp_path / "storage")
    now = time.time()
    history = [StatusEvent(state=s, at=now - 30 + i) for i, s in
               enumerate([JobState.CREATED, JobState.DEPLOYING, JobState.RUNNING,
                          JobState.COMPLETED])]  # fmt: skip
    status = JobStatus(job_id=JOB, state=JobState.COMPLETED, history=history)
    JobStore(root).create(make_record(JOB, "trainer", now - 30), status)
    writer = TrainReportWriter(root, header(started_at=now - 20), min_interval_s=0)
    for step in range(3):
        rank1 = {"loss": 1.0 / (step + 1), "step": step, "phase": "b"}
        writer.add(train_round(step, now - 20 + step, [
            {"loss": 1.0 / (step + 1), "step": step, "phase": "a"}, rank1,
        ], "checkpoint_2" if step == 2 else None))  # fmt: skip
    assert writer.close(timeout_s=10)
    return root.url


def test_metrics_shows_the_reports_in_a_section_of_their_own(root_with_reports):
    shown = cli("metrics", "--job-id", JOB, "--storage-root", root_with_reports)
    assert shown.returncode == 0, shown.stderr
    section = shown.stdout[shown.stdout.index("Ray Train reports") :]
    assert re.search(r"report\s+loss\s+phase\s+step\s+checkpoint", section), section
    assert re.search(r"\b0\s+1\s+a\s+0\s+-", section), section
    assert re.search(r"\b1\s+0\.5\s+a\s+1\s+-", section), section
    assert re.search(r"\b2\s+0\.3333\s+a\s+2\s+checkpoint_2", section), section
    assert "worker 1 differs: phase=b" in section
    data = json.loads(cli("metrics", "--job-id", JOB, "--storage-root", root_with_reports,
                          "-o", "json").stdout)  # fmt: skip
    (run,) = data["train_reports"]
    assert [r["metrics"]["loss"] for r in run["reports"]] == [1.0, 0.5, 1.0 / 3]
    assert run["reports"][0]["workers"] == {"1": {"loss": 1.0, "step": 0, "phase": "b"}}


def test_the_html_report_draws_each_numeric_metric_over_the_report_index(root_with_reports,
                                                                         tmp_path):  # fmt: skip
    from orchestrator.client.api import get_job
    from orchestrator.client.metrics_plot import reports_figure

    job = get_job(JOB, storage_root=root_with_reports)
    fig = reports_figure(job.metrics())
    assert fig is not None
    assert sorted(a.text for a in fig.layout.annotations) == ["loss", "step"]  # not "phase"
    (loss,) = [t for t in fig.data if t.yaxis in ("y", None) and "loss" in t.hovertemplate]
    assert list(loss.x) == [0, 1, 2] and all(
        math.isclose(a, b) for a, b in zip(loss.y, [1.0, 0.5, 1 / 3], strict=True)
    )
    page = tmp_path / "report.html"
    assert cli("metrics", "--job-id", JOB, "--storage-root", root_with_reports,
               "--html", page).returncode == 0  # fmt: skip
    text = page.read_text()
    assert "Ray Train reports" in text and text.count("Plotly.newPlot") == 2
