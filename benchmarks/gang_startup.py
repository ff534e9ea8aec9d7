"""How the time from `push` to all ranks running grows with the number of nodes.

For N in 1, 2, 4 simulated nodes (ray.cluster_utils.Cluster on this machine), measures:
- orchestrator: `push` of a job with node_count=N whose command prints one line, until every
  rank's first line is in the job's logs;
- bare Ray: a STRICT_SPREAD placement group of N bundles plus one actor per bundle answering its
  first call (the least any gang launcher on Ray must do), in the same process.

Run: .venv/bin/python benchmarks/gang_startup.py [--runs 3] [--sizes 1,2,4]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from orchestrator.cluster.local import CLUSTER_ENV, embedded_env

os.environ.update({**embedded_env(), **CLUSTER_ENV})
os.environ.setdefault("ORCHESTRATOR_PYTHON", sys.executable)

import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.client.api import push

CONFIG = """
from orchestrator import definitions as d
project = d.TrainingProject(
    name="bench-gang",
    job=d.TrainingJob(
        image=d.Image(base_image="x"),
        compute=d.Compute(node_count={n}, cpu_count=1, memory="256Mi"),
        runtime=d.Runtime(start_commands=["echo rank $BT_NODE_RANK running"]),
    ),
)
"""


@ray.remote(num_cpus=1)
class Probe:
    def ready(self) -> bool:
        return True


def bare_gang(n: int) -> float:
    start = time.perf_counter()
    pg = placement_group([{"CPU": 1}] * n, strategy="STRICT_SPREAD")
    ray.get(pg.ready())
    actors = [
        Probe.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        ).remote()
        for i in range(n)
    ]
    ray.get([a.ready.remote() for a in actors])
    elapsed = time.perf_counter() - start
    for a in actors:
        ray.kill(a)
    remove_placement_group(pg)
    return elapsed


def orchestrator_gang(n: int, address: str, workdir: Path, storage: str) -> float:
    job_dir = workdir / f"job-{n}"
    job_dir.mkdir(exist_ok=True)
    (job_dir / "config.py").write_text(textwrap.dedent(CONFIG.format(n=n)))
    start = time.perf_counter()
    job = push(job_dir / "config.py", address=address, storage_root=storage)
    wanted = {f"rank {r} running" for r in range(n)}
    while True:
        seen = {line.split("] ", 1)[-1] for line in job.logs()}
        if wanted <= seen:
            elapsed = time.perf_counter() - start
            break
        if job.status().is_terminal:
            raise RuntimeError(f"job {job.id} ended early: {job.logs()[-10:]}")
        time.sleep(0.02)
    job.wait(timeout=120)
    return elapsed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(n: int, runs: int, workdir: Path) -> dict[str, list[float]]:
    port = free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": True,
                        "dashboard_host": "127.0.0.1", "dashboard_port": port},
    )  # fmt: skip
    try:
        for _ in range(n):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        address = f"http://127.0.0.1:{port}"
        storage = str(workdir / f"storage-{n}")
        bare_gang(n)  # warm: workers started once on every node
        orchestrator_gang(n, address, workdir, storage)
        results: dict[str, list[float]] = {"bare": [], "orchestrator": []}
        for _ in range(runs):
            results["bare"].append(bare_gang(n))
            results["orchestrator"].append(orchestrator_gang(n, address, workdir, storage))
        return results
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sizes", default="1,2,4")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"{'nodes':>5} {'bare median s':>14} {'ours median s':>14} {'ratio':>6} {'overhead s':>11}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-gang-") as tmp:
        for n in sizes:
            r = measure(n, args.runs, Path(tmp))
            bare, ours = statistics.median(r["bare"]), statistics.median(r["orchestrator"])
            print(f"{n:>5} {bare:>14.2f} {ours:>14.2f} {ours / bare:>6.1f} {ours - bare:>11.2f}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
