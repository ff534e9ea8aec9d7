"""A rank's stream into its run, and the group's poll (no Ray): what crosses from the agents is
an iterable of items, so the Ray stream and a list are followed alike."""

from __future__ import annotations

import time

from orchestrator.agents.messages import CommandsEnded, OutputLines, StoredCheckpoint
from orchestrator.controller.rank_group import RankRun, RankState, follow, poll_runs


def test_a_long_lines_pieces_are_joined_before_they_are_said():
    said: list[list[str]] = []
    run = RankRun(0)
    items = [
        OutputLines(["a", "b" * 3], continues=True),
        OutputLines(["b" * 2], continues=True),
        OutputLines(["b!", "c"]),
        CommandsEnded(exit_code=0),
    ]
    before = time.time()
    follow(items, run, said.append)
    assert said == [["a"], ["bbbbbb!", "c"]]
    assert run.done.is_set() and run.ended == CommandsEnded(exit_code=0)
    assert run.last_output_at is not None and run.last_output_at >= before


def test_a_stream_that_breaks_is_the_rank_lost():
    def broken():
        yield OutputLines(["step 1"])
        raise RuntimeError("ActorDiedError: the worker died")

    run = RankRun(1)
    follow(broken(), run, lambda lines: None)
    polled = run.poll()
    assert polled.state == RankState.LOST and polled.failed
    assert polled.failure.cause == "rank 1 was lost: RuntimeError: ActorDiedError: the worker died"


class Uploaders:
    def __init__(self) -> None:
        self.last_stored = {1: StoredCheckpoint("checkpoint-20", 1.0)}

    def poll(self) -> tuple[list[str], str | None]:
        return ["[rank 1] [checkpoints] checkpoint-20 uploaded"], None


def test_the_poll_ends_on_a_lost_rank_first_and_carries_the_uploaders_news():
    running, failed, gone = RankRun(0), RankRun(1), RankRun(2)
    failed.ended = CommandsEnded(exit_code=2, command="python train.py")
    failed.done.set()
    gone.lost = RuntimeError("the node died")
    gone.done.set()
    poll = poll_runs([running, failed, gone], Uploaders())  # type: ignore[arg-type]
    assert [r.state for r in poll.ranks] == [RankState.RUNNING, RankState.ENDED, RankState.LOST]
    assert not poll.ended and poll.failed.rank == 2  # the lost rank is the cause, not the exit
    assert poll.ranks[1].last_checkpoint == StoredCheckpoint("checkpoint-20", 1.0)
    assert poll.checkpoint_lines == ("[rank 1] [checkpoints] checkpoint-20 uploaded",)
    ok = RankRun(0, ended=CommandsEnded(exit_code=0))
    ok.done.set()
    assert poll_runs([ok], None).ended and poll_runs([ok], None).failed is None
