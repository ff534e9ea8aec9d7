"""How soon a stuck gang job is found, and what watching for it costs (controller/stuck.py).

    .venv/bin/python benchmarks/stuck_detection.py [--window 8] [--gloo-timeout 120]

1. On a private embedded cluster (stopped at the end): a 2-rank gloo job (CPU torch, the ranks
   colocated) whose rank 1 stops entering the all-reduce at step 5 (it writes when to a file,
   printing nothing). Measured: the hang to the stored stacks (`silent.json`) and to the
   decision (the attempt's end), against the window and the gloo timeout, which would
   otherwise end the job.
2. The detector's own cost on a healthy job: `ProgressTracker` fed a poll of N ranks as the
   attempt loop does (every 0.2 s), CPU time per poll and its share of a core; the resource
   samples it reads are taken anyway (benchmarks/metrics_overhead.py measures those).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from common import code_state, private_environment

from orchestrator.agents.messages import StoredCheckpoint
from orchestrator.client.api import push
from orchestrator.cluster.local import LocalCluster
from orchestrator.controller.rank_group import GroupPoll, RankPoll, RankState
from orchestrator.controller.stuck import ProgressTracker
from orchestrator.storage.metrics import MetricsSample
from orchestrator.storage.root import StorageRoot
from orchestrator.storage.stacks import StackStore

POLL_S = 0.2  # the attempt loop's (controller/attempts.py)

CONFIG = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="stuck-benchmark",
    job=d.TrainingJob(
        image=d.Image(base_image="python:3.11"),
        compute=d.Compute(node_count=2, cpu_count=1, memory="512Mi"),
        runtime=d.Runtime(start_commands=["python hang.py"]),
        stuck_after_s={window},
    ),
)
"""

HANG = """
import datetime, os, time
import torch
import torch.distributed as dist
rank, world = int(os.environ["BT_NODE_RANK"]), int(os.environ["BT_GROUP_SIZE"])
address = f"tcp://{{os.environ['MASTER_ADDR']}}:{{os.environ['MASTER_PORT']}}"
dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds={gloo_timeout}))
grads = torch.ones(8)
for step in range(1, 1000):
    if rank == 1 and step == 5:  # says when without a line: a hung rank prints nothing
        open({hang_file!r}, "w").write(f"{{time.time():.3f}}")
        time.sleep(3600)
    print(f"step {{step}}", flush=True)
    dist.all_reduce(grads)
    time.sleep(0.5)
"""


def hang_to_decision(work: Path, window: float, gloo_timeout: float) -> None:
    job_dir = work / "job"
    job_dir.mkdir()
    (job_dir / "config.py").write_text(CONFIG.format(window=window))
    hang_file = work / "hung-at"
    (job_dir / "hang.py").write_text(
        HANG.format(gloo_timeout=int(gloo_timeout), hang_file=str(hang_file))
    )
    storage = str(work / "storage")
    job = push(job_dir / "config.py", storage_root=storage, colocate_ranks=True)
    state = job.wait(timeout=window + gloo_timeout + 120)
    if os.environ.get("STUCK_BENCH_LOGS"):
        print("\n".join(job.logs()))
    hung = float(hang_file.read_text())
    store = StackStore(StorageRoot(storage), job.id)
    silent = store.silent("attempt-0")
    attempt = job.attempts()[0]
    assert silent is not None and attempt.cause == "stuck", (state, attempt, job.logs()[-20:])
    print(f"job {job.id}: {state.value}, cause {attempt.cause}, silent rank {silent.first}")
    print(f"window {window:g} s (ORCHESTRATOR_STUCK_AFTER_S would be 600), gloo timeout "
          f"{gloo_timeout:g} s (PyTorch's default: 1800)")  # fmt: skip
    print(f"hang -> stacks stored:  {silent.at - hung:6.1f} s")
    print(f"hang -> decision:       {attempt.ended_at - hung:6.1f} s")
    said = next(line for line in job.logs() if " is silent: " in line)
    print(f"the controller said: {said.split('] ', 1)[1]}")
    sizes = {r: len(text) for r, text in store.read("attempt-0").items()}
    print(f"stacks stored: {sizes} characters by rank")


def tracker_cost(ranks: int, seconds: float) -> None:
    """CPU per poll of a healthy job of `ranks` ranks: each prints and samples move."""
    tracker = ProgressTracker(stuck_after_s=600, started=time.time())
    polls = int(seconds / POLL_S)
    now = time.time()
    started = time.process_time()
    for i in range(polls):
        at = now + i * POLL_S
        sample = MetricsSample(at=at - at % 5, cpu_cores=1.0, memory_bytes=1, processes=3,
                               disk_bytes={"checkpoints": i // 25})  # fmt: skip
        stored = StoredCheckpoint("checkpoint-1", now)
        poll = GroupPoll(at, tuple(
            RankPoll(r, RankState.RUNNING, last_output_at=at - 0.1, last_checkpoint=stored,
                     last_sample=sample)
            for r in range(ranks)
        ))  # fmt: skip
        tracker.observe(poll)
        assert not tracker.silent(poll)
    cpu = time.process_time() - started
    per_poll = cpu / polls
    print(f"{ranks:4d} ranks: {per_poll * 1e6:8.1f} µs per poll = "
          f"{per_poll / POLL_S * 100:.3f}% of a core at one poll every {POLL_S:g} s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=float, default=8.0)
    parser.add_argument("--gloo-timeout", type=float, default=120.0)
    parser.add_argument("--skip-job", action="store_true", help="only the detector's cost")
    args = parser.parse_args()
    print(f"code {code_state()}; cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    print("the detector's cost on a healthy job (ProgressTracker, 60 s of polls):")
    for ranks in (2, 16, 128):
        tracker_cost(ranks, 60)
    if args.skip_job:
        return
    work = Path(tempfile.mkdtemp(prefix="bench-stuck-"))
    private_environment(work)
    cluster = LocalCluster(state_dir=work / "home" / "local-cluster")
    try:
        started = time.monotonic()
        info = cluster.start()
        print(f"local cluster {info.dashboard_url} up in {time.monotonic() - started:.1f} s")
        hang_to_decision(work, args.window, args.gloo_timeout)
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
