"""The controller's sequence on a fake cluster with scripted ranks (tests/controller_fakes.py):
no Ray.

What a user sees of each path (the states, the failure, the order of the last steps) is
checked against the job's stored status and logs, as `view` and `logs` read them.
"""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import pytest
from controller_fakes import KEEP_RUNNING, OpenQueue, fake_nodes

from orchestrator.agents.messages import CommandsEnded, StoredCheckpoint
from orchestrator.client.jobs import JobHandle
from orchestrator.client.prepare import prepare_job
from orchestrator.client.submit import store_job
from orchestrator.controller.controller import JobController
from orchestrator.lifecycle import JobState
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.prices import Prices, write_prices
from orchestrator.storage.records import RetryPolicy
from orchestrator.storage.root import StorageRoot

CONFIG = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="sequence",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(node_count={nodes}),
        runtime=d.Runtime(
            start_commands=["python train.py"],
            checkpointing_config=d.CheckpointingConfig(enabled={checkpointing}),
        ),
    ),
)
"""


@pytest.fixture
def job(tmp_path: Path, monkeypatch):
    """A stored job (record, status, archive) in a local storage root, and its controller's
    fake nodes."""
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))

    def make(
        nodes: int = 2, checkpointing: bool = False, retry: RetryPolicy | None = None,
        scheduling_timeout_s: float = 5,
    ):  # fmt: skip
        config = tmp_path / "job" / "config.py"
        config.parent.mkdir(exist_ok=True)
        config.write_text(textwrap.dedent(CONFIG.format(nodes=nodes, checkpointing=checkpointing)))
        (config.parent / "train.py").write_text("print('hi')\n")
        root = StorageRoot(str(tmp_path / "storage"))
        record = store_job(prepare_job(config), root, "jseq00001", ray_address=None, retry=retry)
        store = JobStore(root)
        job_nodes, fake, _ = fake_nodes(store, record, nodes, checkpointing)
        controller = JobController(store, record.job_id, scheduling_timeout_s,
                                   nodes=lambda r, say: job_nodes,
                                   queue=lambda r, say: OpenQueue())  # fmt: skip
        return controller, fake, JobHandle(store, record)

    return make


def states(handle: JobHandle) -> list[str]:
    return [event.state.value for event in handle.details().history]


def test_a_job_whose_ranks_all_exit_0_completes_and_releases_its_nodes(job):
    controller, nodes, handle = job()
    assert controller.run() == JobState.COMPLETED
    assert states(handle) == ["CREATED", "DEPLOYING", "RUNNING", "COMPLETED"]
    assert nodes.calls == ["reserve", "create", "prepare", "start",
                           "release (stored state COMPLETED)"]  # fmt: skip
    assert [n.hostname for n in handle.details().nodes] == ["host-0", "host-1"]
    logs = handle.logs()
    assert "[rank 1] started in /work/rank-1" in logs  # each rank's lines reach the job's logs


def test_one_rank_failing_stops_the_others_and_the_job_fails_with_its_exit(job):
    controller, nodes, handle = job()
    nodes.endings = [
        KEEP_RUNNING,
        CommandsEnded(exit_code=3, command="python train.py", last_lines=["oom at step 7"]),
    ]
    assert controller.run() == JobState.FAILED
    failure = handle.details().failure
    assert failure.node_rank == 1 and failure.exit_code == 3
    assert failure.command == "python train.py" and failure.last_lines == ["oom at step 7"]
    assert failure.cause == "rank 1: command exited with code 3: python train.py"
    assert nodes.calls[-2:] == ["stop", "release (stored state FAILED)"]
    assert nodes.runs[0].ended.stopped  # the rank still running was stopped


def test_a_rank_lost_with_its_node_fails_the_job_naming_it(job):
    controller, nodes, handle = job()
    nodes.endings = [KEEP_RUNNING, KEEP_RUNNING]
    original_start = nodes.start

    def start_then_lose(requests, on_lines):
        original_start(requests, on_lines)
        nodes.cluster.kill("node-0")
        nodes.runs[0].lost = RuntimeError("ActorDiedError: the node died\nnode 10.0.0.1 is gone")
        nodes.runs[0].done.set()

    nodes.start = start_then_lose
    assert controller.run() == JobState.FAILED
    failure = handle.details().failure
    assert failure.node_rank == 0
    assert failure.cause == (
        "rank 0 was lost: RuntimeError: node 10.0.0.1 is gone (the job allows no retries "
        "(--retries, ORCHESTRATOR_MAX_RETRIES))"
    )
    assert handle.details().attempts[0].cause == "node_lost"
    assert handle.details().attempts[0].reason == "rank 0's node node-0 was lost"


def test_a_rank_whose_agent_dies_on_a_live_node_is_an_agent_lost(job):
    """The fault judge looks at the node: alive, its raylet answering, so the agent alone died."""
    controller, nodes, handle = job()
    nodes.endings = [KEEP_RUNNING, KEEP_RUNNING]
    original_start = nodes.start

    def start_then_lose_the_agent(requests, on_lines):
        original_start(requests, on_lines)
        nodes.runs[1].lost = RuntimeError("ActorDiedError: the worker died")
        nodes.runs[1].done.set()

    nodes.start = start_then_lose_the_agent
    assert controller.run() == JobState.FAILED
    attempt = handle.details().attempts[0]
    assert attempt.cause == "agent_lost" and attempt.node_id == "node-1"
    assert attempt.reason.startswith("rank 1's node agent died (RuntimeError: ")
    assert attempt.reason.endswith("; its node lives")


def test_a_stop_while_deploying_records_stopped_and_runs_no_command(job):
    controller, nodes, handle = job()
    nodes.during_prepare = controller.stop_requested.set  # `orchestrator stop` arrives
    assert controller.run() == JobState.STOPPED
    assert "start" not in nodes.calls
    assert nodes.calls[-2:] == ["stop", "release (stored state STOPPED)"]
    assert states(handle)[-1] == "STOPPED" and "DEPLOYING" in states(handle)


def test_a_job_that_cannot_be_placed_says_why_while_pending_then_fails_to_deploy(job):
    controller, nodes, handle = job(scheduling_timeout_s=1)
    nodes.groups.placeable = False  # the nodes are big enough, but busy
    assert controller.run() == JobState.DEPLOY_FAILED
    history = handle.details().history
    assert [e.state.value for e in history] == ["CREATED", "PENDING", "DEPLOY_FAILED"]
    busy = "2 of 2 alive nodes have that much in total but their resources are in use by other work"
    assert history[1].reason.startswith("needs 2 nodes with CPU ") and history[1].reason.endswith(
        busy
    )
    assert (
        handle.details().failure.cause == f"could not be scheduled within 1 s: {history[1].reason}"
    )
    assert "create" not in nodes.calls


def test_checkpoints_are_flushed_after_the_stop_and_before_the_final_state(job):
    """The last checkpoints a failing job wrote are uploaded before it is recorded as ended,
    and the nodes (holding them) are released only after that."""
    controller, nodes, handle = job(checkpointing=True)
    nodes.endings = [KEEP_RUNNING, CommandsEnded(exit_code=137, command="python train.py")]
    assert controller.run() == JobState.FAILED
    assert nodes.calls == [
        "reserve", "create", "prepare", "uploaders ready", "start", "stop",
        "flush (stored state RUNNING)", "release (stored state FAILED)",
    ]  # fmt: skip
    endings = {e.rank: e for e in nodes.uploaders.flushed_with}
    assert not endings[1].clean and endings[1].how == "rank 1's command exited with code 137"
    assert not endings[0].clean and endings[0].how == "the job was stopped (exit code -15)"
    assert handle.details().checkpoints is not None  # the flush's summary is recorded


def test_the_controller_waits_for_a_rank_that_is_still_running(job):
    """No end is recorded while any rank runs: a rank finishing later decides the outcome."""
    controller, nodes, handle = job()
    nodes.endings = [CommandsEnded(exit_code=0), KEEP_RUNNING]
    outcome: list[JobState] = []
    runner = threading.Thread(target=lambda: outcome.append(controller.run()))
    runner.start()
    deadline = time.monotonic() + 10
    while not nodes.runs and time.monotonic() < deadline:
        runner.join(0.05)
    runner.join(0.5)
    assert runner.is_alive() and handle.details().state == JobState.RUNNING
    nodes.runs[1].ended = CommandsEnded(exit_code=0)
    nodes.runs[1].done.set()
    runner.join(10)
    assert outcome == [JobState.COMPLETED]


# --- retries ----------------------------------------------------------------------------------

FAILING = CommandsEnded(exit_code=1, command="python train.py", last_lines=["diverged"])


def test_a_lost_node_is_replaced_alone_and_the_next_attempt_resumes(job):
    """Only the lost rank is placed and prepared again; every rank runs again with the next
    BT_RETRY_COUNT; the attempts and the states in between are recorded."""
    controller, nodes, handle = job(checkpointing=True, retry=RetryPolicy(retries=1))
    nodes.endings = [KEEP_RUNNING, KEEP_RUNNING]
    nodes.lose = {0: 1}
    nodes.later_endings = [[CommandsEnded(exit_code=0)] * 2]
    nodes.latest_checkpoint = "checkpoint-200"
    assert controller.run() == JobState.COMPLETED
    calls = nodes.calls
    assert calls[:5] == ["reserve", "create", "prepare", "uploaders ready", "start"]
    # The survivor stops while the lost rank is replaced; its checkpoints are stored after.
    assert sorted(calls[5:8]) == ["prepare [1]", "replace [1]", "stop"]
    assert calls.index("replace [1]") < calls.index("prepare [1]")
    assert calls[8:] == [
        "end attempt (lost [1])", "uploaders ready", "begin attempt 1", "start",
        "flush (stored state RUNNING)", "release (stored state COMPLETED)",
    ]  # fmt: skip
    assert [[r.env["BT_RETRY_COUNT"] for r in attempt] for attempt in nodes.requests] == [
        ["0", "0"], ["1", "1"],
    ]  # fmt: skip
    status = handle.details()
    assert states(handle) == [
        "CREATED", "DEPLOYING", "RUNNING", "PENDING", "DEPLOYING", "RUNNING", "COMPLETED",
    ]  # fmt: skip
    first, second = status.attempts
    assert (first.number, first.cause, first.rank, first.node_id) == (0, "node_lost", 1, "node-1")
    assert first.decision == "retried: retry 1 of 1" and first.ended_at is not None
    assert (second.number, second.resumed_from, second.decision) == (
        1,
        "checkpoint-200",
        "completed",
    )
    assert [n.prepared_for for n in status.nodes] == [0, 1]  # the survivor was not prepared again
    assert "==== attempt 1 (BT_RETRY_COUNT=1) ====" in "\n".join(handle.logs())


def test_the_nodes_held_are_booked_from_admission_to_release_at_the_prices_then(job):
    """One Hold per admission, at the cluster's prices when admitted; closed once the nodes
    are let go of (after the final state); an attempt a fault ended records when its newest
    checkpoint was stored, and its lost time runs from there."""
    controller, nodes, handle = job(checkpointing=True, retry=RetryPolicy(retries=1))
    root = handle._store.root
    write_prices(root, Prices(gpu={"H100": 2.5}, cpu_hour=0.1))
    nodes.endings = [KEEP_RUNNING, KEEP_RUNNING]
    nodes.lose = {0: 1}
    nodes.later_endings = [[CommandsEnded(exit_code=0)] * 2]
    nodes.latest_checkpoint = "checkpoint-1"  # what attempt 1 resumes from
    original_start = nodes.start

    def start_then_store(requests, on_lines):  # rank 0 stores a checkpoint as attempt 0 runs
        original_start(requests, on_lines)
        if not nodes.uploaders.last_stored:
            nodes.uploaders.last_stored = {0: StoredCheckpoint("checkpoint-1", time.time())}

    nodes.start = start_then_store
    assert controller.run() == JobState.COMPLETED
    write_prices(root, Prices(cpu_hour=9.0))  # a later change rewrites nothing
    status = handle.details()
    (hold,) = status.holds
    assert hold.since <= status.history[1].at and hold.until >= status.history[-1].at
    assert hold.prices == {"GPU:H100": 2.5, "CPU": 0.1} and hold.nodes == 2
    assert hold.bundle["CPU"] == 1.0
    first, second = status.attempts
    saved_at = nodes.uploaders.last_stored[0].at
    assert first.checkpoint_at == saved_at and second.checkpoint_at is None  # none since
    assert second.resumed_from == "checkpoint-1"
    books = handle.usage()
    assert books.usage.held_s == pytest.approx(hold.until - hold.since)
    assert books.usage.cost == pytest.approx(2 * 1.0 * 0.1 * books.usage.held_s / 3600)
    assert books.lost.held_s == pytest.approx(first.ended_at - saved_at)


def test_a_failing_command_is_not_retried_without_retry_on_failure(job):
    controller, nodes, handle = job(retry=RetryPolicy(retries=3))
    nodes.endings = [FAILING, KEEP_RUNNING]
    assert controller.run() == JobState.FAILED
    assert nodes.calls.count("start") == 1
    assert handle.details().failure.cause == (
        "rank 0: command exited with code 1: python train.py (a failed command is not retried "
        "without retry_on_failure)"
    )


def test_retries_on_failure_run_three_attempts_then_fail_listing_every_cause(job):
    controller, nodes, handle = job(
        retry=RetryPolicy(retries=2, retry_on_failure=True, delay_s=0.05)
    )
    nodes.endings = [FAILING, KEEP_RUNNING]
    nodes.lose = {1: 0}
    nodes.later_endings = [[KEEP_RUNNING, KEEP_RUNNING], [KEEP_RUNNING, FAILING]]
    assert controller.run() == JobState.FAILED
    assert nodes.calls.count("start") == 3
    failure = handle.details().failure
    assert failure.attempts == [
        "attempt 0: rank 0: command exited with code 1: python train.py",
        "attempt 1: rank 0's node node-0 was lost",
        "attempt 2: rank 1: command exited with code 1: python train.py",
    ]
    assert failure.cause.startswith(
        "rank 1: command exited with code 1: python train.py (retries spent (2 of 2)); 3 attempts"
    )
    assert failure.node_rank == 1 and failure.last_lines == ["diverged"]
    assert [a.cause for a in handle.details().attempts] == [
        "command_failed", "node_lost", "command_failed",
    ]  # fmt: skip


def test_a_stop_during_the_wait_between_attempts_is_stopped(job):
    controller, nodes, handle = job(retry=RetryPolicy(retries=1, retry_on_failure=True, delay_s=60))
    nodes.endings = [FAILING, FAILING]
    outcome: list[JobState] = []
    runner = threading.Thread(target=lambda: outcome.append(controller.run()))
    runner.start()
    deadline = time.monotonic() + 10
    while "retrying in 60 s" not in "\n".join(handle.logs()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert handle.status() == JobState.PENDING
    controller.stop_requested.set()
    runner.join(10)
    assert outcome == [JobState.STOPPED]
    assert nodes.calls.count("start") == 1
    assert states(handle)[-2:] == ["PENDING", "STOPPED"]


def test_a_replacement_lost_while_being_prepared_is_one_more_fault(job):
    """The spare dies too: that attempt ends before its commands run, and the next one goes on
    while retries last."""
    controller, nodes, handle = job(retry=RetryPolicy(retries=2))
    nodes.endings = [KEEP_RUNNING, KEEP_RUNNING]
    nodes.lose = {0: 1}
    nodes.later_endings = [[CommandsEnded(exit_code=0)] * 2]
    nodes.replacements_lost = 1
    assert controller.run() == JobState.COMPLETED
    assert nodes.calls.count("replace [1]") == 2 and nodes.calls.count("start") == 2
    attempts = handle.details().attempts
    assert [(a.number, a.cause) for a in attempts] == [
        (0, "node_lost"),
        (1, "node_lost"),
        (2, None),
    ]
    assert "lost again while being prepared" in attempts[1].reason
    assert [r.env["BT_RETRY_COUNT"] for r in nodes.requests[1]] == ["2", "2"]
    assert states(handle)[2:] == [
        "RUNNING", "PENDING", "DEPLOYING", "PENDING", "DEPLOYING", "RUNNING", "COMPLETED",
    ]  # fmt: skip


def test_a_checkpoint_directory_over_its_volume_fails_the_job_without_a_retry(job):
    """The volume watcher's fault: never retried, whatever `retries` allows; the job's cause is
    the uploader's own words, and the checkpoints are flushed before the end is recorded."""
    controller, nodes, handle = job(checkpointing=True, retry=RetryPolicy(retries=2))
    nodes.endings = [KEEP_RUNNING, KEEP_RUNNING]
    over = (
        "checkpoint directory on rank 1 holds 1.20 GiB, over volume_size_gib=1: delete old "
        "checkpoints or raise volume_size_gib"
    )
    nodes.uploaders.over_volume = over
    assert controller.run() == JobState.FAILED
    assert handle.details().failure.cause == over
    (attempt,) = handle.details().attempts
    assert attempt.cause == "over_volume" and attempt.reason == over
    assert attempt.decision == "ended: a checkpoint directory over volume_size_gib is not retried"
    assert nodes.calls.count("start") == 1
    assert nodes.calls[-3:] == [
        "stop", "flush (stored state RUNNING)", "release (stored state FAILED)",
    ]  # fmt: skip
