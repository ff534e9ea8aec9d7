"""A concern that only this test knows, added as the seam promises: one watcher class and one
`register` line (controller/watchers.py). It ends an attempt its own way, the failure policy
decides as for any fault, and the attempt loop is not edited (no Ray: the agents run in this
process and their commands are real processes)."""

from __future__ import annotations

import time

import pytest
from controller_fakes import in_process_controller

from orchestrator import definitions as d
from orchestrator.controller.failure_policy import Fault, FaultKind
from orchestrator.controller.rank_group import GroupPoll, RankState
from orchestrator.controller.watchers import WatchScope, register, unregister
from orchestrator.lifecycle import JobState
from orchestrator.storage.records import RetryPolicy


class QuietRank:
    """A rank that printed nothing for QUIET_S while its peers went on: the attempt ends
    (a toy of a hang detector)."""

    QUIET_S = 1.0

    def __init__(self, scope: WatchScope) -> None:
        self.started = time.time()

    def watch(self, poll: GroupPoll) -> Fault | None:
        for rank in poll.ranks:
            quiet = poll.at - (rank.last_output_at or self.started)
            if rank.state == RankState.RUNNING and quiet > self.QUIET_S:
                why = f"rank {rank.rank} printed nothing for {self.QUIET_S:g} s"
                return Fault(FaultKind.COMMAND_FAILED, why, rank.rank)
        return None


@pytest.fixture
def quiet_watched(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ORCHESTRATOR_NODE_ROOT", str(tmp_path / "nodes"))
    register(QuietRank)  # the one registration line
    yield
    unregister(QuietRank)


TALKS_THEN_RANK_1_HANGS = (
    'for i in 1 2 3 4 5 6 7 8; do echo "step $i"; '
    '[ "$BT_NODE_RANK" = 1 ] && [ "$i" = 2 ] && [ "$BT_RETRY_COUNT" = 0 ] && sleep 60; '
    "sleep 0.3; done"
)


def project() -> d.TrainingProject:
    return d.TrainingProject(
        name="watched",
        job=d.TrainingJob(
            image=d.Image(base_image="python:3.11"),
            compute=d.Compute(node_count=2),
            runtime=d.Runtime(start_commands=[TALKS_THEN_RANK_1_HANGS]),
        ),
    )


def test_a_watchers_fault_ends_the_job_as_the_policy_says(quiet_watched, tmp_path):
    controller, ranks, handle = in_process_controller(tmp_path, project(), "jwatch0001")
    started = time.monotonic()
    assert controller.run() == JobState.FAILED
    assert time.monotonic() - started < 30  # not the 60 s the quiet rank sleeps
    failure = handle.details().failure
    assert failure.cause == "rank 1 printed nothing for 1 s" and failure.node_rank == 1
    attempt = handle.details().attempts[0]
    assert (attempt.cause, attempt.rank) == ("command_failed", 1)
    assert all(run.ended is not None and run.ended.stopped for run in ranks.runs)  # stopped


def test_a_watchers_fault_is_retried_when_the_job_allows(quiet_watched, tmp_path):
    retry = RetryPolicy(retries=1, retry_on_failure=True, delay_s=0)
    controller, _, handle = in_process_controller(tmp_path, project(), "jwatch0002", retry)
    assert controller.run() == JobState.COMPLETED  # the second attempt does not hang
    first, second = handle.details().attempts
    assert first.reason == "rank 1 printed nothing for 1 s"
    assert first.decision == "retried: retry 1 of 1" and second.decision == "completed"
