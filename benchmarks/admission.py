"""What the queue adds to a push when there is room: the controller's `enqueue` round trip.

    .venv/bin/python benchmarks/admission.py [--rounds 50]

Starts a private local Ray cluster (stopped at the end) and, as a controller does, calls the
storage root's queue service from a driver on the head: `enqueue` of a job that fits (admitted in
that same call), `placed`, and `release` at the end. Baseline, in the same process: one call of a
no-op method on an actor of the same kind (detached, on the head), the least any Ray-side queue
costs. Also timed: the first `enqueue` after the service was idle long enough to end (its actor
starts again), which a push pays at most once per `IDLE_EXIT_S` of quiet.
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


def entry(i: int) -> dict:
    return QueueEntry(job_id=f"bench-{i}", team="t", pushed_at=time.time(),
                      bundle={"CPU": 1, "memory": 2**29}).model_dump()  # fmt: skip


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.2f} ms (p90 {sorted(values)[len(values) * 9 // 10] * 1000:.2f})"


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
        ray.init(address=info.gcs_address, namespace=NAMESPACE, log_to_driver=False)
        root = str(work / "storage")

        started = time.perf_counter()
        service = start_queue_service(root)
        first = ray.get(service.enqueue.remote(entry(-1)))
        cold = time.perf_counter() - started
        assert first["state"] == "admitted", first
        ray.get(service.release.remote("bench--1"))

        echo = shared_actor(Echo, "bench-echo", pinned_here=True, max_concurrency=1)
        ray.get(echo.ping.remote({}))
        baseline, admit, lifecycle = [], [], []
        for i in range(args.rounds):
            e = entry(i)
            t0 = time.perf_counter()
            ray.get(echo.ping.remote(e))
            t1 = time.perf_counter()
            standing = ray.get(service.enqueue.remote(e))
            t2 = time.perf_counter()
            assert standing["state"] == "admitted", standing
            ray.get(service.placed.remote(e["job_id"], list(standing["placed_on"])))
            ray.get(service.release.remote(e["job_id"]))
            t3 = time.perf_counter()
            baseline.append(t1 - t0)
            admit.append(t2 - t1)
            lifecycle.append(t3 - t1)
        print(f"code: {code_state()}, {args.rounds} rounds, storage root on local disk")
        print(f"bare Ray actor call (baseline):         {ms(baseline)}")
        print(f"enqueue -> admitted (the push's wait):  {ms(admit)}  "
              f"= {statistics.median(admit) / statistics.median(baseline):.1f}x the baseline")  # fmt: skip
        print(f"enqueue + placed + release (per job):   {ms(lifecycle)}")
        print(f"first enqueue, service not running:     {cold * 1000:.0f} ms (actor start included)")
        ray.kill(echo)
        ray.kill(service)
        ray.shutdown()
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
