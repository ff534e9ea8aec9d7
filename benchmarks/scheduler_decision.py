"""How long one scheduling decision takes with a long queue (target: under 10 ms at 1,000 jobs).

    .venv/bin/python benchmarks/scheduler_decision.py [--queued 1000] [--nodes 64] [--rounds 50]

A snapshot of a busy cluster: `--nodes` nodes of 8 H100 and 96 CPUs, three quarters of them full
of running jobs of three teams with quotas (some borrowed), and `--queued` jobs waiting (1 to 4
nodes, 1 to 8 GPUs each, random priorities and push times, three teams). It times
`SchedulingPolicy.decide` over `--rounds` rounds, against a baseline in the same process: sorting
the same queue by priority and push time, the least any queue does per decision.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from orchestrator.scheduler.policy import (
    ClusterSnapshot,
    Demand,
    Node,
    QueuedJob,
    RunningJob,
    SchedulingPolicy,
)
from orchestrator.scheduler.resources import Resources

TEAMS = ("vision", "speech", "research")
NODE = Resources.of(H100=8, CPU=96)


def snapshot(queued: int, nodes: int, seed: int = 0) -> ClusterSnapshot:
    rng = random.Random(seed)
    running, free = [], {}
    for i in range(nodes):
        node_id = f"node-{i:03d}"
        if i < nodes * 3 // 4:
            bundle = Resources.of(H100=8, CPU=64)
            job = RunningJob(f"run-{i}", TEAMS[i % 3], rng.randint(0, 5), float(i),
                             Demand(bundle, 1), (node_id,), borrowed=i % 7 == 0)  # fmt: skip
            running.append(job)
            free[node_id] = NODE - bundle
        else:
            free[node_id] = NODE
    jobs = []
    for j in range(queued):
        gpus = rng.choice((1, 2, 4, 8))
        demand = Demand(Resources.of(H100=gpus, CPU=8 * gpus), rng.choice((1, 1, 2, 4)))
        jobs.append(QueuedJob(f"job-{j}", rng.choice(TEAMS), rng.randint(0, 5),
                              rng.uniform(0, 3600), demand))  # fmt: skip
    quota = {"GPU:H100": nodes * 8 / 3}
    return ClusterSnapshot(
        queued=jobs,
        running=running,
        nodes=[Node(n, NODE, room) for n, room in free.items()],
        quotas={team: quota for team in TEAMS},
        now=3600.0,
    )


def timed(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    snap = snapshot(args.queued, args.nodes)
    policy = SchedulingPolicy()
    decision = policy.decide(snap)
    baseline = timed(lambda: sorted(snap.queued, key=lambda j: (-j.priority, j.pushed_at)),
                     args.rounds)  # fmt: skip
    decide = timed(lambda: policy.decide(snap), args.rounds)
    base_ms, decide_ms = statistics.median(baseline), statistics.median(decide)
    print(f"{args.queued} queued, {len(snap.running)} running on {args.nodes} nodes: "
          f"{len(decision.admit)} admitted, {len(decision.preempt)} preempted, "
          f"{len(decision.waiting)} waiting, {len(decision.impossible)} impossible")  # fmt: skip
    print(f"sort by priority (baseline)  median {base_ms:7.2f} ms  max {max(baseline):7.2f} ms")
    print(f"SchedulingPolicy.decide      median {decide_ms:7.2f} ms  max {max(decide):7.2f} ms")
    print(f"ratio of medians {decide_ms / base_ms:.1f}x; target: decide under 10 ms")


if __name__ == "__main__":
    main()
