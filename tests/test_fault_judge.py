"""What a fault was, judged on a fake cluster (no Ray): a failed program, a lost agent on a live
node, a removed, crashed or preempted node, and a peer's loss behind a failed collective."""

from __future__ import annotations

import time

from controller_fakes import FakeCluster

from orchestrator.agents.messages import CommandsEnded
from orchestrator.controller.failure_policy import FaultKind
from orchestrator.controller.fault_judge import FaultJudge
from orchestrator.controller.rank_group import GroupPoll, RankRun

NODES = {0: "node-0", 1: "node-1"}


def judge(cluster: FakeCluster, verdict_wait_s: float = 0.5) -> FaultJudge:
    return FaultJudge(cluster, death_wait_s=0.05, verdict_wait_s=verdict_wait_s)


def lost(rank: int) -> RankRun:
    run = RankRun(rank, lost=RuntimeError("ActorDiedError: the actor died\nit is gone"))
    run.done.set()
    return run


def ended(rank: int, code: int) -> RankRun:
    run = RankRun(rank, ended=CommandsEnded(exit_code=code, command="python train.py"))
    run.done.set()
    return run


def poll(*runs: RankRun) -> GroupPoll:
    return GroupPoll(time.time(), tuple(run.poll() for run in runs))


def test_a_failed_command_is_its_own_fault():
    fault = judge(FakeCluster(2)).fault_of(ended(1, 3).poll(), "node-1")
    assert fault.kind == FaultKind.COMMAND_FAILED
    assert fault.reason == "rank 1: command exited with code 3: python train.py"
    assert (fault.rank, fault.node_id) == (1, "node-1")


def test_an_agent_lost_on_a_node_whose_raylet_answers_is_the_agent_alone():
    fault = judge(FakeCluster(2)).fault_of(lost(0).poll(), "node-0")
    assert fault.kind == FaultKind.AGENT_LOST
    assert fault.reason == ("rank 0's node agent died (RuntimeError: it is gone); its node lives")


def test_an_agent_lost_with_its_node_is_the_node_lost():
    cluster = FakeCluster(2)
    cluster.kill("node-1")
    fault = judge(cluster).fault_of(lost(1).poll(), "node-1")
    assert (fault.kind, fault.reason) == (FaultKind.NODE_LOST, "rank 1's node node-1 was lost")


def test_a_crashed_node_the_gcs_still_calls_alive_is_lost_once_the_verdict_wait_is_over():
    """Its raylet does not answer: never called alive; lost after the wait, and remembered, so
    a replacement waits for Ray to declare it dead."""
    cluster = FakeCluster(2)
    cluster.silent.add("node-1")
    j = judge(cluster, verdict_wait_s=0.3)
    started = time.monotonic()
    fault = j.fault_of(lost(1).poll(), "node-1")
    assert fault.kind == FaultKind.NODE_LOST and time.monotonic() - started >= 0.3
    assert j.why_wait(["node-1"]) == (
        "waiting for Ray to declare node node-1 dead (its raylet does not answer), so that its "
        "rank is placed elsewhere"
    )
    cluster.kill("node-1")
    assert j.why_wait(["node-1"]) is None


def test_a_node_seen_draining_is_preempted_and_waited_for_until_it_goes():
    cluster = FakeCluster(2)
    cluster.drains["node-1"] = time.time() + 30
    j = judge(cluster)
    draining = j.draining(NODES)
    assert list(draining) == [1] and draining[1] > time.time()
    assert j.why_wait(["node-1"]).startswith("waiting for preempted node node-1 to go")
    cluster.kill("node-1")
    fault = j.fault_of(lost(1).poll(), "node-1")
    assert (fault.kind, fault.reason) == (
        FaultKind.PREEMPTED, "rank 1's node node-1 was preempted and is gone",
    )  # fmt: skip
    assert j.why_wait(["node-1"]) is None


def test_a_command_failing_because_a_peer_vanished_is_the_peers_fault():
    cluster = FakeCluster(2)
    j = judge(cluster)
    assert j.lost_elsewhere(poll(ended(0, 1), RankRun(1)), NODES) is None  # nobody else went
    cluster.kill("node-1")  # the peer's node is gone, its stream not ended yet
    fault = j.lost_elsewhere(poll(ended(0, 1), RankRun(1)), NODES)
    assert (fault.kind, fault.rank) == (FaultKind.NODE_LOST, 1)
    cluster.drains["node-0"] = 0.0  # a peer being preempted counts as well
    fault = j.lost_elsewhere(poll(ended(0, 1), RankRun(1)), {0: "node-0"})
    assert (fault.kind, fault.reason) == (
        FaultKind.PREEMPTED,
        "rank 0's node node-0 is being preempted",
    )


def test_a_peer_crashed_a_moment_ago_is_found_by_its_silent_raylet():
    cluster = FakeCluster(2)
    cluster.silent.add("node-1")
    fault = judge(cluster, verdict_wait_s=0.2).lost_elsewhere(poll(ended(0, 1), RankRun(1)), NODES)
    assert (fault.kind, fault.rank, fault.node_id) == (FaultKind.NODE_LOST, 1, "node-1")
