"""A job's time limit (`max_duration`, controller/time_limit.py): the field as written and its
errors, the `--max-duration` override, the held time over the job's holds (queued time not
counted), the failure policy never retrying it; and end to end on in-process ranks (no Ray:
the agents run in this process, their commands are real processes), where the commands get
SIGTERM within a second of the limit, counted from the queue's admission."""

from __future__ import annotations

import json
import re
import shlex
import sys
import threading
import time
from pathlib import Path

import pytest
from controller_fakes import OpenQueue, in_process_controller
from pydantic import ValidationError
from typer.testing import CliRunner

from orchestrator import definitions as d
from orchestrator.cli.app import app
from orchestrator.client.overrides import Overrides
from orchestrator.controller.failure_policy import (
    NEVER_RETRIED,
    Action,
    FailurePolicy,
    Fault,
    FaultKind,
)
from orchestrator.controller.rank_group import GroupPoll, RankPoll, RankState
from orchestrator.controller.time_limit import (
    TimeLimitWatcher,
    held_from_history,
    held_seconds,
    held_time,
    limit_cause,
)
from orchestrator.controller.watchers import WatchScope
from orchestrator.errors import ConfigError
from orchestrator.lifecycle import JobState
from orchestrator.spec.durations import format_duration, parse_duration, spelled
from orchestrator.spec.validation import describe_validation_error
from orchestrator.storage.records import Hold, JobStatus, RetryPolicy, StatusEvent

T0 = 1_000_000.0


def image() -> d.Image:
    return d.Image(base_image="python:3.11")


# --- the field ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "seconds"),
    [("2h", 7200), ("90m", 5400), ("45s", 45), ("1h30m", 5400), ("1h 30m", 5400),
     ("1.5h", 5400), ("2d", 172800), ("3600", 3600), (6, 6), (2.5, 2.5), ("10M", 600)],
)  # fmt: skip
def test_durations_as_written_are_kept_and_read_as_seconds(written, seconds):
    job = d.TrainingJob(image=image(), max_duration=written)
    assert job.max_duration == written  # the spelling, for messages
    assert job.max_duration_s == pytest.approx(seconds)
    assert parse_duration(written) == pytest.approx(seconds)


def test_no_limit_by_default():
    job = d.TrainingJob(image=image())
    assert job.max_duration is None and job.max_duration_s is None


@pytest.mark.parametrize(
    ("written", "reason"),
    [("2x", "'2x' is not a duration"), ("", "'' is not a duration"),
     ("2h30", "'2h30' is not a duration"), ("h", "'h' is not a duration"),
     ("-1h", "'-1h' is not a duration"), ("inf", "'inf' is not a duration"),
     (0, "must be a time above 0"), (-5, "must be a time above 0"),
     ("0s", "must be a time above 0"), (float("nan"), "must be a time above 0"),
     (True, "must be a duration such as '2h'"), ([7200], "must be a duration such as '2h'")],
)  # fmt: skip
def test_a_bad_duration_names_the_field_in_one_line(written, reason):
    with pytest.raises(ValidationError) as info:
        d.TrainingJob(image=image(), max_duration=written)
    lines = describe_validation_error(info.value, d.TrainingJob)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"TrainingJob.max_duration: {reason}"), lines
    assert "\n" not in lines[0]


def test_a_bad_duration_in_a_project_names_its_path():
    with pytest.raises(ValidationError) as info:
        d.TrainingProject(name="p", job={"image": {"base_image": "x"}, "max_duration": "soon"})
    (line,) = describe_validation_error(info.value, d.TrainingProject)
    assert line.startswith("TrainingProject.job.max_duration: 'soon' is not a duration")
    assert "'2h', '90m'" in line  # what to write instead


def test_the_spelling_and_the_held_time_in_messages():
    assert [spelled(v) for v in ("2h", " 90m ", "600", 6, 2.5)] == [
        "2h", "90m", "600s", "6s", "2.5s",
    ]  # fmt: skip
    assert [format_duration(s) for s in (3.24, 6, 59.96, 61, 7200.4, 5400)] == [
        "3.2s", "6s", "60s", "1m 1s", "2h 0m", "1h 30m",
    ]  # fmt: skip


def test_push_max_duration_overrides_the_config_and_says_so():
    project = d.TrainingProject(name="p", job=d.TrainingJob(image=image(), max_duration="2h"))
    overridden, warnings = Overrides(max_duration="30m").apply(project)
    assert overridden.job.max_duration == "30m" and overridden.job.max_duration_s == 1800
    assert warnings == ["--max-duration '30m' overrides '2h' from the config"]
    plain = d.TrainingProject(name="p", job=d.TrainingJob(image=image()))
    assert Overrides(max_duration="45s").apply(plain) == (
        plain.model_copy(update={"job": plain.job.model_copy(update={"max_duration": "45s"})}),
        [],
    )
    with pytest.raises(ConfigError) as info:
        Overrides(max_duration="a while").apply(plain)
    (problem,) = info.value.problems
    assert problem.startswith("job.max_duration: 'a while' is not a duration")


def test_push_dry_run_shows_the_limit_from_the_flag():
    config = Path(__file__).resolve().parents[1] / "recipes" / "mnist-pytorch" / "config.py"
    runner = CliRunner()
    text = runner.invoke(app, ["push", str(config), "--dry-run", "--max-duration", "1h30m"])
    assert text.exit_code == 0, text.output
    assert "max duration    1h30m holding its nodes (queued time not counted)" in text.output
    shown = runner.invoke(app, ["push", str(config), "--dry-run", "-o", "json",
                                "--max-duration", "5400"])  # fmt: skip
    assert json.loads(shown.output)["summary"]["max_duration"] == "5400"
    bad = runner.invoke(app, ["push", str(config), "--dry-run", "--max-duration", "soon"])
    assert isinstance(bad.exception, ConfigError)  # the entrypoint prints it, exit code 2
    assert "job.max_duration: 'soon' is not a duration" in str(bad.exception)


# --- the held time -----------------------------------------------------------------------------


def hold(since: float, until: float | None = None) -> Hold:
    return Hold(since=T0 + since, until=None if until is None else T0 + until, bundle={"CPU": 1})


def test_held_time_runs_from_the_admission():
    assert held_seconds([], T0 + 50) == 0
    assert held_seconds([hold(10)], T0 + 10) == 0
    assert held_seconds([hold(10)], T0 + 16) == pytest.approx(6)


def test_a_requeues_wait_is_not_counted():
    """Held 10-20, preempted by the queue and back in it 20-65, admitted again at 65."""
    holds = [hold(10, 20), hold(65)]
    assert held_seconds(holds, T0 + 64) == pytest.approx(10)  # waiting: the clock stands
    assert held_seconds(holds, T0 + 70) == pytest.approx(15)
    assert held_seconds([hold(10, 20), hold(65, 71)], T0 + 500) == pytest.approx(16)  # ended


def test_an_open_hold_left_by_a_dead_controller_ends_at_the_next_admission():
    assert held_seconds([hold(0), hold(30)], T0 + 40) == pytest.approx(40)
    assert held_seconds([hold(0), hold(100, 130)], T0 + 40) == pytest.approx(40)  # no future


def event(state: JobState, at: float, reason: str | None = None) -> StatusEvent:
    return StatusEvent(state=state, at=T0 + at, reason=reason)


def test_a_status_without_holds_counts_from_its_deployings():
    history = [
        event(JobState.CREATED, 0), event(JobState.PENDING, 1, "waiting in the queue"),
        event(JobState.DEPLOYING, 30), event(JobState.RUNNING, 32),
        event(JobState.PENDING, 40, "rank 1's node was lost; retry 1 of 1: waiting"),  # held
        event(JobState.DEPLOYING, 45), event(JobState.RUNNING, 46),
        event(JobState.PENDING, 50, "preempted by j2: priority; back in the queue"),
        event(JobState.DEPLOYING, 90), event(JobState.RUNNING, 91),
    ]  # fmt: skip
    # The queue's reason replaces a requeue's in its PENDING event: that one ends a hold too.
    waiting = "waiting in the queue (position 1): needs 1 node with 2 CPU free"
    replaced = [*history[:7], event(JobState.PENDING, 50, waiting), *history[8:]]
    assert held_from_history(replaced, T0 + 95) == pytest.approx(25)
    assert held_from_history(history, T0 + 95) == pytest.approx(20 + 5)
    ended = [*history, event(JobState.FAILED, 100)]
    assert held_from_history(ended, T0 + 500) == pytest.approx(30)
    status = JobStatus(job_id="j", state=JobState.RUNNING, history=history)
    assert held_time(status, T0 + 95) == pytest.approx(25)  # no holds: the history
    held = status.model_copy(update={"holds": [hold(29, 50), hold(89)]})
    assert held_time(held, T0 + 95) == pytest.approx(27)  # the holds, when there are


def test_the_cause_quotes_the_limit_as_written():
    assert limit_cause("2h", 7200.3, 0.2) == (
        "max_duration 2h reached (held its nodes 2h 0m; queued time not counted)"
    )
    assert limit_cause(6, 6.12, 45.5) == (
        "max_duration 6s reached (held its nodes 6.1s; 45.5s queued, not counted)"
    )


# --- the failure policy ------------------------------------------------------------------------

LIMIT = Fault(FaultKind.MAX_DURATION, "max_duration 2h reached (held its nodes 2h 0m)")


def test_a_job_past_its_max_duration_is_never_retried():
    lenient = RetryPolicy(retries=5, retry_on_failure=True, max_preemptions=9)
    for earlier in ([], [Fault(FaultKind.NODE_LOST, "lost", 1)], [LIMIT]):
        decision = FailurePolicy(lenient).decide(LIMIT, earlier)
        assert (decision.action, decision.state) == (Action.END, JobState.FAILED)
        assert decision.why == "a job past its max_duration is not retried"
    assert FaultKind.MAX_DURATION in NEVER_RETRIED  # its cause is not suffixed "(retries ...)"
    assert FaultKind.MAX_DURATION.value == "max_duration"


# --- the watcher, on a job's real run --------------------------------------------------------


def test_the_watcher_fires_past_the_limit_while_ranks_run_but_leaves_their_own_end(
    nodes_here, tmp_path
):
    controller, _, _ = in_process_controller(tmp_path, limited("1m"), "jlimit0004")
    run = controller.job_run
    try:
        watcher = TimeLimitWatcher(WatchScope(run, controller, controller.plan))
        now = time.time()
        running, ended = RankPoll(0, RankState.RUNNING), RankPoll(0, RankState.ENDED)
        run.amend(holds=[Hold(since=now - 30, bundle={"CPU": 1})])
        assert watcher.watch(GroupPoll(now, (running,))) is None  # 30 s of 60
        run.amend(holds=[Hold(since=now - 200, until=now - 150, bundle={"CPU": 1}),
                         Hold(since=now - 11, bundle={"CPU": 1})])  # fmt: skip
        fault = watcher.watch(GroupPoll(now, (running,)))
        assert fault is not None and fault.kind == FaultKind.MAX_DURATION
        assert fault.reason.startswith("max_duration 1m reached (held its nodes 1m 1s; ")
        assert watcher.watch(GroupPoll(now, (ended,))) is None  # completed: not failed late
    finally:
        run.close()


def test_a_job_without_a_limit_is_never_stopped(nodes_here, tmp_path):
    project = limited("1m")
    project.job.max_duration = None
    controller, _, _ = in_process_controller(tmp_path, project, "jlimit0005")
    run = controller.job_run
    try:
        watcher = TimeLimitWatcher(WatchScope(run, controller, controller.plan))
        run.amend(holds=[Hold(since=time.time() - 10**6, bundle={"CPU": 1})])
        assert watcher.watch(GroupPoll(time.time(), (RankPoll(0, RankState.RUNNING),))) is None
    finally:
        run.close()


# --- end to end, ranks in this process ---------------------------------------------------------

UNTIL_SIGTERM = """
import signal, sys, time
def on_term(signum, frame):
    print(f"SIGTERM at {time.time():.3f}", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print(f"started at {time.time():.3f}", flush=True)
while True:
    time.sleep(0.05)
"""


def limited(max_duration: str | float) -> d.TrainingProject:
    command = f"{shlex.quote(sys.executable)} -u -c {shlex.quote(UNTIL_SIGTERM)}"
    return d.TrainingProject(
        name="limited",
        job=d.TrainingJob(
            image=image(),
            runtime=d.Runtime(start_commands=[command]),
            max_duration=max_duration,
        ),
    )


def stamp(logs: list[str], what: str) -> float:
    """The time the last of a rank's lines `<what> at <epoch>` says."""
    found = [float(m.group(1)) for line in logs if (m := re.search(rf"{what} at ([\d.]+)", line))]
    assert found, f"no line says {what!r}"
    return found[-1]


@pytest.fixture
def nodes_here(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ORCHESTRATOR_NODE_ROOT", str(tmp_path / "nodes"))


def test_at_the_limit_the_commands_get_sigterm_within_a_second_and_the_job_fails(
    nodes_here, tmp_path
):
    controller, _, handle = in_process_controller(
        tmp_path, limited("2s"), "jlimit0001", RetryPolicy(retries=3, retry_on_failure=True)
    )
    assert controller.run() == JobState.FAILED
    status = handle.details()
    (attempt,) = status.attempts  # never retried, whatever the retries
    assert attempt.cause == "max_duration"
    assert attempt.decision == "ended: a job past its max_duration is not retried"
    assert status.failure.cause.startswith("max_duration 2s reached (held its nodes 2")
    (held,) = status.holds
    assert held.until is not None  # released at the end
    late = stamp(handle.logs(), "SIGTERM") - (held.since + 2)
    assert 0 <= late < 1.0, late


class SlowQueue(OpenQueue):
    """A busy cluster's queue: the job waits `waits[n]` seconds before its n-th admission
    (saying why, as the queue does); `preempt_after` seconds into its first admission it is
    preempted for another job, once."""

    def __init__(self, waits: list[float], preempt_after: float | None = None) -> None:
        self.waits = list(waits)
        self.preempt_after = preempt_after
        self.admitted_at: list[float] = []
        self.requeued = threading.Event()

    def wait_admitted(self, timeout_s, on_pending, check_stop) -> bool:
        on_pending("waiting in the queue (position 1): needs 1 node with 1 CPU free")
        until = time.monotonic() + self.waits.pop(0)
        while time.monotonic() < until:
            check_stop()
            time.sleep(0.05)
        self.admitted_at.append(time.time())
        return False

    def preemption(self) -> str | None:
        if self.preempt_after is None or self.requeued.is_set():
            return None
        if time.time() < self.admitted_at[0] + self.preempt_after:
            return None
        return "preempted by job j-other (priority 5 over 0)"

    def requeue(self) -> None:
        self.requeued.set()


def test_a_queued_jobs_wait_is_not_counted(nodes_here, tmp_path):
    """It waits 3 s in the queue, longer than its 2 s limit, and still gets its 2 s."""
    controller, _, handle = in_process_controller(tmp_path, limited(2), "jlimit0002")
    controller.queue = controller.deployment.queue = queue = SlowQueue([3.0])
    assert controller.run() == JobState.FAILED
    status = handle.details()
    (held,) = status.holds
    assert held.since >= queue.admitted_at[0] - 0.5 and held.since - status.history[0].at >= 3
    logs = handle.logs()
    assert stamp(logs, "started") > held.since  # it ran
    late = stamp(logs, "SIGTERM") - (held.since + 2)
    assert 0 <= late < 1.0, late
    assert re.match(r"max_duration 2s reached \(held its nodes 2(\.\d)?s; 3(\.\d)?s queued, not "
                    r"counted\)", status.failure.cause), status.failure.cause  # fmt: skip


def test_the_wait_after_a_queue_preemption_is_not_counted(nodes_here, tmp_path):
    """Preempted by the queue 1 s in (held until its nodes are let go, a moment later), 3 s
    back in the queue, then admitted again: the rest of its 5 s comes in the second admission."""
    controller, _, handle = in_process_controller(tmp_path, limited("5s"), "jlimit0003")
    controller.queue = controller.deployment.queue = SlowQueue([0.0, 3.0], preempt_after=1.0)
    assert controller.run() == JobState.FAILED
    status = handle.details()
    assert [a.cause for a in status.attempts] == ["preempted_by_job", "max_duration"]
    first, second = status.holds
    assert first.until is not None and second.since - first.until >= 3  # the wait
    used = first.until - first.since
    assert used < 4, used
    late = stamp(handle.logs(), "SIGTERM") - (second.since + 5 - used)
    assert 0 <= late < 1.0, (late, used)
    assert status.failure.cause.startswith("max_duration 5s reached (held its nodes 5")
