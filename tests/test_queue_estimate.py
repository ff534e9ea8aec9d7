"""Each waiting job's estimated start (`scheduler/estimate.py`), as `orchestrator queue` and
`view` show it: the policy simulated forward over the running jobs' limits and their projects'
runs, and said plainly when it cannot be estimated. No Ray: the policy on hand-made snapshots,
a replayed trace of 200 jobs (`queue_trace.py`), and a `RootQueue` on a fake cluster writing
the view the CLI reads."""

from __future__ import annotations

import datetime as dt
import json
import statistics
import threading
import time

import pytest
from queue_sim import gpus
from queue_trace import errors, replay
from test_cli_checkpoints import make_record
from test_queue_cli import invoke
from test_queue_manager import FakeCluster

from orchestrator.cli.cmd_queue import start_text
from orchestrator.lifecycle import JobState
from orchestrator.scheduler.entries import entry_for
from orchestrator.scheduler.estimate import Estimate, RunTime, estimate_starts
from orchestrator.scheduler.model import (
    ClusterSnapshot,
    Decision,
    Node,
    QueuedJob,
    RunningJob,
    Waiting,
)
from orchestrator.scheduler.policy import SchedulingPolicy
from orchestrator.scheduler.queue_view_writer import INLINE_JOBS, QueueViewWriter
from orchestrator.scheduler.resources import Resources
from orchestrator.scheduler.root_queue import RootQueue
from orchestrator.scheduler.run_history import RunHistory, held_for
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.queue_store import QueueEntry, QueueStore
from orchestrator.storage.records import Hold, JobStatus, StatusEvent
from orchestrator.storage.root import StorageRoot

H100 = Resources.of(H100=8, CPU=32)
NO_HOLD = SchedulingPolicy(hold_after_s=1e9)  # priority and shares alone order the queue


def nodes(*free: Resources) -> list[Node]:
    return [Node(f"n{i}", H100, room) for i, room in enumerate(free)]


def running(job_id: str, team: str | None, node: str, started_at: float = 0.0) -> RunningJob:
    return RunningJob(job_id, team, 0, started_at, gpus(8), (node,))


def queued(job_id: str, team: str | None, pushed_at: float, priority: int = 0) -> QueuedJob:
    return QueuedJob(job_id, team, priority, pushed_at, gpus(8))


def limit(seconds: float) -> RunTime:
    return RunTime(limit=seconds)


# -- the estimator on its own --------------------------------------------------------------------


def test_a_job_behind_a_running_job_with_a_limit_starts_when_that_job_ends():
    snap = ClusterSnapshot([queued("w1", None, 50.0), queued("w2", None, 60.0)],
                           [running("r1", None, "n0")], nodes(Resources()), now=100.0)  # fmt: skip
    found = estimate_starts(snap, SchedulingPolicy(), {"r1": limit(1000), "w1": limit(500)})
    assert found["w1"] == Estimate(1000.0, "after r1 ends (its max_duration 16m 40s), in the "
                                           "queue's order")  # fmt: skip
    # w2 waits on w1 in turn, which runs up to its own limit from its estimated start
    assert found["w2"].start == pytest.approx(1500.0)
    assert "after w1 ends" in found["w2"].how


def test_behind_a_job_with_no_limit_and_no_history_it_says_it_cannot_estimate_and_why():
    waiting = [queued("w1", None, 50.0), queued("w2", None, 60.0)]
    snap = ClusterSnapshot(waiting, [running("jabc", None, "n0")], nodes(Resources()), now=100.0)
    found = estimate_starts(snap, SchedulingPolicy(), {})
    why = "cannot estimate: running job jabc has no time limit and its project no history"
    assert found == {"w1": Estimate(None, why), "w2": Estimate(None, why)}

    # The running job is known, but the one ahead of w2 is not: w1 is estimated, w2 is not.
    found = estimate_starts(snap, SchedulingPolicy(), {"jabc": limit(400)})
    assert found["w1"].start == 400.0
    assert found["w2"] == Estimate(None, "cannot estimate: job w1, which starts before it, has "
                                         "no time limit and its project no history")  # fmt: skip


def test_quotas_and_priorities_order_the_estimates_as_they_order_the_queue():
    """Team a at its quota of 8 GPUs waits for its own job; its higher-priority job, pushed
    later, is estimated first; team b's job takes the node a's would borrow."""
    quotas = {"a": {"GPU:H100": 8.0}, "b": {"GPU:H100": 8.0}}
    snap = ClusterSnapshot(
        [queued("a-low", "a", 10.0), queued("a-high", "a", 50.0, priority=5),
         queued("b-wait", "b", 90.0)],
        [running("ra", "a", "n0"), running("rb", "b", "n1")],
        nodes(Resources(), Resources()), quotas, now=100.0,
    )  # fmt: skip
    runs = {"ra": limit(1000), "rb": limit(1000), "a-high": limit(500), "a-low": limit(500),
            "b-wait": limit(2000)}  # fmt: skip
    found = estimate_starts(snap, NO_HOLD, runs)
    assert found["a-high"].start == 1000.0  # priority 5 first, though pushed 40 s later
    assert found["b-wait"].start == 1000.0  # within b's quota: it takes n1
    assert found["a-low"].start == pytest.approx(1500.0)  # not borrowing n1: after a-high
    assert "after a-high ends" in found["a-low"].how


def test_a_job_that_never_fits_is_never_estimated_as_starting():
    big = QueuedJob("huge", None, 0, 10.0, gpus(16))  # 16 GPUs on one node: no node has them
    # 4 GPUs of the node are held by work the queue does not run: a full-node job never fits.
    foreign = ClusterSnapshot([big, queued("full", None, 20.0)], [],
                              nodes(Resources.of(H100=4, CPU=16)), now=100.0)  # fmt: skip
    found = estimate_starts(foreign, SchedulingPolicy(), {})
    assert "huge" not in found  # impossible: the view says so, not an estimate
    assert found["full"].start is None
    assert "does not fit even once every job the queue runs has ended" in found["full"].how


def test_a_job_past_its_expected_end_is_assumed_to_end_soon():
    snap = ClusterSnapshot([queued("w1", None, 50.0)], [running("r1", None, "n0")],
                           nodes(Resources()), now=1200.0)  # fmt: skip
    found = estimate_starts(snap, SchedulingPolicy(), {"r1": limit(1000)})
    assert found["w1"].start == pytest.approx(1300.0)  # now + a tenth of its run
    assert "past its max_duration 16m 40s: assumed to end soon" in found["w1"].how


def test_a_running_jobs_history_counts_only_runs_longer_than_it_has_run():
    runs = RunTime(runs=(600.0, 1200.0, 1800.0, 2400.0, 3000.0))
    assert runs.after(0.0) == (1800.0, "its project's typical run 30m 0s")
    assert runs.after(1000.0) == (
        2400.0,
        "its project's runs longer than 16m 40s: typically 40m 0s",
    )
    assert RunTime(limit=2000.0, runs=runs.runs).after(1000.0) == (
        2000.0,
        "its max_duration 33m 20s",
    )
    assert runs.after(5000.0) is None  # longer than any: the caller assumes it ends soon


def test_a_preempting_job_is_estimated_once_its_victim_has_left():
    quotas = {"a": {"GPU:H100": 8.0}, "b": {"GPU:H100": 8.0}}
    snap = ClusterSnapshot([queued("a1", "a", 90.0)],
                           [running("rb1", "b", "n0"), running("rb2", "b", "n1", started_at=5.0)],
                           nodes(Resources(), Resources()), quotas, now=100.0)  # fmt: skip
    found = estimate_starts(snap, SchedulingPolicy(), {"rb1": limit(5000), "rb2": limit(5000)})
    assert found["a1"] == Estimate(160.0, "once rb2, preempted, has left (its grace 60 s)")


def test_a_long_queue_stops_at_its_caps_and_says_so():
    jobs = [queued(f"w{i}", None, float(i)) for i in range(5)]
    snap = ClusterSnapshot(jobs, [running("r", None, "n0")], nodes(Resources()), now=100.0)
    runs = {j.job_id: limit(100) for j in jobs} | {"r": limit(200)}
    found = estimate_starts(snap, SchedulingPolicy(), runs, max_steps=3)
    assert [found[f"w{i}"].start for i in range(3)] == [200.0, 300.0, None]
    assert found["w4"].how == (
        "cannot estimate: the simulation reached its limit of 3 job ends before this job's start"
    )
    ticks = iter(range(100))
    found = estimate_starts(snap, SchedulingPolicy(), runs, budget_s=2.5,
                            clock=lambda: float(next(ticks)))  # fmt: skip
    assert found["w0"].start == 200.0 and found["w1"].start == 300.0
    assert found["w2"].how == (
        "cannot estimate: the simulation reached its 2.5 s limit before this job's start"
    )


# -- the replayed trace -----------------------------------------------------------------------


def test_the_estimates_of_a_replayed_200_job_trace_are_within_25_percent_in_the_median():
    """Four traces of 200 jobs of four projects (two teams with quotas, priorities,
    preemptions of borrowers, a tenth failing early, limits), each estimate taken at a push from
    what was known then, against when the job actually started."""
    per_job, cannot, estimates = [], 0, 0
    for seed in range(4):
        trace = replay(seed)
        by_job, unknown = errors(trace)
        per_job += [statistics.median(e) for e in by_job.values()]
        cannot, estimates = cannot + unknown, estimates + len(trace.estimates)
    figure = statistics.median(per_job)
    print(
        f"median relative error over {len(per_job)} jobs: {figure:.3f} ({estimates} "
        f"estimates, {cannot} could not be made)"
    )
    assert len(per_job) > 400  # most jobs waited at some push
    assert figure <= 0.25
    assert cannot <= estimates * 0.1


# -- history, entries, the service's view and the CLI ------------------------------------------


def test_a_finished_jobs_run_is_what_it_held_and_jobs_that_held_nothing_do_not_count():
    def status(state: JobState, *events: tuple[JobState, float], holds=()) -> JobStatus:
        history = [StatusEvent(state=s, at=at) for s, at in events]
        return JobStatus(job_id="j", state=state, history=history, holds=list(holds))

    held = [Hold(since=100.0, until=400.0, bundle={}), Hold(since=500.0, until=None, bundle={})]
    done = status(JobState.COMPLETED, (JobState.RUNNING, 120.0), (JobState.COMPLETED, 700.0),
                  holds=held)  # fmt: skip
    assert held_for(done) == (700.0, 300.0 + 200.0)  # an open hold ends with the job
    old = status(JobState.FAILED, (JobState.RUNNING, 100.0), (JobState.FAILED, 160.0))
    assert held_for(old) == (160.0, 60.0)  # written before holds: its RUNNING span
    assert held_for(status(JobState.RUNNING, (JobState.RUNNING, 100.0))) is None
    assert held_for(status(JobState.DEPLOY_FAILED, (JobState.DEPLOY_FAILED, 9.0))) is None
    assert held_for(status(JobState.STOPPED, (JobState.STOPPED, 9.0))) is None  # while queued


def test_run_history_reads_each_finished_job_once_and_new_ones_at_each_refresh(tmp_path):
    jobs = JobStore(StorageRoot(tmp_path))
    for i, seconds in enumerate((600.0, 1200.0, 1800.0)):
        jobs.create(make_record(f"j{i}", "llm", float(i)), _finished(f"j{i}", seconds))
    history = RunHistory(jobs)
    history.refresh()
    entry = QueueEntry(job_id="q", pushed_at=1.0, bundle={}, project="llm")
    assert history.run_times([entry])["q"] == RunTime(None, (600.0, 1200.0, 1800.0))
    orphan = QueueEntry(job_id="q2", pushed_at=1.0, bundle={}, project="other")
    assert history.run_times([orphan])["q2"] is None

    read = []
    jobs.status = lambda job_id, status=jobs.status: read.append(job_id) or status(job_id)
    jobs.create(make_record("j3", "llm", 3.0), JobStatus.new("j3"))  # not finished yet
    history.refresh()
    assert read == ["j3"]  # the finished ones are not read again
    history.refresh()
    assert read == ["j3", "j3"]


def test_a_jobs_queue_entry_carries_its_project_and_max_duration():
    record = make_record("j1", "llm", 1.0)
    assert entry_for(record).project == record.project_key
    assert entry_for(record).max_duration_s is None
    limited = record.model_copy(update={"spec": record.spec.model_copy(update={
        "job": record.spec.job.model_copy(update={"max_duration": "2h"})})})  # fmt: skip
    assert entry_for(limited).max_duration_s == 7200.0


def test_start_text_reads_as_a_time_or_says_why_not():
    now = dt.datetime(2026, 12, 2, 13, 40).timestamp()
    assert start_text(now + 25 * 60, "after ...", now) == "~14:05 (in 25 min)"
    assert start_text(now + 26 * 3600, "after ...", now) == "~2026-12-03 15:40 (in 1 d 2 h)"
    assert start_text(now + 30, "after ...", now) == "~13:40 (in under a minute)"
    assert start_text(None, "cannot estimate: running job jabc has no time limit", now) == (
        "unknown: running job jabc has no time limit"
    )
    assert start_text(None, "", now) == "unknown: not estimated yet"


def test_the_view_a_root_queue_writes_carries_estimates_and_queue_and_view_show_them(tmp_path):
    cluster = FakeCluster()
    root = StorageRoot(tmp_path)
    queue = RootQueue(str(tmp_path), SchedulingPolicy(), cluster)
    queue.enqueue(QueueEntry(job_id="a", pushed_at=time.time(), bundle={"CPU": 2.0},
                             max_duration_s=1800.0))  # fmt: skip
    jobs = JobStore(root)
    jobs.create(make_record("b", "llm", time.time()), JobStatus.new("b").moved_to(JobState.PENDING))
    queue.enqueue(QueueEntry(job_id="b", pushed_at=time.time(), bundle={"CPU": 2.0}))
    store = QueueStore(root)
    deadline = time.monotonic() + 10  # the estimate is worked out on a thread of its own
    while (waiting := _waiting(store, "b")) is None or waiting.estimated_start is None:
        assert time.monotonic() < deadline, f"no estimate in the view: {waiting}"
        queue.view()  # decides and writes the view, as a tick does
        time.sleep(0.05)
    admitted_at = store.entry("a").admitted_at
    assert waiting.estimated_start == pytest.approx(admitted_at + 1800.0)
    assert waiting.estimate == "after a ends (its max_duration 30m 0s), in the queue's order"

    out = invoke("queue", "--storage-root", root.url)
    assert "estimated start" in out and "(in 30 min)" in out
    rows = json.loads(invoke("queue", "--storage-root", root.url, "-o", "json"))
    assert rows[0]["estimated_start"] == pytest.approx(admitted_at + 1800.0)
    assert rows[0]["estimate"] == waiting.estimate
    out = invoke("view", "--job-id", "b", "--storage-root", root.url)
    assert "estimated start" in out and "(in 30 min)" in out

    # a ends; c runs with no limit and its project has no history: b cannot be estimated.
    queue.release("a")
    queue.enqueue(QueueEntry(job_id="c", pushed_at=time.time(), bundle={"CPU": 2.0}))
    assert queue.admission("b").state == "admitted"  # b took the node, c waits behind it
    queue.enqueue(QueueEntry(job_id="d", pushed_at=time.time(), bundle={"CPU": 2.0}))
    deadline = time.monotonic() + 10
    while (waiting := _waiting(store, "d")) is None or not waiting.estimate.startswith("cannot"):
        assert time.monotonic() < deadline, f"no word on d's estimate: {waiting}"
        queue.view()
        time.sleep(0.1)
    out = invoke("queue", "--storage-root", root.url)
    assert "unknown: running job b has no time limit and its project no history" in out


def test_the_view_writer_estimates_a_long_queue_off_the_lock_and_survives_a_failing_one(tmp_path):
    store = QueueStore(StorageRoot(tmp_path))
    jobs = [queued(f"w{i}", None, float(i)) for i in range(INLINE_JOBS + 1)]
    decision = Decision(waiting=[Waiting(j.job_id, i + 1, "behind r") for i, j in enumerate(jobs)])
    snap = ClusterSnapshot(jobs, [running("r", None, "n0")], nodes(Resources()), now=100.0)
    asked = threading.Event()

    def estimator(snap: ClusterSnapshot):
        def work():
            asked.wait(10)  # holds the estimate until the view without it was written
            return estimate_starts(snap, SchedulingPolicy(), {"r": limit(200)})

        return work

    writer = QueueViewWriter(store, estimator)
    writer.show(decision, snap.nodes, 100.0, snap)  # not waited on: the view says "not yet"
    assert {(w.estimated_start, w.estimate) for w in store.view().waiting} == {(None, "")}
    asked.set()
    writer.estimating.join(10)
    writer.show(decision, snap.nodes, 101.0, snap)
    assert store.view().waiting[0].estimated_start == 200.0

    def failing(snap: ClusterSnapshot):
        raise RuntimeError("a bug in the estimate")

    writer = QueueViewWriter(store, failing)
    assert writer.show(decision, snap.nodes, 102.0, snap)  # the view is written all the same
    assert store.view().waiting[0].estimate.startswith("cannot estimate: the estimate failed")


def _waiting(store: QueueStore, job_id: str):
    view = store.view()
    return next((w for w in view.waiting if w.job_id == job_id), None) if view else None


def _finished(job_id: str, held_s: float) -> JobStatus:
    events = [StatusEvent(state=JobState.CREATED, at=0.0), StatusEvent(state=JobState.RUNNING,
              at=10.0), StatusEvent(state=JobState.COMPLETED, at=10.0 + held_s)]  # fmt: skip
    return JobStatus(job_id=job_id, state=JobState.COMPLETED, history=events,
                     holds=[Hold(since=10.0, until=10.0 + held_s, bundle={})])  # fmt: skip
