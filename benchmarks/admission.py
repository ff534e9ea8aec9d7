"""What the queue adds to a push when there is room: the controller's `enqueue` round trip.

    .venv/bin/python benchmarks/admission.py [--rounds 50]

Starts a private local Ray cluster (stopped at the end) and, as a controller does, calls the
cluster's queue service from a driver on the head: `enqueue` of a job that fits (admitted in
that same call), `placed`, and `release` at the end. Baseline, in the same process: one call of a
no-op method on an actor of the same kind (detached, on the head), the least any Ray-side queue
costs. Also timed: the first `enqueue` after the service was idle long enough to end (its actor
starts), which a push pays once per cluster start, or after an hour with no job at all.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import ray
from common import code_state

from orchestrator.agents.services import NAMESPACE, shared_actor
from orchestrator.cluster.local import LocalCluster, embedded_env
from orchestrator.scheduler.service import start_queue_service
from orchestrator.storage.queue_store import QueueEntry


class Echo:
    def ping(self, entry: dict) -> dict:
        return entry


def entry(i: int) -> QueueEntry:
    return QueueEntry(job_id=f"bench-{i}", team="t", pushed_at=time.time(),
                      bundle={"CPU": 1, "memory": 2**29})  # fmt: skip


def ms(values: list[float]) -> str:
    p90 = sorted(values)[len(values) * 9 // 10]
    return f"{statistics.median(values) * 1000:.2f} ms (p90 {p90 * 1000:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-admission-"))
    os.environ["ORCHESTRATOR_HOME"] = str(work / "home")
    cluster = LocalCluster(state_dir=work / "home" / "local-cluster")
    try:
        info = cluster.start()
        os.environ.update(embedded_env())
        # Ray read RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import: without this it swaps 127.0.0.1
        # for the machine's address and hangs (tests/conftest.py's ray_driver does the same).
        ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
        ray.init(address=info.gcs_address, namespace=NAMESPACE, log_to_driver=False)
        root = str(work / "storage")

        started = time.perf_counter()
        service = start_queue_service()
        first = ray.get(service.enqueue.remote(root, entry(-1)))
        cold = time.perf_counter() - started
        assert first.state == "admitted", first
        ray.get(service.release.remote(root, "bench--1"))

        echo = shared_actor(Echo, "bench-echo", pinned_here=True, max_concurrency=1)
        ray.get(echo.ping.remote({}))
        baseline, admit, lifecycle = [], [], []
        for i in range(args.rounds):
            e = entry(i)
            t0 = time.perf_counter()
            ray.get(echo.ping.remote(e))
            t1 = time.perf_counter()
            standing = ray.get(service.enqueue.remote(root, e))
            t2 = time.perf_counter()
            assert standing.state == "admitted", standing
            ray.get(service.placed.remote(root, e.job_id, list(standing.placed_on)))
            ray.get(service.release.remote(root, e.job_id))
            t3 = time.perf_counter()
            baseline.append(t1 - t0)
            admit.append(t2 - t1)
            lifecycle.append(t3 - t1)
        print(f"code: {code_state()}, {args.rounds} rounds, storage root on local disk")
        print(f"bare Ray actor call (baseline):         {ms(baseline)}")
        ratio = statistics.median(admit) / statistics.median(baseline)
        print(f"enqueue -> admitted (the push's wait):  {ms(admit)} = {ratio:.1f}x the baseline")
        print(f"enqueue + placed + release (per job):   {ms(lifecycle)}")
        print(f"first enqueue, service not running:     {cold * 1000:.0f} ms (its actor starts)")
        ray.kill(echo)
        ray.kill(service)
        ray.shutdown()
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
