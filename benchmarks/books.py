"""What `orchestrator usage` costs over a storage root of many jobs, against reading the same
records and statuses with no books worked out (the floor: the storage reads). No Ray.

    .venv/bin/python benchmarks/books.py --jobs 5000
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from orchestrator import definitions as d
from orchestrator.books.cost import rates
from orchestrator.client.books import by_team, usage
from orchestrator.lifecycle import JobState
from orchestrator.storage.job_store import JobStore
from orchestrator.storage.parallel import parallel_map
from orchestrator.storage.prices import Prices
from orchestrator.storage.records import (
    ArchiveRef,
    Attempt,
    Hold,
    JobRecord,
    JobStatus,
    StatusEvent,
)


def fill(root: Path, jobs: int, seed: int = 0) -> None:
    """`jobs` finished jobs of four teams over 30 days, each with one or two holds and up to
    three attempts, as controllers record them."""
    rnd = random.Random(seed)
    store = JobStore(str(root))
    spec = d.TrainingProject(name="bench", job=d.TrainingJob(image=d.Image(base_image="x")))
    archive = ArchiveRef(path="a", sha256="x", size_bytes=1, file_count=1, config_dir=".")
    prices = rates(Prices(gpu={"H100": 2.49}, cpu_hour=0.04, memory_gib_hour=0.005))
    start = time.time() - 30 * 86400
    for i in range(jobs):
        pushed = start + rnd.uniform(0, 29 * 86400)
        team = rnd.choice(["vision", "nlp", "speech", "infra"])
        record = JobRecord(job_id=f"j{i:07d}", project="bench", team=team, created_at=pushed,
                           spec=spec, archive=archive, storage_root=str(root))  # fmt: skip
        t, holds, attempts = pushed + rnd.uniform(1, 600), [], []
        for _ in range(rnd.choice([1, 1, 2])):
            since = t
            for _ in range(rnd.choice([1, 2])):
                a0 = t + 30
                t = a0 + rnd.uniform(300, 7200)
                attempts.append(Attempt(number=len(attempts), started_at=a0, ended_at=t,
                                        cause=rnd.choice([None, "node_lost"]),
                                        checkpoint_at=a0 + (t - a0) / 2))  # fmt: skip
            holds.append(
                Hold(
                    since=since,
                    until=t + 2,
                    nodes=2,
                    prices=prices,
                    bundle={"CPU": 8.0, "memory": 64 * 2**30, "GPU:H100": 8.0},
                )
            )
            t += rnd.uniform(60, 1800)
        status = JobStatus(
            job_id=record.job_id, state=JobState.COMPLETED, holds=holds, attempts=attempts,
            history=[StatusEvent(state=JobState.CREATED, at=pushed),
                     StatusEvent(state=JobState.COMPLETED, at=holds[-1].until - 1)],
        )  # fmt: skip
        store.create(record, status)


def read_only(root: Path) -> int:
    """The floor: every record and status read, nothing worked out."""
    store = JobStore(str(root))
    records = store.records()
    return len(parallel_map(lambda r: store.status(r.job_id), records, 16))


def books(root: Path) -> int:
    jobs = usage(storage_root=str(root))
    by_team(jobs)
    return len(jobs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="orchestrator-books-") as tmp:
        root = Path(tmp) / "storage"
        began = time.perf_counter()
        fill(root, args.jobs)
        print(f"{args.jobs} jobs written in {time.perf_counter() - began:.1f} s")
        timings: dict[str, list[float]] = {"read records and statuses": [], "usage": []}
        for _ in range(args.runs):
            for name, run in (("read records and statuses", read_only), ("usage", books)):
                began = time.perf_counter()
                assert run(root) == args.jobs
                timings[name].append(time.perf_counter() - began)
        floor = statistics.median(timings["read records and statuses"])
        for name, runs in timings.items():
            med = statistics.median(runs)
            print(f"{name:28s} median {med:6.2f} s  ({med / floor:.2f}x the reads alone)")


if __name__ == "__main__":
    main()
