"""A kind of rank program that only this test knows, added as the seam promises: one class and
one `register` line (agents/rank_program.py). The controller chooses it for the job it takes
and each rank's agent runs it, with nothing else told (no Ray: the agents run in this process).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from controller_fakes import in_process_controller

from orchestrator import definitions as d
from orchestrator.agents.messages import CommandsEnded, OutputLines
from orchestrator.agents.rank_program import RankContext, register, unregister
from orchestrator.lifecycle import JobState
from orchestrator.spec.training import TrainingJob


@dataclass(frozen=True)
class Countdown:
    """Counts down from `start`, a line a step, on every rank: jobs that set COUNTDOWN_FROM."""

    start: int

    @classmethod
    def for_job(cls, job: TrainingJob) -> Countdown | None:
        value = job.runtime.environment_variables.get("COUNTDOWN_FROM")
        return cls(int(value)) if isinstance(value, str) else None

    def describe(self) -> str:
        return f"a countdown from {self.start}"

    def run(self, context: RankContext) -> Iterator[OutputLines | CommandsEnded]:
        for n in range(self.start, 0, -1):
            yield OutputLines([context.tag(f"{n} on BT_NODE_RANK={context.env['BT_NODE_RANK']}",
                                           False)])  # fmt: skip
        yield CommandsEnded(exit_code=0)


@pytest.fixture
def countdown_known(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ORCHESTRATOR_NODE_ROOT", str(tmp_path / "nodes"))
    register(Countdown)  # the one registration line
    yield
    unregister(Countdown)


def project(env: dict[str, str]) -> d.TrainingProject:
    return d.TrainingProject(
        name="programs",
        job=d.TrainingJob(
            image=d.Image(base_image="python:3.11"),
            compute=d.Compute(node_count=2),
            runtime=d.Runtime(start_commands=["echo commands on $BT_NODE_RANK"],
                              environment_variables=env),
        ),
    )  # fmt: skip


def test_a_job_of_a_new_kind_runs_that_program_on_every_rank(countdown_known, tmp_path):
    controller, ranks, handle = in_process_controller(
        tmp_path, project({"COUNTDOWN_FROM": "3"}), "jprog00001"
    )
    assert controller.run() == JobState.COMPLETED
    assert [r.program for r in ranks.requests[0]] == [Countdown(3)] * 2
    logs = "\n".join(handle.logs())
    assert "RUNNING: running a countdown from 3" in logs
    for rank in (0, 1):
        said = [line.split("] ", 1)[1] for line in logs.splitlines()
                if line.startswith(f"[rank {rank} ")]  # fmt: skip
        assert said == [f"{n} on BT_NODE_RANK={rank}" for n in (3, 2, 1)]
    assert "commands on" not in logs


def test_every_other_job_still_runs_its_start_commands(countdown_known, tmp_path):
    controller, _, handle = in_process_controller(tmp_path, project({}), "jprog00002")
    assert controller.run() == JobState.COMPLETED
    logs = "\n".join(handle.logs())
    assert "RUNNING: running 1 command(s)" in logs
    assert "commands on 0" in logs and "commands on 1" in logs
