"""The attempt loop on Ray itself, its controller in this process: the real placement, rank
group and fault judge of a job on the embedded cluster, and what a watcher sees of each poll
(each rank's latest resource sample and newest stored checkpoint) while the commands run."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import ray_driver
from controller_fakes import OpenQueue

from orchestrator import definitions as d
from orchestrator.agents.services import NAMESPACE
from orchestrator.client.prepare import prepare_job
from orchestrator.client.submit import store_job
from orchestrator.controller.controller import JobController
from orchestrator.controller.failure_policy import Fault
from orchestrator.controller.rank_group import GroupPoll
from orchestrator.controller.watchers import WatchScope, register, unregister
from orchestrator.lifecycle import JobState
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.root import StorageRoot

pytestmark = pytest.mark.cluster

TRAIN = textwrap.dedent(
    """
    import os, pathlib, time
    out = pathlib.Path(os.environ["BT_CHECKPOINT_DIR"])
    end = time.monotonic() + 7
    while time.monotonic() < end:  # busy, as training is
        sum(i * i for i in range(10000))
    (out / "checkpoint-1").mkdir()
    (out / "checkpoint-1" / "weights.bin").write_bytes(b"w" * 1000)
    time.sleep(3)  # the checkpoint settles and is stored while the rank still runs
    print("done")
    """
)


class Recorder:
    """Keeps every poll of the attempt."""

    polls: list[GroupPoll] = []

    def __init__(self, scope: WatchScope) -> None:
        pass

    def watch(self, poll: GroupPoll) -> Fault | None:
        Recorder.polls.append(poll)
        return None


@pytest.fixture
def recorded():
    Recorder.polls = []
    register(Recorder)
    yield Recorder.polls
    unregister(Recorder)


def test_the_polls_carry_each_ranks_samples_and_stored_checkpoints(
    ray_cluster, recorded, tmp_path: Path, monkeypatch
):
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(TRAIN)
    project = d.TrainingProject(
        name="on-ray",
        job=d.TrainingJob(
            image=d.Image(base_image="python:3.11"),
            compute=d.Compute(node_count=1, cpu_count=1),
            runtime=d.Runtime(
                start_commands=["python train.py"],
                checkpointing_config=d.CheckpointingConfig(enabled=True),
            ),
        ),
    )
    root = StorageRoot(str(tmp_path / "storage"))
    record = store_job(prepare_job(project, source_dir=code), root, "jonray0001", None)
    store = JobStore(root)
    with ray_driver(ray_cluster, monkeypatch, NAMESPACE):
        controller = JobController(store, record.job_id, 60, queue=lambda r, say: OpenQueue())
        assert controller.run() == JobState.COMPLETED
    samples = [p.ranks[0].last_sample for p in recorded if p.ranks[0].last_sample is not None]
    assert samples, "no poll carried the rank's resource sample"
    assert max(s.cpu_cores for s in samples) > 0.3 and samples[-1].processes >= 1
    stored = [p.ranks[0].last_checkpoint for p in recorded if p.ranks[0].last_checkpoint]
    assert stored and stored[-1].name == "checkpoint-1"
    assert [p.at for p in recorded] == sorted(p.at for p in recorded)
