"""How long one scheduling decision takes with a long queue (target: under 10 ms at 1,000 jobs).

    .venv/bin/python benchmarks/scheduler_decision.py [--queued 1000] [--nodes 64] [--rounds 50]

A snapshot of a busy cluster: `--nodes` nodes of 8 H100 and 96 CPUs, three quarters of them full
of running jobs of three teams with quotas (one team beyond its quota, so its newest jobs
borrow), and `--queued` jobs waiting (1 to 4 nodes, 1 to 8 GPUs each, random priorities and push
times over the last hour, three teams): most have waited past the hold, some can preempt. It
times `SchedulingPolicy.decide` over `--rounds` rounds (p50 and max), with preemption within a
team off (the default) and on (`--within-team always`), against a baseline in the same process:
sorting the same queue by priority and push time, the least any queue does per decision.
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
    WithinTeam,
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
                             Demand(bundle, 1), (node_id,), resumable=i % 2 == 0)  # fmt: skip
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
    share = nodes * 8 / 4  # vision runs a third of the nodes' GPUs on a quarter: it borrows
    quotas = {"vision": share, "speech": share * 1.5, "research": share * 1.5}
    return ClusterSnapshot(
        queued=jobs,
        running=running,
        nodes=[Node(n, NODE, room) for n, room in free.items()],
        quotas={team: {"GPU:H100": gpus} for team, gpus in quotas.items()},
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
    baseline = timed(lambda: sorted(snap.queued, key=lambda j: (-j.priority, j.pushed_at)),
                     args.rounds)  # fmt: skip
    base_ms = statistics.median(baseline)
    print(f"sort by priority (baseline)   p50 {base_ms:7.2f} ms  max {max(baseline):7.2f} ms")
    for mode in (WithinTeam.NEVER, WithinTeam.ALWAYS):
        policy = SchedulingPolicy(within_team=mode)
        decision = policy.decide(snap)
        decide = timed(lambda: policy.decide(snap), args.rounds)  # noqa: B023 (used at once)
        decide_ms = statistics.median(decide)
        print(f"{args.queued} queued, {len(snap.running)} running on {args.nodes} nodes, "
              f"within team {mode.value}: {len(decision.admit)} admitted, "
              f"{len(decision.preempt)} preempted, {len(decision.reserved)} holding nodes, "
              f"{len(decision.waiting)} waiting, {len(decision.impossible)} impossible"
              )  # fmt: skip
        print(
            f"SchedulingPolicy.decide       p50 {decide_ms:7.2f} ms  max {max(decide):7.2f} ms"
            f"  ({decide_ms / base_ms:.1f}x the baseline)"
        )
    print("target: decide under 10 ms")


if __name__ == "__main__":
    main()
