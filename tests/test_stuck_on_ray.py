"""A stuck gang job on the embedded cluster (controller/stuck.py): a 2-rank gloo job whose rank 1
stops entering the all-reduce at step 5 is found within its window, both ranks' stacks are
stored (rank 1's where it waits, rank 0's in the all-reduce), and it ends FAILED `stuck` after
two attempts when it hangs every time; a job printing only a `\\r` progress bar, then only
beating `orchestrator.progress()`, is not stuck, and `job.stacks()` takes its stacks while it
runs."""

from __future__ import annotations

import time

import pytest
from conftest import make_job

from orchestrator.client.api import push
from orchestrator.lifecycle import JobState
from orchestrator.storage.metrics import read_job_metrics
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.stacks import StackStore

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("ray_cluster")]

WINDOW_S = 8

JOB = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="{project}",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(node_count={nodes}, cpu_count=1, memory="512Mi"),
        runtime=d.Runtime(start_commands={commands!r}),
        stuck_after_s={window},
    ),
)
"""

GLOO_HANG = """
import datetime, os, time
import torch
import torch.distributed as dist

rank, world = int(os.environ["BT_NODE_RANK"]), int(os.environ["BT_GROUP_SIZE"])
address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=300))
grads = torch.ones(8)


def next_batch():  # rank 1's data loader stops answering at step 5
    time.sleep(600)


for step in range(1, 11):
    if rank == 1 and step == 5:
        next_batch()
    print(f"step {step}", flush=True)
    dist.all_reduce(grads)
    time.sleep(0.5)
"""

BAR_ONLY = """
import sys, time
for i in range(20):
    sys.stdout.write(f"\\rtrain: {i}/20")
    sys.stdout.flush()
    time.sleep(0.5)
sys.stdout.write("\\n")
"""

BEAT_ONLY = """
import time
import orchestrator
print("from now on only orchestrator.progress()", flush=True)
for step in range(12):
    orchestrator.progress(step)
    time.sleep(1.05)
"""


def test_a_gloo_rank_that_stops_entering_the_all_reduce_is_found(tmp_path, storage_root):
    body = JOB.format(project="stuck", nodes=2, commands=["python hang.py"], window=WINDOW_S)
    config = make_job(tmp_path / "job", body, {"hang.py": GLOO_HANG})
    started = time.monotonic()
    job = push(config, storage_root=storage_root, colocate_ranks=True, retries=3)
    assert job.wait(timeout=150) == JobState.FAILED, job.logs()
    took = time.monotonic() - started
    attempts = job.attempts()
    assert [a.cause for a in attempts] == ["stuck", "stuck"], job.logs()
    assert attempts[0].rank == 1
    failure = job.details().failure
    assert "stuck: rank 1 made no progress" in failure.cause
    assert "stuck twice in a row with no checkpoint" in failure.cause
    store = StackStore(StorageRoot(storage_root), job.id)
    assert store.sets() == ["attempt-0", "attempt-1"]
    stacks = store.read("attempt-0")
    assert set(stacks) == {0, 1}
    assert "next_batch (hang.py:" in stacks[1], stacks[1]  # the line rank 1 waits in
    assert "all_reduce" in stacks[0], stacks[0]
    assert store.silent("attempt-0").first == 1
    logs = job.logs()
    hang = next(i for i, line in enumerate(logs) if "step 4" in line)
    found = next(i for i, line in enumerate(logs) if "rank 1 is silent" in line)
    assert hang < found
    print(f"two stuck attempts found and failed in {took:.0f} s")


def test_a_job_with_only_a_progress_bar_then_only_beats_is_not_stuck_and_gives_its_stacks(
    tmp_path, storage_root, monkeypatch
):
    """Its window is 5 s (5x its bar's 1 s updates): 12 s of nothing but the explicit beat would
    be stuck without it (its samples carry the beat, every second here)."""
    monkeypatch.setenv("ORCHESTRATOR_METRICS_INTERVAL_S", "1")
    commands = ["python bar.py", "python beat.py"]
    body = JOB.format(project="bar", nodes=1, commands=commands, window=4)
    config = make_job(tmp_path / "job", body, {"bar.py": BAR_ONLY, "beat.py": BEAT_ONLY})
    job = push(config, storage_root=storage_root)
    deadline = time.monotonic() + 60
    while not any("train:" in line for line in job.logs()):
        assert time.monotonic() < deadline and not job.status().is_terminal, job.logs()
        time.sleep(0.3)
    taken = job.stacks()  # on demand, while it runs
    assert "bar.py" in taken[0] and "<module>" in taken[0], taken
    assert any(name.startswith("taken-") for name in job.stack_sets())
    assert job.wait(timeout=90) == JobState.COMPLETED, job.logs()
    assert [a.cause for a in job.attempts()] == [None]
    samples = [s for m in read_job_metrics(StorageRoot(storage_root), job.id) for s in m.samples]
    assert any(s.beat_step is not None for s in samples)  # the beat reached the samples
