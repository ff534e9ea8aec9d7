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
from orchestrator.controller.node_group import NodeGroupError, RankRun
from orchestrator.lifecycle import JobState
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.records import CheckpointSummary
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

    def flush(self, endings, timeout=None):
        self.flushed_with = endings
        self.nodes.calls.append(f"flush (stored state {self.nodes.stored_state()})")
        return ["[checkpoints] nothing left to upload"], CheckpointSummary.of([], {})


class FakeNodes:
    """A NodeGroup whose ranks end as scripted; it notes each call, in order."""

    def __init__(self, store: JobStore, job_id: str, size: int) -> None:
        self.store, self.job_id, self.size = store, job_id, size
        self.calls: list[str] = []
        self.runs: list[RankRun] = []
        self.uploaders: FakeUploaders | None = None
        self.cache_affinity = None
        self.endings: list[CommandsEnded | None] = [CommandsEnded(exit_code=0)] * size
        self.unplaceable = False
        self.during_prepare = lambda: None

    def stored_state(self) -> str:
        return self.store.status(self.job_id).state.value

    def reserve(self, timeout_s, on_pending, check_stop) -> None:
        self.calls.append("reserve")
        if self.unplaceable:
            on_pending("needs 2 nodes with GPU 8 each; 0 of 1 alive node have that much")
            raise NodeGroupError(f"could not be scheduled within {timeout_s:g} s: no room")

    def create(self) -> None:
        self.calls.append("create")

    def prepare(self, request, check_stop) -> list[PreparedNode]:
        self.calls.append("prepare")
        self.during_prepare()
        check_stop()
        return [
            PreparedNode(rank, f"node-{rank}", "10.0.0.1", f"host-{rank}", f"/work/rank-{rank}")
            for rank in range(self.size)
        ]

    def start(self, requests, on_lines) -> None:
        self.calls.append("start")
        self.runs = [RankRun(rank) for rank in range(self.size)]
        for run, ending in zip(self.runs, self.endings, strict=True):
            on_lines([f"[rank {run.rank}] started in {requests[run.rank].cwd}"])
            if ending is not KEEP_RUNNING:
                run.ended = ending
                run.done.set()

    def stop(self, grace_s: float) -> str | None:
        self.calls.append("stop")
        for run in self.runs:
            if not run.done.is_set():
                run.ended = CommandsEnded(exit_code=-15, stopped=True)
                run.done.set()
        return None

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

    def make(nodes: int = 2, checkpointing: bool = False):
        config = tmp_path / "job" / "config.py"
        config.parent.mkdir(exist_ok=True)
        config.write_text(textwrap.dedent(CONFIG.format(nodes=nodes, checkpointing=checkpointing)))
        (config.parent / "train.py").write_text("print('hi')\n")
        root = StorageRoot(str(tmp_path / "storage"))
        record = store_job(prepare_job(config), root, "jseq00001", ray_address=None)
        store = JobStore(root)
        fake = FakeNodes(store, record.job_id, nodes)
        if checkpointing:
            fake.uploaders = FakeUploaders(fake)
        controller = JobController(store, record.job_id, 5, node_group=lambda r, say: fake)
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
    assert failure.cause == "rank 0 was lost: RuntimeError: node 10.0.0.1 is gone"


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
