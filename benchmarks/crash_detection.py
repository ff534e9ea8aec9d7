"""How long Ray takes to declare a crashed node dead: a worker raylet of a
`ray.cluster_utils.Cluster` killed (`remove_node(allow_graceful=False)`), `ray.nodes()` polled
until it is not alive; with Ray's default health checks, then with the simulated clusters' of
the tests (tests/conftest.py, SIMULATED_SYSTEM_CONFIG). The controller's retry of a crashed
node's rank waits on exactly this.

    .venv/bin/python benchmarks/crash_detection.py --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
from ray.cluster_utils import Cluster

TUNED = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


def detect(system_config: dict) -> float:
    """Seconds from the raylet's kill to Ray saying the node is dead."""
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "_system_config": system_config})  # fmt: skip
    try:
        node = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        started = time.monotonic()
        cluster.remove_node(node, allow_graceful=False)
        while any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node.node_id):
            time.sleep(0.05)
        return time.monotonic() - started
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    default = [detect({}) for _ in range(runs)]
    tuned = [detect(TUNED) for _ in range(runs)]
    d, t = statistics.median(default), statistics.median(tuned)
    print(f"Ray's defaults: median {d:.1f} s {[round(x, 1) for x in default]}")
    print(f"{TUNED}: median {t:.1f} s {[round(x, 1) for x in tuned]}")
    print(f"ratio tuned/default: {t / d:.2f}")


if __name__ == "__main__":
    main()
