"""What sampling a rank's resources costs: CPU per sample, and a training loop's step time.

1. The sampler's own cost: `MetricsSampler.sample()` on a realistic rank (a process tree of
   `--procs` Python processes, a workspace of `--files` small files and a checkpoint directory
   of `--checkpoint-files` files) and a flush of a full series (MAX_SAMPLES samples), in CPU
   seconds of this thread; as a share of one core at the default interval.
2. A CPU training loop (a torch MLP, one process, run as a child of this process as a job's
   command is) timed per step with the sampler off and on, in alternating rounds; the ratio of
   the medians. The sampler runs at `--interval` (1 s: five times the default rate).

The sampler is a thread of the node agent; this measures the thread itself. Its Ray gauges are
set too (a local `ray.init`, as the agent's worker has one): `--no-gauges` leaves them out.

    .venv/bin/python benchmarks/metrics_overhead.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from common import code_state

from orchestrator.node.node_metrics import (
    DISK_WALK_SHARE,
    FLUSH_S,
    Gauges,
    MetricsSampler,
)
from orchestrator.storage.metrics import MAX_SAMPLES, RankMetrics, write_rank_metrics
from orchestrator.storage.root import StorageRoot

DEFAULT_INTERVAL_S = 5.0

TRAIN = textwrap.dedent("""
    import json, sys, time, torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
    times = []
    for step in range(int(sys.argv[1])):
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    print(json.dumps(times))
""")


def make_rank(base: Path, files: int, checkpoint_files: int) -> dict[str, list[Path]]:
    workspace, checkpoints = base / "workspace", base / "checkpoints" / "checkpoint-100"
    for i in range(files):
        (workspace / f"d{i % 50}").mkdir(parents=True, exist_ok=True)
        (workspace / f"d{i % 50}" / f"f{i}.py").write_bytes(b"x" * 2000)
    checkpoints.mkdir(parents=True)
    for i in range(checkpoint_files):
        (checkpoints / f"shard-{i}.safetensors").write_bytes(b"\0" * 2**20)
    return {"workspace": [workspace], "checkpoints": [base / "checkpoints"], "cache": []}


def sampler_cost(args: argparse.Namespace, base: Path) -> dict[str, float]:
    dirs = make_rank(base, args.files, args.checkpoint_files)
    idle = "import time; time.sleep(3600)"
    procs = [subprocess.Popen([sys.executable, "-c", idle]) for _ in range(args.procs)]
    try:
        root = StorageRoot(base / "root")
        metrics = RankMetrics(job_id="bench", rank=0, interval_s=3600)
        s = MetricsSampler(
            metrics, root.url, root_pid=os.getpid, dirs=lambda: dirs, disk_of=base,
            gpus=[], uploads=lambda: None, gauges=gauges(args),
        )  # fmt: skip
        walk_start = time.thread_time()
        s._disks.sample()  # the first walk, as its own figure
        walk = time.thread_time() - walk_start
        costs = []
        for _ in range(args.samples):
            start = time.thread_time()
            sample = s.sample()
            costs.append(time.thread_time() - start)
        assert sample.processes >= args.procs, sample
        full = RankMetrics(job_id="bench", rank=0, samples=[sample] * MAX_SAMPLES)
        start = time.thread_time()
        for _ in range(5):
            write_rank_metrics(root, full)
        flush = (time.thread_time() - start) / 5
        s._stop.set()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    per_sample = statistics.median(costs)
    # Per default interval: one sample; a walk of the directories as often as DISK_WALK_SHARE
    # lets it (each sample, for a walk this short); a flush every FLUSH_S.
    walks = min(1.0, DEFAULT_INTERVAL_S * DISK_WALK_SHARE / walk) if walk else 1.0
    flushes = DEFAULT_INTERVAL_S / FLUSH_S
    share = (per_sample + walk * walks + flush * flushes) / DEFAULT_INTERVAL_S
    return {"per_sample_ms": per_sample * 1e3, "first_walk_ms": walk * 1e3,
            "flush_ms": flush * 1e3, "share_of_a_core_pct": share * 100}  # fmt: skip


def gauges(args: argparse.Namespace) -> Gauges | None:
    if args.no_gauges:
        return None
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    return Gauges("bench", "bench-project", 0)


def step_times(args: argparse.Namespace, base: Path, sampled: bool) -> list[float]:
    child = subprocess.Popen(
        [sys.executable, "-c", TRAIN, str(args.steps)], stdout=subprocess.PIPE, text=True
    )
    s = None
    if sampled:
        metrics = RankMetrics(job_id="bench", rank=0, interval_s=args.interval)
        s = MetricsSampler(
            metrics, StorageRoot(base / "root").url, root_pid=os.getpid,
            dirs=lambda: {"workspace": [base / "workspace"]}, disk_of=base, gpus=[],
            uploads=lambda: None, gauges=gauges(args),
        )  # fmt: skip
    out, _ = child.communicate()
    if s is not None:
        s.stop()
    return json.loads(out)[5:]  # the first steps warm up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--checkpoint-files", type=int, default=20)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--no-gauges", action="store_true")
    args = parser.parse_args()
    print(f"code: {code_state()}")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        cost = sampler_cost(args, base)
        print(
            f"sampler: {cost['per_sample_ms']:.2f} ms CPU per sample ({args.procs} processes, "
            f"{args.files} + {args.checkpoint_files} files, walked in "
            f"{cost['first_walk_ms']:.1f} ms), a flush of {MAX_SAMPLES} samples "
            f"{cost['flush_ms']:.1f} ms: {cost['share_of_a_core_pct']:.3f}% of one core at the "
            f"default {DEFAULT_INTERVAL_S:g} s interval"
            + (" (no gauges)" if args.no_gauges else ", Ray gauges set")
        )
        off: list[float] = []
        on: list[float] = []
        for _ in range(args.rounds):
            off += step_times(args, base, sampled=False)
            on += step_times(args, base, sampled=True)
        m_off, m_on = statistics.median(off), statistics.median(on)
        print(
            f"training step (torch MLP, 1 thread, {args.rounds} rounds x {args.steps} steps): "
            f"median {m_off * 1e3:.3f} ms unsampled, {m_on * 1e3:.3f} ms sampled every "
            f"{args.interval:g} s: ratio {m_on / m_off:.3f} (run-to-run spread of unsampled "
            f"rounds: p10 {statistics.quantiles(off, n=10)[0] * 1e3:.3f} ms, p90 "
            f"{statistics.quantiles(off, n=10)[-1] * 1e3:.3f} ms)"
        )


if __name__ == "__main__":
    main()
