"""The controller's sequence, with a fake node group: no cluster, no Ray workers.

What a user sees of each path (the states, the failure, the order of the last steps) is
checked against the job's stored status and logs, as `view` and `logs` read them.
"""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import pytest

from orchestrator.agents.messages import CommandsEnded, PreparedNode
from orchestrator.client.jobs import JobHandle
from orchestrator.client.prepare import prepare_job
from orchestrator.client.submit import store_job
from orchestrator.controller.controller import JobController
from orchestrator.controller.failure_policy import Fault, FaultKind
from orchestrator.controller.node_group import NodeGroupError, NodeLostError, RankRun
from orchestrator.lifecycle import JobState
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.records import CheckpointSummary, RetryPolicy
from orchestrator.storage.root import StorageRoot

KEEP_RUNNING = None  # a rank's scripted ending: runs until the group is stopped


class FakeUploaders:
    """Records the final flush and what the stored state was when it came."""

    def __init__(self, nodes: FakeNodes) -> None:
        self.nodes = nodes
        self.actors = [object()] * nodes.size
        self.flushed_with: list = []

    def wait_ready(self) -> None:
        self.nodes.calls.append("uploaders ready")

    def poll(self) -> tuple[list[str], str | None]:
        return [], None

    def writer_ended(self, ending) -> None:
        pass

    flush_timeout_s = 5.0

    def end_attempt(self, endings, timeout, lost) -> list[str]:
        self.nodes.calls.append(f"end attempt (lost {sorted(lost)})")
        return []

    def begin_attempt(self, number: int, check_stop) -> str | None:
        self.nodes.calls.append(f"begin attempt {number}")
        return self.nodes.latest_checkpoint

    def flush(self, endings, timeout=None):
        self.flushed_with = endings
        self.nodes.calls.append(f"flush (stored state {self.nodes.stored_state()})")
        return ["[checkpoints] nothing left to upload"], CheckpointSummary.of([], {})


class OpenQueue:
    """A cluster's queue with room for every job (the queue's own tests use the real one)."""

    def wait_admitted(self, timeout_s, on_pending, check_stop) -> bool:
        return False

    def placed(self, node_ids) -> None:
        self.placed_on = node_ids

    def preemption(self) -> None:
        return None

    def requeue(self) -> None:
        raise AssertionError("nothing preempts a job here")

    def release(self) -> None:
        self.released = True


class FakeNodes:
    """A NodeGroup whose ranks end as scripted, attempt by attempt; it notes each call."""

    def __init__(self, store: JobStore, job_id: str, size: int) -> None:
        self.store, self.job_id, self.size = store, job_id, size
        self.calls: list[str] = []
        self.runs: list[RankRun] = []
        self.uploaders: FakeUploaders | None = None
        self.cache_affinity = None
        self.endings: list[CommandsEnded | None] = [CommandsEnded(exit_code=0)] * size
        self.later_endings: list[list[CommandsEnded | None]] = []  # attempt 1, 2, ...
        self.lose: dict[int, int] = {}  # attempt -> the rank whose node is lost in it
        self.unplaceable = False
        self.during_prepare = lambda: None
        self.requests: list[list] = []  # each attempt's StartRequests
        self.latest_checkpoint: str | None = None
        self.replacements_lost = 0  # how many replacements die while being prepared

    def stored_state(self) -> str:
        return self.store.status(self.job_id).state.value

    def reserve(self, timeout_s, on_pending, check_stop) -> None:
        self.calls.append("reserve")
        if self.unplaceable:
            on_pending("needs 2 nodes with GPU 8 each; 0 of 1 alive node have that much")
            raise NodeGroupError(f"could not be scheduled within {timeout_s:g} s: no room")

    def placed_nodes(self) -> list[str]:
        return [f"node-{rank}" for rank in range(self.size)]

    def create(self) -> None:
        self.calls.append("create")

    def prepare(self, request, check_stop, ranks=None) -> list[PreparedNode]:
        self.calls.append("prepare" if ranks is None else f"prepare {ranks}")
        if ranks is not None and self.replacements_lost:
            self.replacements_lost -= 1
            raise NodeLostError("preparing the node failed: ActorDiedError: its node died")
        self.during_prepare()
        check_stop()
        return [
            PreparedNode(rank, f"node-{rank}", "10.0.0.1", f"host-{rank}", f"/work/rank-{rank}")
            for rank in (range(self.size) if ranks is None else ranks)
        ]

    def start(self, requests, on_lines) -> None:
        self.calls.append("start")
        attempt = len(self.requests)
        self.requests.append(requests)
        endings = self.later_endings[attempt - 1] if attempt else self.endings
        self.runs = [RankRun(rank) for rank in range(self.size)]
        for run, ending in zip(self.runs, endings, strict=True):
            on_lines([f"[rank {run.rank}] started in {requests[run.rank].cwd}"])
            if attempt in self.lose and run.rank == self.lose[attempt]:
                run.lost = RuntimeError("ActorDiedError: the node died\nnode 10.0.0.1 is gone")
                run.done.set()
            elif ending is not KEEP_RUNNING:
                run.ended = ending
                run.done.set()

    def stop(self, grace_s: float) -> str | None:
        self.calls.append("stop")
        for run in self.runs:
            if not run.done.is_set():
                run.ended = CommandsEnded(exit_code=-15, stopped=True)
                run.done.set()
        return None

    def draining(self) -> dict[int, float]:
        return {}

    def fault_of(self, run: RankRun) -> Fault:
        if run.lost is None:
            return Fault(FaultKind.COMMAND_FAILED, run.failure().cause, run.rank)
        why = f"rank {run.rank}'s node node-{run.rank} was lost"
        return Fault(FaultKind.NODE_LOST, why, run.rank, f"node-{run.rank}")

    def lost_elsewhere(self) -> Fault | None:
        lost = next((r for r in self.runs if r.lost is not None), None)
        return self.fault_of(lost) if lost else None

    def replace(self, ranks, timeout_s, on_pending, check_stop) -> None:
        self.calls.append(f"replace {ranks}")
        on_pending(f"placing rank(s) {ranks} again")

    def write_back_cache(self, leader_node_id, wait_s):
        raise AssertionError("these jobs have no training cache")

    def release(self, keep_checkpoints: bool) -> None:
        self.calls.append(f"release (stored state {self.stored_state()})")


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

    def make(nodes: int = 2, checkpointing: bool = False, retry: RetryPolicy | None = None):
        config = tmp_path / "job" / "config.py"
        config.parent.mkdir(exist_ok=True)
        config.write_text(textwrap.dedent(CONFIG.format(nodes=nodes, checkpointing=checkpointing)))
        (config.parent / "train.py").write_text("print('hi')\n")
        root = StorageRoot(str(tmp_path / "storage"))
        record = store_job(prepare_job(config), root, "jseq00001", ray_address=None, retry=retry)
        store = JobStore(root)
        fake = FakeNodes(store, record.job_id, nodes)
        if checkpointing:
            fake.uploaders = FakeUploaders(fake)
        controller = JobController(store, record.job_id, 5, node_group=lambda r, say: fake,
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


def test_a_stop_while_deploying_records_stopped_and_runs_no_command(job):
    controller, nodes, handle = job()
    nodes.during_prepare = controller.stop_requested.set  # `orchestrator stop` arrives
    assert controller.run() == JobState.STOPPED
    assert "start" not in nodes.calls
    assert nodes.calls[-2:] == ["stop", "release (stored state STOPPED)"]
    assert states(handle)[-1] == "STOPPED" and "DEPLOYING" in states(handle)


def test_a_job_that_cannot_be_placed_says_why_while_pending_then_fails_to_deploy(job):
    controller, nodes, handle = job()
    nodes.unplaceable = True
    assert controller.run() == JobState.DEPLOY_FAILED
    history = handle.details().history
    assert [e.state.value for e in history] == ["CREATED", "PENDING", "DEPLOY_FAILED"]
    assert history[1].reason.startswith("needs 2 nodes with GPU 8 each")
    assert handle.details().failure.cause == "could not be scheduled within 5 s: no room"
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
