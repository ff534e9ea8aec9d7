"""What a rank's uploader sees of its rank writing checkpoints (`RankWrites`), the evidence the
resume point rests on (tests/test_resume_point.py). No Ray: the uploader is used directly, on a
local storage root.
"""

from __future__ import annotations

import time
import uuid

import pytest

from orchestrator.agents import checkpoint_uploader
from orchestrator.agents.checkpoint_uploader import CheckpointUploader
from orchestrator.node.node_root import NODE_ROOT_ENV
from orchestrator.node.rank_writes import RankWrites
from orchestrator.storage.checkpoints import CheckpointStore
from orchestrator.storage.root import StorageRoot


def wait_until(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def watch(tmp_path, monkeypatch):
    """An uploader of rank 1 watching `tmp_path / "ckpt"`, as the controller has it before the
    commands start; `earlier`: an earlier job's checkpoints already there."""
    monkeypatch.setenv(NODE_ROOT_ENV, str(tmp_path / "node"))
    made: list[CheckpointUploader] = []

    def start(earlier: dict[str, str] | None = None) -> CheckpointUploader:
        local = tmp_path / "ckpt"
        local.mkdir(exist_ok=True)
        root = StorageRoot(tmp_path / "root")
        up = CheckpointUploader(
            "p", f"j{uuid.uuid4().hex[:6]}", 1, root.url, str(local), {}, None, earlier or {}
        )
        assert up.ready(10)
        made.append(up)
        return up

    yield start
    for up in made:
        up.flush(timeout=5)


def quiet_past(up: CheckpointUploader, moment: float) -> RankWrites:
    """Its report once its quiet spell reaches `moment` (it must, while nothing is written)."""
    wait_until(lambda: any(s.until >= moment for s in up.poll().writes.quiet), "the spell")
    return up.poll().writes


def test_an_empty_directory_is_a_quiet_spell_that_lasts_while_the_commands_run(watch):
    up = watch()
    began = time.time()
    report = quiet_past(up, began + 0.5)
    assert report.wrote is None and len(report.quiet) == 1
    assert report.quiet[0].since <= began
    up.writer_ended(False, "rank 1's command exited with code 1", at=began + 0.7)
    ended = up.poll().writes.quiet[0]
    assert ended.until <= began + 0.7  # no later than the commands' end
    time.sleep(0.3)  # the watch goes on; the spell must not
    assert up.poll().writes.quiet[0].until == ended.until


@pytest.mark.parametrize(
    "entry",
    [".checkpoint-6/w", "tmp-checkpoint-6/w", "checkpoint-6/w", "latest", "empty/"],
)
def test_anything_the_rank_writes_makes_it_a_writer(watch, tmp_path, entry):
    """A hidden or temporary directory (a save under way), a checkpoint, a file at the top, an
    empty directory: each is the rank writing, whatever the uploader makes of it."""
    up = watch()
    quiet_past(up, time.time())
    path = tmp_path / "ckpt" / entry
    if entry.endswith("/"):
        path.mkdir()
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"state")
    wait_until(lambda: up.poll().writes.wrote is not None, f"{entry} seen")
    report = up.poll().writes
    assert report.wrote == entry.split("/")[0]
    assert report.quiet[0].until < report.wrote_at  # the spell ended before it
    until = report.quiet[0].until
    time.sleep(0.3)
    assert up.poll().writes.quiet[0].until == until


def test_a_directory_made_and_deleted_between_two_scans_is_still_seen(watch, tmp_path):
    up = watch()
    quiet_past(up, time.time())
    with up._lock:  # no scan runs meanwhile
        (tmp_path / "ckpt" / ".staging").mkdir()
        (tmp_path / "ckpt" / ".staging").rmdir()
    wait_until(lambda: up.poll().writes.wrote == ".staging", "the vanished directory")


def test_an_earlier_jobs_checkpoint_and_another_ranks_restored_copy_are_not_the_ranks(
    watch, tmp_path
):
    local = tmp_path / "ckpt"
    (local / "checkpoint-1").mkdir(parents=True)
    (local / "checkpoint-1" / "w").write_bytes(b"earlier job")
    from orchestrator.node.checkpoint_rules import earlier_checkpoints

    up = watch(earlier_checkpoints(local))
    store = CheckpointStore(up.store.root)
    copy = tmp_path / "rank0" / "checkpoint-6"
    copy.mkdir(parents=True)
    (copy / "state.pt").write_bytes(b"rank 0's")
    shared = store.upload(copy, "p", up.job_id, 0)
    before = time.time()
    up.begin_attempt(1, shared, [])  # rank 0 writes for all: its copy restored here
    assert (local / "checkpoint-6" / "state.pt").read_bytes() == b"rank 0's"
    report = quiet_past(up, time.time() + 0.3)
    assert report.wrote is None
    assert report.quiet[-1].since >= before  # the attempt's own spell
    (local / "checkpoint-6" / "state.pt").write_bytes(b"changed by this rank")
    wait_until(lambda: up.poll().writes.wrote == "checkpoint-6", "the copy made its own")


def test_an_attempt_begins_a_new_spell_and_sets_aside_a_copy_it_no_longer_resumes_from(
    watch, tmp_path
):
    up = watch()
    copy = tmp_path / "rank0" / "checkpoint-6"
    copy.mkdir(parents=True)
    (copy / "state.pt").write_bytes(b"rank 0's")
    shared = CheckpointStore(up.store.root).upload(copy, "p", up.job_id, 0)
    up.begin_attempt(1, shared, [])
    first = quiet_past(up, time.time()).quiet[-1].since
    up.writer_ended(False, "rank 1 was lost")
    up.begin_attempt(2, None, [])  # the job starts again: no copy stays to resume from
    assert not (tmp_path / "ckpt" / "checkpoint-6").exists()
    moved = up.dirs.set_aside(2) / "checkpoint-6" / "state.pt"
    assert moved.read_bytes() == b"rank 0's"
    report = quiet_past(up, time.time() + 0.2)
    assert report.wrote is None  # moving it away was not the rank writing
    assert report.quiet[-1].since > first
    assert any("a copy of rank-0/checkpoint-6 restored for an earlier attempt" in e
               for e in up.events)  # fmt: skip


def test_a_restarted_uploader_reports_no_quiet_spell_before_its_attempt_begins(watch, monkeypatch):
    """Ray restarts the uploader of a lost node on its replacement while the other ranks are
    stopped, and may still store checkpoints: an empty directory there says nothing of the
    rank until the next attempt's commands run."""
    monkeypatch.setattr(checkpoint_uploader, "_restarted", lambda: True)
    up = watch()
    scans = up.poll().scans
    wait_until(lambda: up.poll().scans >= scans + 5, "five scans of the empty directory")
    assert up.poll().writes.quiet == ()
    began = time.time()
    up.begin_attempt(1, None, [])
    report = quiet_past(up, began + 0.2)
    assert [s.since >= began for s in report.quiet] == [True]
