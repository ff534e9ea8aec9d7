"""CPU seconds one job costs the machine, by process, against a bare Ray job of the same command.

    .venv/bin/python benchmarks/job_cpu.py [--jobs N]

Starts a private embedded cluster (stopped at the end), warms both paths once, then runs N jobs
of `echo hello` each way, one at a time: `ray` is `JobSubmissionClient.submit_job("echo hello")`,
`orchestrator` is `push(config.py)` with that start command. Every process of the cluster (found
by this run's ORCHESTRATOR_HOME in its environment) is sampled while the jobs run, so a process
that lives and dies within a job is counted up to its last sample (every 0.1 s). On a 2-core
machine the test suite is bound by CPU (docs/performance.md), so this, not wall time, says what a
job costs it.
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import time
from pathlib import Path

import psutil
from common import code_state

CONFIG = """
from orchestrator import definitions as d
project = d.TrainingProject(name="job-cpu", job=d.TrainingJob(
    image=d.Image(base_image="python:3.11"),
    compute=d.Compute(cpu_count=1),
    runtime=d.Runtime(start_commands=["echo hello"]),
))
"""
KINDS = ("JobSupervisor", "orchestrator.controller", "NodeAgent", "QueueService", "dashboard",
         "gcs_server", "raylet", "log_monitor")  # fmt: skip


def kind(process: psutil.Process) -> str:
    command = " ".join(process.cmdline())
    return next((k for k in KINDS if k in command), "other")


class Sampler:
    """CPU seconds of this cluster's processes, by kind, since the sampler was made."""

    def __init__(self, home: str) -> None:
        self.home = home
        self.start: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        for pid, (_, cpu) in self._read().items():
            self.start[pid] = cpu

    def _read(self) -> dict[int, tuple[str, float]]:
        found = {}
        for p in psutil.process_iter():
            try:
                if p.pid == os.getpid() or p.environ().get("ORCHESTRATOR_HOME") != self.home:
                    continue
                t = p.cpu_times()
                found[p.pid] = (kind(p), t.user + t.system)
            except psutil.Error:
                continue
        return found

    def sample(self) -> None:
        self.last.update(self._read())

    def by_kind(self) -> collections.Counter[str]:
        totals: collections.Counter[str] = collections.Counter()
        for pid, (k, cpu) in self.last.items():
            totals[k] += cpu - self.start.get(pid, 0.0)
        return totals


def settle(home: str, timeout: float = 30) -> None:
    """Until the jobs before have left: a controller records its end before its process exits,
    and what it spends exiting must not be counted against the next path."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
        k in ("JobSupervisor", "orchestrator.controller", "NodeAgent")
        for k, _ in Sampler(home)._read().values()
    ):
        time.sleep(0.2)


def run(jobs: int, submit, done, home: str) -> tuple[collections.Counter[str], float]:
    settle(home)
    sampler = Sampler(home)
    began = time.monotonic()
    for _ in range(jobs):
        handle = submit()
        while not done(handle):
            sampler.sample()
            time.sleep(0.1)
        sampler.sample()
    return sampler.by_kind(), time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=5)
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="job-cpu-")
    os.environ["ORCHESTRATOR_HOME"] = home
    from ray.job_submission import JobSubmissionClient

    from orchestrator import push
    from orchestrator.cluster.local import LocalCluster

    cluster = LocalCluster()
    info = cluster.ensure_running()
    try:
        config = Path(home) / "config.py"
        config.write_text(CONFIG)
        storage = str(Path(home) / "storage")
        client = JobSubmissionClient(info.dashboard_url)
        paths = {
            "ray": (
                lambda: client.submit_job(entrypoint="echo hello"),
                lambda job_id: client.get_job_status(job_id).is_terminal(),
            ),
            "orchestrator": (
                lambda: push(str(config), storage_root=storage),
                lambda job: job.refresh().state.is_terminal,
            ),
        }
        for submit, done in paths.values():  # warm: the first job starts the queue service
            run(1, submit, done, home)
        print(f"code {code_state()}; {args.jobs} jobs each, one at a time")
        per_job = {}
        for name, (submit, done) in paths.items():
            totals, wall = run(args.jobs, submit, done, home)
            per_job[name] = sum(totals.values()) / args.jobs
            print(f"\n{name}: {per_job[name]:.2f} CPU-s and {wall / args.jobs:.2f} s per job")
            for k, cpu in totals.most_common():
                print(f"  {cpu / args.jobs:6.2f} CPU-s  {k}")
        print(f"\norchestrator / ray: {per_job['orchestrator'] / per_job['ray']:.2f}x CPU per job")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
