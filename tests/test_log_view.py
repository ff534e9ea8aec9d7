"""Progress bars in the logs as a reader sees them (client/log_view.py, `orchestrator logs`); no
Ray: stored segments and statuses are written straight into a storage root, as a job's
controller writes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pexpect
import pyte
import pytest
from test_cli_checkpoints import make_record

from orchestrator.client.log_view import thin_progress
from orchestrator.lifecycle import JobState
from orchestrator.storage import layout
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.logs import is_progress, rank_line
from orchestrator.storage.records import JobStatus
from orchestrator.storage.root import StorageRoot

JOB = "job-bar"


def bar(rank: int, step: int, total: int = 300) -> str:
    return rank_line(rank, f"12:00:{step % 60:02d}", f"training: {step}/{total} it", step < total)


@pytest.fixture
def running(tmp_path) -> tuple[StorageRoot, JobStore]:
    root = StorageRoot(tmp_path / "root")
    store = JobStore(root)
    store.create(make_record(JOB, "bars", time.time()), JobStatus.new(JOB))
    store.put_status(store.status(JOB).moved_to(JobState.DEPLOYING).moved_to(JobState.RUNNING))
    return root, store


def write_segment(root: StorageRoot, seq: int, lines: list[str]) -> None:
    root.write_bytes(layout.log_segment(JOB, seq), "".join(f"{x}\n" for x in lines).encode())


def test_the_tag_marks_progress_states_only():
    assert is_progress(bar(0, 10)) and not is_progress(bar(0, 300))
    assert not is_progress("[rank 0 12:00:01] progress] is just text here")
    assert not is_progress("[orchestrator 12:00:01] RUNNING")


def test_following_gives_a_ranks_latest_state_at_most_every_interval_and_every_line():
    clock = iter([0.0, 1.0, 2.0, 12.0, 13.0])
    batches = [
        ["[rank 0 12:00:00] epoch 1", bar(0, 1), bar(0, 2), bar(1, 1)],
        [bar(0, 3)],  # 1 s later: too soon for rank 0
        [bar(0, 4), "[rank 0 12:00:02] saved checkpoint-4"],  # a line: the state is older
        [bar(0, 150)],  # 12 s: due again
        [bar(0, 300), bar(1, 300)],
    ]
    seen = list(thin_progress(batches, 10.0, clock=lambda: next(clock)))
    assert seen == [
        "[rank 0 12:00:00] epoch 1", bar(0, 2), bar(1, 1),
        "[rank 0 12:00:02] saved checkpoint-4",
        bar(0, 150),
        bar(0, 300), bar(1, 300),
    ]  # fmt: skip
    assert list(thin_progress(batches, 0)) == [x for b in batches for x in b]


def _env() -> dict[str, str]:
    return {**os.environ, "TERM": "xterm", "COLUMNS": "100", "LINES": "30"}


def test_logs_tail_on_a_terminal_draws_a_bar_in_place(running):
    root, store = running
    write_segment(root, 0, ["[rank 0 12:00:00] epoch 1", bar(0, 1)])
    child = pexpect.spawn(
        sys.executable, ["-m", "orchestrator", "logs", "--job-id", JOB, "--tail",
                         "--storage-root", root.url],
        encoding="utf-8", dimensions=(30, 100), timeout=30, env=_env(),
    )  # fmt: skip
    screen = pyte.Screen(100, 30)
    stream = pyte.Stream(screen)
    try:
        child.expect_exact("1/300 it")
        stream.feed(child.before + child.after)
        row = next(i for i, text in enumerate(screen.display) if "1/300 it" in text)
        write_segment(root, 1, [bar(0, 150)])
        child.expect_exact("150/300 it")
        stream.feed(child.before + child.after)
        # The new state is drawn over the old one, on the same row: the old one is gone.
        assert "150/300 it" in screen.display[row]
        assert not any("1/300 it" in text for text in screen.display)
        write_segment(root, 2, [bar(0, 300), "[rank 0 12:01:00] epoch 2"])
        store.put_status(store.status(JOB).moved_to(JobState.COMPLETED))
        child.expect(pexpect.EOF)
        stream.feed(child.before)
    finally:
        child.close(force=True)
    shown = [text.rstrip() for text in screen.display if text.strip()]
    assert shown[:3] == ["[rank 0 12:00:00] epoch 1", bar(0, 300), "[rank 0 12:01:00] epoch 2"], (
        shown
    )  # the bar's final state stays, once, and what follows is on its own line


def test_logs_piped_or_as_json_prints_every_stored_line_as_it_is(running):
    root, store = running
    lines = ["[rank 0 12:00:00] epoch 1", bar(0, 1), bar(0, 150), bar(0, 300)]
    write_segment(root, 0, lines)
    store.put_status(store.status(JOB).moved_to(JobState.COMPLETED))
    base = [sys.executable, "-m", "orchestrator", "logs", "--job-id", JOB, "--storage-root",
            root.url]  # fmt: skip
    piped = subprocess.run([*base, "--tail"], capture_output=True, text=True, timeout=60)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.splitlines()[:4] == lines and "\x1b" not in piped.stdout
    as_json = subprocess.run([*base, "-o", "json"], capture_output=True, text=True, timeout=60)
    rows = [json.loads(x) for x in as_json.stdout.splitlines()]
    assert [(r["line"], r["progress"]) for r in rows] == [
        (lines[0], False), (lines[1], True), (lines[2], True), (lines[3], False)
    ]  # fmt: skip
