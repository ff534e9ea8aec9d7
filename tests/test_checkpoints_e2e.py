"""Checkpoints through real jobs on a local Ray: uploaded while running, flushed at the end,
loaded into later jobs, and the mnist recipe resuming."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import pytest
from checkpoint_jobs import writer_job

from orchestrator.client.api import push
from orchestrator.client.jobs import JobHandle
from orchestrator.client.overrides import Overrides
from orchestrator.lifecycle import JobState
from orchestrator.storage.checkpoints import CheckpointStore
from orchestrator.storage.root import StorageRoot

pytestmark = pytest.mark.usefixtures("ray_cluster")
MNIST = Path(__file__).resolve().parents[1] / "recipes" / "mnist-pytorch"

WRITER = """
import os, pathlib, time
root = pathlib.Path(os.environ["BT_CHECKPOINT_DIR"])
def save(name, text):
    tmp = root / f".{name}"
    tmp.mkdir()
    (tmp / "weights.txt").write_text(text)
    tmp.rename(root / name)
    print(f"saved {name}", flush=True)
save("checkpoint-1", "first")
time.sleep(float(os.environ.get("HOLD", "6")))
save("checkpoint-2", "second")
"""


def names(job: JobHandle) -> list[str]:
    store = CheckpointStore(StorageRoot(job.record.storage_root))
    return [m.name for m in store.list(job.project_id, job.id)]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_checkpoints_upload_while_running_and_flush_at_the_end(tmp_path, storage_root, where):
    if where == "s3":
        import s3fs

        bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem().mkdir(bucket)
        storage_root = f"s3://{bucket}/orchestrator"
    job = push(writer_job(tmp_path / "job", "ckpt-writer", WRITER), storage_root=storage_root)
    deadline = time.monotonic() + 60
    while names(job) != ["checkpoint-1"]:
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.2)
    assert job.status() == JobState.RUNNING, "checkpoint-1 must be uploaded while the job runs"
    assert job.wait(timeout=120) == JobState.COMPLETED, job.logs()
    assert names(job) == ["checkpoint-1", "checkpoint-2"]  # the last one by the final flush
    summary = job.details().checkpoints
    assert summary.all_uploaded and summary.uploaded == [
        "rank-0/checkpoint-1",
        "rank-0/checkpoint-2",
    ]
    assert any("[checkpoints] checkpoint checkpoint-1 uploaded" in line for line in job.logs())


SAVES_ON_SIGTERM = """
import os, pathlib, signal, sys, time
from orchestrator import mark_checkpoint_complete
root = pathlib.Path(os.environ["BT_CHECKPOINT_DIR"])
def save(name, text):
    (root / name).mkdir()
    (root / name / "weights.txt").write_text(text)      # in place: only settling says done
    print(f"saved {name}", flush=True)
def on_stop(signum, frame):                             # as a trainer saving on preemption
    time.sleep(2)                                       # a save that takes a while
    save("checkpoint-2", "saved on SIGTERM")
    mark_checkpoint_complete(root / "checkpoint-2")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_stop)
save("best", "the best so far")                         # its own series: nothing follows it
save("checkpoint-1", "first")
time.sleep(600)
"""


def test_a_stopped_job_flushes_its_checkpoints(tmp_path, storage_root, monkeypatch):
    """A stop gives the whole command its grace: a trainer saving on SIGTERM finishes, and
    the flush stores what it left. What had not settled is stored marked incomplete, unless
    a later checkpoint of its series followed it (the writer had finished it)."""
    monkeypatch.setenv("ORCHESTRATOR_CHECKPOINT_SETTLE_S", "3600")  # only the flush uploads
    job = push(writer_job(tmp_path / "job", "ckpt-stop", SAVES_ON_SIGTERM),
               storage_root=storage_root)  # fmt: skip
    deadline = time.monotonic() + 60
    while not any(line.endswith("saved checkpoint-1") for line in job.logs()):
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.2)
    assert names(job) == []
    assert job.stop() == JobState.STOPPED
    assert sorted(names(job)) == ["best", "checkpoint-1", "checkpoint-2"]
    by_name = {m.name: m for m in job.checkpoints()}
    assert by_name["checkpoint-2"].complete, "saved during the grace and marked complete"
    assert by_name["checkpoint-1"].complete, "checkpoint-2 followed it"
    assert not by_name["best"].complete, "never settled (1 hour) while its writer lived"
    assert "the job was stopped" in by_name["best"].incomplete_reason
    summary = job.details().checkpoints
    assert summary.all_uploaded and summary.sync_status == "incomplete"


READER = """
import os, pathlib
root = pathlib.Path(os.environ["BT_LOAD_CHECKPOINT_DIR"])
for path in sorted(root.rglob("weights.txt")):
    print(f"loaded {path.relative_to(root)}: {path.read_text()}", flush=True)
"""


def test_a_later_job_loads_the_latest_checkpoint_of_a_project(tmp_path, storage_root, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_CHECKPOINT_SETTLE_S", "0")
    first = push(writer_job(tmp_path / "a", "ckpt-source", WRITER.replace('"6"', '"0"')),
                 storage_root=storage_root)  # fmt: skip
    assert first.wait(timeout=120) == JobState.COMPLETED
    load = (
        "d.LoadCheckpointConfig(enabled=True, checkpoints=["
        "d.BasetenCheckpoint.from_latest_checkpoint(project_name='ckpt-source')])"
    )
    second = push(writer_job(tmp_path / "b", "ckpt-reader", READER, load=load),
                  storage_root=storage_root)  # fmt: skip
    assert second.wait(timeout=120) == JobState.COMPLETED, second.logs()
    assert any(
        line.endswith("loaded rank-0/checkpoint-2/weights.txt: second") for line in second.logs()
    )

    named = (
        "d.LoadCheckpointConfig(enabled=True, checkpoints=["
        f"d.BasetenCheckpoint.from_named_checkpoint('checkpoint-1', job_id='{first.id}')])"
    )
    third = push(writer_job(tmp_path / "c", "ckpt-reader", READER, load=named),
                 storage_root=storage_root)  # fmt: skip
    assert third.wait(timeout=120) == JobState.COMPLETED, third.logs()
    loaded = [line for line in third.logs() if "loaded " in line]
    assert len(loaded) == 1 and loaded[0].endswith("loaded rank-0/checkpoint-1/weights.txt: first")


def test_a_reference_that_matches_nothing_fails_the_deploy(tmp_path, storage_root):
    load = (
        "d.LoadCheckpointConfig(enabled=True, checkpoints=["
        "d.BasetenCheckpoint.from_latest_checkpoint(project_name='never-trained')])"
    )
    job = push(writer_job(tmp_path / "job", "ckpt-reader", READER, load=load),
               storage_root=storage_root)  # fmt: skip
    assert job.wait(timeout=60) == JobState.DEPLOY_FAILED
    cause = job.details().failure.cause
    assert "load_checkpoint_config.checkpoints[0]" in cause and "never-trained" in cause


def test_the_mnist_recipe_resumes_from_its_latest_checkpoint(tmp_path, storage_root, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_CHECKPOINT_SETTLE_S", "0")
    short = Overrides(entrypoint="./run.sh --epochs 6 --checkpoint-every 3")
    first = push(MNIST / "config.py", storage_root=storage_root, overrides=short)
    assert first.wait(timeout=180) == JobState.COMPLETED, first.logs()[-20:]
    assert names(first) == ["checkpoint-3", "checkpoint-6"]

    resumed_dir = tmp_path / "mnist-resume"
    shutil.copytree(MNIST, resumed_dir)
    config = (
        (resumed_dir / "config.py")
        .read_text()
        .replace(
            "checkpointing_config=definitions.CheckpointingConfig(enabled=True),",
            "checkpointing_config=definitions.CheckpointingConfig(enabled=True),\n"
            "            load_checkpoint_config=definitions.LoadCheckpointConfig(enabled=True),",
        )
    )
    (resumed_dir / "config.py").write_text(config)
    second = push(resumed_dir / "config.py", storage_root=storage_root,
                  overrides=Overrides(entrypoint="./run.sh --epochs 10"))  # fmt: skip
    assert second.wait(timeout=180) == JobState.COMPLETED, second.logs()[-20:]
    logs = second.logs()
    assert any("resumed from" in line and "checkpoint-6 (epoch 6)" in line for line in logs)
    assert not any("epoch 1/10" in line for line in logs)
    assert any("final test accuracy: 0.9" in line for line in logs)


RAY_TRAIN = """
import os, tempfile
import ray
from ray import train
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

ray.init(address=os.environ["ORCHESTRATOR_RAY_ADDRESS"])  # the cluster running this job
checkpoints = os.environ["BT_CHECKPOINT_DIR"]

def loop(config):
    for epoch in range(2):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "model.txt"), "w") as f:
                f.write(f"epoch {epoch}")
            train.report({"epoch": epoch}, checkpoint=Checkpoint.from_directory(d))

TorchTrainer(
    loop,
    scaling_config=ScalingConfig(num_workers=1),
    # Each reported checkpoint becomes a top-level directory of $BT_CHECKPOINT_DIR.
    run_config=RunConfig(storage_path=os.path.dirname(checkpoints),
                         name=os.path.basename(checkpoints)),
).fit()
"""


def test_ray_train_reports_land_in_the_checkpoint_layout(tmp_path, storage_root):
    job = push(writer_job(tmp_path / "job", "ray-train", RAY_TRAIN), storage_root=storage_root)
    assert job.wait(timeout=240) == JobState.COMPLETED, "\n".join(job.logs()[-30:])
    manifests = [m for m in job.checkpoints() if m.name != "top-level"]
    assert len(manifests) == 2 and all(m.name.startswith("checkpoint_") for m in manifests)
    # Ray Train's own state at the top of the run's directory (its checkpoint manager's
    # snapshot, which a resumed run reads) is the checkpoint of the files at the top.
    (top,) = [m for m in job.checkpoints() if m.name == "top-level"]
    assert "checkpoint_manager_snapshot.json" in {f.path for f in top.files}, top.files
    store = CheckpointStore(StorageRoot(storage_root))
    last = store.download(manifests[-1], tmp_path / "down")
    assert (last / "model.txt").read_text() == "epoch 1"
