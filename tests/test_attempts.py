"""A job's attempts driven against a fake port: no controller, no cluster, no Ray.

`Attempts` decides; the port (the controller in a job) acts on the nodes and the queue and ends
the job. What the attempts asked of it, and what the job's status says, are checked here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from controller_fakes import KEEP_RUNNING, FakeRanks, fake_nodes

from orchestrator import definitions as d
from orchestrator.agents.messages import CommandsEnded, PreparedNode
from orchestrator.client.prepare import prepare_job
from orchestrator.client.submit import store_job
from orchestrator.controller.attempts import Attempts, Unrecoverable
from orchestrator.controller.job_nodes import JobNodes
from orchestrator.controller.job_run import JobRun
from orchestrator.controller.plan import GroupPlan, SpecPlan
from orchestrator.controller.rank_group import GroupError
from orchestrator.lifecycle import JobState
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.records import Failure, NodeInfo, RetryPolicy
from orchestrator.storage.root import StorageRoot


class FakePort:
    """The controller's side of the attempts, noted call by call."""

    def __init__(self, job_run: JobRun, nodes: JobNodes) -> None:
        self.job_run = job_run
        self._nodes = nodes
        self.calls: list[str] = []
        self.preempt: str | None = None  # what the queue says once, when the job must give way
        self.after_requeue: JobNodes | None = None
        self.room = True  # whether a lost rank can be placed again

    @property
    def nodes(self) -> JobNodes:
        return self._nodes

    def preemption(self) -> str | None:
        why, self.preempt = self.preempt, None
        return why

    def replace(self, ranks: list[int]) -> None:
        self.calls.append(f"replace {ranks}")
        if not self.room:
            raise GroupError("could not be scheduled within 5 s: no room")

    def prepare(self, ranks: list[int]) -> list[PreparedNode]:
        self.calls.append(f"prepare {ranks}")
        return [PreparedNode(r, f"spare-{r}", "10.0.0.9", f"spare-{r}", f"/w/{r}") for r in ranks]

    def requeue(self, reason: str, keep_checkpoints: bool, plan: GroupPlan) -> None:
        self.calls.append(f"requeue ({reason}; keep checkpoints: {keep_checkpoints})")
        assert self.after_requeue is not None
        self._nodes = self.after_requeue  # placed and prepared anew, as the controller does
        self.job_run.transition(JobState.PENDING, f"{reason}; back in the queue")
        self.job_run.transition(JobState.DEPLOYING, "preparing 2 node(s)")

    def complete(self) -> None:
        self.calls.append("complete")

    def fail(self, state: JobState, failure: Failure) -> None:
        self.calls.append(f"{state.value}: {failure.cause}")


def nodes_of(job_run: JobRun, store: JobStore) -> tuple[JobNodes, FakeRanks]:
    """Fake nodes for the run's job, its ranks prepared on `node-0` and `node-1`."""
    nodes, ranks, _ = fake_nodes(store, job_run.record, 2)
    ranks.node_ids = {node.rank: node.node_id for node in job_run.status.nodes}
    return nodes, ranks


def attempts(job_run: JobRun, port: FakePort) -> Attempts:
    plans = SpecPlan(job_run.record)
    return Attempts(job_run, port, plans.plan(0), plans)


@pytest.fixture
def run(tmp_path: Path, monkeypatch):
    """A stored two-node job's run, as a controller would have it once its nodes are prepared."""
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    runs: list[JobRun] = []

    def make(retry: RetryPolicy | None = None) -> tuple[JobRun, JobStore]:
        (tmp_path / "code").mkdir(exist_ok=True)
        (tmp_path / "code" / "train.py").write_text("print('hi')\n")
        project = d.TrainingProject(
            name="attempts",
            job=d.TrainingJob(
                image=d.Image(base_image="python:3.11"), compute=d.Compute(node_count=2),
                runtime=d.Runtime(start_commands=["python train.py"]),
            ),
        )  # fmt: skip
        store = JobStore(StorageRoot(str(tmp_path / "storage")))
        prepared = prepare_job(project, source_dir=tmp_path / "code")
        record = store_job(prepared, store.root, "jatt00001", None, retry=retry)
        job_run = JobRun(store, record.job_id)
        job_run.transition(JobState.DEPLOYING, "preparing 2 node(s)")
        job_run.amend(nodes=[NodeInfo(rank=r, node_id=f"node-{r}", ip="10.0.0.1",
                                      hostname=f"host-{r}", working_dir=f"/w/{r}")
                             for r in (0, 1)])  # fmt: skip
        runs.append(job_run)
        return job_run, store

    yield make
    for job_run in runs:
        job_run.close()


def test_a_job_the_queue_preempts_goes_back_in_line_and_starts_again_on_new_nodes(run):
    """Giving way is not a fault: no retry is spent, and the next attempt runs on the group the
    port placed anew."""
    job_run, store = run()
    (first_nodes, first), (second_nodes, second) = (
        nodes_of(job_run, store),
        nodes_of(job_run, store),
    )
    first.endings = [KEEP_RUNNING, KEEP_RUNNING]
    port = FakePort(job_run, first_nodes)
    port.preempt, port.after_requeue = "preempted by j2: borrowed capacity", second_nodes
    attempts(job_run, port).run()
    assert port.calls == [
        "requeue (preempted by j2: borrowed capacity; keep checkpoints: False)",
        "complete",
    ]
    assert first.calls == ["start", "stop"] and second.calls == ["start"]
    assert [r.env["BT_RETRY_COUNT"] for r in second.requests[0]] == ["1", "1"]
    gave_way, ran = job_run.status.attempts
    assert gave_way.cause == "preempted_by_job"
    assert gave_way.decision == "gave way: back in the queue, to resume later"
    assert (ran.number, ran.decision) == (1, "completed")


def test_a_fault_the_policy_does_not_retry_ends_the_job_through_the_port(run):
    job_run, store = run()
    job_nodes, nodes = nodes_of(job_run, store)
    nodes.endings = [KEEP_RUNNING, CommandsEnded(exit_code=3, command="python train.py")]
    port = FakePort(job_run, job_nodes)
    attempts(job_run, port).run()
    assert port.calls == ["FAILED: rank 1: command exited with code 3: python train.py"]
    assert job_run.status.attempts[0].decision.startswith("ended: ")


def test_a_lost_rank_is_replaced_and_prepared_alone_then_every_rank_runs_again(run):
    job_run, store = run(RetryPolicy(retries=1))
    job_nodes, nodes = nodes_of(job_run, store)
    nodes.endings = [KEEP_RUNNING, KEEP_RUNNING]
    nodes.lose = {0: 1}
    nodes.later_endings = [[CommandsEnded(exit_code=0)] * 2]
    port = FakePort(job_run, job_nodes)
    attempts(job_run, port).run()
    assert port.calls == ["replace [1]", "prepare [1]", "complete"]
    placed = job_run.status.nodes
    assert [(n.node_id, n.prepared_for) for n in placed] == [("node-0", 0), ("spare-1", 1)]


def test_no_room_for_a_replacement_is_unrecoverable(run):
    job_run, store = run(RetryPolicy(retries=1))
    job_nodes, nodes = nodes_of(job_run, store)
    nodes.endings = [KEEP_RUNNING, KEEP_RUNNING]
    nodes.lose = {0: 0}
    port = FakePort(job_run, job_nodes)
    port.room = False
    with pytest.raises(Unrecoverable, match="no room"):
        attempts(job_run, port).run()
    assert port.calls == ["replace [0]"]
    assert job_run.status.state == JobState.PENDING  # the controller records how it ends


class GrowingPlan(SpecPlan):
    """A policy that asks for one rank more after the first attempt."""

    def plan(self, attempt: int, last: GroupPlan | None = None) -> GroupPlan:
        plan = super().plan(attempt, last)
        if attempt == 0:
            return plan
        return dataclasses.replace(plan, ranks=(*plan.ranks, plan.ranks[0]))


def test_a_plan_of_another_size_on_the_same_group_is_refused_saying_so(run):
    job_run, store = run(RetryPolicy(retries=1))
    job_nodes, nodes = nodes_of(job_run, store)
    nodes.endings = [KEEP_RUNNING, KEEP_RUNNING]
    nodes.lose = {0: 1}
    port = FakePort(job_run, job_nodes)
    plans = GrowingPlan(job_run.record)
    with pytest.raises(Unrecoverable, match="resizing a placed group is not built yet"):
        Attempts(job_run, port, plans.plan(0), plans).run()
    assert port.calls == []  # refused before anything was replaced
