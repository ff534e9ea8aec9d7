"""A stuck rank found from what the job produces (controller/stuck.py): the window and the 5x
rule on fake polls, the explicit beat, the failure policy's rules for STUCK, the stacks stored
with the job; and end to end on in-process ranks (no Ray: the agents run in this process, their
commands are real processes, py-spy dumps them)."""

from __future__ import annotations

import shlex
import sys
import time

import pytest
from controller_fakes import in_process_controller

from orchestrator import definitions as d
from orchestrator.agents.messages import StoredCheckpoint
from orchestrator.controller.failure_policy import Action, FailurePolicy, Fault, FaultKind
from orchestrator.controller.rank_group import GroupPoll, RankPoll, RankState
from orchestrator.controller.stuck import ProgressTracker
from orchestrator.lifecycle import JobState
from orchestrator.node.progress_beat import PROGRESS_FILE_ENV, progress, read_beat
from orchestrator.node.stacks import rank_stacks
from orchestrator.storage.metrics import GpuSample, MetricsSample
from orchestrator.storage.records import RetryPolicy
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.stacks import StackStore

T0 = 1_000_000.0


def rank(
    r: int = 0, out: float | None = None, ckpt: StoredCheckpoint | None = None,
    sample: MetricsSample | None = None, state: RankState = RankState.RUNNING,
) -> RankPoll:  # fmt: skip
    return RankPoll(r, state, last_output_at=out, last_checkpoint=ckpt, last_sample=sample)


def poll(at: float, *ranks: RankPoll) -> GroupPoll:
    return GroupPoll(T0 + at, ranks)


def sample(at: float, cpu: float = 0.0, **extra) -> MetricsSample:
    return MetricsSample(at=T0 + at, cpu_cores=cpu, memory_bytes=0, processes=1, **extra)


def feed(tracker: ProgressTracker, *polls: GroupPoll) -> list[int]:
    for p in polls:
        tracker.observe(p)
    return tracker.silent(polls[-1])


def test_silent_only_past_the_window_from_the_attempts_start():
    tracker = ProgressTracker(stuck_after_s=10, started=T0)
    assert feed(tracker, poll(9, rank(0))) == []
    assert feed(tracker, poll(11, rank(0))) == [0]  # nothing at all: silent from the start


def test_a_slow_first_output_is_not_stuck_and_sets_no_window():
    """A data download: 9 s silent before the first line, inside the 10 s window; the wait
    before the first output does not count toward the 5x rule."""
    tracker = ProgressTracker(stuck_after_s=10, started=T0)
    assert feed(tracker, poll(9, rank(0, out=T0 + 9))) == []
    assert tracker.longest_silence == 0 and tracker.window_s == 10
    assert feed(tracker, poll(18, rank(0, out=T0 + 9))) == []
    assert feed(tracker, poll(19.5, rank(0, out=T0 + 9))) == [0]


def test_the_window_is_five_times_the_longest_silence_after_the_first_output():
    """A healthy job's evaluation was silent 4 s: from then on its window is 20 s, not 10."""
    tracker = ProgressTracker(stuck_after_s=10, started=T0)
    feed(tracker, poll(1, rank(0, out=T0 + 1)), poll(5, rank(0, out=T0 + 5)))
    assert tracker.longest_silence == pytest.approx(4) and tracker.window_s == pytest.approx(20)
    assert feed(tracker, poll(24, rank(0, out=T0 + 5))) == []  # 19 s: 3x the long gap is fine
    assert feed(tracker, poll(25.5, rank(0, out=T0 + 5))) == [0]


def test_the_silence_that_is_still_going_on_does_not_widen_its_own_window():
    tracker = ProgressTracker(stuck_after_s=10, started=T0)
    feed(tracker, poll(1, rank(0, out=T0 + 1)))
    for at in range(2, 12):
        feed(tracker, poll(at, rank(0, out=T0 + 1)))
    assert tracker.window_s == 10 and tracker.silent(poll(11.5, rank(0, out=T0 + 1))) == [0]


def test_what_a_rank_did_just_before_it_hung_does_not_widen_its_window():
    """Its next sample still shows the CPU it used before the hang: alive until that sample,
    but no silence is counted (the CPU may have been used right after the last output)."""
    tracker = ProgressTracker(stuck_after_s=3, started=T0)
    for at in range(1, 11):  # a line a second; samples every 5 s, busy
        tracker.observe(poll(at, rank(0, out=T0 + at, sample=sample(5 * (at // 5), cpu=1.0))))
    hung = rank(0, out=T0 + 10, sample=sample(12, cpu=0.4))  # 10..12 hung; 7..10 busy
    assert feed(tracker, poll(12, hung)) == [] and tracker.ranks[0].last_moved == T0 + 12
    assert tracker.window_s == pytest.approx(5)  # 5x the 1 s between lines, not 5x 2 s
    assert feed(tracker, poll(17.5, rank(0, out=T0 + 10, sample=sample(17, cpu=0.0)))) == [0]


def test_the_rank_that_went_silent_first_is_the_one_whose_output_stopped_first():
    tracker = ProgressTracker(stuck_after_s=3, started=T0)
    feed(tracker, poll(1, rank(0, out=T0 + 1), rank(1, out=T0 + 1)))
    # Rank 1 stopped after its line at 4; rank 0 printed at 4.5 and then waited in the
    # collective; their next samples (at different times) still show the CPU of before.
    feed(tracker, poll(5, rank(0, out=T0 + 4.5), rank(1, out=T0 + 4)))
    later = poll(9, rank(0, out=T0 + 4.5, sample=sample(6, cpu=0.3)),
                 rank(1, out=T0 + 4, sample=sample(8, cpu=0.3)))  # fmt: skip
    assert feed(tracker, later, poll(30, *later.ranks)) == [1, 0]


def test_progress_bar_updates_are_output():
    """A `\\r` bar reaches the poll as output like a line (node/output_splitter.py forwards its
    state once a second): a job printing only a bar is never silent."""
    tracker = ProgressTracker(stuck_after_s=3, started=T0)
    for at in range(1, 30):
        assert feed(tracker, poll(at, rank(0, out=T0 + at))) == []


def test_cpu_time_gpu_checkpoints_and_the_beat_are_progress():
    tracker = ProgressTracker(stuck_after_s=10, started=T0)
    feed(tracker, poll(1, rank(0, out=T0 + 1), rank(1, out=T0 + 1), rank(2, out=T0 + 1),
                       rank(3, out=T0 + 1), rank(4, out=T0 + 1)))  # fmt: skip
    gpu = GpuSample(index=0, utilization_pct=97, memory_used_bytes=1, memory_total_bytes=2)
    moving = [
        rank(0, out=T0 + 1, sample=sample(10, cpu=0.9)),  # computing without printing
        rank(1, out=T0 + 1, sample=sample(10, gpus=[gpu])),
        rank(2, out=T0 + 1, ckpt=StoredCheckpoint("checkpoint-5", T0 + 10)),
        rank(3, out=T0 + 1, sample=sample(10, beat_at=T0 + 10, beat_step=7)),
        rank(4, out=T0 + 1, sample=sample(10, cpu=0.01)),  # idle: not progress
    ]
    feed(tracker, poll(10, *moving), poll(12, *moving))
    moved = {r: progress.last_moved - T0 for r, progress in tracker.ranks.items()}
    assert moved == {0: 10, 1: 10, 2: 10, 3: 10, 4: 1}
    assert tracker.ranks[3].why == "orchestrator.progress(7)"
    assert tracker.ranks[2].why == "a checkpoint stored"


def test_checkpoint_writes_between_samples_are_progress():
    """A big save: bytes grow under the checkpoint directory while the rank prints nothing."""
    tracker = ProgressTracker(stuck_after_s=10, started=T0)
    feed(tracker, poll(1, rank(0, out=T0 + 1, sample=sample(1, disk_bytes={"checkpoints": 0}))))
    for at in range(5, 40, 5):
        writing = sample(at, disk_bytes={"checkpoints": at * 10**8})
        assert feed(tracker, poll(at, rank(0, out=T0 + 1, sample=writing))) == []


def test_ranks_that_ended_are_not_silent_and_the_longest_silent_comes_first():
    tracker = ProgressTracker(stuck_after_s=5, started=T0)
    feed(tracker, poll(1, rank(0, out=T0 + 1), rank(1, out=T0 + 2), rank(2, out=T0 + 1)))
    later = poll(20, rank(0, out=T0 + 1), rank(1, out=T0 + 2),
                 rank(2, out=T0 + 1, state=RankState.ENDED))  # fmt: skip
    assert feed(tracker, later) == [0, 1]


# --- the explicit beat ---------------------------------------------------------------------


def test_the_beat_is_a_no_op_outside_a_job(monkeypatch, tmp_path):
    monkeypatch.delenv(PROGRESS_FILE_ENV, raising=False)
    progress(3)  # nothing to write to, nothing raised
    beat = tmp_path / "beat"
    monkeypatch.setenv(PROGRESS_FILE_ENV, str(beat))
    monkeypatch.setattr("orchestrator.node.progress_beat._last_written", 0.0)
    progress(42)
    at, step = read_beat(str(beat))
    assert step == 42 and abs(at - time.time()) < 5
    progress(43)  # within a second of the last: not written
    assert read_beat(str(beat))[1] == 42
    import orchestrator

    assert orchestrator.progress is progress


# --- the policy ----------------------------------------------------------------------------


def stuck(checkpoint: str | None = None) -> Fault:
    return Fault(FaultKind.STUCK, "stuck: rank 1 ...", 1, checkpoint=checkpoint)


def test_stuck_is_retried_while_retries_last_without_retry_on_failure():
    policy = FailurePolicy(RetryPolicy(retries=2))
    assert policy.decide(stuck()).action == Action.RETRY
    ended = FailurePolicy(RetryPolicy()).decide(stuck())
    assert (ended.action, ended.state) == (Action.END, JobState.FAILED)


def test_two_stuck_attempts_in_a_row_without_a_checkpoint_between_end_the_job():
    policy = FailurePolicy(RetryPolicy(retries=5))
    again = policy.decide(stuck("ckpt-1"), [stuck("ckpt-1")])
    assert (again.action, again.state) == (Action.END, JobState.FAILED)
    assert "no checkpoint" in again.why
    assert policy.decide(stuck("ckpt-2"), [stuck("ckpt-1")]).action == Action.RETRY  # it moved
    node = Fault(FaultKind.NODE_LOST, "lost", 0)
    assert policy.decide(stuck(), [stuck(), node]).action == Action.RETRY  # not in a row


# --- stacks --------------------------------------------------------------------------------


def test_a_ranks_stacks_show_where_its_python_waits(tmp_path):
    import subprocess

    import psutil

    script = "import time\ndef wait_for_peer():\n    time.sleep(60)\n"
    script += "print('up', flush=True)\nwait_for_peer()\n"
    command = f"{sys.executable} -c {shlex.quote(script)}; true"  # the shell stays its parent
    guard = subprocess.Popen(["/bin/sh", "-c", command], stdout=subprocess.PIPE)
    try:
        assert guard.stdout.readline() == b"up\n"
        text = rank_stacks(guard.pid)
    finally:
        for child in psutil.Process(guard.pid).children(recursive=True):
            child.kill()
        guard.kill()
        guard.wait()
    assert "wait_for_peer" in text and "(<string>:3)" in text and "Thread" in text
    assert "no command is running" in rank_stacks(None)


def test_a_refused_ptrace_is_said_once_a_job(tmp_path, monkeypatch):
    import subprocess

    import psutil

    from orchestrator.controller import stuck
    from orchestrator.node import stacks

    refusing = tmp_path / "py-spy"
    refusing.write_text("#!/bin/sh\necho 'Error: Permission Denied' >&2\nexit 1\n")
    refusing.chmod(0o755)
    monkeypatch.setattr(stacks, "py_spy", lambda: str(refusing))
    shell = subprocess.Popen(["/bin/sh", "-c", "sleep 30; true"])
    try:
        time.sleep(0.2)
        text = rank_stacks(shell.pid)
    finally:
        for child in psutil.Process(shell.pid).children(recursive=True):
            child.kill()
        shell.kill()
        shell.wait()
    assert stacks.REFUSED in text and "ptrace refused" in text
    said = stuck._refusals("jrefused01", {0: text, 1: text})
    assert len(said) == 1 and "rank(s) 0, 1" in said[0] and "CAP_SYS_PTRACE" in said[0]
    assert stuck._refusals("jrefused01", {0: text}) == []  # once


def test_stack_sets_are_stored_with_the_job(tmp_path):
    store = StackStore(StorageRoot(str(tmp_path)), "j1")
    where = store.store("attempt-0", {0: "a\n", 1: "b\n"}, first=1, silent=[1], quiet_s=8.04)
    store.store("taken-20260101T000000Z", {0: "c\n"})
    assert where.endswith("jobs/j1/stacks/attempt-0")
    assert store.sets() == ["attempt-0", "taken-20260101T000000Z"]
    assert store.read("attempt-0") == {0: "a\n", 1: "b\n"}
    assert store.silent("attempt-0").first == 1 and store.silent("taken-20260101T000000Z") is None


# --- end to end, ranks in this process -----------------------------------------------------

HANGS = """
import os, sys, time
rank = int(os.environ["BT_NODE_RANK"])
attempt = int(os.environ["BT_RETRY_COUNT"])
hangs = attempt < HANG_ATTEMPTS
def wait_for_the_other_rank():
    time.sleep(120)
def all_reduce():  # what rank 0 waits in: rank 1 never joins it
    time.sleep(120)
for step in range(1, 9):
    print(f"step {step}", flush=True)
    if rank == 1 and step == 3 and hangs:
        wait_for_the_other_rank()
    if rank == 0 and step == 4 and hangs:
        all_reduce()
    time.sleep(0.2)
"""

BAR_ONLY = """
import sys, time
for i in range(40):
    sys.stdout.write(f"\\rtrain: {i}/40")
    sys.stdout.flush()
    time.sleep(0.1)
sys.stdout.write("\\n")
"""


def job(script: str, stuck_after_s: float) -> d.TrainingProject:
    command = f"{shlex.quote(sys.executable)} -u -c {shlex.quote(script)}"
    return d.TrainingProject(
        name="stuck",
        job=d.TrainingJob(
            image=d.Image(base_image="python:3.11"),
            compute=d.Compute(node_count=2),
            runtime=d.Runtime(start_commands=[command]),
            stuck_after_s=stuck_after_s,
        ),
    )


@pytest.fixture
def nodes_here(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ORCHESTRATOR_NODE_ROOT", str(tmp_path / "nodes"))


def test_a_hang_every_time_ends_failed_stuck_after_two_attempts(nodes_here, tmp_path):
    retry = RetryPolicy(retries=3)  # the two-in-a-row rule ends it, not the budget
    controller, _, handle = in_process_controller(
        tmp_path, job(HANGS.replace("HANG_ATTEMPTS", "99"), 2), "jstuck0001", retry
    )
    started = time.monotonic()
    assert controller.run() == JobState.FAILED
    assert time.monotonic() - started < 40  # not the 120 s the rank sleeps
    attempts = handle.details().attempts
    assert [a.cause for a in attempts] == ["stuck", "stuck"] and attempts[0].rank == 1
    assert attempts[0].decision == "retried: retry 1 of 3"
    failure = handle.details().failure
    assert "stuck: rank 1 made no progress" in failure.cause and failure.node_rank == 1
    assert "stuck twice in a row with no checkpoint" in failure.cause
    assert "jobs/jstuck0001/stacks/attempt-1" in failure.cause
    store = StackStore(StorageRoot(str(tmp_path / "storage")), "jstuck0001")
    assert store.sets() == ["attempt-0", "attempt-1"]
    stacks = store.read("attempt-0")
    assert set(stacks) == {0, 1}
    assert "wait_for_the_other_rank" in stacks[1]  # the line it waits in
    assert "all_reduce" in stacks[0]
    assert store.silent("attempt-0").first == 1
    logs = "\n".join(handle.logs())
    assert "rank 1 is silent" in logs and "stacks of 2 rank(s) taken" in logs


def test_a_hang_once_is_retried_and_completes(nodes_here, tmp_path):
    controller, _, handle = in_process_controller(
        tmp_path, job(HANGS.replace("HANG_ATTEMPTS", "1"), 2), "jstuck0002", RetryPolicy(retries=1)
    )
    assert controller.run() == JobState.COMPLETED
    first, second = handle.details().attempts
    assert first.cause == "stuck" and second.decision == "completed"


def test_a_job_printing_only_a_progress_bar_is_not_stuck(nodes_here, tmp_path):
    controller, _, handle = in_process_controller(tmp_path, job(BAR_ONLY, 1.5), "jstuck0003")
    assert controller.run() == JobState.COMPLETED
    assert [a.cause for a in handle.details().attempts] == [None]
