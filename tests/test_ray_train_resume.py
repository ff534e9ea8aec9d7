"""A Ray Train job's checkpoints and its resume after a lost node (issue 54), on the simulated
GPU cluster of tests/test_faults.py, where each node has a disk of its own.

The script is the way Ray Train's docs save: every worker writes its part of a round into a
temporary directory and reports it with `ray.train.report(metrics, checkpoint=...)`; rank 0's
part holds the model and the step, every worker's part its own shard. One worker runs on each of
the job's two nodes, so every checkpoint has a part on each node. A node is lost mid-run: the
job is retried once, every worker's `ray.train.get_checkpoint()` returns the newest checkpoint
both nodes stored, whole (the model and its own shard), and training goes on at the next step.
"""

from __future__ import annotations

import re

import pytest
import test_faults
from conftest import eventually, make_job
from ray.util.state import list_actors, list_placement_groups

from orchestrator.client.api import push
from orchestrator.client.jobs import JobHandle
from orchestrator.lifecycle import JobState

pytestmark = pytest.mark.cluster  # starts Ray itself (a simulated cluster)

faults = test_faults.faults  # the module's own simulated cluster: a 2-node job and a spare

TRAIN = """
import os, sys, tempfile, time
import ray, ray.train, torch
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

def loop(config):
    rank = ray.train.get_context().get_world_rank()
    model, start = torch.nn.Linear(4, 1), 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "model.pt"))
            model.load_state_dict(state["model"])
            start = state["step"] + 1
            shard = open(os.path.join(d, f"shard-{rank}.txt")).read()
        print(f"worker {rank} resumes at {start} with shard {shard}", flush=True)
    else:
        print(f"worker {rank} starts at 0", flush=True)
    for step in range(start, config["steps"]):
        time.sleep(config["step_s"])
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                torch.save({"model": model.state_dict(), "step": step},
                           os.path.join(tmp, "model.pt"))
            with open(os.path.join(tmp, f"shard-{rank}.txt"), "w") as f:
                f.write(f"{rank}@{step}")
            ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(tmp))
            if rank == 1 and step == config["fail_at"] and not os.path.exists(config["flag"]):
                open(config["flag"], "w").close()  # once, its part of the round written
                print(f"worker 1 dies after its report of step {step}", flush=True)
                os._exit(1)
        print(f"worker {rank} step {step}", flush=True)

steps, step_s = int(sys.argv[1]), float(sys.argv[2])
fail_at, flag = (int(sys.argv[3]), sys.argv[4]) if len(sys.argv) > 4 else (-1, "")
ray.init()
TorchTrainer(
    loop, train_loop_config={"steps": steps, "step_s": step_s, "fail_at": fail_at, "flag": flag},
    torch_config=TorchConfig(backend="gloo"),
    scaling_config=ScalingConfig(num_workers=2, use_gpu=True),
    run_config=RunConfig(name="resumed"),
).fit()
print("trained", flush=True)
"""


def train_job(directory, steps: int, step_s: float, fail: str = ""):
    return make_job(
        directory,
        f"""
        from truss_train import definitions
        project = definitions.TrainingProject(
            name="train-resume",
            job=definitions.TrainingJob(
                image=definitions.Image(base_image="pytorch/pytorch:2.7.1"),
                compute=definitions.Compute(
                    node_count=2, cpu_count=1, memory="512Mi", accelerator="H100:2"
                ),
                runtime=definitions.Runtime(
                    start_commands=["python train.py {steps} {step_s} {fail}"],
                    checkpointing_config=definitions.CheckpointingConfig(enabled=True),
                    environment_variables={{"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}},
                ),
                ray_train=definitions.RayTrain(workers_per_node=1),
            ),
        )
        """,
        {"train.py": TRAIN},
    )


def whole(job: JobHandle) -> list[str]:
    """The checkpoints both nodes stored complete, oldest first."""
    return sorted(test_faults.stored(job, 0) & test_faults.stored(job, 1))


@pytest.mark.parametrize("lost_rank", [1, 0], ids=["worker-node", "driver-node"])
def test_a_lost_node_resumes_every_worker_from_the_newest_whole_checkpoint(
    tmp_path, storage_root, faults, lost_rank
):
    faults.ensure_workers(3)
    config = train_job(tmp_path / "job", steps=12, step_s=0.7)
    job = push(config, address=faults.dashboard_url, storage_root=storage_root, retries=1)
    try:
        eventually(lambda: len(whole(job)) >= 3, "three checkpoints stored whole", 150)
    except AssertionError as e:
        state = job.details().state
        raise AssertionError(f"{e} ({state}):\n" + "\n".join(job.logs()[-80:])) from None
    lost = job.details().nodes[lost_rank].node_id
    faults.cluster.remove_node(faults.node(lost), allow_graceful=False)

    assert job.wait(timeout=240) == JobState.COMPLETED, "\n".join(job.logs()[-60:])
    first, second = job.details().attempts
    assert (first.cause, first.rank, first.node_id) == ("node_lost", lost_rank, lost), first
    assert first.decision == "retried: retry 1 of 1"
    assert second.resumed_from is not None and second.resumed_from.startswith("checkpoint_")
    logs = job.logs()
    text = "\n".join(logs)
    # Every worker resumed from that checkpoint, whole: rank 0's model and its own shard, at
    # the step after the one it holds, and trained to the end.
    resumed = {int(r): (int(s), shard) for r, s, shard
               in re.findall(r"worker (\d) resumes at (\d+) with shard (\S+)", text)}  # fmt: skip
    assert sorted(resumed) == [0, 1], text
    (start,) = {s for s, _ in resumed.values()}
    assert start >= 3, resumed
    assert resumed == {r: (start, f"{r}@{start - 1}") for r in (0, 1)}, resumed
    assert "worker 0 step 11" in text and "trained" in text, text
    # Each worker's lines carry its rank (the callback says which pid is which).
    assert re.search(r"\(RayTrainWorker rank 1 pid=\d+[^)]*\)\S* worker 1 step \d+", text), text
    # Every checkpoint stored is one Train committed (Train's names), each part saying so with
    # the nodes that wrote one; the rounds stored say so too, but for the last ones of a driver
    # whose node crashed (its writer stores rounds a second apart).
    stored = [m for m in job.checkpoints() if not m.top_level]
    assert stored and all(m.name.startswith("checkpoint_") for m in stored), stored
    assert all(m.train_parts == [0, 1] for m in stored), stored
    committed = [r.checkpoint for run in job.metrics().train_reports for r in run.reports]
    assert len({m.name for m in stored} - set(committed)) <= (2 if lost_rank == 0 else 0)
    assert second.resumed_from in {m.name for m in stored}
    assert any("[checkpoints] attempt 1 resumes from checkpoint_" in line
               and "Ray Train committed" in line for line in logs), logs  # fmt: skip
    eventually(lambda: not leftovers(job, faults), "the job's actors and placement group to go")


def leftovers(job: JobHandle, faults: test_faults.FaultCluster) -> list[str]:
    """The job's actors (its Train controller and workers are the driver's: gone with it) and
    its placement group, while any is left."""
    actors = list_actors(address=faults.dashboard_url, filters=[("state", "!=", "DEAD")])
    train = [a.class_name for a in actors if a.class_name in ("TrainController", "RayTrainWorker")]
    groups = list_placement_groups(address=faults.dashboard_url)
    return (
        [a.name for a in actors if job.id in (a.name or "")]
        + train
        + [g.name for g in groups if job.id in g.name and g.state != "REMOVED"]
    )


def test_a_worker_that_dies_once_is_retried_from_the_last_commit(tmp_path, storage_root, faults):
    """Worker 1 dies right after its report of step 4 (a crash, as a killed process's): Train
    commits round 4 only if it collected that report first. Either way the retry (the same
    nodes, their directories still there) resumes both workers after the last round stored as
    committed, and a round's directory Train never committed is set aside, never stored."""
    faults.ensure_workers(3)
    config = train_job(tmp_path / "job", steps=7, step_s=0.7, fail=f"4 {tmp_path / 'died'}")
    job = push(config, address=faults.dashboard_url, storage_root=storage_root, retries=1,
               retry_on_failure=True)  # fmt: skip
    assert job.wait(timeout=240) == JobState.COMPLETED, "\n".join(job.logs()[-60:])
    first, second = job.details().attempts
    assert first.cause == "command_failed" and first.decision == "retried: retry 1 of 1", first
    text = "\n".join(job.logs())
    assert "worker 1 dies after its report of step 4" in text, text
    runs = job.metrics().train_reports
    assert len(runs) == 2, runs
    before = [r.checkpoint for r in runs[0].reports]
    assert len(before) in (4, 5) and all(before), before  # rounds 0-3, and 4 if collected
    start = len(before)
    resumed = dict(re.findall(r"worker (\d) resumes at (\d+ with shard \S+)", text))
    assert resumed == {r: f"{start} with shard {r}@{start - 1}" for r in "01"}, text
    assert second.resumed_from == before[-1]
    after = [r.checkpoint for r in runs[1].reports]
    assert len(after) == 7 - start and all(after), after
    names = {m.name for m in job.checkpoints() if not m.top_level}
    assert names == set(before) | set(after), (names, before, after)  # never an orphan
    if start == 4:  # round 4's directory, written on both nodes, never committed
        for rank in (0, 1):
            assert re.search(
                rf"\[rank {rank} [^]]*\] \[checkpoints\] checkpoint_\S+ moved to "
                r"\S+: it was not complete when the last attempt ended",
                text,
            ), text
    eventually(lambda: not leftovers(job, faults), "the job's actors and placement group to go")
